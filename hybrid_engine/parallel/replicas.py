"""Data-parallel replicas, checked to be bitwise identical.

Job: under train.sharding=replicate every trainer rank holds the whole model,
and under hybrid the ranks at the same place in their shard groups hold the
same shard. Those copies must stay bit for bit the same: the sync moves nothing
between replicas, so each vLLM tensor-parallel group would otherwise serve
slices cut from copies that disagree, and the difference can grow every step.
`check` compares an exact checksum of each rank's parameters (the integer sum
of their bit patterns, per tensor) with its first replica's, and stops the run
with one line at the first difference. The trainer runs it every
`train.replica_check_every` optimizer steps.

Invariant: collective over the trainer's group; every rank reaches the same
verdict (all of them compare the same gathered checksums), so every rank raises
together, before the step's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from hybrid_engine.guards import RunAborted

__all__ = ["ReplicaDrift", "bit_checksums", "check", "replica_group_size"]

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDrift(RunAborted):
    """Replicas of the same weights differ: the run stops (one line)."""


def replica_group_size(sharding: str, shard_group_size: int, world: int) -> int:
    """Ranks per shard group (the replicas of rank r's rows are the ranks
    r % S, r % S + S, ...): 1 replicated, S hybrid, the world otherwise (no replicas)."""
    return {"replicate": 1, "hybrid": shard_group_size}.get(sharding, world) or world


def bit_checksums(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the int64 sum of its elements' bit patterns (this rank's shard
    of a DTensor): equal tensors give equal sums, and a changed bit changes it."""
    sums = []
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        bits = local.detach().reshape(-1).view(_BITS[local.element_size()])
        sums.append(bits.sum(dtype=torch.int64))
    return torch.stack(sums)


def check(params: list[torch.Tensor], group: dist.ProcessGroup, shard_size: int,
          *, layout: str, step: int, device: torch.device | None = None,
          key: str = "train.sharding") -> None:
    """Raises ReplicaDrift when any rank's parameters differ from those of the
    first rank holding the same rows (rank % shard_size). Collective over group;
    `device`: where the group's collectives run (CUDA under NCCL); key: the
    config key that chose the layout (named in the error)."""
    world = dist.get_world_size(group)
    if shard_size >= world:
        return
    local = bit_checksums(params).to(device or "cpu")
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    for r in range(shard_size, world):
        first = r % shard_size
        differ = int((gathered[r] != gathered[first]).sum())
        if differ:
            raise ReplicaDrift(
                f"replicas drifted apart under {key}={layout}: rank {r}'s weights "
                f"differ from rank {first}'s in {differ} of {len(local)} parameter tensors "
                f"after optimizer step {step} (checked every train.replica_check_every "
                "steps); the run stops before this step's checkpoint")
