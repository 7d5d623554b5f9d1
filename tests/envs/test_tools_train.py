"""`hybrid-engine train` with env.name=tools on 2 real ranks: episodes per episode
(`rollout/agent_loop.py`), a model that calls a user's tool (warm-started on the
tool demo's traces), the calls run in worker processes, a parquet file through a
hermes chat template; a run resumed from its step-2 checkpoint repeats the
straight run's steps 3-4."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hybrid_engine.testing import run_ranks

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_VOLATILE = ("_s", "_bytes", "engine_idle")
_GSM8K = "hybrid_engine.envs.preprocess:gsm8k"


def _job(overrides: dict, resume: bool) -> list[dict]:
    from hybrid_engine.config import apply_overrides
    from hybrid_engine.config.recipes import get_recipe
    from hybrid_engine.job import Job

    job = Job(apply_overrides(get_recipe("tiny_grpo_debug"), overrides), resume=resume,
              progress=False)
    try:
        return job.run()["history"]
    finally:
        job.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny model warm-started on the tool demo's traces (it calls the calculator
    in the hermes format, with a wrong answer after), the demo's template, the
    calculator as a user's tools file, a reward that varies with the answer's
    length, and a parquet file of word problems."""
    from hybrid_engine.demo.task import DemoTask, task_files
    from hybrid_engine.demo.tools import END_OF_TURN_ID, TOOL_WORDS, template_file
    from hybrid_engine.demo.warmstart import WarmStartConfig, warm_start
    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model

    d = tmp_path_factory.mktemp("tools_train")
    base = write_tiny_model(d / "base", TinyModelSpec(vocab_size=512, words=TOOL_WORDS,
                                                      max_position_embeddings=256))
    train, _ = task_files(d, DemoTask(num_train=400, num_eval=8))
    template = template_file(d)
    model = warm_start(base, d, WarmStartConfig(
        steps=60, batch_size=16, lr=3e-3, tool_share=1.0, dataset=str(train),
        preprocess=_GSM8K, chat_template=str(template)))
    (d / "tools.py").write_text(
        "def calculator(expression: str) -> str:\n    \"\"\"Adds.\n\n    Args:\n"
        "        expression: Two numbers and a plus sign.\n    \"\"\"\n"
        "    return str(sum(int(x) for x in expression.split(\"+\")))\n")
    (d / "reward.py").write_text(
        "def by_length(prompt, completion, answer, **columns):\n"
        "    return float(len(completion) % 3)\n")
    return {
        "model.path": str(model), "model.compute_dtype": "float32",
        "env.name": "tools", "env.tools": f"{d}/tools.py:calculator",
        "env.dataset_path": str(train), "env.preprocess": _GSM8K,
        "env.chat_template": str(template), "env.max_turns": 2,
        "env.rewards": f"{d}/reward.py:by_length:1.0", "env.tool_workers": 1,
        "rollout.stop_token_ids": [END_OF_TURN_ID], "rollout.max_model_len": 256,
        "rollout.max_tokens": 32, "rollout.num_samples_per_prompt": 2,
        "rollout.tensor_parallel_size": 2, "train.prompts_per_step": 2, "train.lr": 1e-3,
        "train.num_steps": 4, "checkpoint_every": 2, "keep_checkpoints": 2,
        "eval.at_end": False, "eval.every": 0, "output_dir": str(d / "run"),
    }


def _comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.endswith(_VOLATILE)} for h in history]


def test_a_tools_run_resumed_mid_run_equals_the_straight_run(setup, tmp_path) -> None:
    from hybrid_engine.checkpoint import step_checkpoints

    straight = run_ranks(_job, 2, setup, False, timeout=400)[0]
    hist = [h for h in straight if h["step"] > 0]
    assert len(hist) == 4 and "rollout/engine_idle" in hist[0]
    # the model calls the tool, the calls parse and run, their results are observed
    assert all(h["tool/calls"] >= 0.5 and h["observation_tokens_mean"] > 5 for h in hist)
    assert all(h["tool/errors"] < h["tool/calls"] for h in hist)
    assert any(not h["skipped_degenerate"] for h in hist)
    run = tmp_path / "resumed"  # what a run stopped after step 2 leaves
    shutil.copytree(setup["output_dir"], run)
    kept = step_checkpoints(run / "checkpoints")
    assert 2 in [n for n, _ in kept], kept
    for step, path in kept:
        if step > 2:
            shutil.rmtree(path)
    resumed = run_ranks(_job, 2, {**setup, "output_dir": str(run)}, True, timeout=400)[0]
    assert _comparable([h for h in resumed if h["step"] > 2]) == \
        _comparable([h for h in straight if h["step"] > 2])
    assert Path(run, "final").is_dir()


def test_a_tools_run_with_partial_rollouts_parks_episodes_and_resumes_exactly(setup, tmp_path,
                                                                              ) -> None:
    """async_rollout.partial on 2 replicas: a tight token budget parks episodes
    (between turns or mid-segment) with their chat state; a run resumed from a
    checkpoint that holds parked episodes repeats the straight run."""
    import json

    from hybrid_engine.checkpoint import step_checkpoints

    run = {**setup, "rollout.tensor_parallel_size": 1, "algorithm.behaviour_logp": "rollout",
           "async_rollout.partial": True, "async_rollout.max_staleness": 1,
           "async_rollout.step_token_budget": 60, "train.prompts_per_step": 4,
           "train.num_steps": 3, "checkpoint_every": 1, "keep_checkpoints": 3,
           "output_dir": str(tmp_path / "straight")}
    straight = [h for h in run_ranks(_job, 2, run, False, timeout=400)[0] if h["step"] > 0]
    assert sum(h["partial/parked_groups"] for h in straight) >= 1
    assert sum(h["partial/continued_samples"] for h in straight) >= 1
    assert all(h["staleness_max"] <= 1 and h["tool/calls"] > 0 for h in straight)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run["output_dir"], resumed_dir)
    kept = step_checkpoints(resumed_dir / "checkpoints")
    parked = [n for n, path in kept if n < 3 and json.loads(
        (path / "meta.json").read_text())["extra"]["rollout"]["pool"]]
    assert parked, "no checkpoint holds parked episodes: tighten the budget"
    for step, path in kept:
        if step > parked[-1]:
            shutil.rmtree(path)
    resumed = run_ranks(_job, 2, {**run, "output_dir": str(resumed_dir)}, True, timeout=400)[0]
    assert _comparable([h for h in resumed if h["step"] > parked[-1]]) == \
        _comparable([h for h in straight if h["step"] > parked[-1]])


def test_a_tools_run_under_separate_placement(setup, tmp_path) -> None:
    """1 trainer rank + 1 rollout rank: the rollout rank runs the episodes (per
    episode) and the trainer gets them, ahead of the step (sampled on the
    generation thread) and in step (the evaluation at step 0)."""
    run = {**setup, "placement": "separate", "rollout.tensor_parallel_size": 1,
           "async_rollout.max_staleness": 1, "algorithm.behaviour_logp": "rollout",
           "train.num_steps": 2, "checkpoint_every": 0,
           "eval.at_start": True, "eval.num_prompts": 2, "output_dir": str(tmp_path / "run")}
    hist = run_ranks(_job, 2, run, False, timeout=400)[0]
    assert "eval/tool/calls" in hist[0] and "eval/turns_mean" in hist[0]
    trained = [h for h in hist if h["step"] > 0]
    assert len(trained) == 2 and all("tool/calls" in h for h in trained)
    # the rollout rank's schedule reaches the trainer's metrics
    assert all(0.0 <= h["rollout/engine_idle"] < 1.0 for h in trained)
    assert any(not h["skipped_degenerate"] for h in trained)


def test_the_rollout_ranks_view_schedules_per_episode() -> None:
    """Under separate placement the rollout ranks' view of the engine offers what
    the per-episode loop needs (rollout.schedule=episode); the view shared with
    the trainer ranks does not (they have no engine)."""
    from types import SimpleNamespace

    from hybrid_engine.config import RolloutConfig
    from hybrid_engine.policy.separate import _LocalRollout, _SharedRollout
    from hybrid_engine.rollout.episodes import per_episode

    engine = SimpleNamespace(ranks=[1], group=None)
    assert per_episode(_LocalRollout(engine, RolloutConfig()))
    assert not per_episode(_LocalRollout(engine, RolloutConfig(schedule="turn")))
    assert not per_episode(_SharedRollout(engine, RolloutConfig(), src=1))
