"""What one weight sync costs on a cluster: bytes, messages and a time floor per rank.

Job: read a resharding plan (`reshard.plan.build_plan`), or for a whole
cluster just its buckets (`reshard.plan.cut_buckets`), as traffic between
nodes of D devices each (global rank g lives on node g // D, as torchrun
numbers ranks) and price it at given link bandwidths. Nothing here needs
weights or a process group: the plan is a pure function of the config's
shapes, so `hybrid-engine plan` prices a 70B sync from its config.json alone.

A message is one (bucket, source rank) pair with bytes in it: per bucket
the executor's all_to_all_single hands each peer its part, and a peer with
nothing to send sends no bytes (`TransferStats.messages_received` counts the
same pairs on real ranks).

The floor assumes each device has its own link within the node and its own
link out of it (NVLink and a NIC per GPU), each full duplex, all running at
once: a rank needs max(in, out) bytes / bandwidth on each, and the sync ends
with the busiest rank. It leaves out per-message latency, the copies into
and out of the buffers and the engine's re-pack, so a real sync is slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid_engine.reshard.buckets import Geometry, shares
from hybrid_engine.reshard.plan import Cut, ReshardPlan

__all__ = ["RankTraffic", "cluster_traffic", "plan_traffic", "time_floor"]


@dataclass(frozen=True, slots=True)
class RankTraffic:
    """One rank's share of one sync, in bytes on the wire."""

    rank: int
    recv_intra: int = 0
    recv_inter: int = 0
    sent_intra: int = 0
    sent_inter: int = 0
    messages: int = 0
    """Messages received: (bucket, source rank) pairs carrying bytes."""
    local: int = 0
    """Bytes copied from the rank's own shard, never on a link."""

    @property
    def received(self) -> int:
        return self.recv_intra + self.recv_inter

    def seconds(self, intra_bps: float, inter_bps: float) -> float:
        """Time floor of this rank at the given bytes per second."""
        return max(max(self.recv_intra, self.sent_intra) / intra_bps,
                   max(self.recv_inter, self.sent_inter) / inter_bps)


def plan_traffic(plan: ReshardPlan, devices_per_node: int, itemsize: int) -> list[RankTraffic]:
    """Every rank's traffic when the plan's ranks fill nodes of devices_per_node.

    Raises:
        ValueError: devices_per_node does not divide the world size.
    """
    n = plan.world_size
    assert plan.rank is None, "plan_traffic counts every rank's blocks: give it the whole plan"
    if devices_per_node < 1 or n % devices_per_node:
        raise ValueError(f"{devices_per_node} devices per node must divide the world size {n}")
    recv = [[0, 0] for _ in range(n)]  # [intra, inter]
    sent = [[0, 0] for _ in range(n)]
    messages = [0] * n
    for bucket in plan.buckets:
        pairs = set()
        for b in bucket:
            inter = b.src_rank // devices_per_node != b.dst_rank // devices_per_node
            nbytes = b.numel * itemsize
            recv[b.dst_rank][inter] += nbytes
            sent[b.src_rank][inter] += nbytes
            pairs.add((b.src_rank, b.dst_rank))
        for _, dst in pairs:
            messages[dst] += 1
    return [RankTraffic(g, recv[g][0], recv[g][1], sent[g][0], sent[g][1], messages[g],
                        sum(b.numel for b in plan.local[g]) * itemsize) for g in range(n)]


def cluster_traffic(cut: Cut, devices_per_node: int, itemsize: int) -> list[RankTraffic]:
    """Every rank's traffic, as `plan_traffic` gives it from the whole plan, from
    the buckets' closed-form shares alone (no block listed); a twin layer's
    buckets count as its template's.

    Raises:
        ValueError: devices_per_node does not divide the world size.
    """
    geo, n = cut.geo, cut.geo.world
    if devices_per_node < 1 or n % devices_per_node:
        raise ValueError(f"{devices_per_node} devices per node must divide the world size {n}")
    t = geo.tables()
    srcs = np.arange(geo.num_sources)
    theirs = srcs[None, :] != t.dst[:, None]  # a dst's own rows stay local
    inter = srcs[None, :] // devices_per_node != (t.dst // devices_per_node)[:, None]
    times = np.bincount(cut.twin, minlength=len(cut.twin))  # groups each template stands for
    totals = np.zeros((6, n), dtype=np.int64)  # recv intra, inter; sent intra, inter; msgs; local
    for bucket in cut.buckets:
        if cut.twin[bucket[0].group] != bucket[0].group:
            continue
        vol = _from_sources(geo, sum(shares(geo, u)[0] for u in bucket)) * theirs  # [dst, src]
        k = times[bucket[0].group]
        for row, part in ((0, vol * ~inter), (1, vol * inter)):
            totals[row, t.dst] += k * part.sum(1)
            totals[row + 2, :geo.num_sources] += k * part.sum(0)
        totals[4, t.dst] += k * (vol > 0).sum(1)
    own = t.dst < geo.num_sources
    for u in cut.every:
        if cut.twin[u.group] == u.group:
            vol = _from_sources(geo, shares(geo, u)[0])
            totals[5, t.dst[own]] += times[u.group] * vol[own, t.dst[own]]
    totals[[0, 1, 2, 3, 5]] *= itemsize
    return [RankTraffic(g, *(int(x) for x in totals[:, g])) for g in range(n)]


def _from_sources(geo: Geometry, share: np.ndarray) -> np.ndarray:
    """[dst, source rank] elements each destination takes from each source, from
    `shares`' [T, G + 1, S]: a part every group holds from the position of the
    group serving the destination, a split slab's from the group holding it."""
    t, groups = geo.tables(), geo.num_groups
    ranks = np.array([list(geo.sources(k)) for k in range(groups)])  # [G, S]
    rows = np.arange(len(t.dst))[:, None]
    vol = np.zeros((len(t.dst), geo.num_sources), dtype=np.int64)
    np.add.at(vol, (rows, ranks[t.dst_group]), share[t.dst_r, groups])
    for k in range(groups):
        np.add.at(vol, (rows, ranks[k][None, :]), share[t.dst_r, k])
    return vol


def time_floor(traffic: list[RankTraffic], intra_gbps: float, inter_gbps: float) -> float:
    """Seconds of the busiest rank at the given link speeds (gigabits per second)."""
    return max(t.seconds(intra_gbps * 1e9 / 8, inter_gbps * 1e9 / 8) for t in traffic)
