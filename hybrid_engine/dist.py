"""Process-group setup that works with or without torchrun.

Invariant: the package only tears down a process group it created itself; a
host trainer's group (torchrun, accelerate launch) is used as is.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "is_launched", "rank0_logger"]


def is_launched() -> bool:
    """Whether this process was started by a launcher that set RANK/WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(timeout_s: float = 600.0, *, single_process: bool = False) -> bool:
    """Initialises the default process group from torchrun's env if needed.

    Uses NCCL when CUDA is available, else gloo. Returns True if this call
    created the group (the caller then owns its destruction), False if a group
    already existed, or the process was not launched and single_process is
    False.

    single_process=True makes a one-rank group when no launcher set the
    environment (FSDP2 and vLLM's external launcher both need one): it sets
    RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1 and a free
    MASTER_PORT in os.environ, which vLLM reads.
    """
    if dist.is_initialized():
        return False
    if not is_launched():
        if not single_process:
            return False
        from hybrid_engine.testing import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def rank0_logger(name: str) -> logging.Logger:
    """A logger that is silent on ranks other than 0."""
    log = logging.getLogger(name)
    if dist.is_initialized() and dist.get_rank() != 0:
        log.setLevel(logging.WARNING)
    return log
