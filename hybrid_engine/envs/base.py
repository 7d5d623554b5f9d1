"""What every environment shares: tokenizer access, guarded rewards, a problem bank.

Job: (1) `encode` / `decode` / `eos_token_id` accept both a raw
`tokenizers.Tokenizer` and a transformers tokenizer; (2) `score_trajectories`
runs an environment's reward function on each trajectory through
`checked_reward`; (3) `ProblemBank` supplies training and held-out problems,
generated from a seed or read from a JSONL dataset, with a resumable position.

Invariants: a reward that raises, or returns anything but a mapping of finite
real numbers, is a `RewardError` naming the environment and the sample's
prompt, never a silent NaN in the advantages; a trajectory's reward is the sum
of its `reward_components`. Training and held-out problems are disjoint by
construction: a prompt is held out iff a stable hash of its text says so.
"""

from __future__ import annotations

import abc
import math
import numbers
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hybrid_engine.envs.dataset import EpochCursor, Example, load_jsonl
from hybrid_engine.models.tokenizer import EOS_TOKEN

if TYPE_CHECKING:
    from hybrid_engine.trajectory import Trajectory

__all__ = [
    "ProblemBank",
    "RewardError",
    "RewardFn",
    "checked_reward",
    "decode",
    "encode",
    "eos_token_id",
    "is_held_out",
    "score_trajectories",
]

RewardFn = Callable[["Trajectory", str], Mapping[str, float]]
"""(trajectory, prompt text) -> named reward components; the reward is their sum."""

_HELD_OUT_BUCKETS = 16  # 1/16 of the problem space is held out for evaluation


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


def is_held_out(prompt: str) -> bool:
    """True for the held-out (evaluation) share of prompts; stable across runs."""
    return zlib.crc32(prompt.encode("utf-8")) % _HELD_OUT_BUCKETS == 0


class ProblemBank:
    """Training problems (resumable stream) and held-out problems (fixed list).

    Generated mode: training problem i is drawn from a `random.Random` seeded
    by (seed, i), skipping held-out prompts, so the stream's state is the
    integer i. Dataset mode: the file's held-out records are the eval set, the
    others are served by an `EpochCursor`.

    Args:
        generate: rng -> Example, used when dataset_path is ''.
        dataset_path: JSONL file (see `load_jsonl`), or ''.
        seed: generation / shuffle seed.
        name: the environment's name, for error messages.
    """

    def __init__(
        self, generate: Callable[[random.Random], Example], *, dataset_path: str, seed: int,
        name: str,
    ) -> None:
        self.generate, self.seed, self.name = generate, seed, name
        self.index = 0
        self.answers: dict[str, str] = {}
        self.cursor: EpochCursor | None = None
        self.train: list[Example] = []
        self.held_out: list[Example] = []
        if dataset_path:
            self._load(dataset_path)

    def _load(self, path: str) -> None:
        examples = load_jsonl(path)
        for ex in examples:
            if self.answers.setdefault(ex.prompt, ex.answer) != ex.answer:
                raise ValueError(f"{path}: prompt {ex.prompt!r} has two different answers")
        self.train = [ex for ex in examples if not is_held_out(ex.prompt)]
        self.held_out = [ex for ex in examples if is_held_out(ex.prompt)]
        if not self.train:
            raise ValueError(f"{path}: every record falls in the held-out split")
        self.cursor = EpochCursor(len(self.train), seed=self.seed)

    def next_train(self, num: int) -> list[Example]:
        """The next num training problems."""
        if self.cursor is not None:
            return [self.train[i] for i in self.cursor.next_indices(num)]
        out = []
        for _ in range(num):
            for attempt in range(1000):
                ex = self.generate(random.Random(f"train:{self.seed}:{self.index}:{attempt}"))
                if not is_held_out(ex.prompt):
                    break
            else:
                raise AssertionError("generator only produces held-out prompts")
            out.append(ex)
            self.index += 1
        return out

    def eval_problems(self, num: int) -> list[Example]:
        """The first num distinct held-out problems (the same list every call).

        Raises:
            ValueError: fewer than num held-out problems exist.
        """
        if self.cursor is not None:
            found = list({ex.prompt: ex for ex in self.held_out}.values())[:num]
        else:
            seen: dict[str, Example] = {}
            for j in range(num * _HELD_OUT_BUCKETS * 50):
                if len(seen) == num:
                    break
                ex = self.generate(random.Random(f"eval:{self.seed}:{j}"))
                if is_held_out(ex.prompt):
                    seen.setdefault(ex.prompt, ex)
            found = list(seen.values())
        if len(found) < num:
            raise ValueError(
                f"environment {self.name!r}: asked for {num} held-out problems, "
                f"found only {len(found)} (problem space or dataset too small)"
            )
        return found

    def state_dict(self) -> dict[str, Any]:
        """Position of the training stream."""
        if self.cursor is not None:
            return {"cursor": self.cursor.state_dict()}
        return {"index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a position saved by `state_dict()`."""
        if self.cursor is not None:
            self.cursor.load_state_dict(state["cursor"])
            return
        if state["seed"] != self.seed:
            raise ValueError(f"state saved with seed {state['seed']}, bank has {self.seed}")
        self.index = int(state["index"])


class ProblemEnv(abc.ABC):
    """Shared part of environments built on a ProblemBank.

    Subclasses set `name`, `tokenizer`, `bank` and implement
    `_reward(traj, prompt_text) -> dict[str, float]` and
    `_answer_from_prompt(prompt_text) -> str | None` (None: not a prompt of
    this environment).
    """

    name: str
    tokenizer: Any
    bank: ProblemBank

    def answer_for(self, prompt_text: str) -> str:
        """Reference answer of a prompt this environment issued.

        Raises:
            ValueError: neither a dataset prompt nor a generated prompt.
        """
        if prompt_text in self.bank.answers:
            return self.bank.answers[prompt_text]
        answer = self._answer_from_prompt(prompt_text)
        if answer is None:
            raise ValueError(f"environment {self.name!r}: unknown prompt {prompt_text!r}")
        return answer

    @abc.abstractmethod
    def _answer_from_prompt(self, prompt_text: str) -> str | None:
        """The answer of a generated prompt, or None if it is not one."""

    @abc.abstractmethod
    def _reward(self, traj: Any, prompt_text: str) -> dict[str, float]:
        """Named reward parts of one trajectory (summed by the guard)."""

    def sample_prompts(self, num_prompts: int) -> list[list[int]]:
        """The next num_prompts training prompts, as token ids."""
        return [encode(self.tokenizer, ex.prompt) for ex in self.bank.next_train(num_prompts)]

    def eval_prompts(self, num_prompts: int) -> list[list[int]]:
        """The held-out prompts (same list every call, disjoint from training)."""
        return [encode(self.tokenizer, ex.prompt) for ex in self.bank.eval_problems(num_prompts)]

    def score(self, trajs: Sequence[Any]) -> None:
        """Fills reward and reward_components of every trajectory."""
        score_trajectories(self.name, self.tokenizer, trajs, self._reward)

    def state_dict(self) -> dict[str, Any]:
        """Position of the training prompt stream."""
        return self.bank.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes the training prompt stream saved by `state_dict()`."""
        self.bank.load_state_dict(state)
