"""Parks the trainer's optimizer state in host memory while vLLM generates.

Job: move the storage behind every optimizer state tensor (AdamW's moments and
step counters, the local shards of their DTensors) to host buffers and back,
in place. The tensors stay the same objects -- the optimizer, its DTensor
wrappers and the checkpoint code keep their references -- only their storages
are emptied (`resize_(0)`) and later regrown and refilled, the way FSDP2 frees
unsharded parameters.

    offload = OptimizerOffload(trainer.optimizer, trainer.device)
    moved = offload.offload()   # before generation: bytes now in host memory
    offload.reload()            # before the next optimizer step (or checkpoint)

Gradients need no offload: the trainer frees them after every step
(`zero_grad(set_to_none=True)`), so none exist while vLLM generates.

On CUDA the host buffers are pinned, the freed blocks are handed back to the
driver (`empty_cache`) so vLLM can wake into them, and the bytes released are
measured as the drop of `memory_reserved` across the offload (cached blocks
freed earlier, e.g. the gradients, are returned before the first reading and
not counted; a state block sharing a cache segment with live tensors stays
reserved and is not counted either). On CPU the "device" is host memory:
the state only moves between two CPU allocations, nothing is saved, and the
released bytes reported are 0 (the round trip is still exact, which the tests
check there).
"""

from __future__ import annotations

import logging
import time

import torch
from torch.distributed.tensor import DTensor

__all__ = ["OptimizerOffload", "optimizer_state_storages"]

log = logging.getLogger(__name__)


def optimizer_state_storages(optimizer: torch.optim.Optimizer,
                             device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct storages of optimizer's state tensors on device (DTensors: their local shards)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.device.type != device.type:
                continue  # e.g. AdamW's CPU step counters next to CUDA moments
            st = local.untyped_storage()
            if st.nbytes() > 0:
                seen.setdefault(st.data_ptr(), st)
    return list(seen.values())


def _bytes_view(st: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


class OptimizerOffload:
    """Moves an optimizer's state to host memory and back, in place.

    Attributes:
        offloaded: True between `offload()` and `reload()`.
        moved_bytes: bytes the last `offload()` moved to host memory.
        released_bytes: device memory the last `offload()` returned to the
            driver, measured (CUDA); 0 on CPU, where host memory is the device memory.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.offloaded = False
        self.moved_bytes = 0
        self.released_bytes = 0
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    def offload(self) -> int:
        """Copies every state storage to a host buffer and frees it. Returns the
        bytes moved (0 when already offloaded or the optimizer has no state yet:
        AdamW creates it at the first step)."""
        if self.offloaded:
            return 0
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()  # blocks freed before (gradients) are not ours to count
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        storages = optimizer_state_storages(self.optimizer, self.device)
        parked = []
        for st in storages:
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=cuda)
            host.copy_(_bytes_view(st), non_blocking=cuda)
            parked.append((st, host))
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()  # copies done before freeing
        for st, _ in parked:
            st.resize_(0)
        if cuda:
            torch.cuda.empty_cache()
            self.released_bytes = max(0, before - torch.cuda.memory_reserved(self.device))
        else:
            self.released_bytes = 0
        self._parked = parked
        self.moved_bytes = sum(host.numel() for _, host in parked)
        self.offloaded = True
        log.info("optimizer state: %.1f MiB moved to host memory in %.3f s (device memory "
                 "returned: %.1f MiB%s)", self.moved_bytes / 2**20, time.perf_counter() - t0,
                 self.released_bytes / 2**20, "" if cuda else "; on CPU nothing is saved")
        return self.moved_bytes

    def reload(self) -> int:
        """Regrows every parked storage and copies its bytes back. Returns the bytes
        moved (0 when nothing is offloaded)."""
        if not self.offloaded:
            return 0
        cuda = self.device.type == "cuda"
        for st, host in self._parked:
            st.resize_(host.numel())
            _bytes_view(st).copy_(host, non_blocking=cuda)
        if cuda:  # the host buffers are dropped below: their copies must be done
            torch.cuda.current_stream(self.device).synchronize()
        moved = sum(host.numel() for _, host in self._parked)
        self._parked = []
        self.offloaded = False
        return moved
