"""The resharding plan: FSDP2 Shard(0) row ranges -> vLLM tensor-parallel blocks.

Job: for a world of N ranks (FSDP2 over all N) and rollout TP size T dividing
N (N/T replicas; global rank g is TP rank g % T of replica g // T) -- or,
under separate placement, FSDP2 over ranks 0..M-1 and the rollout on ranks
M..N-1 (rank g is TP rank (g - M) % T) -- list every
block that must move: from which source rank's shard of which HF tensor, to
which destination rank's vLLM parameter at which offset.

The source ranks form M/S shard groups of S ranks (`train.sharding`: S = M
for full/grad_op, 1 for replicate, train.shard_group_size for hybrid): source
rank g holds rows `shard_rows(rows, S, g % S)` of every tensor, and so does
every rank at the same position of another group. A destination takes each
row from the group `serving_group(d)`: its own when it is a source rank
(colocated), else the groups take the rollout ranks in turn. A block whose source
and destination rank coincide is *local* (copied directly, never through a
buffer); the others are *remote* and go through per-peer buffers exchanged
with all_to_all_single, in buckets of bounded size (`reshard.buckets`: cut
from per-rank volumes in closed form). Under separate placement no rank is
both source and destination, so every block is remote.

Per rank: a job's rank builds only its own blocks (`build_plan(rank=r)`): the
buckets come from the shapes alone, and a destination's blocks from a shard
group are listed once per TP rank and stamped per destination, so a rank
lists the blocks it sends without listing anyone else's.

Invariant: every element of every destination parameter (padding aside)
comes from exactly one block, and that block's source is a rank that owns
the element's row in FSDP2's layout (the destination itself whenever it owns
it). So the bytes a rank receives are exactly the elements it needs and does
not own: the theoretical minimum for the layout (replicate colocated: zero). The
buckets are a pure function of (HF dims, N, M, S, T, bucket size, adapters),
cut identically on every rank, and a rank's plan is the whole plan restricted
to it, so all ranks agree on buffer layouts without exchanging metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hybrid_engine.reshard.adapters import LoraDims, adapter_layout, adapter_shapes
from hybrid_engine.reshard.buckets import Geometry, Unit, bucketize, shard_rows, shares, twins
from hybrid_engine.reshard.layouts import (ModelDims, TargetParam, hf_shapes, row_units,
                                           tp_layout, train_splits)

__all__ = ["Block", "Cut", "ReshardPlan", "build_plan", "cut_buckets", "padding_rows", "rank_plans", "shard_rows", "target_group"]


class Block(NamedTuple):
    """rows x cols elements moving from src_rank's shard to dst_rank's target.

    src_row and cols are relative to the source rank's local shard (cols are
    the HF tensor's columns unless the training TP splits them); (dst_row,
    dst_col) is the offset in the TP-local target.
    """

    src_rank: int
    dst_rank: int
    hf_name: str
    src_row: int
    cols: tuple[int, int]
    target: str
    dst_row: int
    dst_col: int
    rows: int
    group: int = 0

    @property
    def numel(self) -> int:
        return self.rows * (self.cols[1] - self.cols[0])


@dataclass
class ReshardPlan:
    """All blocks of one resharding, grouped for execution.

    Attributes:
        world_size, tp: N and T.
        num_sources: M, the ranks 0..M-1 whose FSDP2 shards are the sources
            (N when colocated); ranks M..N-1 hold targets only.
        shard_group_size: S, the ranks one copy of the weights is sharded
            over (M/S replicas of it; S = M unless replicated or hybrid).
        hf_shapes: every HF parameter as 2-D (rows, cols).
        row_units: HF tensors sharded by groups of rows (`layouts.row_units`).
        targets: per global rank, its vLLM parameters (layout order).
        groups: target names per group (embeddings, each decoder layer, the
            head); a sync completes one group at a time, so the rollout can
            install (re-pack) a layer while staging only that layer.
        local: per rank, blocks with src_rank == dst_rank == rank.
        buckets: per bucket, the remote blocks in canonical order (by unit,
            `reshard.buckets`, then destination ascending); within a
            bucket a rank packs the blocks it sends, grouped by destination
            rank (ascending), and unpacks what it receives grouped by source.
            A bucket never spans two groups.
        bucket_groups: each bucket's group.
        rank: None for the whole plan; r for rank r's plan, whose local and
            buckets hold only the blocks r copies, sends or receives (the
            same buckets, in the same order, as every other rank's).
        geo: the geometry it was planned on (`reshard.buckets.Geometry`).
    """

    world_size: int
    tp: int
    num_sources: int
    hf_shapes: dict[str, tuple[int, int]]
    targets: list[list[TargetParam]]
    groups: list[list[str]] = field(default_factory=list)
    local: list[list[Block]] = field(default_factory=list)
    buckets: list[list[Block]] = field(default_factory=list)
    shard_group_size: int = 0  # 0: num_sources (set in __post_init__)
    row_units: dict[str, int] = field(default_factory=dict)
    bucket_groups: list[int] = field(default_factory=list)
    rank: int | None = None
    geo: Geometry | None = None

    def __post_init__(self) -> None:
        self.shard_group_size = self.shard_group_size or self.num_sources
        assert len(self.bucket_groups) == len(self.buckets), "every bucket needs its group"
        assert self.rank is None or 0 <= self.rank < self.world_size, self.rank

    def source_block(self, name: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """([start, end) rows, [start, end) columns) of HF tensor name that rank
        holds (no rows: not a source)."""
        rows, cols = self.hf_shapes[name]
        if rank >= self.num_sources:
            return (rows, rows), (0, cols)
        if self.geo is not None:
            return self.geo.source_block(name, rank)
        return shard_rows(rows, self.shard_group_size, rank % self.shard_group_size,
                          self.row_units.get(name, 1)), (0, cols)

    def group_buckets(self, group: int) -> list[int]:
        """Indices of the buckets of one group, in order."""
        return [i for i, g in enumerate(self.bucket_groups) if g == group]

    def sends(self, bucket: int, rank: int) -> list[Block]:
        """Blocks rank sends in a bucket, grouped by destination rank."""
        out = [b for b in self.buckets[bucket] if b.src_rank == rank]
        return sorted(out, key=lambda b: b.dst_rank)  # stable: keeps canonical order

    def recvs(self, bucket: int, rank: int) -> list[Block]:
        """Blocks rank receives in a bucket, grouped by source rank."""
        out = [b for b in self.buckets[bucket] if b.dst_rank == rank]
        return sorted(out, key=lambda b: b.src_rank)

    def elements_received(self, rank: int) -> int:
        """Elements rank receives from other ranks (remote blocks), all buckets."""
        assert self.rank in (None, rank), f"rank {self.rank}'s plan has no blocks of rank {rank}"
        return sum(b.numel for bk in self.buckets for b in bk if b.dst_rank == rank)

    def elements_sent(self, rank: int) -> int:
        assert self.rank in (None, rank), f"rank {self.rank}'s plan has no blocks of rank {rank}"
        return sum(b.numel for bk in self.buckets for b in bk if b.src_rank == rank)

    def naive_elements_received(self, rank: int) -> int:
        """Elements rank receives when every HF tensor is all-gathered (naive path;
        under separate placement a rollout rank receives every full tensor)."""
        total = 0
        for name, (rows, cols) in self.hf_shapes.items():
            (r0, r1), (c0, c1) = self.source_block(name, rank)
            total += rows * cols - (r1 - r0) * (c1 - c0)
        return total

    def target_elements(self, rank: int) -> int:
        """Elements of all vLLM parameters of rank (padding included)."""
        return sum(t.shape[0] * t.shape[1] for t in self.targets[rank])


def _blocks_for(geo: Geometry, d_rank: int, target: TargetParam, serving: int, group: int,
                only: tuple[int, int] | None = None) -> list[Block]:
    """Blocks filling target (of sync group `group`) on d_rank, served by shard
    group `serving` (a split slab's parts by the group holding it: `Geometry.parts`);
    only: just those of that (shard group, position)."""
    out = []
    s = geo.shard_group_size
    for seg in target.segments:
        if seg.rows[1] <= seg.rows[0]:
            continue
        unit = geo.units.get(seg.hf_name, 1)
        for part in geo.parts(seg):
            holder = serving if part.group < 0 else part.group
            if only is not None and only[0] != holder:
                continue
            chunk = -(-part.slab_rows // unit // s) * unit
            a, b = part.rows[0] - part.slab_row, part.rows[1] - part.slab_row  # in the slab
            first, last = a // chunk, (b - 1) // chunk + 1  # positions it overlaps
            if only is not None:
                first, last = max(first, only[1]), min(last, only[1] + 1)
            ranks = geo.sources(holder)
            cols = (part.cols[0] - part.slab_col, part.cols[1] - part.slab_col)
            for p in range(first, last):
                s0, s1 = shard_rows(part.slab_rows, s, p, unit)
                r0, r1 = max(a, s0), min(b, s1)
                if r0 < r1:
                    out.append(Block(ranks[p], d_rank, seg.hf_name, r0 - s0, cols, target.name,
                                     part.dst_row + (r0 - a), part.dst_col, r1 - r0, group))
    return out


def target_group(name: str, num_layers: int) -> int:
    """0 for the embeddings, 1 + i for decoder layer i, num_layers + 1 for the rest."""
    if name.startswith("model.layers."):
        return 1 + int(name.split(".")[2])
    return 0 if name.startswith("model.embed_tokens.") else num_layers + 1


def build_plan(dims: ModelDims, world_size: int, tp: int, *,
               bucket_elems: int = 1 << 24, num_trainers: int | None = None,
               shard_group_size: int | None = None, lora: LoraDims | None = None,
               rank: int | None = None, train_tp: int = 1) -> ReshardPlan:
    """Builds the plan for N = world_size ranks and rollout TP size tp.

    Args:
        dims: model dimensions (`hybrid_engine.reshard.layouts.model_dims`).
        world_size: N ranks.
        tp: T, must divide the rollout ranks (N colocated, N - M separate).
        bucket_elems: most elements any rank sends, or receives, per bucket
            (`reshard.buckets`: a parameter bigger than that is cut into row
            chunks; one row bigger than that is refused).
        num_trainers: None = colocated (FSDP2 over all N ranks, each also a
            rollout rank); M = separate placement (FSDP2 shards every HF
            tensor's rows over ranks 0..M-1, the rollout runs on M..N-1).
        shard_group_size: S, ranks per shard group of the sources (None = M:
            one group; 1 = replicated; train.sharding=hybrid: its group size).
        lora: plan these dims' LoRA adapters, not weights (`reshard.adapters`).
        rank: None = every rank's blocks (the whole plan); r = only the blocks
            rank r sends or receives, and its local ones: the whole plan
            restricted to r, built without listing any other rank's.
        train_tp: the training TP size (train.tensor_parallel_size): sources
            d * train_tp + t hold TP rank t's slab of each tensor it splits
            (`layouts.train_splits`), FSDP2 rows of it over the M / train_tp
            ranks of that TP rank (shard_group_size must be None or that).

    Raises:
        ValueError: T does not divide the rollout ranks, M is not in [1, N),
            S does not divide M, T or train_tp does not fit the model's heads,
            rank is not one of the N, or one row of a parameter passes bucket_elems.
    """
    return next(rank_plans(dims, world_size, tp, [rank], bucket_elems=bucket_elems,
                           num_trainers=num_trainers, shard_group_size=shard_group_size,
                           lora=lora, train_tp=train_tp))


def rank_plans(dims: ModelDims, world_size: int, tp: int, ranks: Iterable[int | None], *,
               bucket_elems: int = 1 << 24, num_trainers: int | None = None,
               shard_group_size: int | None = None, lora: LoraDims | None = None,
               train_tp: int = 1) -> Iterator[ReshardPlan]:
    """`build_plan(..., rank=r)` for each r of ranks, one at a time, the buckets
    computed once (`hybrid-engine plan`'s cluster view holds one rank's plan)."""
    cut = cut_buckets(dims, world_size, tp, bucket_elems=bucket_elems, num_trainers=num_trainers,
                      shard_group_size=shard_group_size, lora=lora, train_tp=train_tp)
    geo, every, units = cut.geo, cut.every, cut.buckets
    groups = [[geo.layouts[0][i].name for i in g] for g in cut.indices]
    targets = [[] if g < geo.first else geo.layouts[(g - geo.first) % tp]
               for g in range(world_size)]
    for rank in ranks:
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of the {world_size} ranks")
        local: list[list[Block]] = [[] for _ in range(world_size)]
        blocks = _Twinned(geo, cut.indices, cut.twin)
        for g in range(world_size) if rank is None else [rank]:
            local[g] = [b for u in every for b in blocks(u, _local, g)]
        buckets = [[b for u in bucket for b in blocks(u, _remote, rank)] for bucket in units]
        yield ReshardPlan(world_size, tp, geo.num_sources, geo.shapes, targets, groups, local,
                          buckets, geo.shard_group_size, geo.units,
                          [bucket[0].group for bucket in units], rank, geo)


@dataclass
class Cut:
    """The sync's buckets, from the shapes alone (`cut_buckets`).

    Attributes:
        geo: who holds what (`reshard.buckets.Geometry`).
        indices: per sync group, its vLLM parameters' indices in layout order.
        twin: per group, the group it equals but for names (itself if none).
        every: every unit (parameters in layout order, a parameter's units in
            their cut order); buckets: the remote ones, cut.
    """

    geo: Geometry
    indices: list[list[int]]
    twin: list[int]
    every: list[Unit]
    buckets: list[list[Unit]]


def cut_buckets(dims: ModelDims, world_size: int, tp: int, *, bucket_elems: int = 1 << 24,
                num_trainers: int | None = None, shard_group_size: int | None = None,
                lora: LoraDims | None = None, train_tp: int = 1) -> Cut:
    """The buckets every rank's plan shares (arguments as `build_plan`'s); a
    decoder layer equal to layer 0 but for names reuses its cut."""
    geo = _geometry(dims, world_size, tp, bucket_elems, num_trainers, shard_group_size, lora,
                    train_tp)
    groups: list[list[int]] = [[] for _ in range(dims.num_layers + 2)]
    for i, t in enumerate(geo.layouts[0]):
        groups[target_group(t.name, dims.num_layers)].append(i)
    twin = twins(geo, groups, [None, *(f"model.layers.{i}." for i in range(dims.num_layers)), None])
    every, buckets = bucketize(geo, groups, bucket_elems, twin)
    return Cut(geo, groups, twin, every, buckets)


class _Twinned:
    """A unit's blocks (`_local`, `_remote`), a twin group's renamed from those
    of the group it twins (`buckets.twins`), listed once."""

    def __init__(self, geo: Geometry, indices: list[list[int]], twin: list[int]) -> None:
        self.geo, self.indices, self.twin = geo, indices, twin
        self.templates = {t for g, t in enumerate(twin) if t != g}
        self.listed: dict[tuple, list[Block]] = {}  # the templates' blocks
        self.names: dict[int, dict[str, str]] = {}

    def __call__(self, u: Unit, blocks: Callable[[Geometry, Unit, int | None], list[Block]],
                 arg: int | None) -> list[Block]:
        """blocks(geo, u, arg), from the template's when u's group is a twin."""
        t, g = self.twin[u.group], u.group
        if t == g:
            out = blocks(self.geo, u, arg)
            if g in self.templates:
                self.listed[(blocks, u.index, u.rows, arg)] = out
            return out
        i = self.indices[t][self.indices[g].index(u.index)]
        key = (blocks, i, u.rows, arg)
        if key not in self.listed:  # the template's unit was not asked for first
            self.listed[key] = blocks(self.geo, Unit(self.geo.layouts[0][i].name, i, u.rows, t),
                                      arg)
        names = self._names(t, g)
        return [Block(b[0], b[1], names[b[2]], b[3], b[4], names[b[5]], b[6], b[7], b[8], g)
                for b in self.listed[key]]

    def _names(self, t: int, g: int) -> dict[str, str]:
        """Group t's names (HF tensors, vLLM parameters) -> group g's."""
        if g not in self.names:
            out: dict[str, str] = {}
            for i, j in zip(self.indices[t], self.indices[g], strict=True):
                for r in range(self.geo.tp):
                    a, b = self.geo.layouts[r][i], self.geo.layouts[r][j]
                    out[a.name] = b.name
                    out.update((x.hf_name, y.hf_name) for x, y in zip(a.segments, b.segments,
                                                                      strict=True))
            self.names[g] = out
        return self.names[g]


def _geometry(dims: ModelDims, world_size: int, tp: int, bucket_elems: int,
              num_trainers: int | None, shard_group_size: int | None,
              lora: LoraDims | None, train_tp: int = 1) -> Geometry:
    """The plan's geometry, its arguments checked (see `build_plan`)."""
    m = world_size if num_trainers is None else num_trainers
    if not 1 <= m <= world_size or (num_trainers is not None and m == world_size):
        raise ValueError(f"separate placement needs 1 <= trainer ranks < world size "
                         f"{world_size}, got {num_trainers}")
    rollout_ranks = world_size if num_trainers is None else world_size - m
    if tp < 1 or rollout_ranks % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the "
                         f"{'world size' if num_trainers is None else 'rollout ranks'} {rollout_ranks}")
    if bucket_elems < 1:
        raise ValueError(f"bucket size must be positive, got {bucket_elems} elements")
    if train_tp < 1 or m % train_tp:
        raise ValueError(f"train.tensor_parallel_size={train_tp} must divide the {m} "
                         "trainer ranks")
    if train_tp > 1 and (lora is not None or shard_group_size not in (None, m // train_tp)):
        raise ValueError(f"train.tensor_parallel_size={train_tp} shards over the {m // train_tp} "
                         f"ranks of each TP rank, without LoRA (got shard group size "
                         f"{shard_group_size}{', LoRA' * (lora is not None)})")
    size = m // train_tp if shard_group_size is None else shard_group_size
    if not 1 <= size <= m or m % size:
        raise ValueError(f"shard group size {shard_group_size} must divide the {m} source ranks")
    shapes = hf_shapes(dims) if lora is None else adapter_shapes(dims, lora)
    units = row_units(dims) if lora is None else {}
    layouts = [tp_layout(dims, tp, r) if lora is None else adapter_layout(dims, lora, tp, r)
               for r in range(tp)]
    splits = train_splits(dims, train_tp) if train_tp > 1 else {}
    return Geometry(world_size, tp, m, size, world_size - rollout_ranks, shapes, units, layouts,
                    splits, train_tp)


def _local(geo: Geometry, u: Unit, g: int) -> list[Block]:
    """The blocks of unit u that rank g copies from its own shard (none: g holds
    no parameters, or its rows come from another group)."""
    r = geo.tp_rank(g)
    if r is None or g >= geo.num_sources or geo.serving(g) != geo.group_of(g):
        return []
    return _blocks_for(geo, g, geo.clipped(r, u.index, u.rows), geo.serving(g), u.group,
                       only=(geo.group_of(g), geo.position(g)))


def _remote(geo: Geometry, u: Unit, rank: int | None) -> list[Block]:
    """Unit u's blocks between two ranks, destinations ascending (canonical order);
    rank given: only those it sends or receives. A destination's blocks from one
    group differ from another's of the same TP rank only in dst_rank, so they
    are listed once per (TP rank, group) and stamped per destination."""
    out: dict[int, list[Block]] = {}
    holds = None  # per TP rank, whether rank holds any of u's rows: [T, any group or its own]
    if rank is not None and rank < geo.num_sources:
        me = (geo.group_of(rank), geo.position(rank))
        held = shares(geo, u, np.array([me[1]]))[0][:, :, 0]
        holds = np.stack([held[:, -1] > 0, held[:, me[0]] > 0], 1)
    for r in range(geo.tp):
        for group in range(geo.num_groups):
            dsts = geo.served(r, group)
            if not len(dsts):
                continue
            receives = rank is None or rank in dsts
            if not receives and (holds is None or not (holds[r, 0] and me[0] == group
                                                       or holds[r, 1])):
                continue  # rank neither receives nor sends these
            protos = _blocks_for(geo, -1 if rank is None else rank,
                                 geo.clipped(r, u.index, u.rows), group, u.group,
                                 None if receives else me)
            for g in dsts.tolist():
                if g == rank:  # every source's rows but its own, already stamped
                    mine = [p for p in protos if p[0] != g]
                elif rank is None:
                    mine = [Block(p[0], g, *p[2:]) for p in protos if p[0] != g]
                else:  # what rank sends g
                    mine = [Block(p[0], g, *p[2:]) for p in protos if p[0] == rank]
                if mine:
                    out.setdefault(g, []).extend(mine)
    return [b for g in sorted(out) for b in out[g]]


def padding_rows(targets: list) -> dict[str, int]:
    """vLLM parameter name -> first local row no segment of the plan writes (the vocab
    padding of embed_tokens / lm_head), for targets with such rows. vLLM zero-fills
    them at load time; after a release that discarded the weights (GPU sleep level 2)
    they hold garbage, so every sync zeroes them again."""
    out = {}
    for t in targets:
        covered = max((seg.dst_row + seg.rows[1] - seg.rows[0] for seg in t.segments), default=0)
        if covered < t.shape[0]:
            out[t.name] = covered
    return out
