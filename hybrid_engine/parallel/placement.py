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
    grouped     the groups of cfg.placement_map, e.g. 'actor,reference,rollout:0-3;
                critic:4-5': the actor's group takes turns between its layouts as
                colocated does, the critic trains on its own ranks

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

ROLES = ("actor", "rollout", "reference", "critic", "reward_model")
"""actor: the policy's training layout (FSDP2); rollout: its vLLM engines;
reference, critic and reward_model: the frozen reference, the value model and
env.reward_model_path's model (FSDP2)."""

RankMap = dict[str, tuple[int, ...]]


def colocated(cfg: RunConfig, world: int) -> RankMap:
    """Every role on every rank."""
    return dict.fromkeys(ROLES, tuple(range(world)))


def separate(cfg: RunConfig, world: int) -> RankMap:
    """The trainer's roles on ranks 0..M-1, the rollout on M..N-1 (`split_ranks`);
    a reward model on every rank."""
    m, _ = split_ranks(world, cfg.rollout)
    train = tuple(range(m))
    return {"actor": train, "reference": train, "critic": train,
            "rollout": tuple(range(m, world)), "reward_model": tuple(range(world))}


_MAP_FORM = "'roles:ranks;roles:ranks', e.g. 'actor,reference,rollout:0-3;critic:4-5'"


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


def _parse_map(spec: str) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """placement_map's groups as (roles, ranks); checks the form and the role names."""
    groups = []
    for text in filter(None, (g.strip() for g in spec.split(";"))):
        roles, colon, ranks = text.rpartition(":")
        names = tuple(r.strip() for r in roles.split(",")) if colon else ()
        if not names or not all(names):
            raise ValueError(f"placement_map: group {text!r} is not 'roles:ranks' ({_MAP_FORM})")
        unknown = [r for r in names if r not in ROLES]
        if unknown:
            raise ValueError(f"placement_map: {unknown} are not roles; the roles are "
                             f"{list(ROLES)}")
        groups.append((names, _parse_ranks(ranks)))
    return groups


def _used_roles(cfg: RunConfig) -> set[str]:
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


def grouped(cfg: RunConfig, world: int) -> RankMap:
    """cfg.placement_map over world ranks: every rank in one group, every role the
    algorithm uses in one group, the rollout and the reference in the actor's,
    the critic in another; rollout.tensor_parallel_size divides the actor's ranks.
    A role the run does not use may not be placed; it gets no rank."""
    groups, where, owner = _parse_map(cfg.placement_map), {}, {}
    for i, (roles, ranks) in enumerate(groups):
        for role in roles:
            if role in where:
                raise ValueError(f"placement_map puts {role} in two groups")
            where[role] = i
        for r in ranks:
            if r >= world:
                raise ValueError(f"placement_map names rank {r}; this world has ranks "
                                 f"0-{world - 1}")
            if r in owner:
                raise ValueError(f"placement_map puts rank {r} in two groups "
                                 f"({','.join(groups[owner[r]][0])} and {','.join(roles)}): "
                                 "under placement=grouped each rank holds one group's roles")
            owner[r] = i
    left = sorted(set(range(world)) - set(owner))
    if left:
        raise ValueError(f"placement_map leaves ranks {left} of the {world} without a role "
                         "(every rank must be in a group)")
    _check_groups(cfg, where, groups)
    return {role: groups[where[role]][1] if role in where else () for role in ROLES}


def _check_groups(cfg: RunConfig, where: dict[str, int],
                  groups: list[tuple[tuple[str, ...], tuple[int, ...]]]) -> None:
    """The roles of a grouped map against what the algorithm builds (see `grouped`)."""
    used = _used_roles(cfg)
    for role in ROLES:
        if role in used and role not in where:
            raise ValueError(f"placement_map puts no rank under {role}, which this run "
                             f"uses (placement_map={cfg.placement_map!r})")
        if role not in used and role in where:
            why = {"reference": "algorithm.kl_coef=0", "critic":
                   f"algorithm.advantage={cfg.algorithm.advantage!r} uses no values",
                   "reward_model": "env.reward_model_path is empty"}[role]
            raise ValueError(f"placement_map places a {role}, but this run has none ({why})")
    actor = where["actor"]
    if 0 not in groups[actor][1]:
        raise ValueError("placement_map: the actor's group must hold rank 0 (it writes the "
                         "run's metrics, checkpoints and final model)")
    for role in ("rollout", "reference"):
        if role in where and where[role] != actor:
            raise ValueError(f"placement_map: {role} must share the actor's group (the "
                             "actor's ranks train, sample and score the reference in turns)")
    if where.get("critic") == actor:
        raise ValueError("placement_map puts the critic in the actor's group: that is "
                         "placement=colocated")
    n, tp = len(groups[actor][1]), cfg.rollout.tensor_parallel_size
    if n % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} must divide the actor group's "
                         f"{n} ranks (placement_map={cfg.placement_map!r})")


KINDS: dict[str, Callable[[RunConfig, int], RankMap]] = {
    "colocated": colocated,
    "separate": separate,
    "grouped": grouped,
}


def rank_map(kind: str, cfg: RunConfig, world: int) -> RankMap:
    """{role: its ranks} of placement kind over world ranks; makes no group.

    Raises:
        ValueError: an unknown kind, or one the world or cfg does not fit.
    """
    if kind not in KINDS:
        raise ValueError(f"placement={kind!r} is not one of {sorted(KINDS)}")
    ranks = KINDS[kind](cfg, world)
    _check_critic_layout(cfg, ranks["critic"])
    return ranks


def _check_critic_layout(cfg: RunConfig, ranks: tuple[int, ...]) -> None:
    """train.critic_sharding=hybrid's shard groups against the critic's ranks."""
    t, n = cfg.train, len(ranks)
    size = t.critic_shard_group_size
    if ("critic" in _used_roles(cfg) and t.critic_sharding == "hybrid"
            and not (1 < size < n and n % size == 0)):
        raise ValueError(f"train.critic_shard_group_size={size} must divide the critic's {n} "
                         f"rank(s) and lie strictly between 1 and {n} "
                         "(train.critic_sharding=hybrid)")


class Placement:
    """This process's view of the job's placement; see the module docstring.

    Args:
        kind: its name in `KINDS`.
        ranks: {role: its ranks}, every role of `ROLES` (none for a role the run
            does not build; the actor and the rollout always have some).
        rank, world: this process's rank and the world size.

    Attributes:
        kind, ranks, rank, world: as given.
    """

    def __init__(self, kind: str, ranks: Mapping[str, tuple[int, ...]], rank: int,
                 world: int) -> None:
        missing = [r for r in ("actor", "rollout") if not ranks.get(r)]
        if missing:
            raise ValueError(f"placement={kind!r} puts no rank under {missing}")
        self.kind, self.ranks, self.rank, self.world = kind, dict(ranks), rank, world
        # One group per distinct rank set short of the world, made by every rank in
        # one order; a role on every rank runs over the default group.
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for members in sorted({tuple(m) for m in self.ranks.values()}):
            if 0 < len(members) < world:
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
