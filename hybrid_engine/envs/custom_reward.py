"""A user's reward function in place of an environment's own (`env.reward_fn`).

Job: load `function` from 'path/to/file.py:function' or
'package.module:function', and wrap an environment so its `score` calls

    function(prompt: str, completion: str, answer: str | None, **columns)
        -> float | {name: float}

on every sample (completion = the response text up to the first EOS; answer =
the environment's reference answer when it has one; columns = the dataset
row's other columns, those the function names, or all with **kwargs). Everything else --
prompts, evaluation prompts, checkpoint state, multi-turn hooks -- comes from
the wrapped environment.

Invariant: the user's function runs behind `checked_reward`, so a raise (also
`sys.exit`) or a NaN / inf / non-number is a `RewardError` naming the function
and the sample, identical on every rank (every rank scores the same
trajectories), never a silent NaN in the advantages. With a timeout, each call
runs in a daemon thread: one that has not returned after `timeout_s` is a
`RewardError` too (the stuck thread is abandoned; the run stops anyway).
"""

from __future__ import annotations

import inspect
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybrid_engine.envs.base import decode, eos_token_id, score_trajectories
from hybrid_engine.envs.user_code import load_function

__all__ = ["CustomRewardEnv", "load_reward_fn"]

UserRewardFn = Callable[[str, str, "str | None"], "float | Mapping[str, float]"]


def load_reward_fn(spec: str) -> UserRewardFn:
    """The callable env.reward_fn names (`user_code.load_function`).

    Raises:
        ValueError: malformed spec, missing file or module, a module that
            fails to import, or no callable of that name.
    """
    return load_function(spec, "env.reward_fn")


class CustomRewardEnv:
    """`base_env` with its reward replaced by a user function (see the module docstring).

    Args:
        base_env: the task environment (prompts, answers, state).
        fn: the user's reward function.
        tokenizer: the policy's tokenizer.
        fn_name: how error messages name the function (the config spec).
        timeout_s: the most one call may take; 0 = no limit.
    """

    def __init__(self, base_env: Any, fn: UserRewardFn, tokenizer: Any, *, fn_name: str,
                 timeout_s: float = 0.0) -> None:
        self.base_env, self.fn, self.tokenizer = base_env, fn, tokenizer
        self.timeout_s = timeout_s
        # The dataset row's other columns it receives: those it names, or all with **kwargs.
        params = inspect.signature(fn).parameters.values()
        self._takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
        self._takes = {p.name for p in list(params)[3:]
                       if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.eos_id = eos_token_id(tokenizer)
        self.name = f"{getattr(base_env, 'name', type(base_env).__name__)} (reward_fn {fn_name})"

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: delegate to the task.
        if name == "base_env":
            raise AttributeError(name)
        return getattr(self.base_env, name)

    def _reward(self, traj: Any, prompt_text: str) -> Any:
        ids = list(traj.response_ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        answer_for = getattr(self.base_env, "answer_for", None)
        try:
            answer = answer_for(prompt_text) if answer_for is not None else None
        except ValueError:
            answer = None
        example_for = getattr(self.base_env, "example_for", None)
        ex = example_for(prompt_text) if example_for is not None else None
        extras = {k: v for k, v in (ex.extras if ex is not None else {}).items()
                  if self._takes_all or k in self._takes}
        out = _call(self.fn, self.timeout_s, prompt_text, decode(self.tokenizer, ids), answer,
                    **extras)
        if isinstance(out, numbers.Real) and not isinstance(out, bool):
            return {"reward": out}
        return out  # a mapping, or something checked_reward rejects with the value shown

    def score(self, trajs: Sequence[Any]) -> None:
        """Fills reward and reward_components of every trajectory from the user function."""
        score_trajectories(self.name, self.tokenizer, trajs, self._reward)


def _call(fn: UserRewardFn, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs); with timeout_s > 0 in a daemon thread, raising
    TimeoutError if it has not returned by then. What fn raises is re-raised here."""
    if not timeout_s:
        return fn(*args, **kwargs)
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            error.append(e)

    worker = threading.Thread(target=run, name="reward_fn", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"no result within env.reward_timeout_s={timeout_s:g} s")
    if error:
        raise error[0]
    return result[0]
