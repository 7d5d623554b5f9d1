"""Executes a ReshardPlan: local copies, then per bucket pack -> all_to_all -> unpack.

Job: move the blocks of a plan from this rank's FSDP2 shards (sources) into
this rank's TP-local vLLM tensors (targets), with the copy_blocks kernel: one
launch packs every block this rank sends in a bucket into one buffer (dtype
cast fused), one `all_to_all_single` exchanges all peers' buffers, one launch
unpacks straight into the targets. Local blocks never touch a buffer.

Invariant: the extra memory is two persistent buffers of the largest bucket
(send and receive), whatever the model size; block tables are built once per
(plan, rank) and reused every sync, so a sync allocates nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybrid_engine.reshard.ops import Block as TableRow
from hybrid_engine.reshard.ops import blocks_tensor, copy_blocks
from hybrid_engine.reshard.plan import Block, ReshardPlan

__all__ = ["ReshardExecutor", "TransferStats"]


@dataclass
class TransferStats:
    """What one run moved and where the time went (seconds, bytes)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    num_buckets: int = 0
    local_s: float = 0.0
    pack_s: float = 0.0
    exchange_s: float = 0.0
    unpack_s: float = 0.0
    per_bucket_s: list[float] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.local_s + self.pack_s + self.exchange_s + self.unpack_s


@dataclass(frozen=True)
class _BucketTables:
    send: torch.Tensor          # copy_blocks table: sources -> send buffer
    recv: torch.Tensor          # copy_blocks table: receive buffer -> targets
    send_splits: list[int]      # bytes per destination rank
    recv_splits: list[int]      # bytes per source rank


class ReshardExecutor:
    """Runs one plan on one rank; build once, call `run` every sync.

    Args:
        plan: the plan (identical on every rank).
        rank: this rank in `group`.
        wire_dtype: dtype of the exchanged bytes (the rollout dtype); the cast
            from the master dtype happens in the pack kernel.
        group: process group over the plan's world (default group if None).
    """

    def __init__(self, plan: ReshardPlan, rank: int, *, wire_dtype: torch.dtype,
                 group: dist.ProcessGroup | None = None) -> None:
        self.plan, self.rank, self.group = plan, rank, group
        self.wire_dtype = wire_dtype
        self.itemsize = torch.empty((), dtype=wire_dtype).element_size()
        self.source_names = sorted(plan.hf_shapes)
        self.target_names = [t.name for t in plan.targets[rank]]
        self._src_idx = {n: i for i, n in enumerate(self.source_names)}
        self._dst_idx = {n: i for i, n in enumerate(self.target_names)}
        self._target_shapes = {t.name: t.shape for t in plan.targets[rank]}
        self._target_cols = {n: s[1] for n, s in self._target_shapes.items()}
        self.local_table = blocks_tensor([self._row(b, "local") for b in plan.local[rank]])
        self.buckets = [self._bucket_tables(i) for i in range(len(plan.buckets))]
        max_send = max((sum(b.send_splits) for b in self.buckets), default=0)
        max_recv = max((sum(b.recv_splits) for b in self.buckets), default=0)
        self._send_buf: torch.Tensor | None = None
        self._recv_buf: torch.Tensor | None = None
        self._buf_elems = (max_send // self.itemsize, max_recv // self.itemsize)

    @property
    def buffer_bytes(self) -> int:
        """Extra memory of the two exchange buffers."""
        return (self._buf_elems[0] + self._buf_elems[1]) * self.itemsize

    def _row(self, b: Block, kind: str, buf_offset: int = 0) -> TableRow:
        cols = b.cols[1] - b.cols[0]
        src_cols = self.plan.hf_shapes[b.hf_name][1]
        dst_cols = self._target_cols[b.target] if kind != "send" else cols
        src = (self._src_idx[b.hf_name], b.src_row * src_cols + b.cols[0], src_cols, 1)
        dst = (self._dst_idx[b.target], b.dst_row * dst_cols + b.dst_col, dst_cols, 1)
        if kind == "send":  # sources -> buffer (dense rows of `cols`)
            dst = (0, buf_offset, cols, 1)
        elif kind == "recv":  # buffer -> targets
            src = (0, buf_offset, cols, 1)
        return TableRow(*src, *dst, b.rows, cols)

    def _bucket_tables(self, i: int) -> _BucketTables:
        world = self.plan.world_size
        send_rows, recv_rows = [], []
        send_splits, recv_splits = [0] * world, [0] * world
        offset = 0
        for b in self.plan.sends(i, self.rank):
            send_rows.append(self._row(b, "send", offset))
            offset += b.numel
            send_splits[b.dst_rank] += b.numel * self.itemsize
        offset = 0
        for b in self.plan.recvs(i, self.rank):
            recv_rows.append(self._row(b, "recv", offset))
            offset += b.numel
            recv_splits[b.src_rank] += b.numel * self.itemsize
        return _BucketTables(blocks_tensor(send_rows), blocks_tensor(recv_rows),
                             send_splits, recv_splits)

    def _check(self, sources: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]):
        srcs, dsts = [], []
        for n in self.source_names:
            t = sources[n]
            assert t.is_contiguous(), f"source {n} must be contiguous"
            srcs.append(t)
        for n in self.target_names:
            t = targets[n]
            shape = self._target_shapes[n]
            assert t.is_contiguous() and t.numel() == shape[0] * shape[1], (
                f"target {n}: expected a contiguous tensor of {shape}, got {tuple(t.shape)}")
            dsts.append(t)
        return srcs, dsts

    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._send_buf is None or self._send_buf.device != device:
            self._send_buf = torch.empty(self._buf_elems[0], dtype=self.wire_dtype, device=device)
            self._recv_buf = torch.empty(self._buf_elems[1], dtype=self.wire_dtype, device=device)
        return self._send_buf, self._recv_buf

    def run(self, sources: Mapping[str, torch.Tensor],
            targets: Mapping[str, torch.Tensor]) -> TransferStats:
        """Fills targets from sources.

        Args:
            sources: HF name -> this rank's FSDP2 shard, contiguous, seen as
                2-D [local_rows, cols] (the plan's row ranges, possibly 0 rows).
            targets: vLLM name -> this rank's TP-local tensor, contiguous, with
                the plan's 2-D numel (any dtype; the unpack casts).
        """
        stats = TransferStats(num_buckets=len(self.buckets))
        srcs, dsts = self._check(sources, targets)
        device = (srcs or dsts)[0].device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        copy_blocks(srcs, dsts, self.local_table)
        sync()
        stats.local_s = time.perf_counter() - t0
        stats.bytes_local = int(sum(r[-2] * r[-1] for r in self.local_table.tolist())) * self.itemsize
        send_buf, recv_buf = self._buffers(device)
        for tables in self.buckets:
            t_bucket = time.perf_counter()
            send = send_buf[: sum(tables.send_splits) // self.itemsize]
            recv = recv_buf[: sum(tables.recv_splits) // self.itemsize]
            copy_blocks(srcs, [send], tables.send)
            sync()
            t1 = time.perf_counter()
            # Bytes on the wire: gloo has no bf16 all_to_all, and splits in bytes
            # keep every dtype on one path.
            dist.all_to_all_single(recv.view(torch.uint8), send.view(torch.uint8),
                                   tables.recv_splits, tables.send_splits, group=self.group)
            sync()
            t2 = time.perf_counter()
            copy_blocks([recv], dsts, tables.recv)
            sync()
            t3 = time.perf_counter()
            stats.pack_s += t1 - t_bucket
            stats.exchange_s += t2 - t1
            stats.unpack_s += t3 - t2
            stats.per_bucket_s.append(t3 - t_bucket)
            stats.bytes_sent += sum(tables.send_splits)
            stats.bytes_received += sum(tables.recv_splits)
        return stats
