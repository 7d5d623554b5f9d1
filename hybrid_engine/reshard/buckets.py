"""The sync's buckets, from per-rank volumes in closed form (no block is listed).

Job: cut each sync group's remote traffic into buckets in which every rank
sends, and receives, at most bucket_elems elements, computed the same on
every rank from the shapes alone, so that a rank can list only its own
blocks (`reshard.plan.build_plan(rank=...)`) and still agree with every peer
on each bucket's content.

A bucket holds units: rows [r0, r1) of one vLLM parameter, the same rows of
its copy on every TP rank (the copies have one shape). A unit's volumes, per
rank, follow from the geometry alone: a destination g of TP rank r receives
the unit's elements less those of its own source rows (colocated, g in its
serving group), and source position p of a serving group sends its rows'
elements to each destination that group serves, itself excepted. Units
follow the layout's order; a bucket closes when a unit would take some rank
past bucket_elems, and at a group's end; a parameter whose volume alone
passes it is cut into row chunks (k equal ones, the fewest that fit; a
single row always fits). Units whose every element is local take no bucket.

Shape legend: N ranks, S ranks per shard group, G shard groups, T TP size.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from hybrid_engine.reshard.layouts import Segment, TargetParam

__all__ = ["Geometry", "Unit", "bucketize", "clip", "serving_group"]


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
    _arrays: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
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

    def arrays(self, target: TargetParam) -> tuple[np.ndarray, ...]:
        """target's segments as arrays: HF rows [a, b), width w, dst_row d, the HF
        tensor's rows n and rows per shard index u (cached per target)."""
        key = id(target)
        if key not in self._arrays:
            self._arrays[key] = tuple(np.array(v, dtype=np.int64) for v in zip(*(
                (s.rows[0], s.rows[1], s.cols[1] - s.cols[0], s.dst_row,
                 self.shapes[s.hf_name][0], self.units.get(s.hf_name, 1))
                for s in target.segments), strict=True))
        return self._arrays[key]

    def clipped(self, r: int, index: int, rows: tuple[int, int]) -> TargetParam:
        """Parameter `index` of TP rank r, restricted to its rows [rows) (`clip`)."""
        target = self.layouts[r][index]
        key = (r, index)
        if key not in self._starts:
            starts = [s.dst_row for s in target.segments]
            assert starts == sorted(starts), f"{target.name}: segments out of dst_row order"
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


def _share(geo: Geometry, target: TargetParam, rows: tuple[int, int],
           ) -> tuple[np.ndarray, int]:
    """(elements of target's rows [rows) each shard position p holds [S], all of them)."""
    if not target.segments:
        return np.zeros(geo.shard_group_size, dtype=np.int64), 0
    a, b, w, d, n, u = geo.arrays(target)
    first = max(int(np.searchsorted(d, rows[0], side="right")) - 1, 0)  # d ascending
    last = int(np.searchsorted(d, rows[1], side="left"))
    a, b, w, d, n, u = (x[first:last] for x in (a, b, w, d, n, u))
    lo_t, hi_t = np.maximum(rows[0], d), np.minimum(rows[1], d + b - a)  # target rows kept
    a, b = a + np.maximum(lo_t - d, 0), a + np.maximum(hi_t - d, 0)
    p = np.arange(geo.shard_group_size, dtype=np.int64)[None, :]
    whole = (n // u * u)[:, None]
    chunk = -(-(n // u) // geo.shard_group_size)[:, None] * u[:, None]  # torch.chunk rows
    lo = np.minimum(p * chunk, whole)
    hi = np.minimum(lo + chunk, whole)
    overlap = np.clip(np.minimum(b[:, None], hi) - np.maximum(a[:, None], lo), 0, None)
    return (overlap * w[:, None]).sum(0), int((np.clip(b - a, 0, None) * w).sum())


def volumes(geo: Geometry, unit: Unit) -> tuple[np.ndarray, np.ndarray]:
    """(elements each rank sends [N], receives [N]) for unit, through buffers
    (its local copies excluded)."""
    send = np.zeros(geo.world, dtype=np.int64)
    recv = np.zeros(geo.world, dtype=np.int64)
    s = geo.shard_group_size
    for r in range(geo.tp):
        share, total = _share(geo, geo.layouts[r][unit.index], unit.rows)
        for group in range(geo.num_groups):
            dsts = geo.served(r, group)
            if not len(dsts):
                continue
            base = group * s
            own = dsts[(dsts >= base) & (dsts < base + s)]  # destinations that are sources
            recv[dsts] += total
            recv[own] -= share[own - base]
            send[base:base + s] += share * len(dsts)
            send[own] -= share[own - base]
    return send, recv


def _units(geo: Geometry, index: int, group: int, limit: int,
           ) -> Iterator[tuple[Unit, np.ndarray, np.ndarray]]:
    """The units of parameter `index` with their volumes: the whole parameter, or
    the fewest equal row chunks whose volumes each fit limit (one row at least)."""
    target = geo.layouts[0][index]
    rows = target.shape[0]
    whole = Unit(target.name, index, (0, rows), group)
    send, recv = volumes(geo, whole)
    peak = int(max(send.max(initial=0), recv.max(initial=0)))
    if peak <= limit or rows == 1:
        yield whole, send, recv
        return
    k = -(-peak // limit)
    while True:
        step = -(-rows // k)
        chunks = [Unit(target.name, index, (c, min(c + step, rows)), group)
                  for c in range(0, rows, step)]
        vols = [volumes(geo, c) for c in chunks]
        if step == 1 or all(max(sd.max(), rv.max()) <= limit for sd, rv in vols):
            yield from ((c, sd, rv) for c, (sd, rv) in zip(chunks, vols, strict=True))
            return
        k = min(rows, 2 * k)


def bucketize(geo: Geometry, groups: list[list[int]], limit: int,
              ) -> tuple[list[Unit], list[list[Unit]]]:
    """(every unit in layout order, the buckets: units in order). groups: per
    sync group, the indices of its parameters in layout order."""
    every: list[Unit] = []
    buckets: list[list[Unit]] = []
    for g, indices in enumerate(groups):
        cur: list[Unit] = []
        sent = np.zeros(geo.world, dtype=np.int64)
        recv = np.zeros(geo.world, dtype=np.int64)
        for index in indices:
            for unit, s, r in _units(geo, index, g, limit):
                every.append(unit)
                if not s.any() and not r.any():  # every element local
                    continue
                if cur and ((sent + s > limit).any() or (recv + r > limit).any()):
                    buckets.append(cur)
                    cur, sent, recv = [], np.zeros_like(sent), np.zeros_like(recv)
                cur.append(unit)
                sent += s
                recv += r
        if cur:
            buckets.append(cur)
    return every, buckets
