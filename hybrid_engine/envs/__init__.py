"""Environments (tasks): a name registry and `make_env`.

Job: map `EnvConfig.name` to a constructor `(cfg, tokenizer) -> Environment`
(`roles.base.Environment`: `sample_prompts`, `score`), so a recipe picks the
task by name and the controller never imports a task module.

Invariant: a name is registered once; an unknown name is a `ValueError`
listing the registered names and the closest one, never a silent default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybrid_engine.algorithms.registry import Registry
from hybrid_engine.envs.arithmetic import ArithmeticEnv
from hybrid_engine.envs.base import RewardError
from hybrid_engine.envs.tool import ToolEnv

if TYPE_CHECKING:
    from hybrid_engine.config import EnvConfig
    from hybrid_engine.roles.base import Environment

__all__ = ["ENVS", "ArithmeticEnv", "RewardError", "ToolEnv", "make_env", "register_env"]

EnvFactory = Callable[["EnvConfig", Any], "Environment"]

ENVS: Registry[EnvFactory] = Registry("environment")


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: registers `factory(cfg, tokenizer) -> Environment` under name."""

    def deco(factory: EnvFactory) -> EnvFactory:
        ENVS.add(name, factory)
        return factory

    return deco


def make_env(cfg: EnvConfig, tokenizer: Any) -> Environment:
    """Builds the environment cfg.name names.

    Args:
        cfg: name, dataset_path ('' = generated problems), seed.
        tokenizer: the policy's tokenizer (`tokenizers.Tokenizer` or transformers).

    Raises:
        ValueError: unknown name (lists the registered ones and the closest),
            or a bad dataset file.
    """
    return ENVS.get(cfg.name)(cfg, tokenizer)


@register_env("arithmetic")
def _arithmetic(cfg: EnvConfig, tokenizer: Any) -> Environment:
    return ArithmeticEnv(tokenizer, seed=cfg.seed, dataset_path=cfg.dataset_path)


@register_env("tool")
def _tool(cfg: EnvConfig, tokenizer: Any) -> Environment:
    return ToolEnv(tokenizer, seed=cfg.seed, dataset_path=cfg.dataset_path)
