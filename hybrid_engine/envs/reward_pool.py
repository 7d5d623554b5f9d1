"""Reward calls in worker processes, with timeouts that stop them.

Job: `RewardPool.run(calls)` runs each `Call` (a function named by its spec,
with its arguments) in one of `workers` spawned processes (pebble's
ProcessPool) and returns one `Outcome` per call, in order:

    ok       the value it returned
    timeout  it ran past timeout_s, or the batch stalled (below): its worker
             process was killed (and replaced)
    error    it raised (also SystemExit) or its worker died: "Type: message"

The calls of one `run` are also timed out together. A stall, timeout_s with
no call of the batch returning (a call that timed out is no progress), stops
the calls running then; a second stall in the same batch stops every call
left, running or queued. A function that hangs on every input so costs about
two timeouts per batch, not one per call and worker restart; one that hangs
on one sample costs that sample only; a batch that keeps returning is never
cut. The clock runs only while a call of the batch runs (a worker's start,
and calls queued behind another thread's batch, are not timed): `run` may be
called from several threads at once (tools of many episodes).

A worker runs a call in its main thread, so libraries whose own timeouts use
signals (math-verify) work. With workers=0 calls run in this process, in
order, in the calling thread, with no timeout.

Workers do not import the parent's `__main__`: a script that starts a job at
module level, without an `if __name__ == "__main__":` guard (as embedding
scripts often are), would otherwise run again inside every worker. They load
only the reward functions their calls name.

Invariant: no worker outlives the pool: `close()` stops them, and each one
is killed by the kernel when its rank dies (PR_SET_PDEATHSIG, where the thread
that spawned it lives as long as the pool), or ends itself when its rank is
gone (a thread that watches the parent's pid, where the pool started in a
thread that may end first).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import signal
import sys
import threading
import time
import types
from multiprocessing import popen_spawn_posix
from multiprocessing.context import SpawnContext, SpawnProcess
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


def _worker_init(specs: Sequence[str], deathsig: bool = True) -> None:
    """Dies with its rank; leaves Ctrl-C to the rank; loads the functions it will
    run, so their imports are not timed as a call.

    deathsig: the kernel kills the worker when the thread that spawned it ends
    (PR_SET_PDEATHSIG follows the spawning thread, not the process), so it is
    set only where that thread lives as long as the pool: the main thread, and
    pebble's own thread that replaces dead workers. Otherwise a thread here
    watches the parent's pid."""
    from hybrid_engine.envs.user_code import load_function

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    try:
        if not deathsig:
            raise OSError("watch the parent instead")
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux, or deathsig off: a watcher (close() still stops them)
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    for spec in specs:
        try:
            _LOADED[spec] = load_function(spec, "env.rewards")
        except ValueError:  # reported by the call that needs it
            pass


def _exit_with(parent: int) -> None:
    """Ends this worker once its parent process is gone (it is re-parented)."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def _noop() -> None:
    """A task that makes pebble start its workers in the calling thread."""


class _MainWithoutScript(types.ModuleType):
    """The parent's `__main__` as the spawn machinery sees it: no file, no spec, so
    a worker imports nothing in its place. Every other attribute is the real
    module's, so other threads that look one up meanwhile (pickle) are unaffected."""

    def __init__(self, main: types.ModuleType) -> None:
        super().__init__("__main__")
        self.__file__, self._main = None, main

    def __getattr__(self, name: str) -> Any:
        return getattr(self._main, name)


class _PopenWithoutMain(popen_spawn_posix.Popen):
    def _launch(self, process_obj: Any) -> None:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = _MainWithoutScript(main)  # read by the preparation data
        try:
            super()._launch(process_obj)
        finally:
            sys.modules["__main__"] = main


class _WorkerProcess(SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> popen_spawn_posix.Popen:  # noqa: N802 (multiprocessing's name)
        return _PopenWithoutMain(process_obj)


class _WorkerContext(SpawnContext):
    """spawn, with workers that do not import the parent's `__main__`."""

    Process = _WorkerProcess


class RewardPool:
    """Worker processes for reward calls (see the module docstring).

    Args:
        workers: processes (0: run calls in this process, no timeouts).
        timeout_s: the most one call may run, and the longest a batch may go
            without a call returning, twice (0: no limit); a worker's start
            (imports, loading `preload`) is not timed.
        preload: the specs each worker loads as it starts.
    """

    def __init__(self, workers: int, timeout_s: float, preload: Sequence[str] = ()) -> None:
        self.workers, self.timeout_s, self.preload = workers, timeout_s, tuple(preload)
        self._pool = None
        self._starting = threading.Lock()  # run() may be called from several threads

    def start(self) -> None:
        """Spawns the workers now (else at the first call): they import while the
        engines start."""
        with self._starting:
            if self.workers and self._pool is None:
                self._pool = self._new_pool()

    def _new_pool(self) -> Any:
        """A pool whose first workers spawn now, in this thread (pebble spawns
        them at the first submit otherwise); later ones from pebble's thread."""
        from pebble import ProcessPool

        main = threading.current_thread() is threading.main_thread()
        pool = ProcessPool(max_workers=self.workers, initializer=_worker_init,
                           initargs=(self.preload, main), context=_WorkerContext())
        pool.submit(_noop, None)
        return pool

    def run(self, calls: Sequence[Call]) -> list[Outcome]:
        """One outcome per call, in order."""
        if not self.workers:
            return [_run(c) for c in calls]
        self.start()
        futures = [self._pool.submit(_run, self.timeout_s or None, c) for c in calls]
        if self.timeout_s:
            self._stop_when_stalled(futures)
        return [self._outcome(f) for f in futures]

    def _stop_when_stalled(self, futures: Sequence[concurrent.futures.Future]) -> None:
        """Waits for futures. A stall (timeout_s with none returning; timeouts do not
        count) stops the calls running then; a second stall in the batch stops all
        that are left. pebble kills the workers of the running ones it stops."""
        pending, last, stalls = set(futures), None, 0
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=0.1, return_when=concurrent.futures.FIRST_COMPLETED)
            now = time.monotonic()
            if any(not f.cancelled() and not isinstance(f.exception(), TimeoutError)
                   for f in done):
                last = now
            if not any(f.running() for f in pending):
                # Queued behind other batches' calls (run() from several threads), or
                # the workers starting: not this batch's stall, the clock waits.
                last = None
            elif last is None:
                last = now  # from the first call that runs
            if last is not None and now - last > self.timeout_s:
                stalls += 1
                for f in [f for f in pending if stalls > 1 or f.running()]:
                    f.cancel()
                last = None  # from the next call's start: a restarting worker is not timed

    def _outcome(self, future: concurrent.futures.Future) -> Outcome:
        try:
            return future.result()
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            return Outcome("timeout")
        except Exception as e:  # the worker died (os._exit, a crash) or the result did not pickle
            return Outcome("error", f"{type(e).__name__}: {e}")

    def close(self) -> None:
        """Stops the workers (idempotent)."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None
