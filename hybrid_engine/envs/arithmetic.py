"""Verifiable multi-digit addition / subtraction: prompts like "12+345=".

Job: generate problems from a seed (or read them from dataset files), hold
out an evaluation set disjoint from training, and reward completions.

Reward (`arithmetic_reward`), on the response cut at the first EOS token and
then at the first newline, with surrounding whitespace stripped:

    correct = 1.0  if that text is an integer ([+-]?digits) equal to the answer
                   (compared as integers; a non-integer dataset answer is
                   compared as text), else 0.0
    format  = 0.1  if that text is an integer AND the response stopped there
                   (an EOS token or a newline follows it), else 0.0
    reward  = correct + format                  (so 1.1, 1.0, 0.1 or 0.0)

Invariant: the answer of a generated prompt is recomputed from its text, so
scoring needs no state and works on any rank or after a restart; a dataset
prompt's answer is the row's, remembered when the prompt was handed out
(`envs/bank.py`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from hybrid_engine.envs.base import ProblemEnv, decode, eos_token_id
from hybrid_engine.envs.bank import ProblemBank
from hybrid_engine.envs.chat import PromptFormat
from hybrid_engine.envs.dataset import DatasetSpec, Example
from hybrid_engine.trajectory import Trajectory

__all__ = ["ArithmeticEnv", "arithmetic_reward", "parse_completion"]

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.1

_INT = re.compile(r"[+-]?[0-9]+")
_PROBLEM = re.compile(r"^([0-9]+)([+-])([0-9]+)=$", re.MULTILINE)  # its own line if templated


def parse_completion(text: str) -> tuple[str, bool]:
    """Answer text of a completion (already cut at EOS) and whether it stopped.

    Returns:
        (text before the first newline, stripped; True when a newline followed).
    """
    head, newline, _ = text.partition("\n")
    return head.strip(), bool(newline)


def arithmetic_reward(answer_text: str, stopped: bool, expected: str) -> dict[str, float]:
    """The reward components of one parsed completion (see the module docstring)."""
    is_int = _INT.fullmatch(answer_text) is not None
    if is_int and _INT.fullmatch(expected):
        correct = int(answer_text) == int(expected)
    else:
        correct = answer_text == expected
    return {
        "correct": CORRECT_REWARD if correct else 0.0,
        "format": FORMAT_REWARD if is_int and stopped else 0.0,
    }


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    num_digits = rng.randint(min_digits, max_digits)
    low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
    return rng.randint(low, 10**num_digits - 1)


class ArithmeticEnv(ProblemEnv):
    """`Environment` for "a+b=" / "a-b=" problems.

    Args:
        tokenizer: `tokenizers.Tokenizer` or a transformers tokenizer.
        seed: generation / shuffle seed.
        dataset: where the problems come from (`envs.dataset.DatasetSpec`, or a
            path); None = generated.
        min_digits: fewest digits of an operand (>= 1).
        max_digits: most digits of an operand (>= min_digits).
        operators: subset of "+" and "-".
        allow_negative: False orders the operands of "-" so results are >= 0.
        prompt_format: how prompts become token ids (`envs.chat.PromptFormat`;
            None = the tokenizer's chat template if it has one).
    """

    name = "arithmetic"

    def __init__(
        self, tokenizer: Any, *, seed: int = 0, dataset: DatasetSpec | str | None = None,
        min_digits: int = 1, max_digits: int = 3, operators: Sequence[str] = ("+", "-"),
        allow_negative: bool = True, prompt_format: PromptFormat | None = None,
    ) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if not operators or set(operators) - {"+", "-"}:
            raise ValueError(f"operators must be a non-empty subset of '+', '-', got {operators}")
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format or PromptFormat()
        self.prompt_format.check(tokenizer)
        self.eos_id = eos_token_id(tokenizer)
        self.min_digits, self.max_digits = min_digits, max_digits
        self.operators, self.allow_negative = tuple(operators), allow_negative
        if isinstance(dataset, str):
            dataset = DatasetSpec(dataset) if dataset else None
        self.bank = ProblemBank(self._generate, dataset=dataset, seed=seed, name=self.name)

    def _generate(self, rng: random.Random) -> Example:
        a = _operand(rng, self.min_digits, self.max_digits)
        b = _operand(rng, self.min_digits, self.max_digits)
        op = rng.choice(self.operators)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        return Example(prompt=f"{a}{op}{b}=", answer=str(a + b if op == "+" else a - b))

    def _answer_from_prompt(self, prompt_text: str) -> str | None:
        m = _PROBLEM.search(prompt_text)
        if m is None:
            return None
        a, op, b = int(m[1]), m[2], int(m[3])
        return str(a + b if op == "+" else a - b)

    def _reward(self, traj: Trajectory, prompt_text: str) -> dict[str, float]:
        ids = list(traj.response_ids)
        stopped_by_eos = self.eos_id in ids
        if stopped_by_eos:
            ids = ids[: ids.index(self.eos_id)]
        answer_text, stopped = parse_completion(decode(self.tokenizer, ids))
        expected = self.answer_for(prompt_text)
        return arithmetic_reward(answer_text, stopped or stopped_by_eos, expected)

