"""Named experiments: Python functions returning a `RunConfig`.

Job: give every experiment a name (`--recipe tiny_grpo_debug`) and build the
final config of a launch: recipe, then the user's YAML file, then CLI
overrides (`build_config`).

Invariant: a recipe is data, never control flow. It only picks values; core
code must not branch on which recipe is running (torchtitan rule), so a run is
fully described by `to_dict(cfg)` whatever recipe produced it. A YAML file is
just a set of dotted overrides on top of a recipe.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from hybrid_engine.config import (
    AlgorithmConfig,
    EnvConfig,
    EvalConfig,
    MemoryConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SyncConfig,
    TrainConfig,
    apply_overrides,
    load_yaml,
)
from hybrid_engine.names import unknown_name_error

__all__ = ["RECIPES", "build_config", "get_recipe", "recipe"]

RECIPES: dict[str, Callable[[], RunConfig]] = {}

# Directory of the tiny random-init Qwen2 used by CPU tests and demos.
# TODO(models): point at whatever hybrid_engine.models writes the tiny model to.
TINY_MODEL_PATH = "runs/models/tiny-qwen2"


def recipe(fn: Callable[[], RunConfig]) -> Callable[[], RunConfig]:
    """Registers fn in RECIPES under its function name."""
    assert fn.__name__ not in RECIPES, f"recipe {fn.__name__!r} registered twice"
    RECIPES[fn.__name__] = fn
    return fn


def get_recipe(name: str) -> RunConfig:
    """Returns the config of the recipe called name.

    Raises:
        ValueError: no such recipe; lists the available ones and the closest.
    """
    fn = RECIPES.get(name)
    if fn is None:
        raise unknown_name_error("recipe", name, RECIPES)
    return fn()


def build_config(
    recipe: str,
    yaml_path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
) -> RunConfig:
    """Builds a launch's config: recipe, then YAML overrides, then CLI overrides.

    Args:
        recipe: a name in RECIPES.
        yaml_path: optional YAML file of overrides (nested sections or dotted keys).
        overrides: "key=value" strings (see parse_cli_overrides); they win over the file.
    """
    cfg = get_recipe(recipe)
    if yaml_path is not None:
        cfg = apply_overrides(cfg, load_yaml(yaml_path))
    return apply_overrides(cfg, list(overrides))


# --------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------


@recipe
def tiny_grpo_debug() -> RunConfig:
    """Smallest end-to-end run: tiny Qwen2 on 2 CPU ranks, a few steps.

    TP 2 over 2 ranks exercises the cross-rank reshard path. The project's
    training defaults (bf16 compute over fp32 master weights, sharding=auto,
    packing); fp32 vLLM weights so the sync's check compares them exactly.
    Prompts are raw text: a completion task for a base-style model.
    Launch with `torchrun --standalone --nproc-per-node=2`.
    """
    return RunConfig(
        model=ModelConfig(path=TINY_MODEL_PATH, rollout_dtype="float32"),
        rollout=RolloutConfig(
            tensor_parallel_size=2,
            num_samples_per_prompt=4,
            max_tokens=16,
            max_model_len=128,
            enforce_eager=True,
        ),
        memory=MemoryConfig(kv_cache_gib=0.25),
        # Up to 32 sequences per micro-batch: a small step's rows in one (under
        # replicate each more micro-batch adds a pass over the whole gradient).
        train=TrainConfig(lr=1e-4, num_steps=3, prompts_per_step=4, micro_batch_size=32),
        # Tiny buckets so even a tiny model's sync goes through several of them.
        sync=SyncConfig(bucket_mb=0.25, verify=True),
        env=EnvConfig(chat_template="none"),
        eval=EvalConfig(at_start=False, at_end=False),
        output_dir="runs/tiny_grpo_debug",
        checkpoint_every=2,
        keep_checkpoints=1,
        max_wall_s=600.0,
    )


@recipe
def tiny_grpo_demo() -> RunConfig:
    """The CPU demo's RL phase: a warm-started 4M-parameter Qwen2 on 2 ranks
    learning GSM8K-shaped word problems (1-2 digit additions), 200 steps, through the chat
    template and the math + format rewards (model.path and the data files set
    by `hybrid-engine demo`)."""
    return apply_overrides(
        tiny_grpo_debug(),
        {
            "rollout.num_samples_per_prompt": 8,
            "rollout.max_tokens": 8,
            "rollout.max_model_len": 64,
            "train.lr": 5e-5,
            "train.lr_schedule": "cosine",
            "train.num_steps": 200,
            "train.prompts_per_step": 32,
            "train.micro_batch_size": 128,
            "sync.bucket_mb": 64.0,
            "sync.verify": False,
            "env.chat_template": "auto",
            "env.rewards": "math:1.0,format:0.1",
            "env.format_pattern": "[0-9]+",
            "eval.num_prompts": 0,
            "eval.every": 10,
            "eval.at_start": True,
            "eval.at_end": True,
            "output_dir": "runs/tiny_grpo_demo",
            "checkpoint_every": 50,
            "keep_checkpoints": 2,
            "max_wall_s": 540.0,
        },
    )


@recipe
def qwen05b_grpo() -> RunConfig:
    """GRPO on a Qwen2.5-0.5B-sized model, one GPU per rank.

    model.path is left to the user (e.g. --model.path=Qwen/Qwen2.5-0.5B-Instruct).
    bf16 compute and rollout with fp32 master weights; the truncated
    importance-sampling cap absorbs the bf16 vLLM vs trainer logprob gap;
    4 mini-batches per rollout, so the PPO ratio leaves 1 and clip-higher acts.
    """
    return RunConfig(
        model=ModelConfig(path=""),
        rollout=RolloutConfig(num_samples_per_prompt=8, max_tokens=1024, max_model_len=2048),
        memory=MemoryConfig(kv_cache_gib=16.0),
        train=TrainConfig(
            lr=1e-6,
            weight_decay=0.01,
            warmup_steps=10,
            micro_batch_size=8,
            activation_checkpointing=True,
            num_steps=300,
            prompts_per_step=64,
            mini_batches_per_rollout=4,  # 4 updates per rollout: clip-higher acts
        ),
        algorithm=AlgorithmConfig(clip_high=0.28, rollout_correction="token_tis",
                                  correction_cap=2.0),
        sync=SyncConfig(bucket_mb=512.0),
        output_dir="runs/qwen05b_grpo",
        eval=EvalConfig(every=25),
        checkpoint_every=50,
        keep_checkpoints=3,
    )


_REASON_THEN_ANSWER = ("Think step by step inside <think> </think>, then give only the final "
                      "answer after the closing tag.")


@recipe
def gsm8k_grpo() -> RunConfig:
    """GRPO on GSM8K with an instruct model, one GPU per rank: the public parquet
    files (openai/gsm8k, main/) under data/gsm8k, the chat template, the math
    reward with a small format bonus, evaluation on the test file.

    model.path is left to the user (e.g. --model.path=Qwen/Qwen2.5-1.5B-Instruct).
    """
    return apply_overrides(qwen05b_grpo(), {
        "env.dataset_path": "data/gsm8k/main/train-*.parquet",
        "env.eval_dataset_path": "data/gsm8k/main/test-*.parquet",
        "env.preprocess": "hybrid_engine.envs.preprocess:gsm8k",
        "env.chat_template": "auto",
        "env.system_prompt": _REASON_THEN_ANSWER,
        "env.rewards": "math:1.0,format:0.1",
        "eval.num_prompts": 256,
        "rollout.max_tokens": 1024,
        "output_dir": "runs/gsm8k_grpo",
    })


_USE_PYTHON = ("Solve the problem. You may call the python tool to run a program and read "
               "what it prints. When you are done, give only the final number as your answer.")


@recipe
def gsm8k_python_tool_grpo() -> RunConfig:
    """gsm8k_grpo as an agent: the instruct model calls the sandboxed `python` tool
    in its own hermes format (Qwen2.5's chat template lists it), up to 4 turns,
    episodes scheduled per episode; the math reward scores the final turn.

    model.path is left to the user (e.g. --model.path=Qwen/Qwen2.5-1.5B-Instruct).
    """
    return apply_overrides(gsm8k_grpo(), {
        "env.name": "tools",
        "env.tools": "python",
        "env.tool_parser": "hermes",
        "env.tool_workers": 8,
        "env.sandbox_timeout_s": 5.0,
        "env.tool_timeout_s": 10.0,
        "env.max_turns": 4,
        "env.max_episode_tokens": 2048,
        "env.system_prompt": _USE_PYTHON,
        "env.rewards": "math:1.0",
        "rollout.max_tokens": 512,
        "rollout.max_model_len": 4096,
        "eval.max_tokens": 512,
        "output_dir": "runs/gsm8k_python_tool_grpo",
    })


@recipe
def math_grpo() -> RunConfig:
    """gsm8k_grpo on MATH: the parquet files of a MATH copy with problem and
    solution columns (e.g. DigitalLearningGmbH/MATH-lighteval, data/) under
    data/math, answers in the solution's last \\boxed{}, longer completions."""
    return apply_overrides(gsm8k_grpo(), {
        "env.dataset_path": "data/math/data/train-*.parquet",
        "env.eval_dataset_path": "data/math/data/test-*.parquet",
        "env.preprocess": "hybrid_engine.envs.preprocess:math",
        "env.system_prompt": _REASON_THEN_ANSWER.replace("only the final answer",
                                                         "only the final answer in \\boxed{}"),
        "rollout.max_tokens": 2048,
        "rollout.max_model_len": 3072,
        "output_dir": "runs/math_grpo",
    })


@recipe
def qwen05b_grpo_debug() -> RunConfig:
    """qwen05b_grpo for a few steps with sync verification, to smoke-test a GPU setup."""
    return apply_overrides(
        qwen05b_grpo(),
        {"train.num_steps": 4, "sync.verify": True, "output_dir": "runs/qwen05b_grpo_debug"},
    )
