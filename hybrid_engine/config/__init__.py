"""Run configuration: `RunConfig`, the sections of `config/sections.py` nested by concern.

Job: the whole run's config and the rules that tie sections together (the
sections declare their own knobs and rules). The generic machinery (value
parsing, bound checks, dotted overrides, renamed keys, YAML and CLI) lives in
`hybrid_engine.config.overrides`, listing in `hybrid_engine.config.listing`;
their public functions are re-exported here
(`from hybrid_engine.config import apply_overrides`).

Invariant: a `RunConfig` that exists is valid. Every section validates its
fields in `__post_init__` (types from the annotations, bounds from the field
metadata, then cross-field rules), raising `ValueError` that names the dotted
key; configs are frozen, so the only way to change one is
`dataclasses.replace` (or `apply_overrides`), which validates again.
`validate_for_run()` adds the checks that only make sense right before
launch (model.path set, dataset file present).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybrid_engine.config.listing import check_registered, describe, help_text, to_dict
from hybrid_engine.config.overrides import (
    apply_overrides,
    flatten,
    load_yaml,
    parse_cli_overrides,
    register_renamed,
    section_prefixes,
    validate_fields,
)
from hybrid_engine.config.overrides import doc_field as _field
from hybrid_engine.config.overrides import from_dict as _from_dict
from hybrid_engine.config.sections import (
    PREFIXES,
    AlgorithmConfig,
    AsyncConfig,
    EnvConfig,
    EvalConfig,
    ExportConfig,
    GuardsConfig,
    LogConfig,
    MemoryConfig,
    ModelConfig,
    RolloutConfig,
    SyncConfig,
    TrainConfig,
)

__all__ = [
    "AlgorithmConfig",
    "AsyncConfig",
    "EnvConfig",
    "EvalConfig",
    "ExportConfig",
    "GuardsConfig",
    "LogConfig",
    "MemoryConfig",
    "ModelConfig",
    "RolloutConfig",
    "RENAMED_KEYS",
    "RunConfig",
    "SyncConfig",
    "TrainConfig",
    "apply_overrides",
    "check_registered",
    "describe",
    "flatten",
    "from_dict",
    "help_text",
    "load_yaml",
    "parse_cli_overrides",
    "to_dict",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """A whole run: one section per role plus the controller's own knobs."""

    model: ModelConfig = _field(ModelConfig, "Policy model and dtypes.")
    rollout: RolloutConfig = _field(RolloutConfig, "vLLM sampling.")
    train: TrainConfig = _field(TrainConfig, "FSDP2 trainer and optimizer.")
    algorithm: AlgorithmConfig = _field(AlgorithmConfig, "Advantages and loss.")
    sync: SyncConfig = _field(SyncConfig, "Weight sync trainer -> rollout.")
    env: EnvConfig = _field(EnvConfig, "Task and reward.")
    async_rollout: AsyncConfig = _field(AsyncConfig, "Generation ahead of training.")
    memory: MemoryConfig = _field(MemoryConfig, "What each layout holds while the other runs.")
    guards: GuardsConfig = _field(GuardsConfig, "Checks that stop a run going wrong.")
    eval: EvalConfig = _field(EvalConfig, "Held-out evaluation.")
    log: LogConfig = _field(LogConfig, "The step line, sample tables and trackers.")
    export: ExportConfig = _field(ExportConfig, "What the run leaves behind.")
    placement: str = _field(
        "colocated",
        "'colocated': every rank trains (FSDP2) and rolls out (vLLM), in turns; "
        "'separate': ranks 0..M-1 only train, the last rollout.num_ranks only roll out; "
        "'grouped': placement_map.", registry="hybrid_engine.policy.placements:PLACEMENTS",
    )
    placement_map: str = _field(
        "", "placement=grouped: each group's roles and ranks, e.g. "
        "'actor,reference,rollout:0-3;critic:4-5' (the actor's group takes turns as "
        "colocated; the critic trains on its own).")
    output_dir: str = _field("runs/default", "Directory for logs, metrics and checkpoints.")
    seed: int = _field(0, "Global seed (model init, prompt order).", ge=0)
    checkpoint_every: int = _field(
        0, "Save a checkpoint every this many steps; 0 = no periodic checkpoints.", ge=0
    )
    keep_checkpoints: int = _field(2, "Keep the newest this many checkpoints.", ge=1)
    max_wall_s: float | None = _field(
        None, "Stop after this many seconds of wall time; None = no limit.", gt=0
    )
    target_reward_ema: float | None = _field(
        None,
        "Stop once the moving average of the mean training reward reaches this; "
        "None = run all num_steps.",
    )
    collective_timeout_s: float = _field(
        600.0, "Seconds any collective may wait for a peer before it raises; also the "
        "watchdog's limit for a silent peer (the job then stops with one line).", gt=0)

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not self.output_dir.strip():
            raise ValueError("output_dir must be non-empty")
        if self.placement == "separate" and self.memory.offload_optimizer:
            raise ValueError("memory.offload_optimizer needs placement=colocated: under "
                             "placement=separate the trainer ranks hold no vLLM engine")
        if self.rollout.tensor_parallel_size == "auto" and self.placement != "colocated":
            raise ValueError(f"rollout.tensor_parallel_size=auto needs placement=colocated (this "
                             f"run is placement={self.placement}): give the size")
        a, k = self.algorithm, self.async_rollout.max_staleness
        if k and a.behaviour_logp != "rollout" and a.rollout_correction == "none":
            raise ValueError(
                f"async_rollout.max_staleness={k} trains on batches sampled "
                "with older weights: set algorithm.behaviour_logp=rollout (the ratio to the "
                "sampling policy) or algorithm.rollout_correction (importance weights or "
                "masks); without either the loss would treat stale samples as on-policy")
        self._check_partial()
        self._check_grouped()
        self._check_inflight()
        self._check_lora()
        e = self.eval.max_tokens
        if e is not None and e >= self.rollout.max_model_len:
            raise ValueError(f"eval.max_tokens={e} must be < rollout.max_model_len="
                             f"{self.rollout.max_model_len} (the prompt needs room too)")

    def _check_partial(self) -> None:
        r = self.async_rollout
        if r.step_token_budget and not r.partial:
            raise ValueError("async_rollout.step_token_budget bounds partial rollouts: set "
                             "async_rollout.partial=true or leave the budget at 0")
        if not r.partial:
            return
        if r.schedule != "auto":
            raise ValueError(f"async_rollout.schedule={r.schedule} schedules batches "
                             "generated ahead; with async_rollout.partial=true nothing "
                             "runs ahead (leave it at auto)")
        if self.placement != "colocated":
            raise ValueError(f"async_rollout.partial=true needs placement=colocated (this run "
                             f"is placement={self.placement}; under separate placement, "
                             "async_rollout.max_staleness overlaps generation with training "
                             "instead)")
        if not r.max_staleness:
            raise ValueError("async_rollout.partial=true needs async_rollout.max_staleness >= 1: "
                             "a parked sequence's prefix is at least one step old when it trains")
        if not r.step_token_budget:
            raise ValueError("async_rollout.partial=true needs async_rollout.step_token_budget > 0 "
                             "(with no budget a step waits for every group it started and "
                             "nothing is ever parked)")

    def _check_grouped(self) -> None:
        if self.placement != "grouped":
            if self.placement_map:
                raise ValueError(f"placement_map={self.placement_map!r} places roles for "
                                 f"placement=grouped; this run is placement={self.placement}")
            return
        if not self.placement_map.strip():
            raise ValueError("placement=grouped needs placement_map, the roles and ranks of "
                             "each group, e.g. 'actor,reference,rollout:0-3;critic:4-5'")
        if self.async_rollout.max_staleness:
            raise ValueError("placement=grouped runs the groups' phases in step: set "
                             "async_rollout.max_staleness=0 (generation ahead needs "
                             "placement=colocated or separate)")

    def _check_inflight(self) -> None:
        r = self.async_rollout
        if not r.inflight_updates:
            return
        if self.placement != "separate" or not r.max_staleness:
            raise ValueError("async_rollout.inflight_updates=true needs placement=separate and "
                             "async_rollout.max_staleness >= 1 (weights installed while the "
                             "rollout ranks sample ahead of the trainer)")
        if self.ahead_burst():
            raise ValueError("async_rollout.inflight_updates=true needs async_rollout.schedule="
                             "stream or auto (a burst does not overlap the trainer)")
        if self.sync.method != "reshard" or self.sync.verify:
            raise ValueError("async_rollout.inflight_updates=true needs sync.method=reshard with "
                             "sync.verify=false: only that sync runs behind the next step")

    def _check_lora(self) -> None:
        if self.sync.lora != "adapter":
            return
        if not self.model.lora_rank:
            raise ValueError("sync.lora=adapter syncs LoRA adapters: set model.lora_rank > 0 "
                             "(or leave sync.lora at merge)")
        if self.sync.method != "reshard" or self.placement != "colocated":
            raise ValueError(f"sync.lora=adapter needs sync.method=reshard and placement="
                             f"colocated (got {self.sync.method}, {self.placement}); "
                             "sync.lora=merge works with every method and placement")

    def ahead_burst(self) -> bool:
        """Whether generation ahead samples k + 1 steps' batches per pass
        (async_rollout.schedule; auto: colocated bursts, separate streams)."""
        schedule = self.async_rollout.schedule
        return schedule == "burst" or (schedule == "auto" and self.placement == "colocated")

    def validate_for_run(self) -> None:
        """Checks that only hold right before launch (not for recipes or tests).

        Raises:
            ValueError: model.path is empty, or env.dataset_path / env.eval_dataset_path
                names no dataset file.
        """
        if not self.model.path:
            raise ValueError("model.path is required to run: pass --model.path=<HF id or dir>")
        for key in ("dataset_path", "eval_dataset_path"):
            path = getattr(self.env, key)
            if path and not (os.path.exists(path) or glob.glob(path)):
                raise ValueError(f"env.{key}={path!r} does not exist (a file, a glob or a "
                                 "folder)")


# Keys that moved when the sections were grouped by concern: they still work,
# with a one-line deprecation notice.
RENAMED_KEYS = {
    "rollout.max_staleness": "async_rollout.max_staleness",
    "rollout.ahead_schedule": "async_rollout.schedule",
    "rollout.partial_rollout": "async_rollout.partial",
    "rollout.step_token_budget": "async_rollout.step_token_budget",
    "rollout.stale_partial": "async_rollout.stale_partial",
    "rollout.inflight_updates": "async_rollout.inflight_updates",
    "rollout.release_memory": "memory.release",
    "rollout.memory_budget": "memory.budget",
    "rollout.kv_cache_gib": "memory.kv_cache_gib",
    "rollout.gpu_memory_fraction": "memory.gpu_memory_fraction",
    "rollout.emulate_gpu_sleep": "memory.emulate_gpu_sleep",
    "train.offload_optimizer": "memory.offload_optimizer",
    "train.max_nonfinite_in_a_row": "guards.max_nonfinite_in_a_row",
    "mismatch_alarm": "guards.mismatch_alarm",
    "mismatch_abort": "guards.mismatch_abort",
    "mismatch_split_sequences": "guards.mismatch_split_sequences",
    "eval_every": "eval.every",
    "env.num_eval_prompts": "eval.num_prompts",
    "log_every": "log.every",
}
register_renamed(RunConfig, RENAMED_KEYS)


def _validate_fields(obj: Any) -> None:
    """Generic type and bound checks of RunConfig's own fields."""
    validate_fields(obj, "")


PREFIXES.update(section_prefixes(RunConfig))


def from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Inverse of to_dict; also accepts dotted keys. Missing keys keep their defaults.

    Raises:
        ValueError: unknown key (with suggestions) or invalid value.
    """
    return _from_dict(RunConfig, d)
