"""Whether the colocated engine must release its memory for a training phase.

Job: `memory.release=auto`. Releasing costs a regrow per step (CPU:
the KV cache's pages faulted back in; GPU: a sleep/wake and a weight resync),
so the engine releases only when the trainer would not fit beside it:

    release  iff  trainer_peak * 1.1 + 64 MiB  >  free

- trainer_peak: what a training phase allocates above what it keeps after it
  (activations, gathered parameters, gradients; not the AdamW state, which
  stays and is counted as used), measured on this rank in the last phases:
  CPU: the peak RSS (VmHWM, reset through /proc/self/clear_refs at the phase
  start) minus the RSS at its end; GPU: max_memory_allocated minus
  memory_allocated, the peak reset at the phase start. The largest seen so far.
  Before the first phase it is the layout's estimate of what that phase adds,
  the AdamW state included (`sharding.first_phase_estimate`), when the caller
  gives one.
- free, read before each training phase with the engine resident:
  CPU: `memory.budget` x RAM minus what the machine uses now, shared
  by this machine's ranks; GPU: `mem_get_info` plus the allocator's cached,
  unused bytes.

With neither a measurement nor an estimate, the engine releases.
The decision is collective (one all-reduce: every rank releases or none
does) and logged at INFO whenever it changes. `true` / `false` always / never
release, with no collective.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ReleasePolicy", "cpu_free_bytes", "needs_release"]

log = logging.getLogger(__name__)

_MARGIN = 1.1
_SLACK = 64 * 2**20


def needs_release(trainer_peak: int | None, free: int) -> bool:
    """The rule above (None: not measured yet -> release)."""
    return trainer_peak is None or trainer_peak * _MARGIN + _SLACK > free


def cpu_free_bytes(budget: float, local_ranks: int) -> int:
    """This rank's share of budget x RAM left after what the machine uses now."""
    import psutil

    vm = psutil.virtual_memory()
    return int((budget * vm.total - (vm.total - vm.available)) / max(local_ranks, 1))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


class ReleasePolicy:
    """memory.release as a decision per training phase.

    Args:
        mode: "auto", "true" or "false".
        first_estimate: bytes the first training phase is expected to add (None:
            release in it).
        budget: memory.budget (CPU: the fraction of RAM the job may use).
        local_ranks: this machine's ranks (they share its RAM).
        device: the trainer's device (cuda: GPU accounting, else CPU).
        group: the ranks that decide together (None: the default group).

    Attributes:
        trainer_peak: the largest transient peak measured (bytes), None before any.
        releasing: the last decision.
    """

    def __init__(self, mode: str | bool, *, budget: float = 0.9, local_ranks: int = 1,
                 device: torch.device | None = None, group: ProcessGroup | None = None,
                 first_estimate: int | None = None) -> None:
        mode = str(mode).lower() if isinstance(mode, bool) else mode
        if mode not in ("auto", "true", "false"):
            raise ValueError(f"memory.release must be 'auto', 'true' or 'false', got {mode!r}")
        self.mode, self.budget, self.local_ranks, self.group = mode, budget, local_ranks, group
        self.cuda = device is not None and device.type == "cuda"
        self.trainer_peak: int | None = None
        self.first_estimate = first_estimate
        self.releasing: bool | None = None
        self._measuring = False

    def should_release(self) -> bool:
        """Before a training phase (collective in auto mode): release the engine?"""
        if self.mode != "auto":
            return self.mode == "true"
        free = self._free_bytes()
        measured = self.trainer_peak is not None
        need = self.trainer_peak if measured else self.first_estimate
        local = needs_release(need, free)
        flag = torch.tensor([int(local)])
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if dist.get_backend(self.group) == "nccl":  # NCCL reduces device tensors only
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        release = bool(flag.item())
        if release != self.releasing:
            what = ("unknown" if need is None else
                    f"{need / 2**20:.0f} MiB above what it keeps, measured on this rank"
                    if measured else f"{need / 2**20:.0f} MiB with its optimizer state, "
                    "estimated from the layout")
            log.info("memory.release=auto: %s (the training phase's growth: %s; %.0f MiB "
                     "free %s)", "the engine releases its memory for training" if release
                     else "the engine stays resident in training: the trainer fits beside it",
                     what, free / 2**20, "on the GPU" if self.cuda else
                     f"in this rank's share of {self.budget:g} x RAM")
        self.releasing = release
        return release

    def training_started(self) -> None:
        """The training layout begins (after any release): the peak counts from here."""
        if self.mode != "auto":
            return
        try:
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            else:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
            self._measuring = True
        except OSError as e:  # no way to measure: stay with releasing
            log.warning("memory.release=auto cannot measure the trainer's peak (%s): "
                        "the engine releases its memory in every training phase", e)
            self.mode = "true"

    def training_ended(self) -> None:
        """The training layout ends (before the engine regrows): record the peak."""
        if not self._measuring:
            return
        self._measuring = False
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        else:
            peak = (_status_kib("VmHWM") - _status_kib("VmRSS")) * 1024
        self.trainer_peak = max(self.trainer_peak or 0, peak)

    def _free_bytes(self) -> int:
        if self.cuda:
            free, _ = torch.cuda.mem_get_info()
            return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        return cpu_free_bytes(self.budget, self.local_ranks)
