"""The critic's loss: PPO's clipped value loss, per token.

Job: the value-model counterpart of `algorithms.losses`' policy losses,
reduced by the caller with `aggregation.aggregate_loss` like the policy loss.

Shape legend: B sequences of a micro-batch, T token positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybrid_engine.algorithms.aggregation import masked_mean

__all__ = ["value_loss"]


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss, per token.

    V_clip = old_V + clip(V - old_V, -clip, clip),
    L = 0.5 * max((V - R)^2, (V_clip - R)^2) (PPO2 baselines, verl); clip=None
    gives 0.5 * (V - R)^2. Reduce with `aggregate_loss` like the policy loss.

    Args:
        values_BT: [B, T] current value predictions (grad).
        old_values_BT: [B, T] predictions when the returns were computed (no grad).
        returns_BT: [B, T] GAE returns.
        mask_BT: [B, T] bool loss mask.
        clip: epsilon of the value clip, or None.

    Returns:
        (loss_BT, metrics): [B, T] float32, 0 outside the mask; metrics
        vf_clip_frac, values_mean, vf_error_mean (mean (V - R)^2).
    """
    mask = mask_BT.bool()
    v, old, ret = (
        torch.where(mask, x.float(), 0.0) for x in (values_BT, old_values_BT, returns_BT)
    )
    err2 = (v - ret).square()
    loss2 = err2
    if clip is not None:
        loss2 = torch.maximum(err2, (old + (v - old).clamp(-clip, clip) - ret).square())
    with torch.no_grad():
        metrics = {
            "vf_clip_frac": masked_mean(loss2 > err2, mask),
            "values_mean": masked_mean(v, mask),
            "vf_error_mean": masked_mean(err2, mask),
        }
    return torch.where(mask, 0.5 * loss2, 0.0), metrics
