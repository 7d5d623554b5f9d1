"""GroupedPolicy: the actor's group takes turns between its layouts, the critic trains on its own.

Job: placement=grouped -- which ranks hold which role (`rank_map`, from
cfg.placement_map) and the policy over them. The ranks of the actor's group
hold a `HybridActor` over that group: the FSDP2 trainer, the vLLM engine and
the reference take turns on their devices as under colocated placement, every
collective over the group. The critic's ranks hold
no policy: the job builds the critic there (`Job._scorers`). Every method is
collective over all N ranks, like the other policies', so the controller runs
unchanged:

    collect / generate   the actor's group samples; the trajectories are
                         broadcast from its first rank, so every rank holds
                         them (their bytes: placement/trajectory_bytes)
    train_step           the actor's group trains and returns {} at once: the
                         critic's group trains the critic meanwhile (the job's
                         `roles.mirrored.MirroredLearner`); the actor's metrics
                         come with the sync
    sync_weights         inside the actor's group; its metrics and the step's
                         training's, broadcast from its first rank
    switch_to(layout)    the actor's group switches; the critic's has nothing to switch

The reference (in the actor's group) and the critic (in its own) score at the
same time too (`roles.mirrored.Mirrored`).

A checkpoint is one folder both groups write (`checkpoint.state`: the policy's
shards from the actor's group, the critic's from its own). Not offered yet: the
drift split, partial rollouts and generation ahead (refused by the config).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_engine.algorithms.losses import LossFn, StepLoss
from hybrid_engine.checkpoint import load_training_state, save_training_state
from hybrid_engine.config import RunConfig
from hybrid_engine.parallel import watchdog
from hybrid_engine.parallel.dist import resync_group_counter
from hybrid_engine.parallel.fsdp import default_device, resolve_model_path
from hybrid_engine.parallel.placement import ROLES, Placement, RankMap, parse_map, used_roles
from hybrid_engine.parallel.precision import with_device_choices
from hybrid_engine.policy.ahead import Generated, timed
from hybrid_engine.policy.colocated import HybridActor
from hybrid_engine.policy.process import PolicyProcess
from hybrid_engine.policy.training import refuse_parked_partials
from hybrid_engine.roles.base import Layout
from hybrid_engine.roles.mirrored import broadcast_pickled
from hybrid_engine.rollout.engine import Completions
from hybrid_engine.trajectory import TrainBatch, Trajectory

__all__ = ["GroupedPolicy", "rank_map"]

log = logging.getLogger(__name__)


def rank_map(cfg: RunConfig, world: int) -> RankMap:
    """placement=grouped: cfg.placement_map over world ranks (`parse_map`): every
    rank in one group, every role the algorithm uses in one group, the rollout
    and the reference in the actor's, the critic in another;
    rollout.tensor_parallel_size divides the actor's ranks. A role the run does
    not use may not be placed; it gets no rank."""
    groups, where, owner = parse_map(cfg.placement_map), {}, {}
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
    """The roles of a grouped map against what the algorithm builds (see `rank_map`)."""
    used = used_roles(cfg)
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


class GroupedPolicy:
    """The policy over an actor group and a critic group; see the module docstring.

    Args:
        cfg: the run config (placement="grouped", placement_map).

    Attributes:
        placement: the grouped `Placement`.
        actor: the `HybridActor` on the actor's ranks, else None.
        trainer: its trainer on the actor's ranks, else None.
        tokenizer, pad_id, model_path, rank, engine_facts: as in `HybridActor`.
    """

    def __init__(self, cfg: RunConfig) -> None:
        cfg.validate_for_run()
        self.cfg = cfg = with_device_choices(cfg, default_device().type)  # "auto" resolved
        self._process = PolicyProcess(cfg.collective_timeout_s)
        self.rank = self._process.rank
        t0 = time.perf_counter()
        # Every rank makes every group, before any engine exists (names must agree).
        self.placement = Placement.build("grouped", rank_map, cfg, self._process.world, self.rank)
        # A peer that sees this rank die names its group ("the critic group").
        watchdog.set_group("+".join(r for r in ROLES if self.placement.holds(r)))
        self.src = self.placement.ranks["actor"][0]
        self.model_path = str(resolve_model_path(cfg.model.path))
        self.actor = (HybridActor(cfg, placement=self.placement, process=self._process)
                      if self.placement.holds("actor") else None)
        resync_group_counter()  # only the actor's ranks made vLLM's groups
        self._process.time_out_own_groups()
        self.trainer = self.actor.trainer if self.actor is not None else None
        if self.actor is not None:
            self.tokenizer = self.actor.tokenizer
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(
                self.model_path, trust_remote_code=cfg.model.trust_remote_code)
        facts = None if self.actor is None else (self.actor.engine_facts, self.actor.pad_id)
        (self.engine_facts, self.pad_id), _ = broadcast_pickled(facts, self.src)
        self._train_metrics: dict[str, float] = {}
        self._trajectory_bytes = 0
        log.info("grouped policy ready in %.1f s: %s", time.perf_counter() - t0,
                 self.placement.describe())

    def _share(self, obj: Any) -> Any:
        """The actor group's obj on every rank (collective)."""
        out, _ = broadcast_pickled(obj, self.src)
        return out

    # --- inference ---------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> Completions:
        """K completions per prompt from the actor's group, on every rank (collective)."""
        return self._share(self.actor.generate(prompts, **kwargs) if self.actor else None)

    def collect(self, env: Any, prompts: Sequence[Sequence[int]], *, num_samples: int,
                seed: int, sampling: Mapping[str, Any] | None = None) -> list[Trajectory]:
        """Trajectories of env for prompts, unscored, the same on every rank (collective)."""
        trajs = None
        if self.actor is not None:
            trajs = self.actor.collect(env, prompts, num_samples=num_samples, seed=seed,
                                       sampling=sampling)
        trajs, size = broadcast_pickled(trajs, self.src)
        self._trajectory_bytes += size
        return trajs

    def collect_async(self, env: Any, prompts: Sequence[Sequence[int]], *, num_samples: int,
                      seed: int) -> Generated:
        """`collect` now, as a handle (nothing runs ahead under this placement)."""
        trajs, seconds = timed(lambda: self.collect(env, prompts, num_samples=num_samples,
                                                    seed=seed))
        return Generated(trajs, seconds)

    def rollout_metrics(self) -> dict[str, float]:
        """The actor's rollout metrics and the bytes of trajectories broadcast since
        the last call (placement/trajectory_bytes)."""
        m = self._share(self.actor.rollout_metrics() if self.actor else None)
        size, self._trajectory_bytes = self._trajectory_bytes, 0
        return {**m, "placement/trajectory_bytes": float(size)}

    def rollout_state(self) -> None:
        """Nothing kept between steps (partial rollouts are colocated only)."""
        return None

    def load_rollout_state(self, state: dict | None) -> None:
        refuse_parked_partials(state)

    def drift_scorer(self) -> None:
        """None: the drift split is not offered under this placement yet."""
        return None

    def switch_to(self, layout: Layout) -> None:
        """The actor's group gives its devices to layout; the critic's has one layout."""
        if self.actor is not None:
            self.actor.switch_to(layout)

    # --- training ----------------------------------------------------------------

    def train_step(self, trajs: Sequence[Trajectory] | TrainBatch,
                   loss: StepLoss | LossFn | None = None, *, entropy_grad: bool | None = None,
                   ) -> dict[str, float]:
        """The actor group's updates (as `HybridActor.train_step`); returns {} at
        once so the critic's group goes on to its own update. The metrics come
        with the next `sync_weights`."""
        if self.actor is not None:
            self._train_metrics = self.actor.train_step(trajs, loss, entropy_grad=entropy_grad)
        return {}

    def sync_weights(self) -> dict[str, float]:
        """The actor group's sync (collective); its metrics and those of the
        training before it, from the actor group's first rank, on every rank."""
        m = None
        if self.actor is not None:
            m = {**self._train_metrics, **self.actor.sync_weights()}
        self._train_metrics = {}
        return self._share(m)

    # --- persistence -------------------------------------------------------------

    def _layout_kept(self) -> contextlib.AbstractContextManager[Any]:
        """The actor's layout as it was after the block (`Phases.optimizer_on_device`)."""
        if self.actor is None:
            return contextlib.nullcontext()
        return self.actor.phases.optimizer_on_device()

    def save(self, path: str | Path, *, extra: dict | None = None, critic: Any = None) -> None:
        """One atomic DCP checkpoint written by every rank: the policy's shards from
        the actor's group, the critic's (the critic's group passes it) from its own
        (collective over the world)."""
        with watchdog.phase("save"), self._layout_kept():
            save_training_state(path, trainer=self.trainer, critic=critic, extra=extra,
                                group=None)

    def load(self, path: str | Path, *, critic: Any = None) -> dict | None:
        """Restores a checkpoint on both groups; the next generate syncs. Returns its
        extra on every rank (collective)."""
        with self._layout_kept():
            extra = load_training_state(path, trainer=self.trainer, critic=critic, group=None)
            if self.actor is not None:
                self.actor.phases.trainer_weights_changed()
        return extra

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Writes the current policy as a HF folder (the actor's group; collective)."""
        with watchdog.phase("export"):
            if self.actor is not None:
                self.actor.export_hf(path, dtype)
            dist.barrier()

    def export_adapter(self, path: str | Path) -> None:
        """Writes a LoRA policy's adapters as a PEFT folder (the actor's group; collective)."""
        with watchdog.phase("export"):
            if self.actor is not None:
                self.actor.export_adapter(path)
            dist.barrier()

    def shutdown(self) -> None:
        """Stops the engine (the actor's ranks); destroys the group if this object made it."""
        self._process.stop_watchdog()
        if self.actor is not None:
            self.actor.shutdown()
        self._process.leave()
