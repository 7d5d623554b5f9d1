"""The built-in `python` tool (`env.tools=python`): the model's program, run in the sandbox.

Job: `python(code)` runs a program with `tools.sandbox.Sandbox` and returns the
text the model reads: its stdout, then its stderr and how it ended when it did
not exit 0. The run's sandbox (limits, or a service's url) is the tool's
setting `sandbox`, which the run passes from the env.sandbox_* keys
(`tools.functions.load_tools(..., settings=)`); the model never sees it.

Invariant: the model's program never runs in the caller's process; a failure of
the sandbox itself raises `SandboxError` (the tool runner reports it as the
call's error).
"""

from __future__ import annotations

import signal

from hybrid_engine.tools.sandbox import Sandbox, SandboxResult

__all__ = ["python", "result_text"]


def python(code: str, sandbox: Sandbox = Sandbox()) -> str:  # noqa: B008 (frozen, shared)
    """Runs a Python 3 program in a fresh process and returns what it prints (its
    stdout, and its stderr when it fails). Nothing is kept between calls, the
    network may be unavailable, and a program that runs too long is stopped.

    Args:
        code: The whole program; print the values you want to see.
        sandbox: Set by the run, not by the model.
    """
    return result_text(sandbox.run(code), sandbox)


def result_text(result: SandboxResult, sandbox: Sandbox) -> str:
    """What the model reads of a run: stdout, then stderr and how it ended."""
    parts = [result.stdout.rstrip("\n")]
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr.rstrip()}")
    if result.timed_out:
        parts.append(f"(stopped: it ran past {sandbox.limits.timeout_s:g} s)")
    elif result.truncated:
        parts.append(f"(stopped: its output passed {sandbox.limits.output_kb} KiB; cut there)")
    elif result.signal:
        parts.append(f"(killed by signal {_signal_name(result.signal)})")
    elif result.exit_code:
        parts.append(f"(exit code {result.exit_code})")
    return "\n".join(p for p in parts if p) or "(no output)"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
