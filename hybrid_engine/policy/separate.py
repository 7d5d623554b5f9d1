"""SeparatePolicy: the policy with its two layouts on different ranks.

Job: the same surface as `HybridActor` (what `Job` and the controller call)
for separate placement: ranks 0..M-1 only train (FSDP2 over their own
group), ranks M..N-1 only sample (vLLM, tensor parallel over their own
world), and fresh weights flow trainer -> rollout through the same planner
and kernels (the plan then has no local blocks: each rollout rank receives
its whole TP shard, cast to the rollout dtype in the pack kernel).

    generate / collect   rollout ranks sample; the trajectories are broadcast
                         from rank M, so every rank holds the same list
    collect_async        async_rollout.max_staleness > 0: the rollout ranks' generation
                         thread samples the batch while the main thread goes on
                         (trains, syncs: the overlap); `result()` broadcasts it
                         (`policy.ahead`). The sync lands in the engine's back
                         buffers while a generation runs and is installed
                         between batches, or, with async_rollout.inflight_updates,
                         between two engine steps of the running batch
                         (`policy.inflight.InstallGate`, agreed by the TP group)
    train_step           trainer ranks step; metrics broadcast from rank 0
    sync_weights         trainer ranks send, rollout ranks receive and re-pack
    (a reference or critic is built on the trainer ranks, `placement.ranks`;
    the job mirrors its scores and metrics to the rollout ranks: `roles.mirrored`)
    switch_to(layout)    nothing to switch: each layout owns its ranks

Memory: nothing is released between phases: each layout owns its ranks.
Every method is collective over all N ranks, like HybridActor's, so the
controller runs unchanged.

Invariant: every rank returns the same trajectories and the same metrics
from every call (the controller's decisions depend on them). The rollout
samples from exactly the trainer's weights after `sync_weights` when the sync
runs on the main thread; behind the step (generation ahead), from the first
batch submitted after it, or from an engine step inside a running batch with
in-flight updates (each token records its version).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_engine.policy.ahead import Inflight, SerialWorker, timed
from hybrid_engine.policy.inflight import InstallGate
from hybrid_engine.policy.process import PolicyProcess
from hybrid_engine.policy.training import (logprob_samples, policy_train,
                                           refuse_parked_partials, sampling_overrides,
                                           train_batch)
from hybrid_engine.algorithms.losses import LossFn, StepLoss
from hybrid_engine.checkpoint import (export_adapter, export_hf, load_training_state,
                                      save_training_state)
from hybrid_engine.config import RolloutConfig, RunConfig
from hybrid_engine.parallel import watchdog
from hybrid_engine.parallel.dist import resync_group_counter, split_ranks
from hybrid_engine.parallel.placement import Placement, RankMap
from hybrid_engine.parallel.precision import with_device_choices
from hybrid_engine.parallel.fsdp import DTYPES, default_device, resolve_model_path
from hybrid_engine.parallel.sharding import (
    model_dims_at,
    resolve_train_config,
    shard_group_size,
)
from hybrid_engine.roles.base import Layout
from hybrid_engine.roles.sync import WeightSync
from hybrid_engine.rollout.agent_loop import ScheduleStats
from hybrid_engine.rollout.engine import Completions
from hybrid_engine.trajectory import TrainBatch, Trajectory

__all__ = ["SeparatePolicy", "rank_map"]

log = logging.getLogger(__name__)


def _from_rank(src: int, obj: Any) -> Any:
    """obj of rank src, on every rank (collective)."""
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _all_ranks(obj: Any) -> list:
    """Every rank's obj, on every rank (collective)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _SharedRollout:
    """What `episodes.collect` needs of a rollout: generate() samples on the
    rollout ranks and returns the same Completions on every rank."""

    def __init__(self, engine: Any, cfg: RolloutConfig, src: int | None) -> None:
        self.engine, self.cfg, self.src = engine, cfg, src  # src None: no broadcast

    def generate(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> Completions:
        out = None
        if self.engine is not None:
            self.engine.cfg = self.cfg  # evaluation swaps the sampling config
            out = self.engine.generate(prompts, **kwargs)
        return out if self.src is None else _from_rank(self.src, out)


class _LocalRollout(_SharedRollout):
    """The rollout ranks' own view of the engine (no broadcast): also what the
    per-episode loop needs (`rollout.agent_loop`), so multi-turn episodes run
    per episode on the rollout ranks. between_steps: given to every generate
    (in-flight updates; they need a single-turn environment)."""

    def __init__(self, engine: Any, cfg: RolloutConfig,
                 between_steps: Callable[[], bool] | None = None) -> None:
        super().__init__(engine, cfg, src=None)
        self.ranks, self.group = engine.ranks, engine.group
        self.between_steps = between_steps

    def generate(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> Completions:
        if self.between_steps is not None:
            kwargs["between_steps"] = self.between_steps
        return super().generate(prompts, **kwargs)

    def open_run(self, kind: str) -> Any:
        self.engine.cfg = self.cfg  # evaluation swaps the sampling config
        return self.engine.open_run(kind)

    def prompt_ids(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        self.engine.cfg = self.cfg
        return self.engine.prompt_ids(prompts)

    def replica(self) -> tuple[int, int]:
        return self.engine.replica()

    def sampling_params(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.sampling_params(*args, **kwargs)

    def wants_logprobs(self, j: int) -> bool:
        return self.engine.wants_logprobs(j)


def rank_map(cfg: RunConfig, world: int) -> RankMap:
    """placement=separate: the trainer's roles on ranks 0..M-1, the rollout on
    M..N-1 (`split_ranks`); a reward model on every rank."""
    m, _ = split_ranks(world, cfg.rollout)
    train = tuple(range(m))
    return {"actor": train, "reference": train, "critic": train,
            "rollout": tuple(range(m, world)), "reward_model": tuple(range(world))}


class SeparatePolicy:
    """The policy over separate trainer and rollout ranks; see the module docstring.

    Args:
        cfg: the run config (placement="separate"; rollout.num_ranks picks R).

    Attributes:
        num_trainers: M; ranks 0..M-1 train, M..N-1 roll out.
        is_trainer: whether this rank trains.
        trainer: the FSDP2 `Trainer` on trainer ranks, else None.
        rollout: the `VLLMRollout` on rollout ranks, else None.
        engine_facts: what vLLM resolved (`VLLMRollout.facts`), on every rank.
        tokenizer, pad_id, model_path, rank: as in `HybridActor`.
    """

    def __init__(self, cfg: RunConfig) -> None:
        cfg.validate_for_run()
        self.cfg = cfg = with_device_choices(cfg, default_device().type)  # "auto" resolved
        self._process = PolicyProcess(cfg.collective_timeout_s)
        self.rank, world = self._process.rank, self._process.world
        # Every rank makes every group, before any engine exists (names must agree).
        self.placement = Placement.build("separate", rank_map, cfg, world, self.rank)
        self.num_trainers = len(self.placement.ranks["actor"])
        self.is_trainer = self.placement.holds("actor")
        self.model_path = str(resolve_model_path(cfg.model.path))
        from hybrid_engine.preflight import check_model_for_run

        check_model_for_run(self.model_path, cfg.rollout.tensor_parallel_size,
                            world - self.num_trainers, what="rollout ranks")
        t0 = time.perf_counter()
        # Every rank resolves the layout (sharding=auto: collective): the plan needs it.
        train_cfg = resolve_train_config(cfg, model_dims_at(self.model_path), self.num_trainers,
                                         colocated=False, device=default_device())
        # Generation ahead: the sync runs on its own thread behind the next step, so
        # it gets its own group (collectives of one group must not interleave
        # between threads). Not with the naive or verified sync: they gather full
        # tensors over the trainers' group, which the next step's training uses.
        self._behind = (cfg.async_rollout.max_staleness > 0 and cfg.sync.method == "reshard"
                        and not cfg.sync.verify)
        sync_group = dist.new_group(list(range(world))) if self._behind else None
        hf_config = self._build_side(train_cfg)
        resync_group_counter()  # only the rollout ranks made vLLM's groups
        self.syncer = WeightSync(hf_config, cfg.sync, tp=cfg.rollout.tensor_parallel_size,
                                 wire_dtype=DTYPES[cfg.model.rollout_dtype],
                                 num_trainers=self.num_trainers, group=sync_group,
                                 shard_group_size=shard_group_size(train_cfg, self.num_trainers),
                                 train_tp=train_cfg.tensor_parallel_size)
        self._process.time_out_own_groups()
        self._shared = _SharedRollout(self.rollout, cfg.rollout, src=self.num_trainers)
        # What vLLM resolved, on every rank (the run's record is written by rank 0).
        self.engine_facts = _from_rank(self.num_trainers, getattr(self.rollout, "facts", None))
        self._init_ahead(cfg)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        # Both sides loaded the same file; a master dtype narrower than fp32 rounded
        # the trainer's copy, so the first generate syncs (step 0 samples the
        # trainer's weights).
        self._stale = cfg.model.master_dtype != "float32"
        log.info("separate policy ready in %.1f s: FSDP2 over ranks 0-%d, vLLM TP=%d over "
                 "ranks %d-%d", time.perf_counter() - t0, self.num_trainers - 1,
                 cfg.rollout.tensor_parallel_size, self.num_trainers, world - 1)

    def _build_side(self, train_cfg: Any) -> Any:
        """This rank's side: the FSDP2 trainer (trainer ranks) or the vLLM engine
        (rollout ranks), and the tokenizer; returns the model's HF config."""
        self.trainer, self.rollout = None, None
        cfg = self.cfg
        if self.is_trainer:
            from transformers import AutoTokenizer

            from hybrid_engine.roles.trainer import Trainer

            self.trainer = Trainer(self.model_path, train_cfg, cfg.model,
                                   mesh=self.placement.mesh("actor"),
                                   logits_chunk_tokens=cfg.train.logits_chunk_tokens,
                                   temperature=cfg.rollout.temperature)
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            return self.trainer.module.config
        from transformers import AutoConfig

        from hybrid_engine.rollout.engine import VLLMRollout

        self.rollout = VLLMRollout(self.model_path, cfg.rollout, memory=cfg.memory,
                                   dtype=cfg.model.rollout_dtype,
                                   # generation ahead: syncs land in back buffers
                                   double_buffer=cfg.async_rollout.max_staleness > 0,
                                   ranks=list(self.placement.ranks["rollout"]),
                                   group=self.placement.group("rollout"),
                                   logprob_samples=logprob_samples(cfg))
        self.tokenizer = self.rollout.tokenizer
        return AutoConfig.from_pretrained(self.model_path)

    def _init_ahead(self, cfg: RunConfig) -> None:
        """The state of generation ahead of training (async_rollout.max_staleness) and of
        in-flight updates: the threads, the install gate, the sync behind the step."""
        # The rollout ranks' generation thread samples through _local (no
        # broadcast: result() shares).
        self._local = (_LocalRollout(self.rollout, cfg.rollout) if self.rollout is not None
                       else None)
        self._gen = SerialWorker("generation")
        # async_rollout.inflight_updates: the sync's install lands between two engine steps
        # of the batch being sampled (agreed by the TP group), not after it.
        self._gate = (InstallGate(self.rollout.tp_all) if self.rollout is not None
                      and cfg.async_rollout.inflight_updates else None)
        self._handed = 0  # syncs handed to the gate so far (main thread, in order)
        # Multi-turn sampling: where the rollout ranks' last batch spent its time
        # (rollout/engine_idle), and whether the run samples multi-turn at all (every rank).
        self._schedule: ScheduleStats | None = None
        self._multi_turn = False
        # The sync behind the next step (generation ahead): its thread, and the
        # metrics of the last one joined (reported by the next sync_weights).
        self._sync_thread = SerialWorker("sync")
        self._sync_job: Any = None
        self._sync_metrics: dict[str, float] | None = None

    def rollout_metrics(self) -> dict[str, float]:
        """Multi-turn: rollout/engine_idle of the last batch the rollout ranks
        sampled, from the first of them (collective); else none (partial
        rollouts are colocated only)."""
        if not self._multi_turn:
            return {}
        stats, self._schedule = self._schedule, None
        idle = _from_rank(self.num_trainers, None if stats is None else stats.idle_fraction)
        return {} if idle is None else {"rollout/engine_idle": idle}

    def rollout_state(self) -> None:
        """Nothing kept between steps but the batches ahead (the controller's)."""
        return None

    def load_rollout_state(self, state: dict | None) -> None:
        refuse_parked_partials(state)

    def _sampling(self, sampling: Mapping[str, Any] | None
                  ) -> contextlib.AbstractContextManager[None]:
        return sampling_overrides(self._shared, sampling)

    # --- inference ---------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]], *, num_samples: int | None = None,
                 seed: int = 0, sampling: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> Completions:
        """K completions per prompt, the same on every rank (collective)."""
        self._join_sync()
        self._gen.drain()  # the engine serves one thread at a time
        if self._stale:
            self.sync_weights()
            self._join_sync()
        with self._sampling(sampling):
            return self._shared.generate(prompts, num_samples=num_samples, seed=seed, **kwargs)

    def collect(self, env: Any, prompts: Sequence[Sequence[int]], *, num_samples: int,
                seed: int, sampling: Mapping[str, Any] | None = None) -> list[Trajectory]:
        """Trajectories of env for prompts, unscored, the same on every rank (collective)."""
        from hybrid_engine.rollout.episodes import collect, is_multi_turn

        self._join_sync()
        self._gen.drain()  # the engine serves one thread at a time
        if self._stale:
            self.sync_weights()
            self._join_sync()
        ids = [list(p) for p in prompts]
        with self._sampling(sampling):
            if not is_multi_turn(env):
                return collect(self._shared, env, ids, num_samples=num_samples, seed=seed)
            # Multi-turn: the rollout ranks run the episodes (per episode: rollout.schedule),
            # the trainer ranks get them.
            trajs, stats = None, ScheduleStats()
            self._multi_turn = self._multi_turn or not sampling
            if self._local is not None:
                self._local.cfg = self._shared.cfg  # evaluation's sampling, if any
                try:
                    trajs = collect(self._local, env, ids, num_samples=num_samples, seed=seed,
                                    stats=stats)
                finally:
                    self._local.cfg = self.cfg.rollout
                if not sampling:
                    self._schedule = stats
            return _from_rank(self.num_trainers, trajs)

    def collect_async(self, env: Any, prompts: Sequence[Sequence[int]], *, num_samples: int,
                      seed: int) -> Inflight:
        """Starts sampling a batch of env's trajectories on the rollout ranks'
        generation thread, with the weights the trainer has now (syncs first if
        they changed); returns at once. `result()` (collective) waits and
        returns (trajectories, generate seconds) on every rank."""
        from hybrid_engine.rollout.episodes import collect, is_multi_turn

        if self._gate is not None and is_multi_turn(env):
            raise ValueError("async_rollout.inflight_updates=true needs a single-turn environment "
                             f"({type(env).__name__} is multi-turn)")
        if self._stale:
            self.sync_weights()
        future = None
        self._multi_turn = self._multi_turn or is_multi_turn(env)
        if self.rollout is not None:
            ids, sync, handed = [list(p) for p in prompts], self._sync_job, self._handed

            def job() -> tuple[list[Trajectory], float]:
                if sync is not None:  # installed first: this batch samples this step's weights
                    sync.result()
                # in-flight updates: the engine offers every step boundary to the gate
                gate = self._gate
                local = self._local if gate is None else _LocalRollout(
                    self.rollout, self.cfg.rollout, between_steps=gate.between_steps)

                def run() -> tuple[list[Trajectory], float]:
                    stats = ScheduleStats()
                    out = timed(lambda: collect(local, env, ids, stats=stats,
                                                num_samples=num_samples, seed=seed))
                    if is_multi_turn(env):
                        self._schedule = stats  # read by rollout_metrics
                    return out

                return run() if gate is None else gate.sample(handed, run)

            future = self._gen.submit(job)
        return Inflight(future, lambda obj: _from_rank(self.num_trainers, obj), _all_ranks)

    # --- training ----------------------------------------------------------------

    def train_step(self, trajs: Sequence[Trajectory] | TrainBatch,
                   loss: StepLoss | LossFn | None = None, *, entropy_grad: bool | None = None,
                   ) -> dict[str, float]:
        """The RL step's updates on the trainer ranks (as `HybridActor.train_step`);
        their metrics on every rank (collective)."""
        metrics = None
        if self.is_trainer:
            # Generation ahead: the sync behind reads the weights until the optimizer
            # step (forward and backward only read them), so that step waits for it.
            metrics = policy_train(self.trainer, self.cfg, trajs, self.pad_id, loss, entropy_grad,
                                   before_update=self._join_sync if self._behind else None)
            metrics["mem_released_bytes"] = 0.0  # each layout owns its ranks
        self._stale = True
        return _from_rank(0, metrics)

    def compute_logprobs(self, trajs: Sequence[Trajectory]) -> list[torch.Tensor]:
        """Trainer log-probs of the step's trajectories under the current weights,
        one response-local tensor each, on every rank (collective, no grad)."""
        out = None
        if self.is_trainer:
            from hybrid_engine.parallel.batch_slices import gather_response_field

            batch, idx = train_batch(trajs, self.pad_id, self.cfg, self.trainer)
            logp_BT, _ = self.trainer.compute_logprobs(batch)
            out = gather_response_field(trajs, idx, batch, logp_BT, self.trainer.data_group)
        return _from_rank(0, out)

    def sync_weights(self) -> dict[str, float]:
        """Trainer ranks' weights into the rollout ranks' engines (collective);
        the metrics of the first rollout rank (bytes it received, re-pack time).

        Generation ahead (async_rollout.max_staleness > 0, sync.method=reshard
        without verify): the sync runs behind the next step on its own thread
        and group. It returns at once, with the metrics of the previous sync
        (sync_behind=1). Trainer ranks wait for it
        right before their next optimizer step (forward and backward only read
        the weights); on rollout ranks the next batch's job waits for it on the
        generation thread, so the main thread goes on. The transfer lands in
        the engine's back buffers while a generation runs and is installed
        once the batches submitted before it have ended (in-flight updates:
        between two engine steps of the running batch). The shards it sends
        are taken here, on the main thread (`WeightSync.sources`)."""
        model = self.trainer.module if self.is_trainer else None
        self._stale = False
        if not self._behind:
            return _from_rank(self.num_trainers, self.syncer.sync(
                model, self.rollout, before_install=self._gen.drain))
        self._join_sync()
        prev, self._sync_metrics = self._sync_metrics, None
        prev = _from_rank(self.num_trainers, prev)
        sampling = self._gen.pending()  # batches of the old weights: installed after them

        def after_them() -> None:
            wait(sampling)  # ended, failed or cancelled (shutdown)

        gate = self._gate  # in-flight: installed inside the running batch if it can be
        install = None if gate is None else lambda commit: gate.hand_over(commit, sampling)
        self._handed += 1
        # The shards' views, taken here: the sync thread must not walk the module
        # while the next step's forward has the root's parameters gathered.
        sources = self.syncer.sources(model)
        self._sync_job = self._sync_thread.submit(
            lambda: self.syncer.sync(model, self.rollout, before_install=after_them,
                                     install=install, sources=sources))
        return {**(prev or {}), "sync_behind": 1.0}

    def _join_sync(self) -> None:
        """Waits for the sync running behind (if any); raises its error; keeps its
        metrics for the next sync_weights."""
        job, self._sync_job = self._sync_job, None
        if job is not None:
            self._sync_metrics = job.result()

    def drift_scorer(self) -> None:
        """None: the drift split needs the engine on the trainer's ranks (colocated)."""
        return None

    def switch_to(self, layout: Layout) -> None:
        """Nothing to switch: the trainer and the engine hold different ranks."""

    # --- persistence -------------------------------------------------------------

    def save(self, path: str | Path, *, extra: dict | None = None, critic: Any = None) -> None:
        """Atomic DCP checkpoint, written by the trainer ranks (collective)."""
        self._join_sync()
        with watchdog.phase("save"):
            if self.is_trainer:
                save_training_state(path, trainer=self.trainer, critic=critic, extra=extra,
                                    group=self.trainer.group)
            dist.barrier()

    def load(self, path: str | Path, *, critic: Any = None) -> dict | None:
        """Restores a checkpoint on the trainer ranks; the next generate syncs.
        Returns its extra on every rank."""
        extra = None
        self._join_sync()
        if self.is_trainer:
            extra = load_training_state(path, trainer=self.trainer, critic=critic,
                                        group=self.trainer.group)
        self._stale = True
        return _from_rank(0, extra)

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Writes the current policy as a HF folder (trainer ranks; collective)."""
        with watchdog.phase("export"):
            if self.is_trainer:
                export_hf(path, model=self.trainer, hf_config_source=self.model_path,
                          dtype=dtype, group=self.trainer.group)
            dist.barrier()

    def export_adapter(self, path: str | Path) -> None:
        """Writes a LoRA policy's adapters as a PEFT folder (trainer ranks; collective)."""
        with watchdog.phase("export"):
            if self.is_trainer:
                export_adapter(path, model=self.trainer, lora=self.cfg.model,
                               base_model=self.model_path, group=self.trainer.group)
            dist.barrier()

    def shutdown(self) -> None:
        """Stops the engine (rollout ranks); destroys the group if this object made it."""
        self._process.stop_watchdog()
        try:
            self._gen.cancel_queued()  # batches ahead not started: nothing will train them
            self._join_sync()
        finally:
            self._sync_thread.shutdown()
            self._gen.shutdown()
            if self.rollout is not None:
                self.rollout.shutdown()
        self._process.leave()
