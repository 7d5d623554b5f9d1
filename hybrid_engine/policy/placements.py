"""The placements a run can name: where each role lives, and the policy that runs there.

Job: one registry, `PLACEMENTS`: name -> `PlacementKind(rank_map, policy)`. A
placement is one module under policy/ -- its `rank_map(cfg, world)` (which
ranks hold which role) and its policy class -- and one line below. The config
checks cfg.placement against this registry; the job checks its rank map before
any engine (`rank_map`) and builds its policy (`make_policy`):

    colocated   every role on every rank, the layouts taking turns (`HybridActor`)
    separate    the trainer's roles on ranks 0..M-1, the rollout on M..N-1
                (`SeparatePolicy`)
    grouped     the groups of cfg.placement_map, e.g. 'actor,rollout,reference:0-3;
                critic,reward_model:4-5' (`GroupedPolicy`)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from hybrid_engine.names import Registry
from hybrid_engine.parallel.placement import RankMap, check_ranks
from hybrid_engine.policy import colocated, grouped, separate

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig

__all__ = ["PLACEMENTS", "PlacementKind", "make_policy", "rank_map"]


class PlacementKind(NamedTuple):
    """A placement: its ranks per role on a world, and its policy class (built
    from the run config, collectively on every rank)."""

    rank_map: Callable[[RunConfig, int], RankMap]
    policy: type


PLACEMENTS: Registry[PlacementKind] = Registry("placement")
PLACEMENTS.add("colocated", PlacementKind(colocated.rank_map, colocated.HybridActor))
PLACEMENTS.add("separate", PlacementKind(separate.rank_map, separate.SeparatePolicy))
PLACEMENTS.add("grouped", PlacementKind(grouped.rank_map, grouped.GroupedPolicy))


def _kind(cfg: RunConfig) -> PlacementKind:
    try:
        return PLACEMENTS.get(cfg.placement)
    except ValueError as e:
        raise ValueError(f"placement: {e}") from None


def rank_map(cfg: RunConfig, world: int) -> RankMap:
    """{role: its ranks} of cfg.placement on world ranks, checked (`check_ranks`);
    makes no group.

    Raises:
        ValueError: an unknown placement, or one the world or cfg does not fit.
    """
    return check_ranks(cfg.placement, cfg, _kind(cfg).rank_map(cfg, world))


def make_policy(cfg: RunConfig) -> object:
    """cfg.placement's policy (collective: every rank builds it)."""
    return _kind(cfg).policy(cfg)
