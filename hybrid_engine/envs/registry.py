"""Environments (tasks): a name registry and `make_env` (imported through
`hybrid_engine.envs`, which loads this module on first use).

Job: map `EnvConfig.name` to a constructor `(cfg, tokenizer) -> Environment`
(`roles.base.Environment`: `sample_prompts`, `score`), so a recipe picks the
task by name and the controller never imports a task module.

With `EnvConfig.rewards` (or `reward_fn`, one user function) set, the named
environment is wrapped in `composed.RewardsEnv`: prompts come from the task,
the reward is the weighted sum of the terms, scored once across the ranks.
With only `EnvConfig.reward_model_path` set, it is wrapped in
`reward_model.RewardModelEnv`: the reward model's score is the reward
(imported lazily, so importing this package stays light).

Invariant: a name is registered once; an unknown name is a `ValueError`
listing the registered names and the closest one, never a silent default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybrid_engine.names import Registry
from hybrid_engine.envs.arithmetic import ArithmeticEnv
from hybrid_engine.envs.base import RewardError
from hybrid_engine.envs.chat import PromptFormat
from hybrid_engine.envs.dataset import DatasetSpec
from hybrid_engine.envs.tool import CalcEnv

if TYPE_CHECKING:
    from hybrid_engine.config import EnvConfig
    from hybrid_engine.parallel.placement import Placement
    from hybrid_engine.roles.base import Environment
    from hybrid_engine.tools.sandbox import Sandbox

__all__ = ["ENVS", "ArithmeticEnv", "PromptFormat", "RewardError", "CalcEnv", "dataset_spec",
           "make_env", "prompt_format", "register_env", "reward_terms", "sandbox"]

EnvFactory = Callable[["EnvConfig", Any], "Environment"]



class _EnvRegistry(Registry[EnvFactory]):
    """Registered environments, and 'file.py:Class' / 'module:Class': a user's
    `envs.agent.ChatTask` run as a `ChatEnv`."""

    def get(self, name: str) -> EnvFactory:
        if ":" not in name or name in self:
            return super().get(name)
        from hybrid_engine.envs.user_code import load_function

        task_class = load_function(name, "env.name")
        if not isinstance(task_class, type):
            raise ValueError(f"env.name={name!r} names a {type(task_class).__name__}, not a "
                             "class (a ChatTask: reset(row) and step(messages))")
        missing = [m for m in ("reset", "step") if not callable(getattr(task_class, m, None))]
        if missing:
            raise ValueError(f"env.name={name!r}: {task_class.__name__} has no "
                             f"{' or '.join(missing)} (a ChatTask: reset(row) -> messages and "
                             "step(messages) -> (new messages, done, reward parts))")
        return lambda cfg, tokenizer: _chat_env(cfg, tokenizer, task_class())


ENVS: _EnvRegistry = _EnvRegistry("environment")


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: registers `factory(cfg, tokenizer) -> Environment` under name."""

    def deco(factory: EnvFactory) -> EnvFactory:
        ENVS.add(name, factory)
        return factory

    return deco


def make_env(cfg: EnvConfig, tokenizer: Any, placement: Placement | None = None) -> Environment:
    """Builds the environment cfg.name names.

    Args:
        cfg: name, dataset_path ('' = generated problems), seed, the chat
            template, rewards / reward_fn (the weighted terms) and
            reward_model_path (without rewards, the reward model's score
            replaces the task's: see `envs.reward_model.RewardModelEnv`).
        tokenizer: the policy's tokenizer (`tokenizers.Tokenizer` or transformers).
        placement: where the job's roles live: a reward model on some ranks only
            (placement=grouped) is built there and its scores broadcast
            (`PlacedRewardModel`); None, or a role on every rank: sharded over
            the whole default group.

    Collective when cfg.reward_model_path is set under a process group.

    Raises:
        ValueError: unknown name (lists the registered ones and the closest),
            a bad dataset file, a reward model that is not num_labels=1, or a
            reward term that cannot be loaded.
    """
    env = ENVS.get(cfg.name)(cfg, tokenizer)
    rm = None
    if cfg.reward_model_path:
        from hybrid_engine.envs.reward_model import (PlacedRewardModel, RewardModel,
                                                     RewardModelEnv)

        placed = placement is not None and len(placement.ranks["reward_model"]) < placement.world
        sharding = cfg.reward_model_sharding
        model = (PlacedRewardModel(cfg.reward_model_path, placement, sharding=sharding) if placed
                 else RewardModel(cfg.reward_model_path, sharding=sharding))
        rm = RewardModelEnv(env, model, tokenizer, task_metrics=not cfg.rewards)
    terms = reward_terms(cfg)
    if not terms:
        return rm or env
    from hybrid_engine.envs.composed import RewardsEnv
    from hybrid_engine.envs.reward_pool import RewardPool

    from hybrid_engine.envs.services import services

    pool = RewardPool(cfg.reward_workers, cfg.reward_timeout_s,
                      preload=[t.spec for t in terms if t.spec])
    return RewardsEnv(env, terms, tokenizer, pool=pool, on_timeout=cfg.reward_on_timeout,
                      reward_model=rm, services=services(cfg, [t.name for t in terms]))


def reward_terms(cfg: EnvConfig) -> list:
    """The weighted terms of cfg.rewards, or cfg.reward_fn's one ([] = the
    environment's own reward, or the reward model's score).

    Raises:
        ValueError: a bad spec (`envs.rewards.parse_rewards`).
    """
    from hybrid_engine.envs.rewards import function_term, parse_rewards

    if cfg.reward_fn:
        return [function_term(cfg.reward_fn, key="env.reward_fn")]
    if not cfg.rewards:
        return []
    # code's cases stop before the worker's timeout (env.reward_timeout_s) would kill it
    budget_s = max(cfg.reward_timeout_s - 1.5, 0.0) if cfg.reward_timeout_s else 0.0
    terms = parse_rewards(cfg.rewards, format_pattern=cfg.format_pattern,
                          settings={"code": {"sandbox": sandbox(cfg), "budget_s": budget_s}})
    if any(t.name == "judge" for t in terms):
        from hybrid_engine.envs.services import judge_template

        judge_template(cfg.judge_template)  # its placeholders, before any engine starts
    return terms


def sandbox(cfg: EnvConfig) -> Sandbox:
    """Where the python tool and the code reward run code: a `tools.sandbox.Sandbox`
    with the env.sandbox_* limits (its url: a service instead of a local process)."""
    from hybrid_engine.tools.sandbox import Sandbox, SandboxLimits

    return Sandbox(SandboxLimits(timeout_s=cfg.sandbox_timeout_s, memory_mb=cfg.sandbox_memory_mb,
                                 output_kb=cfg.sandbox_output_kb,
                                 processes=cfg.sandbox_processes), url=cfg.sandbox_url)


def dataset_spec(cfg: EnvConfig) -> DatasetSpec | None:
    """Where cfg's problems come from (None: generated). An evaluation file alone
    (`hybrid-engine eval`) is the whole problem set: the evaluation problems,
    and training problems nothing draws (a training run refuses it, `preflight`)."""
    if not (cfg.dataset_path or cfg.eval_dataset_path):
        return None
    return DatasetSpec(cfg.dataset_path or cfg.eval_dataset_path, eval_path=cfg.eval_dataset_path,
                       prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                       preprocess=cfg.preprocess)


def prompt_format(cfg: EnvConfig) -> PromptFormat:
    """How cfg's prompts become token ids (chat template, system prompt, template kwargs)."""
    return PromptFormat(cfg.chat_template, cfg.system_prompt, cfg.template_kwargs())


@register_env("arithmetic")
def _arithmetic(cfg: EnvConfig, tokenizer: Any) -> Environment:
    return ArithmeticEnv(tokenizer, seed=cfg.seed, dataset=dataset_spec(cfg),
                         prompt_format=prompt_format(cfg),
                         min_digits=cfg.min_digits, max_digits=cfg.max_digits,
                         operators=cfg.operators, allow_negative=cfg.allow_negative)


@register_env("tool")
def _tool(cfg: EnvConfig, tokenizer: Any) -> Environment:
    return CalcEnv(tokenizer, seed=cfg.seed, dataset=dataset_spec(cfg),
                   prompt_format=prompt_format(cfg), max_turns=cfg.max_turns,
                   max_episode_tokens=cfg.max_episode_tokens, at_budget=cfg.at_budget)


@register_env("tools")
def _tools(cfg: EnvConfig, tokenizer: Any) -> Environment:
    """The model calls env.tools in its own format (`envs.agent.ToolTask`)."""
    from hybrid_engine.envs.agent import ToolTask
    from hybrid_engine.envs.reward_pool import RewardPool
    from hybrid_engine.tools.functions import load_tools

    if not cfg.tools:
        raise ValueError("env.name=tools needs env.tools (the functions the model may call, "
                         "'file.py:fn1,fn2')")
    tools = load_tools(cfg.tools, settings={"sandbox": sandbox(cfg)})
    pool = RewardPool(cfg.tool_workers, cfg.tool_timeout_s, preload=[t.spec for t in tools])
    task = ToolTask(tools, pool, prompt_format=prompt_format(cfg),
                    error_penalty=cfg.tool_error_penalty)
    return _chat_env(cfg, tokenizer, task, tools=tools, name="tools")


def _chat_env(cfg: EnvConfig, tokenizer: Any, task: Any, *, tools: list | None = None,
              name: str = "") -> Environment:
    """A ChatTask as the run's environment (`envs.agent.ChatEnv`)."""
    from hybrid_engine.envs.agent import ChatEnv
    from hybrid_engine.tools.functions import load_tools
    from hybrid_engine.tools.parsers import tool_parser

    if tools is None:
        tools = load_tools(cfg.tools, settings={"sandbox": sandbox(cfg)}) if cfg.tools else []
    return ChatEnv(tokenizer, task, dataset=dataset_spec(cfg), parser=tool_parser(cfg.tool_parser),
                   tools=tools, max_turns=cfg.max_turns, max_episode_tokens=cfg.max_episode_tokens,
                   at_budget=cfg.at_budget, seed=cfg.seed, prompt_format=prompt_format(cfg),
                   name=name or cfg.name)
