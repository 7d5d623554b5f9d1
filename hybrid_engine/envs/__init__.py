"""Environments (tasks): prompts, answers and rewards.

The registry and `make_env` live in `envs/registry.py` and load on first use
of a name below: importing `hybrid_engine.envs.<module>` alone stays light (no
torch), so a reward worker process starts in a fraction of a second.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ENVS", "ArithmeticEnv", "PromptFormat", "RewardError", "CalcEnv", "dataset_spec",
           "make_env", "prompt_format", "register_env", "reward_terms"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hybrid_engine.envs import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
