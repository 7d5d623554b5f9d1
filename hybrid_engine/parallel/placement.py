"""Which ranks hold which role, and the process groups those roles run over.

Job: one object per process that says where each model of the RL dataflow
lives, and owns the groups it works over. Whoever needs a group or a mesh
gets it from here, explicitly (a role is handed its mesh when it is built;
its checkpoints, batch slices and gathers then run over that mesh's group):

    placement = Placement.build("separate", cfg, world, rank)   # collective
    placement.holds("critic")       # whether this rank holds the critic
    placement.ranks["rollout"]      # the ranks that sample
    placement.group("actor")        # the trainer's group (None: the default group)
    placement.mesh("actor")         # a 1-D data-parallel mesh over it

The kinds, each a function from (cfg, world) to {role: ranks} in `KINDS`; a new
placement is one such function and one line there:

    colocated   every role on every rank: the layouts take turns on each device
    separate    actor, reference and critic on ranks 0..M-1 (FSDP2 over them),
                rollout on M..N-1 (`split_ranks`)

Invariant: every rank makes every group, in one order, before any engine
exists (torch names a group by a counter that must agree across ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybrid_engine.parallel.dist import split_ranks
from hybrid_engine.parallel.fsdp import dp_mesh

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig

__all__ = ["KINDS", "ROLES", "Placement", "rank_map"]

ROLES = ("actor", "rollout", "reference", "critic")
"""actor: the policy's training layout (FSDP2); rollout: its vLLM engines;
reference and critic: the frozen reference and the value model (FSDP2)."""

RankMap = dict[str, tuple[int, ...]]


def colocated(cfg: RunConfig, world: int) -> RankMap:
    """Every role on every rank."""
    return dict.fromkeys(ROLES, tuple(range(world)))


def separate(cfg: RunConfig, world: int) -> RankMap:
    """The trainer's roles on ranks 0..M-1, the rollout on M..N-1 (`split_ranks`)."""
    m, _ = split_ranks(world, cfg.rollout)
    train = tuple(range(m))
    return {"actor": train, "reference": train, "critic": train,
            "rollout": tuple(range(m, world))}


KINDS: dict[str, Callable[[RunConfig, int], RankMap]] = {
    "colocated": colocated,
    "separate": separate,
}


def rank_map(kind: str, cfg: RunConfig, world: int) -> RankMap:
    """{role: its ranks} of placement kind over world ranks; makes no group.

    Raises:
        ValueError: an unknown kind, or one the world or cfg does not fit.
    """
    if kind not in KINDS:
        raise ValueError(f"placement={kind!r} is not one of {sorted(KINDS)}")
    return KINDS[kind](cfg, world)


class Placement:
    """This process's view of the job's placement; see the module docstring.

    Args:
        kind: its name in `KINDS`.
        ranks: {role: its ranks}, every role of `ROLES`.
        rank, world: this process's rank and the world size.

    Attributes:
        kind, ranks, rank, world: as given.
    """

    def __init__(self, kind: str, ranks: Mapping[str, tuple[int, ...]], rank: int,
                 world: int) -> None:
        missing = [r for r in ROLES if not ranks.get(r)]
        if missing:
            raise ValueError(f"placement={kind!r} puts no rank under {missing}")
        self.kind, self.ranks, self.rank, self.world = kind, dict(ranks), rank, world
        # One group per distinct rank set short of the world, made by every rank in
        # one order; a role on every rank runs over the default group.
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for members in sorted({tuple(m) for m in self.ranks.values()}):
            if len(members) < world:
                self._groups[members] = dist.new_group(list(members))

    @classmethod
    def build(cls, kind: str, cfg: RunConfig, world: int, rank: int) -> Placement:
        """The placement of kind for cfg on this world (collective: makes the groups)."""
        return cls(kind, rank_map(kind, cfg, world), rank, world)

    def holds(self, role: str) -> bool:
        """Whether this rank holds role."""
        return self.rank in self.ranks[role]

    def group(self, role: str) -> dist.ProcessGroup | None:
        """The process group of role's ranks; None when they are every rank (the
        default group)."""
        return self._groups.get(tuple(self.ranks[role]))

    def mesh(self, role: str, device: torch.device | None = None) -> DeviceMesh:
        """A 1-D data-parallel mesh ("dp") over role's ranks, for an FSDP2 role.

        Raises:
            ValueError: this rank does not hold role.
        """
        if not self.holds(role):
            raise ValueError(f"rank {self.rank} holds no {role} under placement={self.kind!r} "
                             f"(its ranks: {list(self.ranks[role])})")
        return dp_mesh(self.group(role), device)

    def describe(self) -> str:
        """One line: each distinct rank set and the roles on it."""
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for role in ROLES:
            by_ranks.setdefault(tuple(self.ranks[role]), []).append(role)
        return "; ".join(f"{'+'.join(roles)} on ranks {_span(r)}" for r, roles in by_ranks.items())


def _span(ranks: tuple[int, ...]) -> str:
    """'0-3' for consecutive ranks, else '0,2,5'."""
    if ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))
