"""In-flight weight updates (`async_rollout.inflight_updates`): a sync's install handed to
the generation thread's next engine-step boundary.

Job: under placement=separate with generation ahead, the sync thread writes new
weights into the engine's back buffers while a batch is being sampled. Without
in-flight updates the install waits until that batch ends; with them,
`InstallGate` lets the generation thread install between two engine steps of
the batch (`VLLMRollout._step_loop` calls `between_steps` after each step):

    sync thread                            generation thread (in a batch)
    transfer into the back buffers         step, step, ...
    hand_over(commit, batches before) ---> between_steps(): offer agreed by the
      waits                                  TP group -> commit(running=True):
                                             install, preempt the running
      <--------------------------------------requests (KV recomputed)
    returns (repack seconds, True)         step, ... (tokens count one install more)

If every batch submitted before the sync ends first (the offer was never taken),
the sync thread withdraws the offer and installs itself, between batches, as
without in-flight updates.

Tensor parallelism: the ranks of a TP group must install at the same step (they
run the same steps in lockstep, each a shard of one model), so every boundary
asks the group (`agree`: an all-reduce MIN of "my back buffers are ready" over
vLLM's TP CPU group, on the generation thread, which alone uses that group
while a batch runs). A boundary installs on every rank of the group or on none;
so once a rank's batches have ended, the group made the same choices, and a
fallback install there is consistent too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

__all__ = ["InstallGate"]

Commit = Callable[..., float]  # commit(running=bool) -> re-pack seconds


class InstallGate:
    """One pending install at a time, taken at an engine-step boundary or, failing
    that, run by the sync thread once the batches before it have ended.

    Args:
        agree: called with this rank's "ready" at every boundary; returns whether
            the whole TP group is ready (identity with TP = 1).
    """

    def __init__(self, agree: Callable[[bool], bool] = bool) -> None:
        self._agree = agree
        self._lock = threading.Lock()
        self._offer: Commit | None = None
        self._taken: Future | None = None
        self.inflight_installs = 0  # installs taken between engine steps, for tests / metrics
        # Installs through this gate, in or between batches: they happen in the order
        # the syncs were handed over (one pending at a time), so this is the number
        # of the last sync installed (`sample`).
        self.installed = 0

    def between_steps(self) -> bool:
        """Generation thread, after an engine step with requests still running:
        installs the pending weights if the TP group agrees; whether it did."""
        with self._lock:
            ready = self._offer is not None
        if not self._agree(ready):
            return False
        with self._lock:
            commit, taken, self._offer = self._offer, self._taken, None
        if commit is None or taken is None:  # agreed, so offered on every rank: cannot happen
            raise RuntimeError("in-flight install agreed by the TP group without an offer here")
        try:
            taken.set_result(commit(running=True))
        except BaseException as e:
            taken.set_exception(e)
            raise
        self.inflight_installs += 1
        self.installed += 1
        return True

    def hand_over(self, commit: Commit, before: Sequence[Future]) -> tuple[float, bool]:
        """Sync thread: offers the install to the generation thread and waits until
        it is taken, or until every batch in `before` (submitted before this sync)
        has ended, in which case it installs here. Returns (re-pack seconds,
        whether the install landed inside a batch)."""
        taken: Future = Future()
        with self._lock:
            if self._offer is not None:
                raise RuntimeError("an in-flight install is already pending")
            self._offer, self._taken = commit, taken
        pending = [f for f in before if not f.done()]
        while pending and not taken.done():
            wait([taken, *pending], return_when=FIRST_COMPLETED)
            pending = [f for f in pending if not f.done()]
        with self._lock:
            mine = self._offer is commit  # not taken: withdraw it, install between batches
            if mine:
                self._offer = self._taken = None
        if mine:
            repack = commit(running=False)
            self.installed += 1
            return repack, False
        return taken.result(), True

    def sample(self, handed: int, run: Callable[[], tuple[list, float]]) -> tuple[list, float]:
        """Generation thread: runs a batch (`run()` -> (trajectories, seconds); its
        engine offers every step boundary to `between_steps`) that was submitted
        when `handed` syncs had been handed to this gate. Later syncs installed
        before it started (inside an earlier batch, k >= 2) are counted in every
        token's installs ("installs", from the submission on): the batch samples
        their weights from its first token."""
        newer = self.installed - handed
        trajs, seconds = run()
        for t in trajs if newer else ():
            t.info["installs"] = [i + newer for i in t.info["installs"]]
        return trajs, seconds
