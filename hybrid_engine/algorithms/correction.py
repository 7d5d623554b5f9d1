"""Rollout correction: importance weights and masks for the gap between the sampler and the trainer.

Job: `correction_weights(name, old_logp, rollout_logp, mask, cap=, low=, high=)`
turns the per-token log-ratio lr = old_logp - rollout_logp (the trainer's
log-probs under the weights that sampled, or the current ones for stale
samples, against the engine's sampling log-probs; clamped to +-20 before any
exp, as verl and SkyRL do) into a detached weight per token that multiplies
the policy-gradient term (`losses.policy_loss_fn`), and reports the share it
truncated or masked and the ratio's quantiles. `algorithm.rollout_correction`
names one (`CORRECTIONS`; register_correction adds one; `none`: weight 1):

    token_tis   w_t = min(r_t, cap)                      r_t = exp(lr_t)
    seq_tis     w_t = min(R, cap)                        R = exp(sum_t lr_t)
    token_mask  w_t = r_t * [low <= r_t <= high]
    seq_mask    w_t = R * [low <= R <= high]
    icepop      w_t = r_t * [low <= r_t <= high]         (IcePop's bounds)
    geo_mask    w_t = [low <= G <= high]                 G = exp(mean_t lr_t)

Sums and means run over the sequence's loss tokens. A masked token keeps its
place in the loss's normaliser (its weight is 0), as in TRL and OpenRLHF;
verl's and SkyRL's rejection masks take it out of the normaliser instead.

Peers, read at these commits:
- token_tis, seq_tis: verl `compute_rollout_correction_weights`
  (verl/trainer/ppo/rollout_corr_helper.py @ b178a3cd56f5, levels "token" and
  "sequence", truncated above only), equal to TRL's token_truncate /
  sequence_truncate with no lower clip (trl/trainer/grpo_trainer.py @ f2cd57710ae3).
- token_mask, seq_mask: TRL's token_mask / sequence_mask
  (`vllm_importance_sampling_mode`, clip_min / clip_max) @ f2cd57710ae3.
- icepop: OpenRLHF `PolicyLoss` is_correction_type='icepop'
  (openrlhf/models/loss.py @ 3c3be6234e0c), default bounds [0.5, 5].
- geo_mask: verl's geometric rejection mask (rollout_corr_helper.py @
  2f2996b7dcc0, rollout_rs='geometric') and SkyRL's geometric sequence mask
  (skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py @
  a9564572eb8e), default bounds SkyRL's [0.99, 1.01].

Invariant: the weights are 0 off the loss mask and carry no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hybrid_engine.algorithms.aggregation import masked_mean
from hybrid_engine.algorithms.kl import MAX_LOG_RATIO, k3
from hybrid_engine.names import Registry

__all__ = ["CORRECTIONS", "Correction", "bounds_of", "check_correction", "correction_weights",
           "register_correction"]

QUANTILES = (0.1, 0.5, 0.9)
"""The ratio's quantiles a step reports (correction/ratio_p10, _p50, _p90)."""


@dataclass(frozen=True)
class Correction:
    """A registered correction.

    Fields:
        weights: (lr_BT, mask_BT, cap, low, high) -> (w_BT, the ratio each
            token's weight was judged on [B, T], which tokens it truncated or
            masked [B, T] bool).
        bounds: its default (low, high) when the config gives none; None: it
            takes a cap instead.
    """

    weights: Callable[[Tensor, Tensor, float, float, float], tuple[Tensor, Tensor, Tensor]]
    bounds: tuple[float, float] | None = None


CORRECTIONS: Registry[Correction] = Registry("rollout correction")


def register_correction(name: str, bounds: tuple[float, float] | None = None,
                        ) -> Callable[[Callable], Callable]:
    """Decorator: registers a weights function under name, with its default bounds."""

    def deco(fn: Callable) -> Callable:
        CORRECTIONS.add(name, Correction(fn, bounds))
        return fn

    return deco


def _per_sequence(lr_BT: Tensor, mask_BT: Tensor, mean: bool) -> Tensor:
    """The masked sum (or mean) of lr over each row, clamped, broadcast to [B, T]."""
    total = (lr_BT * mask_BT).sum(-1, keepdim=True)
    if mean:
        total = total / mask_BT.sum(-1, keepdim=True).clamp(min=1)
    return total.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).expand_as(lr_BT)


@register_correction("none")
def _none(lr, mask, cap, low, high):  # noqa: ANN001, ANN202
    return torch.ones_like(lr), lr.exp(), torch.zeros_like(lr, dtype=torch.bool)


@register_correction("token_tis")
def _token_tis(lr, mask, cap, low, high):  # noqa: ANN001, ANN202
    r = lr.exp()
    return r.clamp(max=cap), r, r > cap


@register_correction("seq_tis")
def _seq_tis(lr, mask, cap, low, high):  # noqa: ANN001, ANN202
    r = _per_sequence(lr, mask, mean=False).exp()
    return r.clamp(max=cap), r, r > cap


def _masked(r: Tensor, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    out = (r < low) | (r > high)
    return torch.where(out, 0.0, r), r, out


@register_correction("token_mask", bounds=(0.0, 3.0))
def _token_mask(lr, mask, cap, low, high):  # noqa: ANN001, ANN202
    return _masked(lr.exp(), low, high)


@register_correction("seq_mask", bounds=(0.0, 3.0))
def _seq_mask(lr, mask, cap, low, high):  # noqa: ANN001, ANN202
    return _masked(_per_sequence(lr, mask, mean=False).exp(), low, high)


@register_correction("icepop", bounds=(0.5, 5.0))
def _icepop(lr, mask, cap, low, high):  # noqa: ANN001, ANN202
    return _masked(lr.exp(), low, high)


@register_correction("geo_mask", bounds=(0.99, 1.01))
def _geo_mask(lr, mask, cap, low, high):  # noqa: ANN001, ANN202
    g = _per_sequence(lr, mask, mean=True).exp()
    out = (g < low) | (g > high)
    return (~out).float(), g, out


def check_correction(cfg: Any) -> None:
    """Refuses a correction the config names but cannot use.

    Raises:
        ValueError: an unknown name (lists the registered ones), or bounds
            (the config's, else the correction's own) with low >= high.
    """
    try:
        CORRECTIONS.get(cfg.rollout_correction)
    except ValueError as e:
        raise ValueError(f"algorithm.rollout_correction: {e}") from None
    low, high = bounds_of(cfg.rollout_correction, cfg.correction_low, cfg.correction_high)
    if low >= high:
        raise ValueError(f"algorithm.rollout_correction={cfg.rollout_correction!r} keeps ratios "
                         f"in [{low}, {high}]: set algorithm.correction_low below "
                         "algorithm.correction_high")


def bounds_of(name: str, low: float | None, high: float | None) -> tuple[float, float]:
    """The (low, high) a correction uses: the config's, else its defaults (0, inf for one
    that takes a cap)."""
    default = CORRECTIONS.get(name).bounds or (0.0, float("inf"))
    return (default[0] if low is None else low, default[1] if high is None else high)


@torch.no_grad()
def correction_weights(name: str, old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor,
                       *, cap: float, low: float | None = None, high: float | None = None,
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """The named correction's weights (see the module docstring), 0 off the mask.

    Returns:
        (w_BT float32, metrics): correction/weight_mean, correction/clipped_frac
        (the loss tokens it truncated or masked), correction/ratio_p10, _p50,
        _p90 (quantiles of the ratio it judged, over the loss tokens) and
        rollout_kl (k3 estimate of KL(pi_rollout || pi_trainer)).

    Raises:
        ValueError: an unknown name (lists the registered ones).
    """
    mask = mask_BT.bool()
    lr = torch.where(mask, old_logp_BT.float() - rollout_logp_BT.float(), 0.0)
    lr = lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    lo, hi = bounds_of(name, low, high)
    w, ratio, clipped = CORRECTIONS.get(name).weights(lr, mask.float(), cap, lo, hi)
    w = torch.where(mask, w.float(), 0.0)
    picked = ratio[mask].float()
    qs = (torch.quantile(picked, torch.tensor(QUANTILES)) if picked.numel()
          else torch.ones(len(QUANTILES)))
    metrics = {"correction/weight_mean": masked_mean(w, mask),
               "correction/clipped_frac": masked_mean(clipped & mask, mask),
               "rollout_kl": masked_mean(k3(lr), mask)}
    metrics.update({f"correction/ratio_p{round(q * 100):02d}": v for q, v in zip(QUANTILES, qs)})
    return w, metrics
