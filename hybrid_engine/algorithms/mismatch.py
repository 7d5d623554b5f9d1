"""Rollout-vs-trainer log-prob mismatch on the sampled tokens.

Job: measure how far the sampling engine's log-probs (vLLM) are from the
trainer's for the same tokens under the same weights, with no extra pass:
from the old log-probs when the trainer computed them (several updates per
rollout), else from the forward of the step's update (with
behaviour_logp='rollout' and several updates: the first update's, on its
mini-batch; later updates' weights have moved, so `roles/updates.py` leaves
their mismatch metrics out).
`with_mismatch_metrics(loss_fn)` wraps any `LossFn` and adds

    mismatch_abs_mean    mean |logp_train - logp_rollout| over loss tokens
    mismatch_abs_max     its max
    mismatch_ratio_out   fraction of loss tokens whose probability ratio
                         exp(logp_train - logp_rollout) leaves [0.8, 1.25]
    mismatch_tokens      the loss tokens they are measured on: those whose
                         rollout log-prob vLLM returned (NaN marks the
                         others; `policy.training.logprob_samples` says which)

A healthy sync gives ~1e-6 in fp32 and ~1e-2 in bf16; a broken one (a
layer not written, stale weights) gives values orders of magnitude larger.

Under staleness (async_rollout.max_staleness, partial rollouts) the rollout's
log-probs come from older weights, so the three metrics mix the policy's own
drift with the engine/trainer numerics. When the batch carries the engine's
log-probs under the trainer's current weights (`engine_logp_BT`, the
colocated policy's drift scorer), the same three metrics are also reported
split:

    mismatch_numerics_*  trainer vs engine, the same weights: numerics only
    mismatch_drift_*     engine now vs the rollout's log-probs: the weights'
                         change since sampling, numerics-free (one engine)
    mismatch_split_tokens  the loss tokens they are measured on

The scorer re-scores a sample of the batch (`guards.mismatch_split_sequences`); the
other sequences carry NaN engine log-probs and are left out of the split,
whose means are weighted by mismatch_split_tokens when micro-batches, ranks
and updates combine (`losses.metric_weight`). The mismatch alarm watches the
numerics (`guards.py`).

Invariant: metrics only; the loss and its gradient are those of the wrapped
function, bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hybrid_engine.algorithms.aggregation import masked_extreme, masked_mean
from hybrid_engine.algorithms.losses import LossFn, LossInputs

__all__ = ["RATIO_BAND", "mismatch_metrics", "with_mismatch_metrics"]

RATIO_BAND = (0.8, 1.25)


@torch.no_grad()
def mismatch_metrics(logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """The three mismatch metrics over the masked tokens whose rollout_logp is not
    NaN (0-dim float32 tensors, 0 when there are none)."""
    mask = mask_BT.bool() & ~rollout_logp_BT.isnan()
    diff = torch.where(mask, logp_BT.detach().float() - rollout_logp_BT.float(), 0.0)
    out = (diff < math.log(RATIO_BAND[0])) | (diff > math.log(RATIO_BAND[1]))
    return {
        "mismatch_abs_mean": masked_mean(diff.abs(), mask),
        "mismatch_abs_max": masked_extreme(diff.abs(), mask, largest=True),
        "mismatch_ratio_out": masked_mean(out, mask),
    }


def with_mismatch_metrics(loss_fn: LossFn) -> LossFn:
    """loss_fn, whose metrics also carry `mismatch_metrics` of its inputs."""

    def wrapped(inputs: LossInputs, normalizer: Tensor | float | None = None):  # noqa: ANN202
        loss, metrics = loss_fn(inputs, normalizer)
        if inputs.rollout_logp_BT is not None:
            # The trainer's log-probs under the rollout's weights: the old ones when
            # the trainer computed them (several updates), else this update's.
            trainer = inputs.old_logp_BT if inputs.old_logp_BT is not None else inputs.logp_BT
            metrics.update(mismatch_metrics(trainer, inputs.rollout_logp_BT, inputs.mask_BT))
            metrics["mismatch_tokens"] = (inputs.mask_BT.bool()
                                          & ~inputs.rollout_logp_BT.isnan()).sum().float()
            if inputs.engine_logp_BT is not None:
                engine = inputs.engine_logp_BT
                scored = inputs.mask_BT.bool() & ~engine.isnan()  # NaN: not in the sample
                for name, (a, b) in (("numerics", (trainer, engine)),
                                     ("drift", (engine, inputs.rollout_logp_BT))):
                    metrics.update({k.replace("mismatch_", f"mismatch_{name}_"): v for k, v in
                                    mismatch_metrics(a, b, scored).items()})
                metrics["mismatch_split_tokens"] = scored.sum().float()
        return loss, metrics

    return wrapped
