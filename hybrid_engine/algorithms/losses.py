"""Policy losses, and the trainer's per-micro-batch loss closure.

Job: turn per-token log-probabilities and advantages into one scalar loss per
micro-batch: a registered policy loss (PPO with clip-higher and dual-clip,
GSPO), optionally reweighted by truncated importance sampling, plus the KL
and entropy terms, reduced by the aggregation mode of `AlgorithmConfig`
(`aggregation.aggregate_loss` / `loss_normalizer`).

Invariant: with the normaliser of the whole batch, the micro-batch losses sum
to the full-batch loss exactly, in every aggregation mode; and nothing the
trainer can feed in (padding, all-masked rows, an all-masked micro-batch,
garbage log-probs at masked positions) gives NaN in the loss or its gradient.

Trainer contract (the trainer knows no formula, only this):

    loss_fn = policy_loss_fn(cfg.algorithm, constant=cfg.rollout.max_tokens)
    norm = loss_normalizer(mask_BT_of_the_whole_step, cfg.algorithm.loss_agg,
                           constant=cfg.rollout.max_tokens)
    for mb in micro_batches:                # rows are whole sequences
        loss, metrics = loss_fn(LossInputs(logp_BT=..., advantages_BT=...,
                                           mask_BT=..., old_logp_BT=...), norm)
        loss.backward(); per_mb.append(metrics)
    step_metrics = combine_metrics(per_mb)

- `norm` is a count (tokens, or non-empty sequences, times the constant), so
  the global one over data-parallel ranks is the all-reduce SUM of the
  per-rank ones. Each rank's loss is then its share of the global loss; FSDP2
  averages gradients over ranks, so scale the loss by the DP world size (or
  make the reduce-scatter sum) to get the gradient of the global loss.
- `normalizer=None` normalises by the micro-batch itself (one micro-batch per
  step, or tests).
- Metrics are detached 0-dim float tensors (no device sync); see
  `combine_metrics` for how per-micro-batch values reduce.

Shape legend: B sequences of a micro-batch, T token positions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from hybrid_engine.algorithms.aggregation import (
    aggregate_loss,
    check_loss_agg,
    masked_extreme,
    masked_mean,
)
from hybrid_engine.algorithms.correction import correction_weights
from hybrid_engine.algorithms.kl import MAX_LOG_RATIO, get_kl_estimator, kl_divergence
from hybrid_engine.names import Registry

if TYPE_CHECKING:
    from hybrid_engine.config import AlgorithmConfig

__all__ = [
    "ADDITIVE_METRICS",
    "POLICY_LOSSES",
    "LossFn",
    "LossInputs",
    "PolicyLoss",
    "StepLoss",
    "combine_metrics",
    "get_policy_loss",
    "gspo",
    "metric_weight",
    "policy_loss_fn",
    "ppo",
    "register_policy_loss",
    "step_loss",
]

Metrics = dict[str, Tensor]
# Metrics that are a micro-batch's share of a batch total: combine_metrics sums them.
ADDITIVE_METRICS = frozenset({"loss", "pg_loss", "num_tokens", "num_seqs",
                              "mismatch_tokens", "mismatch_split_tokens"})
# Token means over a subset of the loss tokens, weighted by that subset's count:
# the mismatch on the tokens whose rollout log-probs vLLM returned, its split on
# the sequences the drift scorer scored.
_SUBSET_WEIGHTS = (("mismatch_numerics_", "mismatch_split_tokens"),
                   ("mismatch_drift_", "mismatch_split_tokens"),
                   ("mismatch_abs_", "mismatch_tokens"), ("mismatch_ratio_out", "mismatch_tokens"))


def metric_weight(key: str) -> str:
    """The additive count a token-mean metric is weighted by when micro-batches,
    ranks or updates combine: num_tokens, or the count of the subset it is
    measured on (a part with none of those tokens then does not count)."""
    return next((w for prefix, w in _SUBSET_WEIGHTS if key.startswith(prefix)), "num_tokens")


# --------------------------------------------------------------------------
# Policy losses: (logp, old_logp, advantages, mask) -> (loss_BT, metrics)
# --------------------------------------------------------------------------


class PolicyLoss(Protocol):
    """Signature of a registered policy loss: [B, T] inputs -> ([B, T] loss, metrics)."""

    def __call__(
        self,
        logp_BT: Tensor,
        old_logp_BT: Tensor,
        advantages_BT: Tensor,
        mask_BT: Tensor,
        *,
        clip_low: float,
        clip_high: float,
        dual_clip: float | None = None,
    ) -> tuple[Tensor, Metrics]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: registers a policy loss (the PolicyLoss signature) under name."""

    def deco(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES.add(name, fn)
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as name.

    Raises:
        ValueError: unknown name; lists the registered ones and the closest.
    """
    return POLICY_LOSSES.get(name)


def _clipped_surrogate(
    ratio_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, Metrics]:
    """PPO's pessimistic clipped loss, with optional dual clip, and its metrics."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    unclipped = -adv_BT * ratio_BT
    clipped = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics: Metrics = {}
    with torch.no_grad():
        is_clipped = (clipped > unclipped) & mask_BT
        metrics["clip_frac"] = masked_mean(is_clipped, mask_BT)
        metrics["clip_frac_high"] = masked_mean(is_clipped & (ratio_BT > 1.0), mask_BT)
        metrics["clip_frac_low"] = masked_mean(is_clipped & (ratio_BT < 1.0), mask_BT)
    if dual_clip is not None:
        cap = -adv_BT * dual_clip  # dual_clip * |A| where A < 0
        negative = adv_BT < 0
        with torch.no_grad():
            metrics["dual_clip_frac"] = masked_mean(negative & (loss > cap), mask_BT)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return loss, metrics


@torch.no_grad()
def _ratio_metrics(ratio_BT: Tensor, log_ratio_BT: Tensor, mask_BT: Tensor) -> Metrics:
    return {
        "ratio_mean": masked_mean(ratio_BT, mask_BT),
        "ratio_max": masked_extreme(ratio_BT, mask_BT, largest=True),
        "ratio_min": masked_extreme(ratio_BT, mask_BT, largest=False),
        # k1 estimate of KL(pi_old || pi) on the old policy's samples.
        "ppo_kl": masked_mean(-log_ratio_BT, mask_BT),
    }


@register_policy_loss("ppo")
def ppo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017) per token, with DAPO clip-higher.

    rho = exp(logp - old_logp), L = max(-A * rho, -A * clip(rho, 1 - clip_low,
    1 + clip_high)); asymmetric bounds are DAPO's clip-higher (Yu et al. 2025).
    Dual clip (Ye et al. 2020): for A < 0, L = min(L, dual_clip * |A|), which
    bounds the loss when rho explodes on a negative advantage.
    Computed in float32; log ratios clamped to +-MAX_LOG_RATIO.

    Args:
        logp_BT: [B, T] log-probs of the sampled tokens under the current policy (grad).
        old_logp_BT: [B, T] log-probs under the policy that sampled (no grad).
        advantages_BT: [B, T] float.
        mask_BT: [B, T] bool, True on loss tokens.
        clip_low: ratio clipped below at 1 - clip_low.
        clip_high: ratio clipped above at 1 + clip_high.
        dual_clip: bound c > 1 on negative advantages; None disables it.

    Returns:
        (loss_BT, metrics): [B, T] float32 loss, 0 outside the mask; metrics
        clip_frac (tokens where the clipped branch is active), clip_frac_high,
        clip_frac_low, dual_clip_frac (with dual_clip), ratio_mean/max/min, ppo_kl.
    """
    mask = mask_BT.bool()
    # Mask before exp(): garbage log-probs at padding must not become inf * 0.
    log_ratio = torch.where(mask, logp_BT.float() - old_logp_BT.float(), 0.0)
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    adv = torch.where(mask, advantages_BT.float(), 0.0)
    loss, metrics = _clipped_surrogate(
        ratio, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    metrics.update(_ratio_metrics(ratio, log_ratio, mask))
    return torch.where(mask, loss, 0.0), metrics


@register_policy_loss("gspo")
def gspo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO, sequence-level ratio (Zheng et al. 2025), in its GSPO-token form.

    s_b = exp(mean_{t in loss} (logp_bt - old_logp_bt)) is clipped to
    [1 - clip_low, 1 + clip_high] per sequence. GSPO-token: token t's ratio is
    sg(s_b) * exp(logp_bt - sg(logp_bt)), equal to s_b in value with the
    gradient s_b * grad logp_bt. With per-sequence advantages and
    loss_agg="seq_mean_token_mean" this is exactly GSPO's gradient; the paper
    uses tiny clip ranges (clip_low 3e-4, clip_high 4e-4). Args and returns
    as `ppo` (ratio metrics are token-weighted means of s_b).
    """
    mask = mask_BT.bool()
    logp = torch.where(mask, logp_BT.float(), 0.0)
    tok_log_ratio = torch.where(mask, logp - old_logp_BT.float(), 0.0)
    num_tokens_B1 = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio_B1 = tok_log_ratio.sum(-1, keepdim=True) / num_tokens_B1
    seq_log_ratio_B1 = seq_log_ratio_B1.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).detach()
    log_ratio = logp - logp.detach() + seq_log_ratio_B1
    ratio = log_ratio.exp()
    adv = torch.where(mask, advantages_BT.float(), 0.0)
    loss, metrics = _clipped_surrogate(
        ratio, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    metrics.update(_ratio_metrics(ratio.detach(), log_ratio.detach(), mask))
    return torch.where(mask, loss, 0.0), metrics


# --------------------------------------------------------------------------
# Composition: the closure the trainer calls per micro-batch
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LossInputs:
    """One micro-batch's tensors for the policy loss; all [B, T], rows = whole sequences.

    Attributes:
        logp_BT: current policy's log-probs of the taken tokens (requires grad).
        advantages_BT: float, per-token advantages (0 outside the mask).
        mask_BT: bool, True on loss tokens (policy-generated response tokens).
        old_logp_BT: trainer's log-probs under the rollout's weights (no grad);
            None = rollout_logp_BT with behaviour_logp='rollout', else the
            on-policy single update: logp_BT.detach() (ratio 1 in value).
        ref_logp_BT: reference policy's log-probs; needed when the KL is in the loss.
        entropy_BT: per-token entropy of the policy (grad); needed when entropy_coef != 0
            (else NaN outside the metric's sample is allowed).
        rollout_logp_BT: the rollout engine's sampled-token log-probs; needed with a
            rollout correction.
        engine_logp_BT: the engine's log-probs of the same tokens under the weights
            the trainer holds now (metrics only: splits the mismatch), or None.
    """

    logp_BT: Tensor
    advantages_BT: Tensor
    mask_BT: Tensor
    old_logp_BT: Tensor | None = None
    ref_logp_BT: Tensor | None = None
    entropy_BT: Tensor | None = None
    rollout_logp_BT: Tensor | None = None
    engine_logp_BT: Tensor | None = None


LossFn = Callable[[LossInputs, Tensor | float | None], tuple[Tensor, Metrics]]


def _behaviour_logp(inputs: LossInputs, cfg: AlgorithmConfig) -> Tensor:
    """The old log-probs of the ratio: the trainer's under the rollout's weights when
    given; else the rollout engine's (behaviour_logp='rollout'); else the current
    ones detached (one update per rollout: the ratio is 1 in value)."""
    if inputs.old_logp_BT is not None:
        return inputs.old_logp_BT
    if getattr(cfg, "behaviour_logp", "trainer") == "rollout":
        if inputs.rollout_logp_BT is None:
            raise ValueError("behaviour_logp='rollout': LossInputs.rollout_logp_BT is required")
        return inputs.rollout_logp_BT
    return inputs.logp_BT.detach()


def _policy_term(
    pg_fn: PolicyLoss, inputs: LossInputs, mask: Tensor, cfg: AlgorithmConfig
) -> tuple[Tensor, Metrics]:
    """The policy-gradient loss per token, times the rollout correction's weight
    (`algorithms.correction`) when algorithm.rollout_correction is set."""
    old = _behaviour_logp(inputs, cfg)
    pg_BT, metrics = pg_fn(
        inputs.logp_BT,
        old,
        inputs.advantages_BT,
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
    )
    name = getattr(cfg, "rollout_correction", "none")
    if name != "none":
        if inputs.rollout_logp_BT is None:
            raise ValueError(f"rollout_correction={name!r}: LossInputs.rollout_logp_BT is "
                             "required")
        w_BT, correction_metrics = correction_weights(
            name, old, inputs.rollout_logp_BT, mask, cap=cfg.correction_cap,
            low=cfg.correction_low, high=cfg.correction_high)
        pg_BT = pg_BT * w_BT
        metrics.update(correction_metrics)
    return pg_BT, metrics


def _regularizers(
    inputs: LossInputs, mask: Tensor, cfg: AlgorithmConfig, metrics: Metrics
) -> Tensor | float:
    """kl_coef * KL (when not in the reward) - entropy_coef * entropy, per token."""
    extra: Tensor | float = 0.0
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        if inputs.ref_logp_BT is None:
            raise ValueError("kl_coef > 0 with kl_in_reward=False needs ref_logp_BT")
        kl = kl_divergence(inputs.logp_BT, inputs.ref_logp_BT, mask, cfg.kl_estimator)
        metrics["kl"] = masked_mean(kl.detach(), mask)
        extra = extra + cfg.kl_coef * kl
    if inputs.entropy_BT is not None:
        known = mask & ~inputs.entropy_BT.isnan()  # NaN: outside the metric's sample
        entropy = torch.where(known, inputs.entropy_BT.float(), 0.0)
        metrics["entropy"] = masked_mean(entropy.detach(), known)
        if cfg.entropy_coef != 0:
            extra = extra - cfg.entropy_coef * entropy
    elif cfg.entropy_coef != 0:
        raise ValueError("entropy_coef != 0 needs entropy_BT")
    return extra


@dataclass(frozen=True)
class StepLoss:
    """What the trainer takes from an algorithm for a step's updates: the
    per-micro-batch `LossFn`, the aggregation mode it was built with (the trainer
    computes the whole step's normaliser from it) and its constant, and whether
    the entropy enters the loss with grad (an entropy bonus)."""

    fn: LossFn
    agg: str = "token_mean"
    agg_constant: float | None = None
    entropy_grad: bool = False


def step_loss(cfg: AlgorithmConfig, max_tokens: int, fn: LossFn | None = None) -> StepLoss:
    """The config's StepLoss: `policy_loss_fn(cfg)`, or fn (a custom LossFn) with
    the config's aggregation; loss_agg='constant' defaults its constant to
    max_tokens (rollout.max_tokens)."""
    constant = (cfg.loss_agg_constant or float(max_tokens)) if cfg.loss_agg == "constant" else None
    return StepLoss(fn or policy_loss_fn(cfg, constant=constant), cfg.loss_agg, constant,
                    cfg.entropy_coef != 0)


def policy_loss_fn(
    cfg: AlgorithmConfig, *, constant: float | None = None, policy_loss: str | None = None
) -> LossFn:
    """Builds the per-micro-batch loss closure from the algorithm config.

    loss_BT = w * L_policy + kl_coef * KL(pi || pi_ref) - entropy_coef * H,
    reduced by `aggregate_loss(loss_BT, mask, cfg.loss_agg, normalizer=...)`.
    The rollout correction's weight w (`algorithms.correction`; 1 without one)
    multiplies the policy-gradient term only; the KL term is
    in the loss only when kl_coef > 0 and not kl_in_reward.

    Args:
        cfg: AlgorithmConfig (or an object with its fields).
        constant: Dr.GRPO constant for loss_agg="constant"; None uses
            cfg.loss_agg_constant (the caller passes rollout.max_tokens when
            that is None too).
        policy_loss: registry name; None = cfg.policy_loss.

    Returns:
        `loss_fn(inputs: LossInputs, normalizer=None) -> (loss, metrics)`:
        loss a 0-dim tensor with grad; metrics as in the module docstring
        plus loss, pg_loss (the policy term alone), num_tokens, num_seqs.

    Raises:
        ValueError: unknown policy loss, KL estimator or aggregation mode, or
            loss_agg="constant" without a constant (at build time); a needed
            tensor missing from LossInputs (at call time).
    """
    pg_fn = get_policy_loss(policy_loss or cfg.policy_loss)
    if constant is None:
        constant = cfg.loss_agg_constant
    get_kl_estimator(cfg.kl_estimator)
    check_loss_agg(cfg.loss_agg, constant=constant)

    def loss_fn(
        inputs: LossInputs, normalizer: Tensor | float | None = None
    ) -> tuple[Tensor, Metrics]:
        mask = inputs.mask_BT.bool()
        pg_BT, metrics = _policy_term(pg_fn, inputs, mask, cfg)
        loss_BT = pg_BT + _regularizers(inputs, mask, cfg, metrics)

        def agg(x_BT: Tensor) -> Tensor:
            return aggregate_loss(
                x_BT, mask, cfg.loss_agg, constant=constant, normalizer=normalizer
            )

        loss = agg(loss_BT)
        with torch.no_grad():
            metrics["loss"] = loss.detach()
            metrics["pg_loss"] = agg(pg_BT)
            metrics["num_tokens"] = mask.sum().float()
            metrics["num_seqs"] = mask.any(-1).sum().float()
        return loss, metrics

    return loss_fn


def combine_metrics(per_micro_batch: Sequence[Mapping[str, Tensor]]) -> Metrics:
    """Reduces the metrics of a step's micro-batches to the step's metrics.

    Keys in ADDITIVE_METRICS are summed (with the whole batch's normaliser,
    the summed "loss" is the step's loss); keys ending in "_max" / "_min" take
    the max / min; every other key is a token mean, combined weighted by
    num_tokens (or its subset's count, `metric_weight`). Micro-batches without
    such tokens do not affect means, maxima or minima. Tensors stay on their
    device (no sync).

    Args:
        per_micro_batch: metrics dicts returned by a LossFn (same keys).

    Returns:
        dict of detached 0-dim float32 tensors.
    """
    if not per_micro_batch:
        return {}
    out: Metrics = {}
    for key in per_micro_batch[0]:
        v = torch.stack([m[key].float() for m in per_micro_batch])
        w = torch.stack([m[metric_weight(key)].float() for m in per_micro_batch])
        if key in ADDITIVE_METRICS:
            out[key] = v.sum()
        elif key.endswith("_max") or key.endswith("_min"):
            largest = key.endswith("_max")
            out[key] = masked_extreme(v, w > 0, largest=largest)
        else:
            out[key] = (v * w).sum() / w.sum().clamp(min=1)
    return out
