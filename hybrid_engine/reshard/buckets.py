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

Shape legend: N ranks, S ranks per shard group, G shard groups, T TP size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hybrid_engine.reshard.layouts import Segment, TargetParam

__all__ = ["Geometry", "Unit", "bucketize", "clip", "serving_group", "shares", "twins"]


def serving_group(d_rank: int, first_target: int, shard_group_size: int,
                  num_groups: int) -> int:
    """The shard group whose ranks send destination d_rank its rows: its own when
    d_rank is a source (colocated: first_target = 0), else round-robin over the
    rollout ranks, so the groups feed equal shares (within one) of them."""
    if first_target == 0:
        return d_rank // shard_group_size
    return (d_rank - first_target) % num_groups


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


@dataclass
class Geometry:
    """Who holds what: N ranks, sources 0..M-1 in shard groups of S (rank g at
    position g % S), destinations `first`..N-1 (rank g is TP rank (g - first) % T),
    each served by one group (`serving_group`).

    Attributes:
        layouts: per TP rank, its vLLM parameters (layout order, the same names).
        shapes, units: HF tensor -> 2-D shape, -> rows per Shard(0) index.
    """

    world: int
    tp: int
    num_sources: int
    shard_group_size: int
    first: int
    shapes: dict[str, tuple[int, int]]
    units: dict[str, int]
    layouts: list[list[TargetParam]]
    _served: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    _segments: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
    _tables: Tables | None = None
    _starts: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return self.num_sources // self.shard_group_size

    def serving(self, d_rank: int) -> int:
        return serving_group(d_rank, self.first, self.shard_group_size, self.num_groups)

    def sources(self, group: int) -> range:
        """The ranks of shard group `group`, in shard order."""
        return range(group * self.shard_group_size, (group + 1) * self.shard_group_size)

    def tp_rank(self, d_rank: int) -> int | None:
        """d_rank's TP rank, None when it holds no vLLM parameters."""
        return None if d_rank < self.first else (d_rank - self.first) % self.tp

    def segments(self, index: int) -> tuple[np.ndarray, ...]:
        """Parameter `index`'s segments on every TP rank as arrays: HF rows [a, b),
        width w, dst_row d, the HF tensor's rows n, its rows per shard index u,
        and the TP rank r (cached)."""
        if index not in self._segments:
            rows = np.array([(s.rows[0], s.rows[1], s.cols[1] - s.cols[0], s.dst_row,
                              self.shapes[s.hf_name][0], self.units.get(s.hf_name, 1), r)
                             for r in range(self.tp) for s in self.layouts[r][index].segments],
                            dtype=np.int64).reshape(-1, 7)
            self._segments[index] = tuple(rows.T)
        return self._segments[index]

    def tables(self) -> Tables:
        """Per destination (ranks first..N-1): its TP rank, and its position in the
        group serving it (-1: not a source there); per source (0..M-1): its group,
        its position, and its TP rank when its own group serves it (else -1);
        per (TP rank, group): how many destinations the group serves."""
        if self._tables is None:
            s = self.shard_group_size
            dst = np.arange(self.first, self.world)
            group = np.array([self.serving(g) for g in dst.tolist()], dtype=np.int64)
            pos = np.where((dst >= group * s) & (dst < (group + 1) * s), dst - group * s, -1)
            dst_r = (dst - self.first) % self.tp
            counts = np.zeros((self.tp, self.num_groups), dtype=np.int64)
            np.add.at(counts, (dst_r, group), 1)
            src = np.arange(self.num_sources)
            self_r = np.full(self.num_sources, -1)
            own = dst[pos >= 0]
            self_r[own] = dst_r[pos >= 0]
            self._tables = Tables(dst, dst_r, pos, counts, src, src // s, src % s, self_r)
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
    [T, S] (positions given: [T, len(positions)]), all elements of each copy [T])."""
    a, b, w, d, n, u, r = geo.segments(unit.index)
    c0, c1 = unit.rows
    keep = (d < c1) & (d + b - a > c0)
    a, b, w, d, n, u, r = (x[keep] for x in (a, b, w, d, n, u, r))
    a, b = a + np.maximum(c0 - d, 0), a + np.minimum(c1, d + b - a) - d
    p = (np.arange(geo.shard_group_size, dtype=np.int64) if positions is None
         else positions)[None, :]
    whole = (n // u * u)[:, None]
    chunk = (-(-(n // u) // geo.shard_group_size) * u)[:, None]  # torch.chunk's rows
    lo = np.minimum(p * chunk, whole)
    hi = np.minimum(lo + chunk, whole)
    overlap = np.clip(np.minimum(b[:, None], hi) - np.maximum(a[:, None], lo), 0, None)
    share = np.zeros((geo.tp, p.shape[1]), dtype=np.int64)
    np.add.at(share, r, overlap * w[:, None])
    total = np.zeros(geo.tp, dtype=np.int64)
    np.add.at(total, r, (b - a) * w)
    return share, total


def _piece_volumes(geo: Geometry, index: int, bounds: np.ndarray,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(sends [m, N], receives [m, N]) of the m pieces [bounds[j], bounds[j + 1])
    of parameter `index`, each inside at most one segment per TP rank (bounds
    hold every segment's start and end): one pass over (segment, piece) pairs."""
    a, b, w, d, n, u, r = geo.segments(index)
    m, s = len(bounds) - 1, geo.shard_group_size
    j0, j1 = np.searchsorted(bounds, d), np.searchsorted(bounds, d + b - a)
    seg = np.repeat(np.arange(len(d)), j1 - j0)  # (segment, piece) pairs
    piece = np.arange(len(seg)) - np.repeat(np.cumsum(j1 - j0) - (j1 - j0), j1 - j0) + j0[seg]
    lo_row = a[seg] + bounds[piece] - d[seg]
    hi_row = lo_row + bounds[piece + 1] - bounds[piece]
    p = np.arange(s, dtype=np.int64)[None, :]
    whole = (n // u * u)[seg][:, None]
    chunk = (-(-(n // u) // s) * u)[seg][:, None]  # torch.chunk's rows
    lo = np.minimum(p * chunk, whole)
    hi = np.minimum(lo + chunk, whole)
    overlap = np.clip(np.minimum(hi_row[:, None], hi) - np.maximum(lo_row[:, None], lo), 0, None)
    share = np.zeros((geo.tp, m, s), dtype=np.int64)
    np.add.at(share, (r[seg], piece), overlap * w[seg][:, None])
    total = np.zeros((geo.tp, m), dtype=np.int64)
    np.add.at(total, (r[seg], piece), (hi_row - lo_row) * w[seg])
    t = geo.tables()
    recv = np.zeros((m, geo.world), dtype=np.int64)
    own = np.where(t.dst_pos >= 0, share[t.dst_r, :, np.maximum(t.dst_pos, 0)].T, 0)
    recv[:, t.dst] = total[t.dst_r].T - own
    send = np.zeros((m, geo.world), dtype=np.int64)
    out = (share[:, :, t.src_pos] * t.counts[:, None, t.src_group]).sum(0)
    mine = np.where(t.self_r >= 0, share[np.maximum(t.self_r, 0), :, t.src_pos].T, 0)
    send[:, t.src] = out - mine
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
    a, b, _, d, n, u, r = (x[geo.segments(index)[6] == 0] for x in geo.segments(index))
    if not len(d):
        return np.zeros(len(starts), dtype=np.int64)
    k = np.maximum(np.searchsorted(d, starts, side="right") - 1, 0)
    hf = a[k] + starts - d[k]
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
