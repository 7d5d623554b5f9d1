"""Run configuration: one frozen dataclass per role, nested in `RunConfig`.

Job: declare every knob of a run (type, default, doc, bounds) and the rules
that tie knobs together, grouped by role. This is the file users read. The
generic machinery (value parsing, bound checks, dotted overrides, YAML and
CLI) lives in `hybrid_engine.config.overrides`; its public functions are re-exported
here (`from hybrid_engine.config import apply_overrides`).

Invariant: a `RunConfig` that exists is valid. Every section validates its
fields in `__post_init__` (types from the annotations, bounds from the field
metadata, then cross-field rules), raising `ValueError` that names the dotted
key; configs are frozen, so the only way to change one is
`dataclasses.replace` (or `apply_overrides`), which validates again.
`validate_for_run()` adds the checks that only make sense right before
launch (model.path set, dataset file present).

Adding a field is one line: `name: type = _field(default, "doc", ge=0)`.
Its doc and default then show up in `describe()`, its annotation drives
parsing of override strings, and its bounds are checked generically.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hybrid_engine.config.overrides import (
    apply_overrides,
    check_registered,
    describe,
    flatten,
    help_text,
    load_yaml,
    parse_cli_overrides,
    section_prefixes,
    to_dict,
    validate_fields,
)
from hybrid_engine.config.overrides import doc_field as _field
from hybrid_engine.config.overrides import from_dict as _from_dict

__all__ = [
    "AlgorithmConfig",
    "EnvConfig",
    "ModelConfig",
    "RolloutConfig",
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

Dtype = Literal["bfloat16", "float32"]
# The reductions are arithmetic of their own (aggregation.py), not plug-ins.
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
# Fields naming a registry entry are open str, checked at build time
# (`check_registered`, from preflight and the Algorithm/make_env builders).
_ADVANTAGES = "hybrid_engine.algorithms.advantages:ADVANTAGES"
_POLICY_LOSSES = "hybrid_engine.algorithms.losses:POLICY_LOSSES"
_KL_ESTIMATORS = "hybrid_engine.algorithms.kl:KL_ESTIMATORS"
_ENVS = "hybrid_engine.envs:ENVS"


# --------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The policy model and the dtypes of its two layouts."""

    path: str = _field(
        "",
        "HF model id or local directory of the policy. Required to run "
        "(checked by RunConfig.validate_for_run); empty in recipes that leave it to the user.",
    )
    master_dtype: Dtype = _field(
        "float32", "dtype of the master weights (FSDP2 shards, or replicated) and optimizer state."
    )
    compute_dtype: Dtype = _field(
        "bfloat16",
        "dtype of training forward/backward (FSDP2 MixedPrecisionPolicy param_dtype; "
        "train.sharding=replicate: torch.autocast); gradients are reduced in master_dtype.",
    )
    rollout_dtype: Dtype = _field(
        "bfloat16", "dtype of the vLLM weights; weight sync casts master -> this."
    )
    trust_remote_code: bool = _field(
        False, "Allow custom modeling code from the model repo (HF and vLLM)."
    )

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """vLLM sampling: how many completions per prompt and how they are drawn."""

    tensor_parallel_size: int = _field(
        1, "vLLM tensor-parallel size T; must divide the world size (N/T replicas).", ge=1
    )
    num_samples_per_prompt: int = _field(
        8, "K: completions sampled per prompt (the group of group-based advantages).", ge=1
    )
    temperature: float = _field(1.0, "Sampling temperature.", gt=0)
    top_p: float = _field(1.0, "Nucleus sampling mass; 1.0 disables it.", gt=0, le=1)
    top_k: int = _field(-1, "Top-k sampling; -1 disables it.")
    max_tokens: int = _field(256, "Maximum new tokens per completion.", ge=1)
    max_model_len: int = _field(
        1024, "Maximum prompt + completion length in tokens (vLLM max_model_len).", ge=2
    )
    kv_cache_gib: float = _field(
        4.0, "CPU: KV cache size per rank in GiB (vLLM's kv_cache_memory_bytes, exact to the byte). "
        "GPU: unused (see gpu_memory_fraction).", gt=0
    )
    gpu_memory_fraction: float = _field(
        0.9,
        "GPU: share of the device memory still free when the engine is built (after the "
        "trainer's parameters, less the optimizer state it will allocate) that vLLM may use "
        "for its weights, activations and KV cache (vLLM's gpu_memory_utilization is derived "
        "from it). CPU: unused.",
        gt=0, le=1,
    )
    seed: int = _field(0, "Base seed of vLLM sampling (per-request seeds derive from it).", ge=0)
    prompt_too_long: Literal["reject", "truncate"] = _field(
        "reject",
        "What to do with a prompt longer than max_model_len - max_tokens: "
        "'reject' raises, 'truncate' keeps its last tokens.",
    )
    stop: tuple[str, ...] = _field(
        (), "Strings that end a completion (not included in it); comma-separated on the CLI."
    )
    stop_token_ids: tuple[int, ...] = _field(
        (), "Token ids that end a completion, besides the tokenizer's EOS."
    )
    enforce_eager: bool = _field(False, "Disable CUDA graphs / compilation in vLLM.")
    num_ranks: int = _field(
        0,
        "placement=separate: how many ranks only roll out (the last ones; the others only "
        "train); 0 = half the world (rounded down to a multiple of tensor_parallel_size).",
        ge=0,
    )
    release_memory: Literal["auto", "true", "false"] = _field(
        "auto",
        "Release the engine's memory while the trainer runs (GPU: sleep; CPU: the KV cache): "
        "'true' in every training phase; 'auto' only when the trainer's measured peak would "
        "not fit beside the resident engine (see memory_budget; the first phase, unmeasured, "
        "releases); 'false' never (both stay resident).",
    )
    memory_budget: float = _field(
        0.9,
        "The fraction of the machine's RAM (GPU: of the device's memory) the job may use. "
        "release_memory=auto on CPU: the engine stays resident when the trainer's peak fits "
        "in it beside what is used now (GPU: the device's free memory decides). "
        "train.sharding=auto: the per-rank budget its layout must fit in.",
        gt=0, le=1,
    )
    max_staleness: int = _field(
        0,
        "k: generation runs k steps ahead of training; the batch a step trains on was "
        "sampled with weights up to k RL steps old (its staleness, reported per "
        "step). 0 = synchronous (generate, then train on it). With placement=separate and "
        "k >= 1 the rollout ranks generate the next batch while the trainer ranks train "
        "(step ~ max(generate, train)); colocated, the phases take turns, so by default one "
        "generation pass samples the next k + 1 steps' batches (ahead_schedule). k > 0 needs "
        "algorithm.behaviour_logp=rollout or algorithm.tis_cap (the importance correction).",
        ge=0,
    )
    ahead_schedule: Literal["auto", "stream", "burst"] = _field(
        "auto",
        "max_staleness = k > 0: how generation runs ahead. 'stream': every step starts the "
        "batch of the step k ahead (staleness k from step k on); the schedule that overlaps "
        "under placement=separate. 'burst': when no batch is queued, one generation pass "
        "samples the batches of the next k + 1 steps (none past train.num_steps) with the "
        "current weights (staleness "
        "0, 1, .., k): one generation pass (one decode loop) for k + 1 steps, the weights "
        "still synced after every step; the colocated use of the bound (the device takes "
        "turns, so nothing can overlap; under placement=separate a burst gives up the "
        "overlap). 'auto': burst colocated, stream separate. Not with partial_rollout "
        "(nothing runs ahead).",
    )
    partial_rollout: bool = _field(
        False,
        "placement=colocated: a step's generation stops once the step has prompts_per_step "
        "finished groups or has sampled step_token_budget tokens (with >= 1 group finished); "
        "the unfinished sequences are parked with their tokens, log-probs and per-token "
        "versions and continue next step, after the sync, with the new weights. Each step "
        "starts up to prompts_per_step new groups (the pool holds at most twice that). Needs "
        "max_staleness >= 1 (a parked prefix is at least one step old when it trains) and "
        "step_token_budget > 0; single-turn environments only.",
    )
    step_token_budget: int = _field(
        0,
        "partial_rollout: tokens a step's generation may sample (over all replicas) before it "
        "stops and parks what is unfinished; 0 = no budget (only with partial_rollout=false).",
        ge=0,
    )
    stale_partial: Literal["regenerate", "drop"] = _field(
        "regenerate",
        "partial_rollout: a parked group whose oldest token would train more than "
        "max_staleness steps after it was sampled is restarted from its prompt with the "
        "current weights ('regenerate') or discarded ('drop').",
    )
    inflight_updates: bool = _field(
        False,
        "placement=separate with max_staleness >= 1: a sync's weights are installed between "
        "two engine steps of the batch being sampled (its running requests are preempted and "
        "their KV recomputed with the new weights) instead of after the batch; each token "
        "records the version that sampled it (info['token_versions']; a trajectory's "
        "policy_version is its first token's). Needs sync.method=reshard without verify (the "
        "sync runs behind) and a single-turn environment. Runs then depend on timing (where "
        "an install lands): a resume does not repeat the straight run's samples.",
    )
    emulate_gpu_sleep: bool = _field(
        False,
        "CPU only (tests): make release_memory lose the weights as GPU sleep level 2 does -- "
        "every torch-visible vLLM parameter (norms, embeddings, biases) is overwritten with "
        "NaN and the engine refuses to sample until a sync rewrites them -- so ordering bugs "
        "that would sample discarded weights on a GPU fail on CPU too.",
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        p = _prefix(self)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"{p}top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_model_len <= self.max_tokens:
            raise ValueError(
                f"{p}max_model_len must be > {p}max_tokens={self.max_tokens} "
                f"(room for at least one prompt token), got {self.max_model_len}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Optimizer, schedule and batch shape of the FSDP2 trainer."""

    lr: float = _field(1e-6, "Peak AdamW learning rate.", gt=0)
    weight_decay: float = _field(0.0, "AdamW decoupled weight decay.", ge=0)
    betas: tuple[float, float] = _field((0.9, 0.999), "AdamW (beta1, beta2), each in [0, 1).")
    warmup_steps: int = _field(0, "Linear warmup steps from 0 to lr.", ge=0)
    lr_schedule: Literal["constant", "cosine"] = _field(
        "constant", "Learning-rate shape after warmup (cosine decays to 0 at num_steps)."
    )
    grad_clip: float = _field(1.0, "Max global gradient norm.", gt=0)
    micro_batch_size: int = _field(
        4,
        "Sequences per forward/backward on one rank (gradient accumulation splits). With "
        "any sharding but 'full' each micro-batch adds a pass over the whole gradient "
        "(accumulated in master_dtype): prefer few large micro-batches where memory allows "
        "(see max_tokens_per_micro_batch).",
        ge=1,
    )
    max_tokens_per_micro_batch: int | None = _field(
        None,
        "If set, micro-batches are cut by padded tokens instead of micro_batch_size "
        "(length-sorted, so padding stays bounded).",
        ge=1,
    )
    logits_chunk_tokens: int = _field(
        1024,
        "Token positions per chunk of the vocab projection in logprob computation "
        "(full-vocab fp32 logits exist for one chunk at a time).",
        ge=1,
    )
    activation_checkpointing: bool = _field(
        False, "Recompute decoder-layer activations in backward to save memory."
    )
    sharding: Literal["full", "grad_op", "replicate", "hybrid", "auto"] = _field(
        "full",
        "Training layout over the data-parallel ranks: 'full' reshards each layer's "
        "parameters after its forward and reduce-scatters gradients after every "
        "micro-batch (least memory: 3 collectives per layer per micro-batch); 'grad_op' "
        "keeps them gathered from forward to backward and across a step's micro-batches, "
        "accumulating whole gradients locally and reduce-scattering once per optimizer "
        "step (holds the whole model and its gradient during the step); 'replicate' holds "
        "parameters, gradients and AdamW state whole on every rank and all-reduces the "
        "gradients once per step, in buckets while backward runs (DDP, no FSDP: plain "
        "parameters; the sync then moves nothing between ranks); 'hybrid' shards over groups of "
        "shard_group_size ranks and replicates across groups (HSDP), gathering and reducing "
        "once per step like grad_op; 'auto' picks the first of replicate, hybrid (when "
        "shard_group_size is set), grad_op, full whose estimated memory fits the budget "
        "(rollout.memory_budget) beside the rollout's resident share, and logs why.",
    )
    cpu_shm_allreduce: bool = _field(
        True,
        "sharding='replicate' on CPU with every trainer rank on one host: average the "
        "gradients through vLLM-CPU's shared-memory all-reduce (the one its TP groups use) "
        "instead of gloo's TCP loopback (725 MB fp32 on 2 ranks: 0.16 s against 0.52 s, "
        "without gloo's system time). Ignored elsewhere; false: always the process group.",
    )
    shard_group_size: int = _field(
        0,
        "sharding='hybrid' (and 'auto'): ranks per shard group; must divide the trainer "
        "ranks and lie strictly between 1 and their number. 0 = unset.",
        ge=0,
    )
    replica_check_every: int = _field(
        10,
        "sharding='replicate' or 'hybrid': every this many optimizer steps, compare an "
        "exact checksum of every rank's parameters with its replicas' and stop the run with "
        "one line if any differ (replicas must stay bitwise identical). 1 = after every "
        "step (debugging); 0 = never.",
        ge=0,
    )
    offload_optimizer: bool = _field(
        False,
        "Colocated: move the policy's AdamW state to host memory from the weight sync "
        "until the next optimizer step, so vLLM wakes into its memory (GPU: 8 bytes per "
        "parameter-shard element; CPU: the state only moves within RAM, nothing is saved).",
    )
    num_steps: int = _field(100, "RL steps (generate -> train -> sync) in the run.", ge=1)
    prompts_per_step: int = _field(
        32, "Prompts per RL step over all ranks; sequences = this * K.", ge=1
    )
    ppo_epochs: int = _field(
        1,
        "Passes over one RL step's trajectories; each pass takes mini_batches_per_rollout "
        "optimizer steps. With more than one update per rollout the PPO ratio leaves 1 "
        "and the clip knobs act.",
        ge=1,
    )
    mini_batches_per_rollout: int = _field(
        1,
        "Optimizer steps per pass: the step's trajectories are shuffled (seeded, the same "
        "on every rank) and cut into this many mini-batches (at most one per trajectory).",
        ge=1,
    )
    max_nonfinite_in_a_row: int = _field(
        3,
        "A step whose loss or gradient norm is NaN/inf is skipped (no update) and counted; "
        "the run aborts after this many such steps in a row (0 = never abort).",
        ge=0,
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{_prefix(self)}betas must each be in [0, 1), got {self.betas}")
        if self.sharding == "hybrid" and self.shard_group_size < 2:
            raise ValueError(f"{_prefix(self)}sharding=hybrid needs {_prefix(self)}"
                             f"shard_group_size >= 2 (ranks per shard group), got "
                             f"{self.shard_group_size}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmConfig:
    """Advantage estimator and policy loss."""

    advantage: str = _field("grpo", "Advantage estimator (registry name; register_advantage "
                            "adds one).", registry=_ADVANTAGES)
    loss_agg: LossAgg = _field(
        "token_mean",
        "How per-token losses reduce to a scalar: mean over all tokens, per-sequence "
        "sum or mean then mean over sequences, or sum / a constant (Dr.GRPO).",
    )
    clip_low: float = _field(0.2, "PPO ratio clip below: ratio >= 1 - clip_low.", ge=0)
    clip_high: float = _field(
        0.2, "PPO ratio clip above: ratio <= 1 + clip_high (DAPO clip-higher > clip_low).", ge=0
    )
    dual_clip: float | None = _field(
        None, "Dual-clip bound c on negative advantages; None disables it.", gt=1
    )
    kl_coef: float = _field(0.0, "Weight of the KL penalty to the reference policy; 0 = off.", ge=0)
    kl_estimator: str = _field(
        "k3", "KL estimator of logp - ref_logp (registry name; Schulman's k1/k2/k3).",
        registry=_KL_ESTIMATORS,
    )
    kl_in_reward: bool = _field(
        False, "Subtract kl_coef * KL from the reward instead of adding it to the loss. With "
        "a group estimator (grpo, rloo, ...) the KL enters before the group normalisation: a "
        "group whose task rewards are equal then gets advantages from its KL differences "
        "(as in verl), and counts as flat only on its task rewards."
    )
    entropy_coef: float = _field(0.0, "Weight of the entropy bonus in the loss; 0 = off.")
    tis_cap: float | None = _field(
        None,
        "Truncated importance sampling cap on pi_train / pi_rollout per token "
        "(corrects vLLM vs trainer logprob mismatch); None disables it.",
        gt=0,
    )
    gamma: float = _field(1.0, "Discount factor (GAE only; REINFORCE++ here is the "
                          "outcome-reward form, undiscounted).", ge=0, le=1)
    lam: float = _field(1.0, "GAE lambda.", ge=0, le=1)
    policy_loss: str = _field(
        "ppo", "Policy loss (registry name): token-level PPO clip, or GSPO's sequence-level "
        "ratio.", registry=_POLICY_LOSSES
    )
    loss_agg_constant: float | None = _field(
        None,
        "Normaliser of loss_agg='constant' (Dr.GRPO); None uses rollout.max_tokens.",
        gt=0,
    )
    value_coef: float = _field(0.5, "Weight of the critic's value loss (PPO with GAE).", ge=0)
    value_clip: float | None = _field(
        0.2, "Clip range of the value loss around the old values; None disables it.", gt=0
    )
    dynamic_sampling: bool = _field(
        False,
        "DAPO: drop groups whose rewards are all equal (counted as degenerate) and draw "
        "more prompt groups until train.prompts_per_step groups carry signal "
        "(at most max_sampling_rounds generate rounds per step).",
    )
    max_sampling_rounds: int = _field(
        4,
        "dynamic_sampling: most generate rounds per step; then the step trains on the "
        "groups with signal it has.",
        ge=1,
    )
    behaviour_logp: Literal["trainer", "rollout"] = _field(
        "trainer",
        "Old (behaviour) log-probs of the PPO ratio: 'trainer' recomputes them with the "
        "rollout's weights once per step (only when more than one update follows); "
        "'rollout' takes the engine's sampled-token log-probs (no extra forward; the "
        "ratio pi/pi_rollout is then the importance ratio, truncated by the clip).",
    )
    overlong_buffer: int = _field(
        0, "DAPO overlong shaping: penalty ramp length in tokens before max_tokens; 0 = off.", ge=0
    )
    overlong_penalty_factor: float = _field(
        1.0, "DAPO overlong shaping: penalty at max_tokens (reward -= factor at the limit).", ge=0
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if self.behaviour_logp == "rollout" and self.tis_cap is not None:
            raise ValueError(
                f"{_prefix(self)}tis_cap would never act with {_prefix(self)}behaviour_logp="
                "'rollout' (its weight exp(old - rollout) is then 1): the ratio to the "
                "rollout's log-probs is already the importance ratio; unset one of them")


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    """Weight sync from the training layout into the inference layout."""

    method: Literal["reshard", "naive", "naive_bucketed"] = _field(
        "reshard",
        "'reshard' moves only the blocks each rank needs; 'naive' all-gathers every full "
        "tensor in the master dtype, one at a time, then vLLM's reload (the reference "
        "path, the oracle); 'naive_bucketed' casts each local shard to the rollout dtype, "
        "all-gathers buckets of bucket_mb into persistent buffers and loads each bucket "
        "through vLLM's reload (for layouts the planner does not cover; colocated only).",
    )
    bucket_mb: float = _field(
        256.0, "Max MiB per exchange bucket: per all_to_all ('reshard') or per gathered "
        "bucket of full tensors ('naive_bucketed'); bounds sync peak memory.", gt=0
    )
    verify: bool = _field(
        False, "After each sync, check bit-equality with the naive path (slow; for tests)."
    )

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvConfig:
    """The task: where prompts come from and how completions are rewarded."""

    name: str = _field("arithmetic", "Environment (registry name; register_env adds one).",
                       registry=_ENVS)
    dataset_path: str = _field("", "Dataset file for the environment; '' = generated prompts.")
    seed: int = _field(0, "Seed of prompt generation / dataset shuffling.", ge=0)
    reward_model_path: str = _field(
        "",
        "HF sequence-classification model folder whose score (logit 0) replaces the "
        "environment's reward function; '' = the environment's own reward.",
    )
    reward_fn: str = _field(
        "",
        "Custom reward replacing the environment's: 'path/to/file.py:function' or "
        "'package.module:function', called as function(prompt, completion, answer) -> "
        "float or {name: float}; '' = the environment's own reward.",
    )
    reward_timeout_s: float = _field(
        60.0,
        "reward_fn: seconds one call may take; a call that has not returned by then stops "
        "the run with an error naming the sample (0 = no limit).",
        ge=0,
    )
    num_eval_prompts: int = _field(
        64, "Held-out prompts per evaluation (greedy, one sample each).", ge=1
    )
    min_digits: int = _field(1, "arithmetic: fewest digits of a generated operand.", ge=1)
    max_digits: int = _field(
        3, "arithmetic: most digits of a generated operand (at most 4000: Python converts "
        "ints of up to 4300 digits to text).", ge=1, le=4000)
    operators: tuple[str, ...] = _field(
        ("+", "-"), "arithmetic: operators of generated problems (subset of + and -)."
    )
    allow_negative: bool = _field(
        True, "arithmetic: False orders the operands of '-' so results are >= 0."
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not self.name.strip():
            raise ValueError(f"{_prefix(self)}name must be non-empty")
        if self.min_digits > self.max_digits:
            raise ValueError(f"{_prefix(self)}min_digits={self.min_digits} must be <= "
                             f"{_prefix(self)}max_digits={self.max_digits}")
        if self.reward_fn and self.reward_model_path:
            raise ValueError(f"set at most one of {_prefix(self)}reward_fn and "
                             f"{_prefix(self)}reward_model_path (each replaces the reward)")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """A whole run: one section per role plus the controller's own knobs."""

    model: ModelConfig = _field(ModelConfig, "Policy model and dtypes.")
    rollout: RolloutConfig = _field(RolloutConfig, "vLLM sampling.")
    train: TrainConfig = _field(TrainConfig, "FSDP2 trainer and optimizer.")
    algorithm: AlgorithmConfig = _field(AlgorithmConfig, "Advantages and loss.")
    sync: SyncConfig = _field(SyncConfig, "Weight sync trainer -> rollout.")
    env: EnvConfig = _field(EnvConfig, "Task and reward.")
    placement: Literal["colocated", "separate"] = _field(
        "colocated",
        "'colocated': every rank trains (FSDP2) and rolls out (vLLM), taking turns; "
        "'separate': ranks 0..M-1 only train, the last rollout.num_ranks only roll out.",
    )
    output_dir: str = _field("runs/default", "Directory for logs, metrics and checkpoints.")
    seed: int = _field(0, "Global seed (model init, prompt order).", ge=0)
    log_every: int = _field(1, "Log metrics every this many steps.", ge=1)
    eval_every: int = _field(0, "Evaluate every this many steps; 0 = never.", ge=0)
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
    mismatch_alarm: float | None = _field(
        0.5,
        "Warn when a step's mean |logp_trainer - logp_rollout| over the sampled tokens "
        "exceeds this (healthy: ~1e-6 in fp32, ~1e-2 in bf16; a broken weight sync jumps "
        "far above); None = off.",
        gt=0,
    )
    mismatch_abort: bool = _field(
        False, "Stop the run with an error (after the warning) when mismatch_alarm trips."
    )
    mismatch_split_sequences: int = _field(
        32,
        "Colocated with stale samples (rollout.max_staleness >= 1, rollout.temperature 1, "
        "no rollout.top_p / top_k): "
        "the stale sequences per sampling round (evenly spaced over them; all when fewer) "
        "whose log-probs the engine re-scores under the current weights (a fresh one, "
        "sampled with no sync since, joins with its sampling log-probs), which splits the "
        "mismatch into drift and numerics (mismatch_drift_* / mismatch_numerics_*, over "
        "mismatch_split_tokens tokens; the alarm then watches the numerics, or the total "
        "when the sample has no trained token). One prefill of those sequences per round "
        "(one round per step unless dynamic sampling refills); 0 = no split (the alarm "
        "watches the total, drift included).",
        ge=0,
    )
    collective_timeout_s: float = _field(
        600.0,
        "Timeout of every collective on every process group (ours, FSDP2's, vLLM's): a "
        "rank waiting longer for a dead or stuck peer raises instead of hanging. Also the "
        "watchdog's limit: a peer silent this long (stopped, wedged, spinning in vLLM's "
        "all-reduce) aborts the job with one error line.",
        gt=0,
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not self.output_dir.strip():
            raise ValueError("output_dir must be non-empty")
        if self.placement == "separate" and self.train.offload_optimizer:
            raise ValueError("train.offload_optimizer needs placement=colocated: under "
                             "placement=separate the trainer ranks hold no vLLM engine")
        a = self.algorithm
        if self.rollout.max_staleness and a.behaviour_logp != "rollout" and a.tis_cap is None:
            raise ValueError(
                f"rollout.max_staleness={self.rollout.max_staleness} trains on batches sampled "
                "with older weights: set algorithm.behaviour_logp=rollout (the ratio to the "
                "sampling policy) or algorithm.tis_cap (truncated importance weights); without "
                "either the loss would treat stale samples as on-policy")

        r = self.rollout
        if r.step_token_budget and not r.partial_rollout:
            raise ValueError("rollout.step_token_budget bounds partial rollouts: set "
                             "rollout.partial_rollout=true or leave the budget at 0")
        if r.partial_rollout:
            if r.ahead_schedule != "auto":
                raise ValueError(f"rollout.ahead_schedule={r.ahead_schedule} schedules batches "
                                 "generated ahead; with rollout.partial_rollout=true nothing "
                                 "runs ahead (leave it at auto)")
            if self.placement != "colocated":
                raise ValueError("rollout.partial_rollout=true needs placement=colocated (under "
                                 "placement=separate, rollout.max_staleness overlaps generation "
                                 "with training instead)")
            if not r.max_staleness:
                raise ValueError("rollout.partial_rollout=true needs rollout.max_staleness >= 1: a "
                                 "parked sequence's prefix is at least one step old when it trains")
            if not r.step_token_budget:
                raise ValueError("rollout.partial_rollout=true needs rollout.step_token_budget > 0 "
                                 "(with no budget a step waits for every group it started and "
                                 "nothing is ever parked)")

        if r.inflight_updates:
            if self.placement != "separate" or not r.max_staleness:
                raise ValueError("rollout.inflight_updates=true needs placement=separate and "
                                 "rollout.max_staleness >= 1 (weights installed while the rollout "
                                 "ranks sample ahead of the trainer)")
            if self.ahead_burst():
                raise ValueError("rollout.inflight_updates=true needs rollout.ahead_schedule="
                                 "stream or auto (a burst does not overlap the trainer)")
            if self.sync.method != "reshard" or self.sync.verify:
                raise ValueError("rollout.inflight_updates=true needs sync.method=reshard with "
                                 "sync.verify=false: only that sync runs behind the next step")

    def ahead_burst(self) -> bool:
        """Whether generation ahead samples k + 1 steps' batches per pass
        (rollout.ahead_schedule; auto: colocated bursts, separate streams)."""
        schedule = self.rollout.ahead_schedule
        return schedule == "burst" or (schedule == "auto" and self.placement == "colocated")

    def validate_for_run(self) -> None:
        """Checks that only hold right before launch (not for recipes or tests).

        Raises:
            ValueError: model.path is empty, or env.dataset_path names no file.
        """
        if not self.model.path:
            raise ValueError("model.path is required to run: pass --model.path=<HF id or dir>")
        if self.env.dataset_path and not os.path.exists(self.env.dataset_path):
            raise ValueError(f"env.dataset_path={self.env.dataset_path!r} does not exist")


# --------------------------------------------------------------------------
# Glue: section prefixes in RunConfig for the generic machinery
# --------------------------------------------------------------------------


def _prefix(obj: Any) -> str:
    """Dotted prefix of obj's section in RunConfig ('train.'), for error messages."""
    return section_prefixes(RunConfig).get(type(obj), "")


def _validate_fields(obj: Any) -> None:
    """Generic type and bound checks of a section, with its dotted prefix."""
    validate_fields(obj, _prefix(obj))


def from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Inverse of to_dict; also accepts dotted keys. Missing keys keep their defaults.

    Raises:
        ValueError: unknown key (with suggestions) or invalid value.
    """
    return _from_dict(RunConfig, d)
