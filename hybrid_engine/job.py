"""A training job: builds every role from a RunConfig, runs the controller, saves.

Job: the wiring that `hybrid-engine train` and `hybrid-engine demo` share --
the policy (`policy.placements`: one per cfg.placement; the roles sit where
its `Placement` says), the environment, the algorithm, the reference
(when the KL needs it) and the critic (when the estimator needs values), the
checkpointer (DCP, newest k kept, resume from the latest complete one), the
metrics sink and progress bar, then the final HF export and plot.

Output folder layout (cfg.output_dir):
    config.yaml        the resolved config of the run
    metrics.jsonl      one JSON object per step (and step 0: the first eval)
    samples.jsonl      every log.samples_every steps, the samples table's rows
    <eval.samples_file>  with that knob, every evaluated completion (`eval_samples`)
    tb/                TensorBoard event files (scalars; the samples tables as text)
    wandb/, mlruns/    W&B's and MLflow's files, when log.trackers names them
    trackers.json      their run ids, so that a resumed run continues them
    checkpoints/       step_<n>/ complete DCP checkpoints (newest keep_checkpoints)
    final/             the policy as a HF folder
    metrics.png        reward and accuracy over steps
    .lock              held (flock) by the running job's rank 0: a second job
                       on the same folder is refused, not interleaved (`output_dir.py`)

Invariant: the controller is built the same way for every placement, algorithm
and task; this module is the only place that knows which roles exist.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_engine.algorithms.algorithm import Algorithm
from hybrid_engine.checkpoint import (
    COMPLETE_MARKER, checkpoint_problem, latest_checkpoint, prune_checkpoints,
    step_checkpoint_path, step_checkpoints)
from hybrid_engine.config import ModelConfig, RunConfig, flatten, to_dict
from hybrid_engine.controller import Controller, FinalEvaluationFailed
from hybrid_engine.evaluation import Evaluator
from hybrid_engine.guards import Guards, RunAborted
from hybrid_engine.parallel.dist import set_collective_timeout
from hybrid_engine.parallel.fsdp import default_device
from hybrid_engine.parallel.precision import with_device_choices
from hybrid_engine.envs import make_env
from hybrid_engine.metrics import MetricsSink, SampleFile, plot_metrics
from hybrid_engine.output_dir import OutputDir
from hybrid_engine.parallel.placement import Placement
from hybrid_engine.rollout.episodes import is_multi_turn
from hybrid_engine.preflight import check_file_target, preflight
from hybrid_engine.roles.base import JobPolicy
from hybrid_engine.policy.engine_only import EnginePolicy
from hybrid_engine.policy.placements import make_policy, rank_map

__all__ = ["Job", "JobCheckpointer", "RunAborted", "check_env_fits_algorithm",
           "make_policy"]

log = logging.getLogger("hybrid_engine.train")


class JobCheckpointer:
    """Saves policy (+ critic) and controller state to checkpoints/step_<n>, keeps the newest k."""

    def __init__(self, actor: JobPolicy, critic: Any, root: Path, keep: int) -> None:
        self.actor, self.critic, self.root, self.keep = actor, critic, root, keep

    def save(self, step: int, extra: dict) -> None:
        path = step_checkpoint_path(self.root, step)
        self.actor.save(path, extra=extra, critic=self.critic)
        prune_checkpoints(self.root, self.keep)
        log.info("saved checkpoint %s", path)

    def load_latest(self) -> dict:
        """Restores the newest sound checkpoint; returns the controller state.

        A damaged one (a file missing, truncated or changed since the save:
        `checkpoint_problem`, every rank checking a share) is skipped with a
        warning for the one before; it stays on disk for inspection, renamed
        `step_<n>.damaged-<time>` so that keep_checkpoints neither counts it
        among the newest nor deletes the sound ones for it.

        Raises:
            ValueError: no sound checkpoint under the folder.
        """
        path, damaged = None, []
        for _, candidate in reversed(step_checkpoints(self.root)):
            problem = checkpoint_problem(candidate, group=dist.group.WORLD)
            if problem is None:
                path = candidate
                break
            damaged.append(candidate)
            log.warning("checkpoint %s is damaged (%s): resuming from the one before; it is "
                        "kept as %s.damaged-*", candidate, problem, candidate.name)
        if damaged:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            if dist.get_rank() == 0:
                for p in damaged:
                    p.rename(p.with_name(f"{p.name}.damaged-{stamp}"))
            dist.barrier()  # every rank lists the folder after the renames
        if path is None:
            raise ValueError(f"no complete checkpoint under {self.root} to resume from"
                             + (": every one is damaged (see the warnings above)"
                                if step_checkpoints(self.root) else ""))
        extra = self.actor.load(path, critic=self.critic)
        log.info("resumed from %s (step %d)", path, extra["step"])
        return extra


class Job:
    """Every role of a run, built collectively from cfg.

    Args:
        cfg: the run config (checked by `preflight` before any engine starts).
        resume: continue from the newest complete checkpoint in output_dir.
        progress: show a tqdm bar on rank 0.
        overwrite: start over in an output_dir that holds an earlier run's
            checkpoints (they, its metrics and its final model are deleted).
        allow_model_change: resume a run made from another model (architecture
            or weights) with a warning instead of refusing it (`preflight`).

    Raises:
        ValueError: bad input (see `preflight`), found alike on every rank.
    """

    def __init__(self, cfg: RunConfig, *, resume: bool = False, progress: bool = True,
                 overwrite: bool = False, allow_model_change: bool = False) -> None:
        preflight(cfg, rank_map=rank_map, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                  local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                  resume=resume, overwrite=overwrite, allow_model_change=allow_model_change)
        torch.manual_seed(cfg.seed)
        self.cfg, self.out = cfg, Path(cfg.output_dir)
        self.output_dir = OutputDir(self.out)
        try:
            self.actor = make_policy(cfg)
        except BaseException:
            self.output_dir.unlock(remove_if_unused=True)  # a failed start leaves no empty folder
            raise
        try:
            self._build(cfg, resume, progress, overwrite)
        except BaseException:
            self._close_env()
            self.actor.shutdown()  # the engine goes before the error does
            self.output_dir.unlock(remove_if_unused=True)
            raise

    def _build(self, cfg: RunConfig, resume: bool, progress: bool, overwrite: bool) -> None:
        """Every role but the actor, the checkpointer, the sink (and resume)."""
        self.rank0 = dist.get_rank() == 0
        self.output_dir.sweep_unfinished()
        if overwrite and not resume:
            self.output_dir.clear()
        self.env = make_env(cfg.env, self.actor.tokenizer, self.actor.placement)
        check_env_fits_algorithm(cfg, self.env)
        self.algorithm = Algorithm(cfg.algorithm, num_samples=cfg.rollout.num_samples_per_prompt,
                                   max_tokens=cfg.rollout.max_tokens,
                                   prompts_per_step=cfg.train.prompts_per_step)
        scorers, learners = self._scorers(cfg)
        self.checkpointer = JobCheckpointer(self.actor, self.critic, self.out / "checkpoints",
                                            cfg.keep_checkpoints)
        self.controller = Controller(self.actor, self.env, self.algorithm, cfg, scorers=scorers,
                                     learners=learners, checkpointer=self.checkpointer,
                                     on_metrics=self._on_metrics,
                                     on_samples=lambda step, trajs: self.sink.write_samples(
                                         step, trajs, self._decode),
                                     on_eval_samples=lambda rows: self.sink.write_eval_samples(
                                         rows),
                                     guards=Guards(cfg, lambda: latest_checkpoint(
                                         self.out / "checkpoints")))
        start = None
        if resume:
            self.controller.load_state_dict(self.checkpointer.load_latest())
            start = self.controller.state.step + 1
        self.sink = MetricsSink(self.out, cfg.log, resume=start, run_name=self.out.resolve().name,
                                config=flatten(to_dict(cfg)), eval_samples=cfg.eval.samples_file)
        self.bar = None
        if progress and self.rank0:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.num_steps, initial=self.controller.state.step,
                            desc="GRPO" if cfg.algorithm.advantage == "grpo" else "RL",
                            unit="step", dynamic_ncols=True)
        if self.rank0:
            self.out.mkdir(parents=True, exist_ok=True)
            import yaml

            (self.out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            facts = self.actor.engine_facts
            (self.out / "engine.json").write_text(json.dumps(facts, indent=1) + "\n")
            log.info("vLLM engine: %s", ", ".join(f"{k}={v}" for k, v in facts.items()))
            if cfg.rollout.async_scheduling == "true" and not facts["async_scheduling"]:
                log.warning("rollout.async_scheduling=true: vLLM turned it off on this "
                            "platform (vLLM's CPU platform always does)")
        set_collective_timeout(cfg.collective_timeout_s)  # the scorers' groups too
        self.output_dir.drop_cleared()  # built: an --overwrite's earlier outputs go now

    def _scorers(self, cfg: RunConfig) -> tuple[list, list]:
        """(scorers, learners) the algorithm needs: the drift scorer, the reference,
        the critic (which also learns), each built on the ranks the placement gives
        it and called on every rank (`roles.mirrored`); sets self.critic."""
        scorers, learners, self.critic = [], [], None
        model_cfg = with_device_choices(cfg, default_device().type).model  # as the policy's
        # Stale samples (colocated): the engine's log-probs under the current weights
        # split the mismatch into drift and numerics; first, in the inference layout.
        drift = self.actor.drift_scorer()
        if drift is not None:
            scorers.append(drift)
        from hybrid_engine.roles.mirrored import Member, Mirrored, MirroredLearner

        placement, members = self.actor.placement, []
        rm_ranks = placement.ranks["reward_model"]
        if cfg.env.reward_model_path and len(rm_ranks) < placement.world:
            # on its own ranks: it scores beside the reference, the env takes the scores
            from hybrid_engine.envs.reward_model import placed_reward_scorer

            members.append(Member("reward_model", placed_reward_scorer(self.env), "rm_score",
                                  per_token=False))
        if self.algorithm.needs_reference:
            members.append(Member("reference", self._reference(cfg, model_cfg, placement),
                                  "ref_logp"))
        critic = None
        if self.algorithm.needs_values:
            from hybrid_engine.roles.critic import Critic
            from hybrid_engine.roles.scorers import CriticScorer

            if placement.holds("critic"):
                self.critic = Critic(self.actor.model_path, cfg.train, model_cfg,
                                     mesh=placement.mesh("critic"))
                critic = CriticScorer(self.critic, pad_id=self.actor.pad_id,
                                      algorithm_cfg=cfg.algorithm)
            members.append(Member("critic", critic, "values"))
        if members:
            scores = Mirrored(placement, members)
            scorers.append(scores)
            if self.algorithm.needs_values:
                learners.append(MirroredLearner(placement, "critic", critic, scores))
        return scorers, learners

    def _reference(self, cfg: RunConfig, model_cfg: ModelConfig, placement: Placement) -> Any:
        """The reference's scorer on the ranks holding it, else None (model_cfg: the
        policy's, its `auto` choices resolved)."""
        from hybrid_engine.roles.reference import Reference
        from hybrid_engine.roles.scorers import ReferenceScorer

        if not placement.holds("reference"):
            return None
        lora = self.actor.trainer if cfg.model.lora_rank else None  # its own base
        mesh = lora.mesh if lora else placement.mesh("reference")
        ref = Reference(self.actor.model_path, model_cfg, mesh,
                        logits_chunk_tokens=cfg.train.logits_chunk_tokens,
                        temperature=cfg.rollout.temperature, adapted=lora and lora.module)
        return ReferenceScorer(ref, pad_id=self.actor.pad_id, train_cfg=cfg.train)

    def _on_metrics(self, step: int, m: dict[str, float]) -> None:
        """Writes the metrics and moves the bar (the controller's guards decide stops)."""
        self.sink.write(step, m)
        if self.bar is not None and step > 0:
            post = {k: f"{m[k]:.3f}" for k in ("reward_mean", "accuracy", "eval/accuracy") if k in m}
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(step - self.bar.n)

    def _decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens kept (the samples tables)."""
        return self.actor.tokenizer.decode(ids, skip_special_tokens=False)

    def run(self) -> dict[str, Any]:
        """Runs the controller, exports the final policy and plots; returns the summary."""
        try:
            summary = self.controller.run()
        except FinalEvaluationFailed as e:  # the trained policy is kept all the same
            final = self._export()
            raise ValueError(f"{e} ({final} is written; the last step's checkpoint too when "
                             "checkpointing is on)") from None
        finally:
            if self.bar is not None:
                self.bar.close()
            self.sink.close()
        final = self._export()
        if self.rank0 and "jsonl" in self.cfg.log.trackers and self.sink.path.exists():
            plot_metrics(self.sink.path, self.out / "metrics.png", title=self.out.name)
        evals = [h for h in summary["history"] if "eval/accuracy" in h]
        summary.update(final_model=str(final.resolve()), output_dir=str(self.out.resolve()))
        if evals:
            summary.update(acc_start=evals[0]["eval/accuracy"], acc_end=evals[-1]["eval/accuracy"])
        return summary

    def _export(self) -> Path:
        """The final policy: final/ as a HF folder (a LoRA policy merged, unless
        export.merge_lora=false) and final_adapter/ as a PEFT folder (LoRA).
        Returns the folder a user loads: final/ when written."""
        lora = self.cfg.model.lora_rank > 0
        final = self.out / "final"
        if not lora or self.cfg.export.merge_lora:
            self.actor.export_hf(final)
        if lora:
            self.actor.export_adapter(self.out / "final_adapter")
            if not self.cfg.export.merge_lora:
                return self.out / "final_adapter"
        return final

    def shutdown(self) -> None:
        self._close_env()
        self.actor.shutdown()
        self.output_dir.unlock()

    def _close_env(self) -> None:
        """Stops what the environment started (its reward workers), if it has any."""
        close = getattr(getattr(self, "env", None), "close", None)
        if close is not None:
            close()


def evaluate_model(cfg: RunConfig, *, checkpoint: str | None = None, output: str | None = None,
                   cleanup: list | None = None) -> dict[str, Any]:
    """`hybrid-engine eval`: the eval section's metrics of cfg.model.path, or of a
    training checkpoint of it, on this world (collective). A model folder needs
    the engine alone (`EnginePolicy`: no trainer); a checkpoint's weights load
    into the trainer first. Returns {"model", "checkpoint", "step", metrics...};
    a checkpoint's step seeds the sampled pass as in the run, so its evaluation
    there repeats exactly.
    output: a JSON-lines file to write every evaluated completion to
    (`eval_samples`; rank 0 writes); None = nothing is written.
    cleanup: a list to append the shutdown (engine, reward workers) to, for the
    caller to run after its own error handling; None = shut down before returning.

    Raises:
        ValueError: bad input (see `preflight`), or a checkpoint that does not load.
    """
    preflight(cfg, rank_map=rank_map, world_size=int(os.environ.get("WORLD_SIZE", "1")),
              local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
              resume=False, overwrite=False, writes_output=False)
    if output:
        check_file_target(Path(output), "--output")
    if checkpoint and not (Path(checkpoint) / COMPLETE_MARKER).is_file():
        raise ValueError(f"--checkpoint={checkpoint!r} is not a complete checkpoint folder "
                         "(a run's checkpoints/step_<n>)")
    actor = make_policy(cfg) if checkpoint else EnginePolicy(cfg)
    env, step = None, 0

    def shutdown() -> None:
        close = getattr(env, "close", None)
        if close is not None:
            close()
        actor.shutdown()

    if cleanup is not None:
        cleanup.append(shutdown)
    try:
        env = make_env(cfg.env, actor.tokenizer)
        if checkpoint:
            problem = checkpoint_problem(Path(checkpoint), group=dist.group.WORLD)
            if problem is not None:
                raise ValueError(f"--checkpoint={checkpoint!r} (a run's checkpoints/step_<n>) "
                                 f"does not load: {problem}")
            step = int(actor.load(checkpoint)["step"])
        samples = SampleFile(output) if output else None
        metrics = Evaluator(actor, env, cfg, write_samples=samples and samples.write)(step)
    finally:
        if cleanup is None:
            shutdown()
    return {"model": cfg.model.path, "checkpoint": checkpoint, "step": step, **metrics}


def check_env_fits_algorithm(cfg: RunConfig, env: Any) -> None:
    """Refuses an algorithm setting the environment cannot honour (found once the
    environment is built, so after the engine started).

    Raises:
        ValueError: DAPO overlong shaping with a multi-turn environment.
    """
    if cfg.algorithm.overlong_buffer and is_multi_turn(env):
        raise ValueError(
            "algorithm.overlong_buffer (DAPO overlong shaping) compares a response's "
            "length with rollout.max_tokens, which limits each segment of a multi-turn "
            f"episode, not the episode (env {cfg.env.name!r} is multi-turn): set "
            "algorithm.overlong_buffer=0")
