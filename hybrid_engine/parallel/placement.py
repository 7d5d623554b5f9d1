"""Which ranks hold which role, and the process groups those roles run over.

Job: one object per process that says where each model of the RL dataflow
lives, and owns the groups it works over. Whoever needs a group or a mesh
gets it from here, explicitly (a role is handed its mesh when it is built;
its checkpoints, batch slices and gathers then run over that mesh's group):

    placement = Placement.build("separate", rank_map, cfg, world, rank)   # collective
    placement.holds("critic")       # whether this rank holds the critic
    placement.ranks["rollout"]      # the ranks that sample
    placement.group("actor")        # the trainer's group (None: the default group)
    placement.mesh("actor")         # a 1-D data-parallel mesh over it

A placement kind is a function from (cfg, world) to {role: ranks} (a
`RankMap`), kept beside its policy (`policy.placements` registers both):
colocated puts every role on every rank, separate splits training from
rollout (`split_ranks`), grouped reads cfg.placement_map (`parse_map`). What
holds for every kind is checked here (`check_ranks`).

Invariant: every rank makes every group, in one order, before any engine
exists (torch names a group by a counter that must agree across ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybrid_engine.parallel.fsdp import dp_mesh

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig

__all__ = ["MAP_FORM", "ROLES", "Placement", "RankMap", "check_ranks", "parse_map", "used_roles"]

ROLES = ("actor", "rollout", "reference", "critic", "reward_model")
"""actor: the policy's training layout (FSDP2); rollout: its vLLM engines;
reference, critic and reward_model: the frozen reference, the value model and
env.reward_model_path's model (FSDP2)."""

RankMap = dict[str, tuple[int, ...]]


MAP_FORM = "'roles:ranks;roles:ranks', e.g. 'actor,reference,rollout:0-3;critic:4-5'"


def _parse_ranks(text: str) -> tuple[int, ...]:
    """'0-3' / '4' / '0,2,5' / '0-1,4' as ranks, ascending (the order of the
    group's ranks, vLLM's TP grid and the sync's shards)."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"placement_map: {text!r} is not a rank list ('0-3', '4' or '0,2')")
        out += range(int(lo), int(hi or lo) + 1)
    if len(set(out)) < len(out):
        raise ValueError(f"placement_map: {text!r} names a rank twice")
    return tuple(sorted(out))


def parse_map(spec: str) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """placement_map's groups as (roles, ranks); checks the form and the role names."""
    groups = []
    for text in filter(None, (g.strip() for g in spec.split(";"))):
        roles, colon, ranks = text.rpartition(":")
        names = tuple(r.strip() for r in roles.split(",")) if colon else ()
        if not names or not all(names):
            raise ValueError(f"placement_map: group {text!r} is not 'roles:ranks' ({MAP_FORM})")
        unknown = [r for r in names if r not in ROLES]
        if unknown:
            raise ValueError(f"placement_map: {unknown} are not roles; the roles are "
                             f"{list(ROLES)}")
        groups.append((names, _parse_ranks(ranks)))
    return groups


def used_roles(cfg: RunConfig) -> set[str]:
    """The roles cfg builds: the actor and its rollout, the reference (a KL term),
    the critic (a per-token advantage estimator), the reward model (a path)."""
    from hybrid_engine.algorithms.advantages import get_advantage

    used = {"actor", "rollout"}
    if cfg.algorithm.kl_coef > 0:
        used.add("reference")
    if get_advantage(cfg.algorithm.advantage).per_token:
        used.add("critic")
    if cfg.env.reward_model_path:
        used.add("reward_model")
    return used


def check_ranks(kind: str, cfg: RunConfig, ranks: RankMap) -> RankMap:
    """ranks with every role of `ROLES` (a role not named: no rank), once what
    every kind must hold is checked: only roles named, the actor and the
    rollout on some ranks, train.critic_sharding=hybrid's shard groups
    dividing the critic's ranks.

    Raises:
        ValueError: what is wrong and which key to fix.
    """
    unknown = sorted(set(ranks) - set(ROLES))
    if unknown:
        raise ValueError(f"placement={kind!r} places {unknown}, which are not roles {ROLES}")
    ranks = {r: tuple(ranks.get(r, ())) for r in ROLES}
    missing = [r for r in ("actor", "rollout") if not ranks[r]]
    if missing:
        raise ValueError(f"placement={kind!r} puts no rank under {missing}")
    t, n = cfg.train, len(ranks["critic"])
    size = t.critic_shard_group_size
    if ("critic" in used_roles(cfg) and t.critic_sharding == "hybrid"
            and not (1 < size < n and n % size == 0)):
        raise ValueError(f"train.critic_shard_group_size={size} must divide the critic's {n} "
                         f"rank(s) and lie strictly between 1 and {n} "
                         "(train.critic_sharding=hybrid)")
    return ranks


class Placement:
    """This process's view of the job's placement; see the module docstring.

    Args:
        kind: its name (`policy.placements.PLACEMENTS`).
        ranks: {role: its ranks}, every role of `ROLES` (none for a role the run
            does not build; the actor and the rollout always have some).
        rank, world: this process's rank and the world size.

    Attributes:
        kind, ranks, rank, world: as given.
    """

    def __init__(self, kind: str, ranks: Mapping[str, tuple[int, ...]], rank: int,
                 world: int) -> None:
        self.kind, self.ranks, self.rank, self.world = kind, dict(ranks), rank, world
        # One group per distinct rank set short of the world, made by every rank in
        # one order; a role on every rank runs over the default group.
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for members in sorted({tuple(m) for m in self.ranks.values()}):
            if 0 < len(members) < world:
                self._groups[members] = dist.new_group(list(members))

    @classmethod
    def build(cls, kind: str, rank_map: Callable[[RunConfig, int], RankMap], cfg: RunConfig,
              world: int, rank: int) -> Placement:
        """The placement kind, whose ranks rank_map gives, for cfg on this world
        (checked: `check_ranks`; collective: makes the groups)."""
        return cls(kind, check_ranks(kind, cfg, rank_map(cfg, world)), rank, world)

    def holds(self, role: str) -> bool:
        """Whether this rank holds role."""
        return self.rank in self.ranks[role]

    def group(self, role: str) -> dist.ProcessGroup | None:
        """The process group of role's ranks; None when they are every rank (the
        default group) or none."""
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
            if self.ranks[role]:
                by_ranks.setdefault(tuple(self.ranks[role]), []).append(role)
        return "; ".join(f"{'+'.join(roles)} on ranks {_span(r)}" for r, roles in by_ranks.items())


def _span(ranks: tuple[int, ...]) -> str:
    """'0-3' for consecutive ranks, else '0,2,5'."""
    if ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))
