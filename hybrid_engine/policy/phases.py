"""The colocated device's phase machine: one object owns what the device holds.

Job: the actor's two layouts take turns on one device. Three facts change
together and live here, changed only by the transitions below (each logged
at DEBUG on the `hybrid_engine.policy.phases` logger):

    layout      "inference" (the engine holds its memory) or "training"
                (the engine released it, when memory.release says so:
                `true`, or `auto` when the trainer would not fit beside it,
                policy/memory.py)
    weights     "valid"  vLLM holds the trainer's current weights
                "stale"  the trainer changed them since (a train step, a load)
                "lost"   a release discarded vLLM's weights (GPU sleep level 2,
                         or memory.emulate_gpu_sleep on CPU): the engine's own
                         `weights_valid` says so, and it refuses to sample
    optimizer   "device" or "host" (memory.offload_optimizer parks it while the
                engine holds the device)

    to_train()    engine releases (weights -> lost where the platform drops
                  them), optimizer state back on the device
    trainer_weights_changed()  the trainer's weights changed: valid -> stale
    sync()        optimizer parked, engine weights mapped, the trainer's
                  weights written: -> valid
    to_rollout()  optimizer parked, weights synced unless valid, KV cache back
    check_rollout()  raises unless inference layout and valid weights

          to_train()                         to_rollout()
    inference ------------> training ------------------------> inference
    (valid)     release      (lost on GPU,   wake, sync unless   (valid)
                             stale after     valid, restore KV
                             trainer_weights_changed())

Invariant: generation only ever happens in the inference layout with valid
weights: `check_rollout` before every sample, and the engine's own guard
(`VLLMRollout.weights_valid`, NaN log-probs refused) behind it, so a missed
transition fails loudly instead of sampling discarded weights. Nothing but
these methods changes the layout; save, load and scoring declare what they
need (`optimizer_on_device`, `to_train`) and say so in the log.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from hybrid_engine.policy.memory import ReleasePolicy

if TYPE_CHECKING:
    from hybrid_engine.parallel.offload import OptimizerOffload
    from hybrid_engine.rollout.engine import VLLMRollout

__all__ = ["Phases"]

log = logging.getLogger(__name__)


class Phases:
    """The device's state in the colocated actor, and its transitions (collective:
    every rank makes the same transitions in the same order, since a sync is one).

    Args:
        rollout: the engine (release_memory / wake_weights / restore_memory,
            weights_valid).
        sync: writes the trainer's weights into the engine; returns metrics.
        offload: the optimizer offload (memory.offload_optimizer), or None.
        release: memory.release: whether the engine releases its memory
            for a training phase (a bool, or a `ReleasePolicy` that decides per
            phase: memory.release=auto).

    Attributes:
        layout: "inference" or "training".
        released_bytes: what the release into the current (or last) training
            layout freed (0 when the engine stayed resident).
    """

    def __init__(self, rollout: VLLMRollout, sync: Callable[[], dict[str, float]],
                 offload: OptimizerOffload | None = None, *,
                 release: bool | ReleasePolicy = True) -> None:
        self.rollout, self._sync, self.offload = rollout, sync, offload
        self.release = release if isinstance(release, ReleasePolicy) else ReleasePolicy(release)
        self.layout = "inference"
        self._trainer_changed = False
        self.released_bytes = 0

    # --- state -------------------------------------------------------------------

    @property
    def weights(self) -> str:
        """"valid", "stale" or "lost" (see the module docstring)."""
        if not self.rollout.weights_valid:
            return "lost"
        return "stale" if self._trainer_changed else "valid"

    @property
    def trainer_changed(self) -> bool:
        """Whether the trainer's weights changed since the engine's last sync
        (whatever the engine holds now: its weights may also be lost)."""
        return self._trainer_changed

    @property
    def optimizer(self) -> str:
        """Where the optimizer state is: "host" while parked, else "device"."""
        return "host" if self.offload is not None and self.offload.offloaded else "device"

    def describe(self) -> str:
        return f"layout={self.layout} weights={self.weights} optimizer={self.optimizer}"

    def _log(self, what: str) -> None:
        log.debug("phase: %s -> %s", what, self.describe())

    # --- transitions ---------------------------------------------------------------

    def to_train(self) -> None:
        """The training layout: the engine releases its memory (if configured), the
        optimizer state comes back to the device (if parked)."""
        if self.layout != "training":
            release = self.release.should_release()
            self.released_bytes = self.rollout.release_memory() if release else 0
            self.layout = "training"
            self.release.training_started()
            self._log("to_train")
        if self.offload is not None and self.offload.offloaded:
            self.offload.reload()
            self._log("optimizer reloaded")

    def trainer_weights_changed(self) -> None:
        """The trainer's weights changed (an optimizer step, a checkpoint load)."""
        self._trainer_changed = True

    def _park(self) -> None:
        if self.offload is not None and not self.offload.offloaded:
            self.offload.offload()  # no-op without state yet

    def sync(self) -> dict[str, float]:
        """Writes the trainer's weights into the engine (collective): the optimizer
        is parked first (the engine's weights wake into its memory), the layout
        stays what it is. Returns the sync's metrics."""
        self._park()
        self.rollout.wake_weights()
        metrics = self._sync()
        self._trainer_changed = False
        self._log("sync")
        return metrics

    def to_rollout(self) -> dict[str, float]:
        """The inference layout with valid weights (collective): parks the optimizer,
        syncs unless the engine already holds the trainer's weights, brings the
        KV cache back. Returns the sync's metrics ({} when none was needed)."""
        metrics: dict[str, float] = {}
        if self.layout == "training":
            self._park()
        if self.weights != "valid":
            metrics = self.sync()
        if self.layout == "training":
            self.release.training_ended()
            self.rollout.restore_memory()  # a no-op when nothing was released
            self.layout = "inference"
            self._log("to_rollout")
        return metrics

    def check_rollout(self) -> None:
        """Raises unless the engine may sample now (inference layout, valid weights)."""
        if self.layout != "inference" or self.weights != "valid":
            raise RuntimeError(f"cannot sample in this phase ({self.describe()}): call "
                               "to_rollout() first")

    @contextlib.contextmanager
    def optimizer_on_device(self) -> Iterator[None]:
        """The optimizer state on the device inside the block (a checkpoint reads or
        replaces it); after it, the layout is the one before the block.

        A parked state comes back through the training layout (from the inference
        layout the engine releases its memory first, and resyncs on the way back
        if that discarded its weights: logged at INFO; right after a sync in the
        training layout -- the controller's save -- the engine's woken weights
        stay, with its KV cache released: the state takes the room the gradients
        had, so the step's peak is not exceeded); a state the block created
        beside an awake engine (DCP makes one for a fresh optimizer) is parked
        after it."""
        before = self.layout
        if self.optimizer == "host":
            log.info("checkpoint: optimizer state parked in host memory; the engine "
                     "releases the device while it is read (%s)", self.describe())
            self.to_train()
        yield
        if before == "inference":
            self.to_rollout()
            self._park()
