"""Loss aggregation: per-token loss -> scalar, exact under micro-batching.

Job: the four reductions of `AlgorithmConfig.loss_agg` (token_mean,
seq_mean_token_sum, seq_mean_token_mean, constant), split into a numerator
computed per micro-batch (`aggregate_loss`) and a denominator computed once
over the whole batch (`loss_normalizer`); plus masked statistics for metrics.

Invariant: aggregating micro-batches (whole rows) with the whole batch's
normaliser and summing gives the full-batch value exactly, in every mode;
masked positions, all-masked rows and empty batches contribute exactly 0 and
never NaN, to the value or to its gradient.

Shape legend: B sequences, T token positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybrid_engine.names import unknown_name_error

__all__ = [
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "check_loss_agg",
    "loss_normalizer",
    "masked_extreme",
    "masked_mean",
]

LOSS_AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant")

# --------------------------------------------------------------------------
# Masked statistics (metrics; never NaN on an empty mask)
# --------------------------------------------------------------------------


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty), float32 0-dim."""
    mask = mask_BT.bool()
    return torch.where(mask, x_BT.float(), 0.0).sum() / mask.sum().clamp(min=1)


def masked_extreme(x_BT: Tensor, mask_BT: Tensor, *, largest: bool) -> Tensor:
    """Max (largest=True) or min of x over mask, float32 0-dim; 0 when the mask is empty."""
    mask = mask_BT.bool()
    if not mask.numel():
        return x_BT.new_zeros((), dtype=torch.float32)
    fill = float("-inf") if largest else float("inf")
    x = torch.where(mask, x_BT.float(), fill)
    out = x.amax() if largest else x.amin()
    return torch.where(mask.any(), out, 0.0)


# --------------------------------------------------------------------------
# Aggregation: loss_BT -> scalar
# --------------------------------------------------------------------------


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise unknown_name_error("loss aggregation mode", mode, LOSS_AGG_MODES)


def check_loss_agg(mode: str, *, constant: float | None = None) -> None:
    """Validates an aggregation mode (and its constant, for mode "constant").

    Raises:
        ValueError: unknown mode (suggests the closest), or mode "constant"
            without a constant > 0.
    """
    _check_mode(mode)
    if mode == "constant" and (constant is None or constant <= 0):
        raise ValueError(
            f"loss_agg='constant' needs a constant > 0 (e.g. max_tokens), got {constant}"
        )


def loss_normalizer(mask_BT: Tensor, mode: str, *, constant: float | None = None) -> Tensor:
    """Denominator of `aggregate_loss`; compute it once over the whole batch.

    token_mean: number of loss tokens. seq_mean_token_sum / seq_mean_token_mean:
    number of sequences with at least one loss token (all-masked rows are
    padding and do not count). constant: that number times `constant`.
    Every mode's normaliser is a count, additive over micro-batches and ranks.

    Args:
        mask_BT: [B, T] bool loss mask of the whole batch.
        mode: one of LOSS_AGG_MODES.
        constant: the Dr.GRPO constant (e.g. max response tokens); mode "constant" only.

    Returns:
        0-dim float32 tensor.

    Raises:
        ValueError: unknown mode, or mode "constant" without a constant > 0.
    """
    check_loss_agg(mode, constant=constant)
    mask = mask_BT.bool()
    if mode == "token_mean":
        return mask.sum().float()
    num_seqs = mask.any(-1).sum().float()
    if mode != "constant":
        return num_seqs
    assert constant is not None
    return num_seqs * float(constant)


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: str,
    *,
    constant: float | None = None,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """Reduces a per-token loss to a scalar.

    With S_b = sum_t mask_bt * loss_bt and n_b = sum_t mask_bt:
        token_mean           sum_b S_b / sum_b n_b              (DAPO)
        seq_mean_token_sum   sum_b S_b / #seqs
        seq_mean_token_mean  sum_b (S_b / n_b) / #seqs          (GRPO paper, GSPO)
        constant             sum_b S_b / (#seqs * constant)     (Dr.GRPO, Liu et al. 2025)
    (#seqs counts rows with a loss token.) The numerator is computed here, the
    denominator is `normalizer`, by default `loss_normalizer(mask_BT, mode, constant)`.
    Pass the whole batch's normaliser to a micro-batch of whole rows and the
    micro-batch results sum to the full-batch result. Masked positions and
    empty rows contribute exactly 0; an empty batch gives 0 (with a graph, so
    backward still runs and yields zero gradients).

    Args:
        loss_BT: [B, T] float per-token loss.
        mask_BT: [B, T] bool loss mask.
        mode: one of LOSS_AGG_MODES.
        constant: Dr.GRPO constant, used only when normalizer is None.
        normalizer: denominator; None = this batch's own.

    Returns:
        0-dim tensor.
    """
    _check_mode(mode)
    mask = mask_BT.bool()
    if normalizer is None:
        normalizer = loss_normalizer(mask, mode, constant=constant)
    masked = torch.where(mask, loss_BT, 0.0)
    if mode == "seq_mean_token_mean":
        total = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    else:
        total = masked.sum()
    norm = torch.as_tensor(normalizer, dtype=total.dtype, device=total.device)
    return total / torch.where(norm > 0, norm, 1.0)
