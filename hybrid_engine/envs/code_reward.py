"""The built-in `code` reward: the share of a row's test cases the completion's code passes.

Job: `code_reward(prompt, completion, answer, tests)` takes the code (the last
```python fenced block of the completion, else all of it) and runs each case
of the row's `tests` column in its own sandboxed process (`tools.sandbox`):

    ["assert f(1) == 2", ...]                  each statement after the code; it
                                               passes when the program reaches
                                               the end (a marker printed after
                                               the statement) and exits 0
    [{"input": "1 2\\n", "output": "3\\n"}, ...] stdin / stdout pairs; a pair
                                               passes when the program exits 0
                                               and prints the output (lines
                                               compared without trailing spaces)
    {"inputs": [...], "outputs": [...]}        the same pairs (APPS, TACO)

or any of them as a JSON string. The reward is passed / cases, in [0, 1].

Invariant: every case runs in the sandbox, never in the reward worker; a case
that fails, times out, crashes or floods its output scores 0 and the run goes
on; a malformed `tests` value or a failing sandbox raises (a data or setup
error, not a score).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import replace
from typing import Any

from hybrid_engine.tools.sandbox import Sandbox

__all__ = ["code_reward", "extract_code", "read_cases"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)```", re.S | re.I)
_MIN_CASE_S = 0.5  # a case is not started with less of the budget left


def extract_code(completion: str) -> str:
    """The last ```python (or untagged) fenced block of completion, else all of it."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def read_cases(tests: Any) -> list[str | tuple[str, str]]:
    """The cases of a `tests` value: assert statements, or (stdin, stdout) pairs.

    Raises:
        ValueError: a value of none of the shapes (the module docstring's), or no case.
    """
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            raise ValueError(f"tests: a string that is not JSON: {tests[:200]!r}") from None
    if isinstance(tests, dict) and "fn_name" in tests:
        raise ValueError("tests: call-based cases (fn_name) are not supported; give assert "
                         "statements or stdin/stdout pairs")
    if isinstance(tests, dict) and {"inputs", "outputs"} <= set(tests):
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"],
                                                             strict=True)]
    cases: list[str | tuple[str, str]] = []
    for case in tests if isinstance(tests, (list, tuple)) else [None]:
        if isinstance(case, str):
            cases.append(case)
        elif isinstance(case, dict) and {"input", "output"} <= set(case):
            cases.append((_text(case["input"]), _text(case["output"])))
        else:
            raise ValueError("tests must be a list of assert statements, a list of "
                             "{'input', 'output'} pairs or {'inputs': [...], 'outputs': [...]}; "
                             f"got {str(tests)[:200]!r}")
    if not cases:
        raise ValueError("tests: a row without test cases")
    return cases


def _text(value: Any) -> str:
    """A case's input or output as text (a list: its items as lines)."""
    if isinstance(value, list):
        return "\n".join(map(str, value))
    return value if isinstance(value, str) else str(value)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _passes(code: str, case: str | tuple[str, str], sandbox: Sandbox) -> bool:
    """Whether one case passes (see the module docstring)."""
    if isinstance(case, str):
        marker = secrets.token_hex(8)
        result = sandbox.run(f"{code}\n\n{case}\nprint({marker!r})\n")
        return result.ok and result.stdout.rstrip().rsplit("\n", 1)[-1] == marker
    stdin, want = case
    result = sandbox.run(code, stdin)
    return result.ok and _lines(result.stdout) == _lines(want)


def code_reward(prompt: str, completion: str, answer: str | None, tests: Any,  # noqa: ARG001
                sandbox: Sandbox = Sandbox(), budget_s: float = 0.0) -> float:  # noqa: B008
    """The share of tests the completion's code passes, each case in its own
    sandboxed run.

    Args:
        tests: the row's test cases (`read_cases` reads them).
        sandbox: where each case runs and under which limits (the run's
            env.sandbox_* keys).
        budget_s: the most seconds all cases may take (0: no limit); a case is
            cut to what is left, and those it leaves no time for fail, so the
            call returns before its worker's timeout.

    Raises:
        ValueError: tests has none of the supported shapes.
        SandboxError: the sandbox could not run a case.
    """
    cases, code = read_cases(tests), extract_code(completion)
    start, passed = time.monotonic(), 0
    for case in cases:
        run_in = sandbox
        if budget_s:
            left = budget_s - (time.monotonic() - start)
            if left < _MIN_CASE_S:
                break
            if left < sandbox.limits.timeout_s:
                run_in = replace(sandbox, limits=replace(sandbox.limits, timeout_s=left))
        passed += _passes(code, case, run_in)
    return passed / len(cases)
