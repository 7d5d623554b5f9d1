"""The built-in reward functions `env.rewards` names: `math` and `format`.

    math    1.0 when the completion's final answer equals the reference answer
            symbolically (math-verify: `\\boxed{}` first, then LaTeX, then plain
            numbers and expressions), else 0.0. A reference is GSM8K's `#### N`,
            MATH's `\\boxed{...}`, LaTeX or a plain number.
    format  1.0 when the whole completion matches a regex, else 0.0. The
            default regex is reasoning in `<think>...</think>`, then an answer.

Both are plain functions `(prompt, completion, answer, **settings) -> float`
that the reward pool runs in its worker processes, where math-verify's own
signal-based timeouts work (they refuse to run outside a main thread).
"""

from __future__ import annotations

import functools
import re

from math_verify import parse, verify  # at import: a reward worker loads it before any call

__all__ = ["THINK_FORMAT", "format_reward", "math_reward", "reference_answer"]

THINK_FORMAT = r"\s*<think>.*?</think>\s*\S.*"
"""`format`'s default: reasoning inside <think>...</think>, then a non-empty answer."""


def reference_answer(answer: str) -> str:
    """The part of a reference answer to compare: the text after GSM8K's last
    '####' when there is one, else all of it, stripped."""
    _, sep, tail = answer.rpartition("####")
    return (tail if sep else answer).strip()


@functools.lru_cache(maxsize=4096)
def _gold(answer: str) -> tuple:
    """math-verify's parse of a reference answer, as LaTeX in math mode unless it
    already has delimiters or a box (plain numbers parse either way)."""
    text = reference_answer(answer)
    if "$" not in text and "\\boxed" not in text and "\\(" not in text:
        text = f"${text}$"
    return tuple(parse(text))


def math_reward(prompt: str, completion: str, answer: str | None) -> float:  # noqa: ARG001
    """1.0 if the completion's answer equals `answer` symbolically, else 0.0 (an
    empty or unparseable completion, or no reference answer, is 0.0)."""
    if not answer or not completion.strip():
        return 0.0
    gold = list(_gold(answer))
    if not gold:
        return 0.0
    return 1.0 if verify(gold, parse(completion)) else 0.0


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


def format_reward(prompt: str, completion: str, answer: str | None,  # noqa: ARG001
                  pattern: str = "") -> float:
    """1.0 if the whole completion matches pattern ('' = THINK_FORMAT, dot
    matching newlines), else 0.0."""
    return 1.0 if _compiled(pattern or THINK_FORMAT).fullmatch(completion) else 0.0
