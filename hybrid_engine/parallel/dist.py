"""Process-group setup that works with or without torchrun.

Invariant: the package only tears down a process group it created itself; a
host trainer's group (torchrun, accelerate launch) is used as is.

Groups are passed, not found: the placement (`parallel/placement.py`) makes
each role's group and hands it to whoever runs over it.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from hybrid_engine.config import RolloutConfig

__all__ = ["all_gather_ragged", "any_rank", "all_groups", "collective_timeouts", "free_port", "init_distributed", "is_launched", "rank0_logger",
           "resync_group_counter", "set_collective_timeout", "split_ranks"]


def split_ranks(world_size: int, cfg: RolloutConfig) -> tuple[int, int]:
    """(trainer ranks M, rollout ranks R) of a separate placement over world_size.

    R = cfg.num_ranks, or half the world rounded down to a multiple of T when 0.

    Raises:
        ValueError: fewer than 2 ranks, no rank left for either side, or T
            not dividing R.
    """
    tp = cfg.tensor_parallel_size
    if world_size < 2:
        raise ValueError("placement=separate needs at least 2 ranks (one trains, one rolls out); "
                         f"this run has {world_size}")
    r = cfg.num_ranks or max(tp, world_size // 2 // tp * tp)
    if not 1 <= r < world_size:
        given = (f"rollout.num_ranks={r}" if cfg.num_ranks else
                 f"rollout.num_ranks=0 (auto: half the ranks in multiples of "
                 f"rollout.tensor_parallel_size={tp}, at least one group: {r})")
        raise ValueError(f"{given} must leave at least one of the {world_size} ranks "
                         "to train (placement=separate)")
    if r % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the rollout ranks "
                         f"(rollout.num_ranks={r})")
    return world_size - r, r


def any_rank(flag: bool) -> bool:
    """True on every rank if flag is True on any rank (collective when distributed)."""
    if not dist.is_initialized():
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces device tensors
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def is_launched() -> bool:
    """Whether this process was started by a launcher that set RANK/WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def all_groups() -> list[dist.ProcessGroup]:
    """Every process group this process is a member of (default group included)."""
    from torch.distributed import distributed_c10d as c10d

    return [pg for pg in list(c10d._world.pg_map) if isinstance(pg, dist.ProcessGroup)]


def set_collective_timeout(timeout_s: float, groups: list[dist.ProcessGroup] | None = None) -> int:
    """Sets the timeout of every collective on groups (default: all of them).

    Groups made by `new_group` (vLLM's TP groups, device meshes) otherwise
    keep torch's default (30 min for gloo, 10 for NCCL) whatever the default
    group was given. Returns how many groups were set.
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    groups = all_groups() if groups is None else groups
    for pg in groups:
        c10d._set_pg_timeout(timeout, pg)
    return len(groups)


def collective_timeouts() -> dict[str, float]:
    """{group name: its timeout in seconds} over every backend of every group
    (the shortest when a group has several); for checks and tests."""
    from torch.distributed import distributed_c10d as c10d

    out: dict[str, float] = {}
    for pg in all_groups():
        name = c10d._world.pg_names.get(pg, str(pg))
        for device in pg._device_types:
            options = getattr(pg._get_backend(device), "options", None)
            if options is not None and hasattr(options, "_timeout"):
                t = options._timeout.total_seconds()
                out[name] = min(t, out.get(name, t))
    return out


def resync_group_counter() -> None:
    """Makes torch's group-name counter equal on every rank (collective).

    Groups made by only some ranks (vLLM's, under separate placement) advance
    the counter there only; the next `new_group` would then get different
    names on different ranks and wait forever in the store.
    """
    from torch.distributed import distributed_c10d as c10d

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    count = torch.tensor([c10d._world.group_count], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    c10d._world.group_count = int(count)


def all_gather_ragged(rows: list[torch.Tensor], group: dist.ProcessGroup | None = None,
                      ) -> list[list[torch.Tensor]]:
    """Every rank's list of 1-D tensors (any lengths, any count, one dtype), per rank
    in rank order: three all-gathers of tensors (counts, lengths, the concatenated
    values padded to the longest), no pickling. Collective over group; on NCCL the
    exchange goes through the current CUDA device and the results come back on CPU.

    Raises:
        ValueError: the ranks' dtypes differ (checked through the values' byte views).
    """
    world = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    dtype = rows[0].dtype if rows else torch.float32
    code = torch.tensor([len(rows), _DTYPE_CODES.get(dtype, -1)], device=device)
    heads = [torch.empty_like(code) for _ in range(world)]
    dist.all_gather(heads, code, group=group)
    counts = [int(h[0]) for h in heads]
    if not any(counts):
        return [[] for _ in range(world)]
    kinds = {int(h[1]) for h, n in zip(heads, counts) if n}
    if len(kinds) > 1 or -1 in kinds:
        raise ValueError(f"all_gather_ragged needs one dtype of {list(_DTYPE_CODES)} on every "
                         f"rank, got codes {sorted(kinds)}")
    dtype = next((d for d, c in _DTYPE_CODES.items() if c in kinds), dtype)
    lens = torch.zeros(max(counts), dtype=torch.int64, device=device)
    lens[: len(rows)] = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
    all_lens = [torch.empty_like(lens) for _ in range(world)]
    dist.all_gather(all_lens, lens, group=group)
    totals = [int(x.sum()) for x in all_lens]
    flat = torch.zeros(max(max(totals), 1), dtype=dtype, device=device)
    if rows:
        flat[: totals[dist.get_rank(group)]] = torch.cat([r.reshape(-1) for r in rows]).to(dtype)
    flats = [torch.empty_like(flat) for _ in range(world)]
    # byte views: gloo has no bf16 collectives, and one code path for every dtype
    dist.all_gather([f.view(torch.uint8) for f in flats], flat.view(torch.uint8), group=group)
    out = []
    for n, ls, f in zip(counts, all_lens, flats, strict=True):
        sizes = ls[:n].tolist()
        out.append(list(f[: sum(sizes)].cpu().split(sizes)))
    return out


_DTYPE_CODES = {torch.float32: 0, torch.int64: 1, torch.bfloat16: 2, torch.int32: 3,
                torch.float64: 4}
