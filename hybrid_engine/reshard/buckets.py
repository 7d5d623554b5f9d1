"""The sync's buckets, from per-rank volumes in closed form (no block is listed).

Job: cut each sync group's remote traffic into buckets in which every rank
sends, and receives, at most bucket_elems elements, computed the same on
every rank from the shapes alone, so that a rank can list only its own
blocks (`reshard.plan.build_plan(rank=...)`) and still agree with every peer
on each bucket's content.

A bucket holds units: rows [r0, r1) of one vLLM parameter, the same rows of
its copy on every TP rank (the copies have one shape). Volumes, per rank,
follow from the geometry alone: a destination g of TP rank r receives the
rows' elements less those of its own source rows (colocated, g in its
serving group), and source position p of a serving group sends its rows'
elements to each destination that group serves, itself excepted. A
parameter is cut into pieces at its segments' boundaries (all its pieces'
volumes in one numpy pass; a piece whose volume passes bucket_elems cut into
equal row chunks until each fits; a single row that does not is refused).
Parameters follow the layout's order, and a parameter's pieces the order of
where their rows sit in their sources' shards, so that consecutive pieces
come from different sources; a bucket closes when a piece would take some
rank past bucket_elems, and at a group's end; a parameter's contiguous
pieces in one bucket form one unit. Pieces whose every element is local take
no bucket. Decoder layers equal to layer 0 but for their names reuse its
cut (`twins`).

With TP in training (train.tensor_parallel_size = G > 1) the shard groups
are the training TP ranks: source g = d G + t is position d of group t.
A tensor the training TP splits (`Geometry.splits`) has its slab t (rows
for colwise, columns for rowwise) in group t alone, row-sharded over its
positions; a segment is cut into parts at the slabs' bounds (`parts`), and
a part of slab t comes from group t whatever group serves the destination.
The rest is row-sharded in every group alike, as under HSDP.

Shape legend: N ranks, S ranks per shard group, G shard groups, T TP size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hybrid_engine.reshard.layouts import Segment, TargetParam

__all__ = ["Geometry", "Part", "Unit", "bucketize", "clip", "shard_rows", "shares", "twins"]

ANY = -1  # a part any shard group holds (`Part.group`)


def shard_rows(num_rows: int, world_size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """[start, end) rows of a rank under FSDP2's Shard(0) (torch.chunk semantics).

    unit: rows per index of the tensor's first dim (a 3-D tensor seen 2-D, e.g.
    MoE experts: `layouts.row_units`); Shard(0) splits whole units."""
    n = num_rows // unit
    chunk = -(-n // world_size)
    start = min(rank * chunk, n)
    return start * unit, min(start + chunk, n) * unit


class Part(NamedTuple):
    """A segment's rows and columns within one training TP slab.

    group: the shard group holding it (ANY: every group, the tensor is not split);
    its slab is HF rows [slab_row, slab_row + slab_rows), row-sharded over the
    group's positions, whose columns start at HF column slab_col."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    dst_row: int
    dst_col: int
    group: int
    slab_row: int
    slab_rows: int
    slab_col: int


@dataclass(frozen=True, slots=True)
class Unit:
    """Rows [rows[0], rows[1]) of vLLM parameter `target` (index `index` in the
    layout), on every TP rank, in sync group `group`."""

    target: str
    index: int
    rows: tuple[int, int]
    group: int


class Tables(NamedTuple):
    """Rank facts as arrays (`Geometry.tables`)."""

    dst: np.ndarray
    dst_r: np.ndarray
    dst_pos: np.ndarray
    counts: np.ndarray
    src: np.ndarray
    src_group: np.ndarray
    src_pos: np.ndarray
    self_r: np.ndarray
    dst_group: np.ndarray


@dataclass
class Geometry:
    """Who holds what: N ranks, sources 0..M-1 in shard groups of S (rank g at
    position g % S of group g // S; with TP in training, position g // G of
    group g % G), destinations `first`..N-1 (rank g is TP rank (g - first) % T),
    each served by one group (`serving`).

    Attributes:
        layouts: per TP rank, its vLLM parameters (layout order, the same names).
        shapes, units: HF tensor -> 2-D shape, -> rows per Shard(0) index.
        splits: HF tensor -> "colwise" / "rowwise": split over the training TP
            ranks (`parallel.tensor_parallel`); train_tp: their number (G).
    """

    world: int
    tp: int
    num_sources: int
    shard_group_size: int
    first: int
    shapes: dict[str, tuple[int, int]]
    units: dict[str, int]
    layouts: list[list[TargetParam]]
    splits: dict[str, str] = field(default_factory=dict)
    train_tp: int = 1
    _served: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    _segments: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
    _tables: Tables | None = None
    _starts: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return self.num_sources // self.shard_group_size

    def serving(self, d_rank: int) -> int:
        """The shard group whose ranks send destination d_rank its rows (but the
        split slabs' parts): its own when d_rank is a source (colocated), else
        round-robin over the rollout ranks, so the groups feed equal shares
        (within one) of them."""
        if self.first == 0:
            return self.group_of(d_rank)
        return (d_rank - self.first) % self.num_groups

    def group_of(self, g: int) -> int:
        """Source rank g's shard group."""
        return g % self.train_tp if self.train_tp > 1 else g // self.shard_group_size

    def position(self, g: int) -> int:
        """Source rank g's position in its shard group."""
        return g // self.train_tp if self.train_tp > 1 else g % self.shard_group_size

    def sources(self, group: int) -> range:
        """The ranks of shard group `group`, in shard order."""
        if self.train_tp > 1:
            return range(group, self.num_sources, self.train_tp)
        return range(group * self.shard_group_size, (group + 1) * self.shard_group_size)

    def parts(self, s: Segment) -> list[Part]:
        """Segment s cut at the training TP slabs' bounds (one part, held by every
        group, when its tensor is not split)."""
        n, c = self.shapes[s.hf_name]
        split = self.splits.get(s.hf_name)
        if split is None:
            return [Part(s.rows, s.cols, s.dst_row, s.dst_col, ANY, 0, n, 0)]
        out = []
        for t in range(self.train_tp):
            if split == "colwise":
                o, e = shard_rows(n, self.train_tp, t)
                lo, hi = max(s.rows[0], o), min(s.rows[1], e)
                if lo < hi:
                    out.append(Part((lo, hi), s.cols, s.dst_row + lo - s.rows[0], s.dst_col,
                                    t, o, e - o, 0))
            else:
                o, e = shard_rows(c, self.train_tp, t)
                lo, hi = max(s.cols[0], o), min(s.cols[1], e)
                if lo < hi:
                    out.append(Part(s.rows, (lo, hi), s.dst_row, s.dst_col + lo - s.cols[0],
                                    t, 0, n, o))
        return out

    def source_block(self, name: str, g: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """([start, end) rows, [start, end) columns) of HF tensor name that source
        rank g holds."""
        n, c = self.shapes[name]
        t, p, s = self.group_of(g), self.position(g), self.shard_group_size
        split = self.splits.get(name)
        if split == "colwise":
            o, e = shard_rows(n, self.train_tp, t)
            a, b = shard_rows(e - o, s, p)
            return (o + a, o + b), (0, c)
        if split == "rowwise":
            return shard_rows(n, s, p), shard_rows(c, self.train_tp, t)
        return shard_rows(n, s, p, self.units.get(name, 1)), (0, c)

    def tp_rank(self, d_rank: int) -> int | None:
        """d_rank's TP rank, None when it holds no vLLM parameters."""
        return None if d_rank < self.first else (d_rank - self.first) % self.tp

    def segments(self, index: int) -> tuple[np.ndarray, ...]:
        """Parameter `index`'s segments' parts (`parts`) on every TP rank as arrays:
        HF rows [a, b), width w, dst_row d, its slab's rows n, its rows per shard
        index u, the TP rank r, the group holding it f (ANY: every group) and its
        slab's first row o (cached)."""
        if index not in self._segments:
            rows = np.array([(p.rows[0], p.rows[1], p.cols[1] - p.cols[0], p.dst_row,
                              p.slab_rows, self.units.get(s.hf_name, 1), r, p.group, p.slab_row)
                             for r in range(self.tp) for s in self.layouts[r][index].segments
                             for p in self.parts(s)],
                            dtype=np.int64).reshape(-1, 9)
            self._segments[index] = tuple(rows.T)
        return self._segments[index]

    def tables(self) -> Tables:
        """Per destination (ranks first..N-1): its TP rank, its position in the
        group serving it (-1: not a source there) and that group; per source
        (0..M-1): its group, its position, and its TP rank when its own group
        serves it (else -1); per (TP rank, group): how many destinations the
        group serves."""
        if self._tables is None:
            dst = np.arange(self.first, self.world)
            group = np.array([self.serving(g) for g in dst.tolist()], dtype=np.int64)
            pos = np.array([self.position(g) if g < self.num_sources and self.group_of(g) == k
                            else -1 for g, k in zip(dst.tolist(), group.tolist())],
                           dtype=np.int64)
            dst_r = (dst - self.first) % self.tp
            counts = np.zeros((self.tp, self.num_groups), dtype=np.int64)
            np.add.at(counts, (dst_r, group), 1)
            src = np.arange(self.num_sources)
            self_r = np.full(self.num_sources, -1)
            own = dst[pos >= 0]
            self_r[own] = dst_r[pos >= 0]
            self._tables = Tables(dst, dst_r, pos, counts, src,
                                  np.array([self.group_of(g) for g in src.tolist()]),
                                  np.array([self.position(g) for g in src.tolist()]), self_r,
                                  group)
        return self._tables

    def clipped(self, r: int, index: int, rows: tuple[int, int]) -> TargetParam:
        """Parameter `index` of TP rank r, restricted to its rows [rows) (`clip`)."""
        target = self.layouts[r][index]
        key = (r, index)
        if key not in self._starts:
            starts = [s.dst_row for s in target.segments]
            assert all(a < b for a, b in zip(starts, starts[1:])), \
                f"{target.name}: segments must start on increasing dst_rows"
            self._starts[key] = starts
        return clip(target, rows, self._starts[key])

    def served(self, r: int, group: int) -> np.ndarray:
        """The destinations of TP rank r that shard group `group` serves, ascending."""
        key = (r, group)
        if key not in self._served:
            dsts = range(self.first + r, self.world, self.tp)
            self._served[key] = np.array([g for g in dsts if self.serving(g) == group],
                                         dtype=np.int64)
        return self._served[key]


def twins(geo: Geometry, groups: list[list[int]], prefixes: list[str | None]) -> list[int]:
    """Per sync group, the first group equal to it but for its names' prefix
    (prefixes[g]; None: no twin), else itself. Twins have the same units and
    blocks, their names aside: a model's decoder layers are twins of layer 0."""
    seen: dict[tuple, int] = {}
    out = []
    for g, (indices, prefix) in enumerate(zip(groups, prefixes, strict=True)):
        key = None if prefix is None else _signature(geo, indices, prefix)
        out.append(g if key is None else seen.setdefault(key, g))
    return out


def _signature(geo: Geometry, indices: list[int], prefix: str) -> tuple | None:
    """What a group's units and blocks depend on, its names less prefix (None:
    a name without it): per parameter, on every TP rank, its shape and its
    segments (HF rows, columns, dst offsets, the HF tensor's rows and row unit,
    which distinct HF tensor)."""
    out: list = []
    for i in indices:
        names: dict[str, int] = {}
        rows = [(*s.rows, *s.cols, s.dst_row, s.dst_col, *geo.shapes[s.hf_name],
                 geo.units.get(s.hf_name, 1), names.setdefault(s.hf_name, len(names)))
                for r in range(geo.tp) for s in geo.layouts[r][i].segments]
        rel = [n[len(prefix):] if n.startswith(prefix) else None
               for n in [geo.layouts[0][i].name, *names]]
        if None in rel:
            return None
        out.append((*rel, *(geo.layouts[r][i].shape for r in range(geo.tp)),
                    np.array(rows, dtype=np.int64).tobytes()))
    return tuple(out)


def clip(target: TargetParam, rows: tuple[int, int], starts: list[int]) -> TargetParam:
    """target restricted to its local rows [rows[0], rows[1]) (segments cut to them;
    starts: its segments' dst_rows, ascending: they tile it in that order, so
    only the segments that overlap are visited)."""
    if rows == (0, target.shape[0]):
        return target
    c0, c1 = rows
    first = max(bisect.bisect_right(starts, c0) - 1, 0)
    out = []
    for s in target.segments[first:bisect.bisect_left(starts, c1)]:
        n = s.rows[1] - s.rows[0]
        lo, hi = max(c0, s.dst_row), min(c1, s.dst_row + n)
        if lo < hi:
            out.append(Segment(s.hf_name, (s.rows[0] + lo - s.dst_row, s.rows[0] + hi - s.dst_row),
                               s.cols, lo, s.dst_col))
    return TargetParam(target.name, target.shape, tuple(out))


def shares(geo: Geometry, unit: Unit, positions: np.ndarray | None = None,
           ) -> tuple[np.ndarray, np.ndarray]:
    """(elements of unit's rows that shard position p holds for TP rank r's copy
    [T, G + 1, S] (positions given: [T, G + 1, len(positions)]): [:, k] those
    only group k holds (a split tensor's slab), [:, G] those every group holds;
    all elements of each copy [T])."""
    a, b, w, d, n, u, r, f, o = geo.segments(unit.index)
    c0, c1 = unit.rows
    keep = (d < c1) & (d + b - a > c0)
    a, b, w, d, n, u, r, f, o = (x[keep] for x in (a, b, w, d, n, u, r, f, o))
    a, b = a + np.maximum(c0 - d, 0), a + np.minimum(c1, d + b - a) - d
    p = (np.arange(geo.shard_group_size, dtype=np.int64) if positions is None
         else positions)[None, :]
    lo, hi = _held(geo, n, u, o, p)
    overlap = np.clip(np.minimum(b[:, None], hi) - np.maximum(a[:, None], lo), 0, None)
    share = np.zeros((geo.tp, geo.num_groups + 1, p.shape[1]), dtype=np.int64)
    np.add.at(share, (r, np.where(f < 0, geo.num_groups, f)), overlap * w[:, None])
    total = np.zeros(geo.tp, dtype=np.int64)
    np.add.at(total, r, (b - a) * w)
    return share, total


def _held(geo: Geometry, n: np.ndarray, u: np.ndarray, o: np.ndarray, p: np.ndarray,
          ) -> tuple[np.ndarray, np.ndarray]:
    """HF rows [lo, hi) that positions p [1, P] hold of each slab (n rows from o,
    u rows per index): torch.chunk's rows over the group's S positions."""
    whole = (n // u * u)[:, None]
    chunk = (-(-(n // u) // geo.shard_group_size) * u)[:, None]
    lo = np.minimum(p * chunk, whole)
    return o[:, None] + lo, o[:, None] + np.minimum(lo + chunk, whole)


def _piece_volumes(geo: Geometry, index: int, bounds: np.ndarray,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(sends [m, N], receives [m, N]) of the m pieces [bounds[j], bounds[j + 1])
    of parameter `index`, each inside at most one segment part per TP rank
    (bounds hold every part's start and end): one pass over (part, piece) pairs.
    A position's share held by every group goes to the destinations its group
    serves; a split slab's share to every destination of the TP rank."""
    a, b, w, d, n, u, r, f, o = geo.segments(index)
    m, s, groups = len(bounds) - 1, geo.shard_group_size, geo.num_groups
    j0, j1 = np.searchsorted(bounds, d), np.searchsorted(bounds, d + b - a)
    seg = np.repeat(np.arange(len(d)), j1 - j0)  # (part, piece) pairs
    piece = np.arange(len(seg)) - np.repeat(np.cumsum(j1 - j0) - (j1 - j0), j1 - j0) + j0[seg]
    lo_row = a[seg] + bounds[piece] - d[seg]
    hi_row = lo_row + bounds[piece + 1] - bounds[piece]
    lo, hi = _held(geo, n[seg], u[seg], o[seg], np.arange(s, dtype=np.int64)[None, :])
    overlap = np.clip(np.minimum(hi_row[:, None], hi) - np.maximum(lo_row[:, None], lo), 0, None)
    share = np.zeros((geo.tp, m, groups + 1, s), dtype=np.int64)  # [:, :, groups]: any group
    np.add.at(share, (r[seg], piece, np.where(f[seg] < 0, groups, f[seg])),
              overlap * w[seg][:, None])
    total = np.zeros((geo.tp, m), dtype=np.int64)
    np.add.at(total, (r[seg], piece), (hi_row - lo_row) * w[seg])
    t = geo.tables()
    recv = np.zeros((m, geo.world), dtype=np.int64)
    pos, grp = np.maximum(t.dst_pos, 0), t.dst_group
    own = share[t.dst_r, :, groups, pos] + share[t.dst_r, :, grp, pos]  # [dst, m]
    recv[:, t.dst] = total[t.dst_r].T - np.where(t.dst_pos[:, None] >= 0, own, 0).T
    send = np.zeros((m, geo.world), dtype=np.int64)
    anyg = (share[:, :, groups, t.src_pos] * t.counts[:, None, t.src_group]).sum(0)
    split = (share[:, :, t.src_group, t.src_pos] * t.counts.sum(1)[:, None, None]).sum(0)
    sr = np.maximum(t.self_r, 0)
    mine = share[sr, :, groups, t.src_pos] + share[sr, :, t.src_group, t.src_pos]  # [src, m]
    send[:, t.src] = anyg + split - np.where(t.self_r[:, None] >= 0, mine, 0).T
    return send, recv


def _pieces(geo: Geometry, index: int, limit: int,
            ) -> list[tuple[tuple[int, int], np.ndarray, np.ndarray]]:
    """Parameter `index`'s rows cut at every segment boundary, with their volumes
    (one numpy pass per round); a piece whose volume passes limit cut into
    ceil(volume / limit) equal row chunks, again while one still does. Ordered
    by where their rows sit in their source's shard (on TP rank 0), so that
    consecutive pieces come from different sources: a bucket then loads every
    source alike, not one whose shard holds a run of rows (e.g. a group's experts).

    Raises:
        ValueError: one row alone passes limit (it goes to every destination at
            once): the bucket is too small for this model and layout.
    """
    rows = geo.layouts[0][index].shape[0]
    a, b, _, d, *_ = geo.segments(index)
    bounds = np.unique(np.concatenate([[0, rows], d, d + b - a]))
    while True:
        sends, recvs = _piece_volumes(geo, index, bounds)
        peak = np.maximum(sends.max(1, initial=0), recvs.max(1, initial=0))
        over = np.flatnonzero(peak > limit)
        if not len(over):
            break
        lo, hi = bounds[over], bounds[over + 1]
        if (one := over[hi - lo == 1]).size:
            raise ValueError(
                f"a sync bucket of {limit} elements is smaller than one row of "
                f"{geo.layouts[0][index].name}, of which one rank sends or receives "
                f"{int(peak[one[0]])} elements at once: raise sync.bucket_mb")
        step = -(-(hi - lo) // -(-peak[over] // limit))
        cuts = [np.arange(x0 + s, x1, s) for x0, x1, s in zip(lo, hi, step, strict=True)]
        bounds = np.unique(np.concatenate([bounds, *cuts]))
    order = np.argsort(_shard_offsets(geo, index, bounds[:-1]), kind="stable")
    return [((int(bounds[k]), int(bounds[k + 1])), sends[k], recvs[k]) for k in order.tolist()]


def _shard_offsets(geo: Geometry, index: int, starts: np.ndarray) -> np.ndarray:
    """Where each row of `starts` (parameter `index`'s, TP rank 0's copy) sits in
    the shard of the source holding it (0: no segment writes it)."""
    a, b, _, d, n, u, r, _, o = (x[geo.segments(index)[6] == 0] for x in geo.segments(index))
    if not len(d):
        return np.zeros(len(starts), dtype=np.int64)
    k = np.maximum(np.searchsorted(d, starts, side="right") - 1, 0)
    hf = a[k] + starts - d[k] - o[k]
    chunk = -(-(n[k] // u[k]) // geo.shard_group_size) * u[k]
    return np.where(starts < d[k] + b[k] - a[k], hf % np.maximum(chunk, 1), 0)


def bucketize(geo: Geometry, groups: list[list[int]], limit: int,
              twin: list[int] | None = None) -> tuple[list[Unit], list[list[Unit]]]:
    """(every unit, the buckets: units in order). groups: per sync group, the
    indices of its parameters in layout order; twin: per group, a group it
    equals but for names (`twins`), whose units it reuses. A unit is a run of
    a parameter's contiguous pieces (`_pieces`, in their order) that one
    bucket takes; pieces whose every element is local take none."""
    every: list[Unit] = []
    buckets: list[list[Unit]] = []
    done: dict[int, tuple[list[Unit], list[list[Unit]]]] = {}
    for g, indices in enumerate(groups):
        t = g if twin is None else twin[g]
        if t == g:
            done[g] = _group_units(geo, g, indices, limit)
            units, cut = done[g]
        else:
            at = {i: k for k, i in enumerate(groups[t])}
            units = [Unit(geo.layouts[0][indices[at[u.index]]].name, indices[at[u.index]],
                          u.rows, g) for u in done[t][0]]
            own = {id(u): v for u, v in zip(done[t][0], units, strict=True)}
            cut = [[own[id(u)] for u in b] for b in done[t][1]]
        every.extend(units)
        buckets.extend(cut)
    return every, buckets


def _group_units(geo: Geometry, g: int, indices: list[int], limit: int,
                 ) -> tuple[list[Unit], list[list[Unit]]]:
    """One sync group's units and buckets (`bucketize`): a unit is a run of
    contiguous rows of one parameter, in one bucket, all remote or all local."""
    every: list[Unit] = []
    buckets: list[list[Unit]] = []
    cur: list[Unit] = []
    sent = np.zeros(geo.world, dtype=np.int64)
    recv = np.zeros(geo.world, dtype=np.int64)
    for index in indices:
        name, run = geo.layouts[0][index].name, None  # run: rows of the open unit
        for rows, s, r in _pieces(geo, index, limit):
            remote = s.any() or r.any()
            held = bool(cur) or (run is not None and run_remote)  # the bucket so far
            full = remote and held and ((sent + s > limit).any() or (recv + r > limit).any())
            if run is not None and (full or remote != run_remote or rows[0] != run[1]):
                every.append(Unit(name, index, run, g))
                if run_remote:
                    cur.append(every[-1])
                run = None
            if full:
                buckets.append(cur)
                cur, sent, recv = [], np.zeros_like(sent), np.zeros_like(recv)
            if run is None:
                run, run_remote = rows, remote
            else:
                run = (run[0], rows[1])
            sent += s
            recv += r
        if run is not None:
            every.append(Unit(name, index, run, g))
            if run_remote:
                cur.append(every[-1])
    if cur:
        buckets.append(cur)
    return every, buckets
