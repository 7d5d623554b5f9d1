"""Reward calls in worker processes, with timeouts that stop them.

Job: `RewardPool.run(calls)` runs each `Call` (a function named by its spec,
with its arguments) in one of `workers` spawned processes (pebble's
ProcessPool) and returns one `Outcome` per call, in order:

    ok       the value it returned
    timeout  it ran past timeout_s: its worker process was killed (and replaced)
    error    it raised (also SystemExit) or its worker died: "Type: message"

A worker runs a call in its main thread, so libraries whose own timeouts use
signals (math-verify) work. With workers=0 calls run in this process, in
order, with no timeout.

Invariant: no worker outlives the pool: `close()` stops them, and each one
is killed by the kernel when its rank dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Call", "Outcome", "RewardPool"]

_LOADED: dict[str, Callable[..., Any]] = {}  # per process: spec -> function


@dataclass(frozen=True)
class Call:
    spec: str  # 'module:function' or 'file.py:function'
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    kind: str  # "ok", "timeout" or "error"
    value: Any = None  # the returned value, or the error text


def _run(call: Call) -> Outcome:
    """Runs one call (in a worker, or here with workers=0)."""
    from hybrid_engine.envs.user_code import load_function

    try:
        fn = _LOADED.get(call.spec)
        if fn is None:
            fn = _LOADED[call.spec] = load_function(call.spec, "env.rewards")
        return Outcome("ok", fn(*call.args, **call.kwargs))
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # the user's code: reported
        return Outcome("error", f"{type(e).__name__}: {e}")


def _worker_init(specs: Sequence[str]) -> None:
    """Dies with its rank; leaves Ctrl-C to the rank; loads the functions it will
    run, so their imports are not timed as a call."""
    from hybrid_engine.envs.user_code import load_function

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: close() still stops the workers
        pass
    for spec in specs:
        try:
            _LOADED[spec] = load_function(spec, "env.rewards")
        except ValueError:  # reported by the call that needs it
            pass


class RewardPool:
    """Worker processes for reward calls (see the module docstring).

    Args:
        workers: processes (0: run calls in this process, no timeouts).
        timeout_s: the most one call may run (0: no limit); a worker's start
            (imports, loading `preload`) is not timed.
        preload: the specs each worker loads as it starts.
    """

    def __init__(self, workers: int, timeout_s: float, preload: Sequence[str] = ()) -> None:
        self.workers, self.timeout_s, self.preload = workers, timeout_s, tuple(preload)
        self._pool = None

    def start(self) -> None:
        """Spawns the workers now (else at the first call): they import while the
        engines start."""
        if self.workers and self._pool is None:
            from pebble import ProcessPool

            self._pool = ProcessPool(max_workers=self.workers, initializer=_worker_init,
                                     initargs=(self.preload,),
                                     context=multiprocessing.get_context("spawn"))

    def run(self, calls: Sequence[Call]) -> list[Outcome]:
        """One outcome per call, in order."""
        if not self.workers:
            return [_run(c) for c in calls]
        self.start()
        futures = [self._pool.submit(_run, self.timeout_s or None, c) for c in calls]
        return [self._outcome(f) for f in futures]

    def _outcome(self, future: concurrent.futures.Future) -> Outcome:
        try:
            return future.result()
        except concurrent.futures.TimeoutError:
            return Outcome("timeout")
        except Exception as e:  # the worker died (os._exit, a crash) or the result did not pickle
            return Outcome("error", f"{type(e).__name__}: {e}")

    def close(self) -> None:
        """Stops the workers (idempotent)."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None
