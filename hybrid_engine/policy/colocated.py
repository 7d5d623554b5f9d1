"""HybridActor: the colocated policy, and the embeddable actor backend.

Job: hold the policy in its two layouts in this process -- the FSDP2
trainer and the vLLM engine -- and own the switch between them, so a caller
(the package's controller, or another trainer's loop) only says what to do:

    actor = HybridActor.from_pretrained(path, cfg)     # collective
    out = actor.generate(prompts, num_samples=4)       # inference layout
    metrics = actor.train_step(trajs)                  # training layout
    actor.sync_weights()                               # fresh weights -> vLLM
    actor.save(folder); actor.load(folder); actor.export_hf(folder)
    actor.shutdown()                                   # after the last collective

Memory: one phase machine (`policy/phases.py`) owns which layout holds the
device, whether vLLM holds the trainer's current weights, and where the
optimizer state is. `switch_to(layout)` switches explicitly (the controller
does, before every phase); everything that runs the trainer (`train_step`,
`compute_logprobs`) switches to the training layout itself too: the engine releases its memory (GPU: vLLM
sleep level 2, which discards its weights; CPU: the KV cache storage, the
only thing vLLM-CPU can drop -- the log says so; `memory.emulate_gpu_sleep`
makes CPU lose the weights too, for tests). `generate` / `collect` switch
back, syncing the weights if they changed or were discarded, and never sample
otherwise (the engine refuses). `save` / `load` leave the layout as they
found it. With `memory.offload_optimizer`, the AdamW state waits in host
memory from the sync until the next optimizer step, while the engine holds
the device (`parallel/offload.py`); gradients are freed after every step
anyway. `training()` / `inference()` make the switch explicit around code of
the caller's own. Every method is collective: every
rank calls it in the same order (prompts and trajectories are the same list
on every rank; each rank trains on its own slice).

What it does to the host process, and nothing else:
- uses the default process group if one exists (torchrun, `accelerate
  launch`); otherwise creates one (one rank when not launched, setting
  RANK/WORLD_SIZE/MASTER_* in os.environ) and destroys it in `shutdown`;
- vLLM's engine teardown destroys the default process group too (vLLM's
  behaviour, not ours): call `shutdown()` after your last collective;
- installs no signal handler and configures no logging handler (it logs
  through the `hybrid_engine` loggers);
- sets `cfg.collective_timeout_s` on the process groups it creates (and on
  the default group if it created it), never on a host's groups.

Invariant: after `sync_weights()` (or inside `generate`), vLLM samples from
exactly the trainer's current weights (cast to the rollout dtype).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_engine.algorithms.losses import LossFn, StepLoss
from hybrid_engine.checkpoint import (export_adapter, export_hf, load_training_state,
                                      save_training_state)
from hybrid_engine.config import RunConfig, apply_overrides
from hybrid_engine.parallel import watchdog
from hybrid_engine.parallel.fsdp import DTYPES, default_device, resolve_model_path
from hybrid_engine.parallel.offload import OptimizerOffload
from hybrid_engine.parallel.placement import ROLES, Placement, RankMap
from hybrid_engine.parallel.precision import with_device_choices
from hybrid_engine.parallel.rollout_tp import with_rollout_tp
from hybrid_engine.parallel.sharding import (
    first_phase_estimate,
    model_dims_at,
    resolve_train_config,
    shard_group_size,
)
from hybrid_engine.parallel.batch_slices import gather_response_field
from hybrid_engine.policy.ahead import Generated, timed
from hybrid_engine.policy.memory import ReleasePolicy
from hybrid_engine.policy.phases import Phases
from hybrid_engine.policy.process import PolicyProcess
from hybrid_engine.policy.training import (completions_to_trajectories, logprob_samples,
                                           policy_train, sampling_overrides, train_batch)
from hybrid_engine.roles.base import Layout
from hybrid_engine.preflight import check_model_for_run
from hybrid_engine.roles.sync import WeightSync
from hybrid_engine.roles.trainer import Trainer
from hybrid_engine.rollout.engine import Completions, VLLMRollout
from hybrid_engine.rollout.partial import PartialRollouts
from hybrid_engine.trajectory import TrainBatch, Trajectory

# completions_to_trajectories: part of the embedding API beside HybridActor.
__all__ = ["DriftScorer", "HybridActor", "completions_to_trajectories", "rank_map"]

log = logging.getLogger(__name__)


class DriftScorer:
    """Scores a sample of the batch with the engine's current weights, which are
    the weights the trainer trains this step with (colocated: the last sync
    installed them): sets engine_logp, so the mismatch metric splits into drift
    (engine now vs the rollout's log-probs) and numerics (trainer vs engine,
    same weights); see algorithms/mismatch.py. One prefill of `sequences`
    stale trajectories, evenly spaced over them (all when fewer), in the
    inference layout (`layout`; put it before the trainer-side scorers, so
    one step switches layouts once); the others get
    NaN engine log-probs (outside the split), as does a token vLLM cannot
    score (a sequence filling max_model_len: its last). A fresh trajectory
    (every token sampled by the engine's current weights: no sync since;
    e.g. a burst's first batch) needs no prefill: its sampling log-probs
    are the engine's now, so it joins the split whole, with no drift
    (freshness is per object: a batch restored from a checkpoint counts as
    stale, so after a step that trained nothing a resumed run may prefill
    what the straight run did not; only the split's metrics differ). Called
    once per sampling round (one per step unless dynamic sampling refills)."""

    layout = "inference"

    def __init__(self, actor: HybridActor, sequences: int) -> None:
        if sequences < 1:
            raise ValueError(f"DriftScorer needs sequences >= 1, got {sequences}")
        self.actor, self.sequences = actor, sequences

    def score(self, trajs: Sequence[Trajectory]) -> None:
        a = self.actor
        changed = getattr(a.phases, "trainer_changed", False)  # then nothing is fresh
        stale = [i for i, t in enumerate(trajs) if changed or a.fresh.get(id(t)) is not t]
        n, fresh = len(stale), set(range(len(trajs))) - set(stale)
        m = min(self.sequences, n)
        picked = {stale[i * n // m] for i in range(m)}
        for i, t in enumerate(trajs):
            if i not in picked:
                t.engine_logp = (list(t.rollout_logp) if i in fresh
                                 else [math.nan] * len(t.response_ids))
        sample = [trajs[i] for i in sorted(picked)]
        if not sample:
            return
        a.phases.check_rollout()  # the controller switched to the inference layout
        scores = a.rollout.score([list(t.prompt_ids) + list(t.response_ids) for t in sample],
                                 [len(t.prompt_ids) for t in sample])
        for t, lps in zip(sample, scores, strict=True):
            t.engine_logp = lps


def _release_policy(cfg: RunConfig, trainer: Trainer, rollout: VLLMRollout,
                    model_path: str) -> ReleasePolicy:
    """memory.release per training phase, decided together by the trainer's ranks;
    before the first is measured, its growth is estimated from the trainer's
    resolved layout."""
    world = dist.get_world_size(trainer.group)
    first = first_phase_estimate(cfg, trainer.train_cfg, model_dims_at(model_path), world,
                                 cuda=trainer.device.type == "cuda")
    return ReleasePolicy(cfg.memory.release, budget=cfg.memory.budget,
                         local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                         device=trainer.device, first_estimate=first, group=trainer.group,
                         engine=lambda: (rollout.weight_bytes(), rollout.kv_cache_bytes()),
                         trainer=trainer.kept_bytes)


def rank_map(cfg: RunConfig, world: int) -> RankMap:
    """placement=colocated: every role on every rank."""
    return dict.fromkeys(ROLES, tuple(range(world)))


class HybridActor:
    """The policy in both layouts on this process's device; see the module docstring.

    Args:
        cfg: the run config (model, rollout, train, algorithm, sync sections).
        placement: where it lives: None builds the colocated one (every rank);
            placement=grouped passes its own, whose actor group holds both
            layouts (every collective of this object then runs over that group).
        process: the process's `PolicyProcess` when the caller holds it (grouped);
            None makes (and, on shutdown, leaves) one.

    Attributes:
        trainer: the FSDP2 `Trainer` (its `module` is the sync source).
        rollout: the `VLLMRollout`.
        tokenizer: the policy's tokenizer (vLLM's).
        pad_id: id written in padding positions of training batches.
        phase: "inference" or "training": which layout holds the memory now.
        phases: the `Phases` machine (layout, weights valid/stale/lost, optimizer place).
        fresh: the trajectories sampled with the engine's current weights (id ->
            trajectory; emptied by every sync), for the drift scorer.
        offload: the `OptimizerOffload` (memory.offload_optimizer), else None.
        rank: this process's rank in the default group.
        placement: the `Placement` (colocated: every role on every rank).
    """

    def __init__(self, cfg: RunConfig, *, placement: Placement | None = None,
                 process: PolicyProcess | None = None) -> None:
        cfg.validate_for_run()
        self.cfg = cfg = with_device_choices(cfg, default_device().type)  # "auto" resolved
        self._owns_process = process is None
        self._process = process or PolicyProcess(cfg.collective_timeout_s)
        self.rank = self._process.rank
        self.placement = placement or Placement.build("colocated", rank_map, cfg, self._process.world,
                                                      self.rank)
        ranks, group = self.placement.ranks["actor"], self.placement.group("actor")
        world = len(ranks)
        self.model_path = str(resolve_model_path(cfg.model.path))
        self.cfg = cfg = with_rollout_tp(cfg, self.model_path, default_device(), group)
        check_model_for_run(self.model_path, cfg.rollout.tensor_parallel_size, world)  # no build
        t0 = time.perf_counter()
        train_cfg = resolve_train_config(cfg, model_dims_at(self.model_path), world, colocated=True,
                                         device=default_device(), group=group)
        layout = ("replicated, DDP-style" if train_cfg.sharding == "replicate"
                  else f"FSDP2, {train_cfg.sharding}")
        log.info("loading %s into the trainer (%s)", self.model_path, layout)
        self.trainer = Trainer(self.model_path, train_cfg, cfg.model,
                               mesh=self.placement.mesh("actor"),
                               logits_chunk_tokens=cfg.train.logits_chunk_tokens,
                               temperature=cfg.rollout.temperature)
        log.info("starting the vLLM engine (TP=%d)", cfg.rollout.tensor_parallel_size)
        # GPU: the engine's budget leaves room for the optimizer state the first step creates.
        reserve = 0 if cfg.memory.offload_optimizer else self.trainer.optimizer_state_bytes()
        adapter = cfg.model if cfg.model.lora_rank and cfg.sync.lora == "adapter" else None
        self.rollout = VLLMRollout(self.model_path, cfg.rollout, memory=cfg.memory,
                                   dtype=cfg.model.rollout_dtype, reserve_bytes=reserve,
                                   lora_rank=adapter.lora_rank if adapter else 0,
                                   logprob_samples=logprob_samples(cfg),
                                   ranks=None if group is None else list(ranks), group=group)
        self.syncer = WeightSync(self.trainer.module.config, cfg.sync,
                                 tp=cfg.rollout.tensor_parallel_size,
                                 wire_dtype=DTYPES[cfg.model.rollout_dtype], group=group,
                                 shard_group_size=shard_group_size(train_cfg, world),
                                 adapter=adapter, train_tp=train_cfg.tensor_parallel_size)
        self._process.time_out_own_groups()  # vLLM's, the FSDP mesh's; a host's keep theirs
        self.partial = PartialRollouts(cfg.rollout, cfg.async_rollout) if cfg.async_rollout.partial else None
        self._schedule = None  # the last multi-turn sampling's ScheduleStats (rollout_metrics)
        self.tokenizer = self.rollout.tokenizer
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.offload = (OptimizerOffload(self.trainer.optimizer, self.trainer.device)
                        if cfg.memory.offload_optimizer else None)
        # Trajectories sampled with the engine's current weights (id -> itself): the
        # drift scorer's free part of the split; a sync empties it.
        self.fresh: dict[int, Trajectory] = {}
        self.phases = Phases(self.rollout, self._install_weights, self.offload,
                             release=_release_policy(cfg, self.trainer, self.rollout,
                                                     self.model_path))
        if cfg.model.master_dtype != "float32":
            # vLLM loaded the file itself; the trainer holds it rounded to the master
            # dtype. The first generate syncs, so step 0 samples the trainer's weights.
            # (An fp32 master holds every checkpoint value exactly: vLLM's own cast of
            # the file and the sync's are the same rounding.)
            self.phases.trainer_weights_changed()
        log.info("hybrid actor ready in %.1f s: trainer %s over %d rank(s), vLLM TP=%d",
                 time.perf_counter() - t0, layout, world, cfg.rollout.tensor_parallel_size)

    @classmethod
    def from_pretrained(
        cls, path: str, config: RunConfig | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> HybridActor:
        """Builds the actor for the HF folder at path (collective).

        Args:
            path: HF model folder (or hub id), written into config.model.path.
            config: the run config; None = defaults (see `hybrid-engine config`).
            overrides: dotted keys applied on top, e.g. {"rollout.max_tokens": 64}.
        """
        cfg = apply_overrides(config or RunConfig(), {**(overrides or {}), "model.path": path})
        return cls(cfg)

    # --- phases (policy/phases.py owns the state) ----------------------------------

    @property
    def phase(self) -> str:
        """"inference" or "training": which layout holds the memory now."""
        return self.phases.layout

    @property
    def released_bytes(self) -> int:
        return self.phases.released_bytes

    @property
    def engine_facts(self) -> dict:
        """What vLLM resolved for this engine (`VLLMRollout.facts`)."""
        return self.rollout.facts

    @contextlib.contextmanager
    def training(self) -> Iterator[HybridActor]:
        """Switches to the training layout (collective): the engine releases its
        memory (GPU: its weights too; the next generate resyncs). The layout stays
        after the block; the next generate switches back. The block may change
        the trainer's weights (its own optimizer step): they count as changed
        after it, so the next generate syncs whether or not the engine kept its
        own."""
        self.phases.to_train()
        try:
            yield self
        finally:
            self.phases.trainer_weights_changed()

    @contextlib.contextmanager
    def inference(self) -> Iterator[HybridActor]:
        """Switches to the inference layout with the trainer's current weights
        (collective: syncs if they changed or were discarded)."""
        self.phases.to_rollout()
        yield self

    # --- inference ---------------------------------------------------------------

    def generate(
        self, prompts: Sequence[str | Sequence[int]], *, num_samples: int | None = None,
        seed: int = 0, sampling: Mapping[str, Any] | None = None, **kwargs: Any,
    ) -> Completions:
        """K completions per prompt with sampled-token log-probs (collective): for
        every completion when training reads them, else for the first
        rollout.mismatch_sample of each group, NaN for the others
        (`policy.training.logprob_samples`).

        sampling: RolloutConfig fields replaced for this call ({"top_k": 1}:
        greedy, deterministic, its log-probs 0).
        Other keyword arguments go to `VLLMRollout.generate`. Switches to the
        inference layout first, syncing if the weights changed or were discarded.
        """
        self.phases.to_rollout()
        self.phases.check_rollout()
        with self._sampling(sampling):
            return self.rollout.generate(prompts, num_samples=num_samples, seed=seed, **kwargs)

    def _sampling(self, sampling: Mapping[str, Any] | None
                  ) -> contextlib.AbstractContextManager[None]:
        return sampling_overrides(self.rollout, sampling)

    def collect(self, env: Any, prompts: Sequence[Sequence[int]], *, num_samples: int,
                seed: int, sampling: Mapping[str, Any] | None = None,
                version: int | None = None) -> list[Trajectory]:
        """Trajectories of env for prompts, single- or multi-turn, unscored (collective).

        sampling: RolloutConfig fields replaced for this call (evaluation's);
        such trajectories are not the step's samples (the mismatch monitor
        and partial rollouts leave them alone).

        With async_rollout.partial (and no sampling) the step's generation may
        stop early (`rollout.partial.PartialRollouts`): version is then the
        current weights' version (the controller's step), recorded per token,
        and up to len(prompts) finished groups come back, parked ones first;
        multi-turn episodes park between turns or mid-segment
        (`rollout.partial_turns`).
        """
        from hybrid_engine.rollout.agent_loop import ScheduleStats
        from hybrid_engine.rollout.episodes import collect, is_multi_turn

        self.phases.to_rollout()
        self.phases.check_rollout()
        if self.partial is not None and not sampling:
            if version is None:
                raise ValueError("async_rollout.partial: collect() needs the weights' version")
            return self._sampled_now(self.partial.collect(
                self.rollout, [list(p) for p in prompts], num_samples=num_samples, seed=seed,
                version=version, env=env if is_multi_turn(env) else None), version)
        stats = ScheduleStats()
        with self._sampling(sampling):
            trajs = collect(self.rollout, env, [list(p) for p in prompts],
                            num_samples=num_samples, seed=seed, stats=stats)
        if sampling:
            return trajs
        if is_multi_turn(env):  # several rounds in a step (dynamic sampling): all of them
            self._schedule = stats if self._schedule is None else stats.merged(self._schedule)
        return self._sampled_now(trajs, None)

    def _install_weights(self) -> dict[str, float]:
        """The trainer's weights into the engine (the phases' sync)."""
        self.fresh = {}  # sampled by the weights this replaces
        return self.syncer.sync(self.trainer.module, self.rollout)

    def _sampled_now(self, trajs: list[Trajectory], version: int | None) -> list[Trajectory]:
        """Records trajs as fresh (partial rollouts: those with every token of this
        version, not a parked prefix) for the drift scorer; returns them."""
        for t in trajs:
            if version is None or set(t.token_versions or [version]) == {version}:
                self.fresh[id(t)] = t
        return trajs

    def rollout_state(self) -> dict | None:
        """The parked partial sequences (async_rollout.partial), JSON-able; else None."""
        return None if self.partial is None else self.partial.state_dict()

    def rollout_metrics(self) -> dict[str, float]:
        """The generation's own metrics since the last call: with partial rollouts
        the pool's partial/* counts (`PartialRollouts.metrics`); else none. The
        controller reads them after every step's sampling, trained or not.
        Multi-turn: rollout/engine_idle, the share of the sampling's time the
        engine had no request while episodes waited for their environment."""
        out = {} if self.partial is None else self.partial.metrics()
        if self._schedule is not None:
            out["rollout/engine_idle"] = self._schedule.idle_fraction
            self._schedule = None
        return out

    def load_rollout_state(self, state: dict | None) -> None:
        """Restores what rollout_state() returned."""
        if state is None:
            return
        if self.partial is None:
            log.warning("the checkpoint holds %d parked partial group(s); this run has "
                        "async_rollout.partial=false: they are discarded", len(state["pool"]))
            return
        self.partial.load_state_dict(state)

    def collect_async(self, env: Any, prompts: Sequence[Sequence[int]], *, num_samples: int,
                      seed: int) -> Generated:
        """`collect` now (the layouts take turns on the device, so nothing overlaps),
        as a handle: `result()` returns (trajectories, generate seconds)."""
        trajs, seconds = timed(lambda: self.collect(env, prompts, num_samples=num_samples,
                                                    seed=seed))
        return Generated(trajs, seconds)

    # --- training ----------------------------------------------------------------

    def _batch(self, trajs: Sequence[Trajectory] | TrainBatch) -> tuple[TrainBatch, range | None]:
        return train_batch(trajs, self.pad_id, self.cfg, self.trainer)

    def compute_logprobs(self, trajs: Sequence[Trajectory] | TrainBatch) -> list[torch.Tensor] | tuple:
        """Trainer log-probs under the current weights (collective, no grad), in the
        training layout (switches to it).

        Given the step's trajectories (the same list on every rank): a list of
        response-local log-prob tensors, one per trajectory, on every rank.
        Given a TrainBatch (this rank's rows): (logp_BT, entropy_BT).
        """
        self.phases.to_train()
        batch, idx = self._batch(trajs)
        logp_BT, entropy_BT = self.trainer.compute_logprobs(batch)
        if idx is None:
            return logp_BT, entropy_BT
        return gather_response_field(trajs, idx, batch, logp_BT, self.trainer.data_group)

    def train_step(
        self, trajs: Sequence[Trajectory] | TrainBatch, loss: StepLoss | LossFn | None = None,
        *, entropy_grad: bool | None = None,
    ) -> dict[str, float]:
        """The RL step's updates (collective): on trajectories, train.ppo_epochs x
        train.mini_batches_per_rollout optimizer steps on seeded, shuffled
        mini-batches, with old log-probs computed once first when there is more
        than one (`roles.updates`; sets each trajectory's old_logp); on a
        TrainBatch, one optimizer step.

        Args:
            trajs: the step's trajectories with advantages (the same list on
                every rank; each trains on its slice of every mini-batch), or
                this rank's TrainBatch.
            loss: an Algorithm's `loss` (`losses.StepLoss`: its LossFn,
                aggregation and entropy term), or a bare `LossFn` (the config's
                aggregation), or None: the config's algorithm. The LossFn is
                wrapped to also report the rollout/trainer mismatch.
            entropy_grad: entropy with grad, replacing loss's (default:
                loss's; the config's is algorithm.entropy_coef != 0).

        Returns:
            The trainer's global metrics (combined over the updates:
            `updates.combine_updates`), plus mem_released_bytes (the
            engine's release) and, with memory.offload_optimizer,
            offload_moved_bytes / offload_released_bytes of the offload
            during the generation before this step.
        """
        self.phases.to_train()
        metrics = policy_train(self.trainer, self.cfg, trajs, self.pad_id, loss, entropy_grad)
        self.phases.trainer_weights_changed()
        metrics["mem_released_bytes"] = float(self.released_bytes)
        if self.offload is not None:  # the offload during this step's generation
            metrics["offload_moved_bytes"] = float(self.offload.moved_bytes)
            metrics["offload_released_bytes"] = float(self.offload.released_bytes)
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """Writes the trainer's weights into vLLM (collective); returns sync metrics.
        The layout does not change (the optimizer state is parked: the next
        optimizer step brings it back)."""
        return self.phases.sync()

    def switch_to(self, layout: Layout) -> None:
        """Gives the device to `layout` (collective): "inference" syncs the weights
        if they changed or were discarded and brings the KV cache back;
        "training" releases the engine's memory where configured."""
        if layout == "inference":
            self.phases.to_rollout()
        else:
            self.phases.to_train()

    def drift_scorer(self) -> DriftScorer | None:
        """The scorer that splits the mismatch metric when samples can be stale
        (async_rollout.max_staleness > 0 or partial rollouts), the engine's prompt
        log-probs equal its sampling ones (rollout.temperature 1, no top_p or
        top_k: the sampling log-probs are vLLM's processed ones, renormalised
        over what top-p/top-k keep; prompt log-probs are not) and
        guards.mismatch_split_sequences > 0; else None."""
        r = self.cfg.rollout
        if (not self.cfg.async_rollout.max_staleness
                or (r.temperature, r.top_p, r.top_k) != (1.0, 1.0, -1)
                or not self.cfg.guards.mismatch_split_sequences):
            return None
        return DriftScorer(self, self.cfg.guards.mismatch_split_sequences)

    # --- persistence -------------------------------------------------------------

    def save(self, path: str | Path, *, extra: dict | None = None, critic: Any = None) -> None:
        """Atomic DCP checkpoint of the policy (and critic) with extra JSON state.
        The layout after it is the one before (`Phases.optimizer_on_device`)."""
        with watchdog.phase("save"), self.phases.optimizer_on_device():
            save_training_state(path, trainer=self.trainer, critic=critic, extra=extra,
                                group=self.trainer.group)

    def load(self, path: str | Path, *, critic: Any = None) -> dict | None:
        """Restores a checkpoint; the next generate syncs vLLM. Returns its extra.
        The layout after it is the one before."""
        with self.phases.optimizer_on_device():
            extra = load_training_state(path, trainer=self.trainer, critic=critic,
                                        group=self.trainer.group)
            self.phases.trainer_weights_changed()
        return extra

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Writes the current policy as a HF folder (atomic; collective)."""
        with watchdog.phase("export"):
            export_hf(path, model=self.trainer, hf_config_source=self.model_path, dtype=dtype,
                      group=self.trainer.group)

    def export_adapter(self, path: str | Path) -> None:
        """Writes a LoRA policy's adapters as a PEFT folder over model.path (collective)."""
        with watchdog.phase("export"):
            export_adapter(path, model=self.trainer, lora=self.cfg.model,
                           base_model=self.model_path, group=self.trainer.group)

    def shutdown(self) -> None:
        """Stops the engine; destroys the process group if this actor created it
        (not when the caller passed its `PolicyProcess`: the caller leaves).

        vLLM's teardown also destroys the default group: call after the job's
        last collective. Idempotent.
        """
        if self._owns_process:
            self._process.stop_watchdog()
        self.rollout.shutdown()
        if self._owns_process:
            self._process.leave()
