"""The naive weight sync written with ordinary care (sync.method=naive_bucketed).

Job: `BucketedGather`: each rank casts its local FSDP2 shards to the rollout
dtype into a persistent send bucket, one `all_gather_into_tensor` per bucket
into a persistent receive buffer, and the full tensors are rebuilt from the
per-rank parts for vLLM's own loading (`roles.sync.WeightSync` drives it).
Buckets follow the plan's load units, so a fused vLLM weight (qkv, gate_up)
is loaded whole from one bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybrid_engine.reshard.plan import shard_rows

__all__ = ["BucketedGather", "load_units"]


@dataclass(frozen=True, slots=True)
class _Slot:
    """One HF tensor in a gather bucket: rows x cols, `chunk` rows per rank
    (FSDP2 Shard(0), torch.chunk sizes; a rank's part is padded to chunk rows),
    at `offset` elements into every rank's part of the bucket."""

    name: str
    rows: int
    cols: int
    chunk: int
    offset: int
    unit: int = 1  # rows per index of dim 0 (`layouts.row_units`)


@dataclass(frozen=True, slots=True)
class _GatherBucket:
    slots: tuple[_Slot, ...]
    part: int  # elements per rank (padded)

    @property
    def full_elems(self) -> int:
        return sum(s.rows * s.cols for s in self.slots)


def load_units(plan: Any, rank: int) -> list[list[str]]:
    """HF tensor names grouped by the vLLM module they load into (q/k/v ->
    qkv_proj, gate/up -> gate_up_proj, ...), in the plan's HF order.

    vLLM's reload processes a module once all of its weights arrived in one
    call; a module split over two calls would be packed half-loaded. So a
    bucket of `BucketedGather` always holds whole units.
    """
    parent = {n: n for n in plan.hf_shapes}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    by_module: dict[str, list[str]] = {}
    for t in plan.targets[rank]:
        by_module.setdefault(t.name.rsplit(".", 1)[0], []).extend(s.hf_name for s in t.segments)
    for names in by_module.values():
        for n in names[1:]:
            parent[find(n)] = find(names[0])
    units: dict[str, list[str]] = {}
    for n in plan.hf_shapes:
        units.setdefault(find(n), []).append(n)
    return list(units.values())


class BucketedGather:
    """The `naive_bucketed` sync: bucketed all-gathers of wire-dtype shards.

    Per bucket: each rank casts its FSDP2 shard of every tensor of the bucket
    into a persistent send buffer (its part, each tensor padded to the
    largest rank's rows), one `all_gather_into_tensor` over byte views (gloo
    has no bf16 collectives) fills a persistent receive buffer with every
    rank's part, the full tensors are rebuilt in a persistent buffer from the
    parts, and `load` (vLLM's own reload) takes the bucket's full tensors.

    Buckets hold whole vLLM modules (`load_units`) and at most `bucket_bytes`
    of gathered (padded) full tensors, unless one module alone is bigger.
    Invariant: the three buffers are allocated once, on the first run, and
    reused by every sync; the loaded tensors are views into them, so `load`
    must be done with a bucket when it returns (vLLM's reload copies).

    Args:
        plan: the reshard plan (HF shapes, world, this rank's vLLM targets).
        rank: this rank in `group`.
        wire_dtype: dtype of the gathered bytes (the rollout dtype).
        bucket_bytes: most bytes of gathered full tensors per bucket.
        group: process group (default group if None).
    """

    def __init__(self, plan: Any, rank: int, *, wire_dtype: torch.dtype, bucket_bytes: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.world, self.group = rank, plan.world_size, group
        self.wire_dtype = wire_dtype
        self.itemsize = torch.empty((), dtype=wire_dtype).element_size()
        self.buckets = self._bucketize(plan, max(1, bucket_bytes // self.itemsize))
        self._part_max = max(b.part for b in self.buckets)
        self._full_max = max(b.full_elems for b in self.buckets)
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _bucketize(self, plan: Any, bucket_elems: int) -> list[_GatherBucket]:
        """Greedy over whole units: a bucket closes when the gathered size
        (world x padded part) would pass bucket_elems."""
        out, cur, part = [], [], 0
        for unit in load_units(plan, self.rank):
            shapes = [(n, *plan.hf_shapes[n], plan.row_units.get(n, 1)) for n in unit]
            chunks = [-(-rows // u // self.world) * u for _, rows, _, u in shapes]
            unit_part = sum(c * cols for c, (_, _, cols, _) in zip(chunks, shapes, strict=True))
            if cur and (part + unit_part) * self.world > bucket_elems:
                out.append(_GatherBucket(tuple(cur), part))
                cur, part = [], 0
            for chunk, (name, rows, cols, u) in zip(chunks, shapes, strict=True):
                cur.append(_Slot(name, rows, cols, chunk, part, u))
                part += chunk * cols
        if cur:
            out.append(_GatherBucket(tuple(cur), part))
        return out

    @property
    def buffer_bytes(self) -> int:
        """The persistent buffers: send part, gathered parts, rebuilt full tensors."""
        return (self._part_max * (1 + self.world) + self._full_max) * self.itemsize

    def _bufs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The persistent buffers, on the parameters' device (NCCL gathers device memory)."""
        if self._buffers is None or self._buffers[0].device != device:
            self._buffers = tuple(torch.empty(n, dtype=self.wire_dtype, device=device) for n in
                                  (self._part_max, self._part_max * self.world, self._full_max))
        return self._buffers

    def _local_rows(self, p: torch.Tensor, s: _Slot) -> torch.Tensor:
        """This rank's rows of p as [rows, cols] (a DTensor's local shard; the
        same rows of a replicated plain tensor or DTensor, train.sharding=replicate)."""
        r0, r1 = shard_rows(s.rows, self.world, self.rank, s.unit)
        i0, i1 = r0 // s.unit, r1 // s.unit  # the same rows as indices of dim 0
        if isinstance(p, DTensor) and p.device_mesh.size(-1) == 1 and self.world > 1:
            local = p.to_local()[i0:i1]
        elif isinstance(p, DTensor):
            local = p.to_local()
            if local.shape[0] != i1 - i0:
                raise ValueError(f"{s.name}: local shard has {local.shape[0]} rows, expected "
                                 f"{i1 - i0} (FSDP2 Shard(0) over {self.world} ranks)")
        else:
            local = p[i0:i1]
        return local.detach().reshape(r1 - r0, s.cols)

    def run(self, params: dict[str, torch.Tensor],
            load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> dict[str, float]:
        """Gathers and loads every bucket (collective over the group); returns
        the sync metrics (seconds per phase, bytes received by this rank)."""
        any_param = next(iter(params.values()))
        device = (any_param.to_local() if isinstance(any_param, DTensor) else any_param).device
        send, recv, full = self._bufs(device)
        t = {"pack": 0.0, "exchange": 0.0, "unpack": 0.0, "load": 0.0}
        received = 0
        for b in self.buckets:
            t0 = time.perf_counter()
            for s in b.slots:
                local = self._local_rows(params[s.name], s)
                send[s.offset : s.offset + local.numel()].view_as(local).copy_(local)
            t1 = time.perf_counter()
            gathered = recv[: b.part * self.world]
            dist.all_gather_into_tensor(gathered.view(torch.uint8),
                                        send[: b.part].view(torch.uint8), group=self.group)
            t2 = time.perf_counter()
            weights, off = [], 0
            for s in b.slots:
                out = full[off : off + s.rows * s.cols]
                for r in range(self.world):
                    r0, r1 = shard_rows(s.rows, self.world, r, s.unit)
                    n = (r1 - r0) * s.cols
                    src = r * b.part + s.offset
                    out[r0 * s.cols : r1 * s.cols].copy_(gathered[src : src + n])
                shape = tuple(params[s.name].shape)
                weights.append((s.name, out.view(shape)))
                off += s.rows * s.cols
            t3 = time.perf_counter()
            load(weights)
            t4 = time.perf_counter()
            t["pack"] += t1 - t0
            t["exchange"] += t2 - t1
            t["unpack"] += t3 - t2
            t["load"] += t4 - t3
            received += (self.world - 1) * b.part * self.itemsize
        return {"sync_transfer_s": t["pack"] + t["exchange"] + t["unpack"],
                "sync_repack_s": t["load"], "sync_local_s": 0.0, "sync_pack_s": t["pack"],
                "sync_exchange_s": t["exchange"], "sync_unpack_s": t["unpack"],
                "sync_bytes_received": float(received), "sync_buckets": float(len(self.buckets)),
                "sync_buffer_bytes": float(self.buffer_bytes)}
