"""What every environment shares: tokenizer access, guarded rewards, problem environments.

Job: (1) `encode` / `decode` / `eos_token_id` accept both a raw
`tokenizers.Tokenizer` and a transformers tokenizer; (2) `score_trajectories`
runs an environment's reward function on each trajectory through
`checked_reward`; (3) `ProblemEnv` is the shared part of environments whose
problems come from a `ProblemBank` (`envs/bank.py`), templated through a
`PromptFormat` (`envs/chat.py`).

Invariants: a reward that raises, or returns anything but a mapping of finite
real numbers, is a `RewardError` naming the environment and the sample's
prompt, never a silent NaN in the advantages; a trajectory's reward is the sum
of its `reward_components`.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hybrid_engine.envs.bank import ProblemBank
from hybrid_engine.envs.chat import PromptFormat
from hybrid_engine.envs.dataset import Example
from hybrid_engine.models.tokenizer import EOS_TOKEN

if TYPE_CHECKING:
    from hybrid_engine.trajectory import Trajectory

__all__ = [
    "ProblemEnv",
    "RewardError",
    "RewardFn",
    "checked_reward",
    "decode",
    "encode",
    "eos_token_id",
    "score_trajectories",
]

RewardFn = Callable[["Trajectory", str], Mapping[str, float]]
"""(trajectory, prompt text) -> named reward components; the reward is their sum."""

def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text, without special tokens added."""
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(out, "ids", out))


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of ids, special tokens dropped."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def eos_token_id(tokenizer: Any) -> int:
    """The tokenizer's end-of-sequence id (transformers or raw `tokenizers`)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None and hasattr(tokenizer, "token_to_id"):
        eos = tokenizer.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no EOS token")
    return int(eos)


class RewardError(ValueError):
    """A reward function raised or returned a non-finite / non-numeric value.

    A ValueError: like other bad input it is found the same way on every rank
    (every rank scores the same trajectories) and reported once."""


def _is_finite_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def checked_reward(
    env_name: str, prompt_text: str, fn: RewardFn, traj: Trajectory
) -> dict[str, float]:
    """Runs fn on one sample and validates its result.

    Returns:
        The components as plain floats.

    Raises:
        RewardError: fn raised, returned something other than a non-empty
            mapping of str -> finite real, naming env_name and the prompt.
    """
    where = f"environment {env_name!r}, sample with prompt {prompt_text[:200]!r}"
    try:
        components = fn(traj, prompt_text)
    except (Exception, SystemExit) as exc:  # a sys.exit() in a user's reward is a bug too
        raise RewardError(f"{where}: reward function raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(components, Mapping) or not components:
        raise RewardError(
            f"{where}: reward function must return a number or a non-empty mapping of "
            f"components, got {components!r}"
        )
    bad = {k: v for k, v in components.items() if not _is_finite_real(v)}
    if bad:
        raise RewardError(f"{where}: reward components must be finite numbers, got {bad!r}")
    return {str(k): float(v) for k, v in components.items()}


def score_trajectories(
    env_name: str, tokenizer: Any, trajs: Sequence[Trajectory], fn: RewardFn
) -> None:
    """Fills reward_components (checked) and reward (their sum) of every trajectory."""
    for traj in trajs:  # the whole prompt, also when the rollout truncated it
        prompt_text = decode(tokenizer, traj.info.get("source_prompt_ids", traj.prompt_ids))
        traj.reward_components = checked_reward(env_name, prompt_text, fn, traj)
        traj.reward = math.fsum(traj.reward_components.values())


class ProblemEnv(abc.ABC):
    """Shared part of environments built on a ProblemBank.

    Subclasses set `name`, `tokenizer`, `bank` (and `prompt_format`, how
    prompts become ids: `envs/chat.py`) and implement
    `_reward(traj, prompt_text) -> dict[str, float]` and
    `_answer_from_prompt(prompt_text) -> str | None` (None: not a prompt of
    this environment).
    """

    name: str
    tokenizer: Any
    bank: ProblemBank
    prompt_format: PromptFormat = PromptFormat()

    def example_for(self, prompt_text: str) -> Example | None:
        """The problem this environment handed out with that prompt (as the rewards
        read it: its ids decoded), if it was handed out recently."""
        return self.bank.recalled(prompt_text)

    def prompt_origin(self, prompt_ids: Sequence[int]) -> str | None:
        """Where a prompt handed out recently came from, for a message: its
        dataset file and row ('env.dataset_path=..., row i'); None for a
        generated prompt or one this environment did not hand out."""
        ex = self.bank.recalled(decode(self.tokenizer, list(prompt_ids)))
        return None if ex is None else self.bank.origin(ex)

    def answer_for(self, prompt_text: str) -> str:
        """Reference answer of a prompt this environment issued.

        Raises:
            ValueError: neither a problem handed out recently nor a generated prompt.
        """
        ex = self.bank.recalled(prompt_text)
        if ex is not None:
            return ex.answer
        answer = self._answer_from_prompt(prompt_text)
        if answer is None:
            raise ValueError(f"environment {self.name!r}: unknown prompt {prompt_text!r}")
        return answer

    def _hand_out(self, examples: Sequence[Example]) -> list[list[int]]:
        """The problems' prompts as token ids (templated once), each remembered for
        its answer."""
        out = []
        for ex in examples:
            ids = self.prompt_format.ids(self.tokenizer, ex.prompt)
            self.bank.remember(decode(self.tokenizer, ids), ex)
            out.append(ids)
        return out

    @abc.abstractmethod
    def _answer_from_prompt(self, prompt_text: str) -> str | None:
        """The answer of a generated prompt, or None if it is not one."""

    @abc.abstractmethod
    def _reward(self, traj: Any, prompt_text: str) -> dict[str, float]:
        """Named reward parts of one trajectory (summed by the guard)."""

    def sample_prompts(self, num_prompts: int) -> list[list[int]]:
        """The next num_prompts training prompts, as token ids."""
        return self._hand_out(self.bank.next_train(num_prompts))

    def eval_prompts(self, num_prompts: int) -> list[list[int]]:
        """The evaluation prompts (same list every call, disjoint from training);
        0 = all of a dataset's."""
        return self._hand_out(self.bank.eval_problems(num_prompts))

    def eval_sources(self, num_prompts: int) -> list[str | None]:
        """The data_source column of each of `eval_prompts(num_prompts)` (None
        where a row has none)."""
        return [ex.extras.get("data_source") for ex in self.bank.eval_problems(num_prompts)]

    def score(self, trajs: Sequence[Any]) -> None:
        """Fills reward and reward_components of every trajectory."""
        score_trajectories(self.name, self.tokenizer, trajs, self._reward)

    def state_dict(self) -> dict[str, Any]:
        """Position of the training prompt stream."""
        return self.bank.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes the training prompt stream saved by `state_dict()` (and remembers
        the problems handed out just before it)."""
        self._hand_out(self.bank.load_state_dict(state))
