"""Preprocessors for public datasets: a row in, `{"prompt", "answer", ...}` out (`env.preprocess`).

Job: the shapes `env.prompt_key` / `env.answer_key` cannot express --
`hybrid_engine.envs.preprocess:gsm8k` for GSM8K (`question`; `answer` a
worked solution ending in "#### N": the answer is N, commas dropped) and
`hybrid_engine.envs.preprocess:math` for MATH (`problem`; `solution` with the
answer in its last `\\boxed{...}`). The row's other columns are kept, so
reward functions receive them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["gsm8k", "last_boxed", "math"]


def gsm8k(row: Mapping[str, Any]) -> dict[str, Any]:
    """GSM8K's row: the question, and the number after the solution's '####'.

    Raises:
        ValueError: the answer has no '####'.
    """
    solution = str(row["answer"])
    if "####" not in solution:
        raise ValueError(f"a GSM8K answer ends in '#### N', got {solution[-80:]!r}")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    rest = {k: v for k, v in row.items() if k not in ("question", "answer")}
    return {**rest, "prompt": row["question"], "answer": final, "solution": solution}


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in text, braces balanced;
    None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def math(row: Mapping[str, Any]) -> dict[str, Any]:
    """MATH's row: the problem, and the last \\boxed{} of the solution.

    Raises:
        ValueError: the solution has no complete \\boxed{...}.
    """
    answer = last_boxed(str(row["solution"]))
    if answer is None:
        raise ValueError(f"a MATH solution puts its answer in \\boxed{{...}}, got "
                         f"{str(row['solution'])[-80:]!r}")
    rest = {k: v for k, v in row.items() if k not in ("problem", "solution")}
    return {**rest, "prompt": row["problem"], "answer": answer.strip(),
            "solution": row["solution"]}
