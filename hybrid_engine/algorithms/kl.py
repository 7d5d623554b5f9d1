"""KL estimators between the policy and the reference policy, per token.

Job: Schulman's k1 / k2 / k3 estimators of KL(pi || pi_ref) from the sampled
tokens' log-probabilities (a name registry, `AlgorithmConfig.kl_estimator`),
and the helper that folds the KL into the rewards (`kl_in_reward=True`)
instead of the loss (`losses.policy_loss_fn` adds kl_coef * k there).

Invariant: estimates are finite and exactly 0 outside the mask, whatever the
log-probabilities hold there (padding positions may carry garbage), and so is
their gradient.

Shape legend: N or B sequences, T token positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hybrid_engine.names import Registry

__all__ = [
    "KL_ESTIMATORS",
    "get_kl_estimator",
    "k1",
    "k2",
    "k3",
    "kl_divergence",
    "kl_in_reward",
    "register_kl_estimator",
]

# |log pi_ref / pi| beyond this is a broken sample, not a signal: clamping it
# keeps exp() in k3 finite (verl clamps the same way).
MAX_LOG_RATIO = 20.0

KlEstimator = Callable[[Tensor], Tensor]
KL_ESTIMATORS: Registry[KlEstimator] = Registry("KL estimator")


def register_kl_estimator(name: str) -> Callable[[KlEstimator], KlEstimator]:
    """Decorator: registers `fn(log_ratio_BT) -> kl_BT` under name."""

    def deco(fn: KlEstimator) -> KlEstimator:
        KL_ESTIMATORS.add(name, fn)
        return fn

    return deco


def get_kl_estimator(name: str) -> KlEstimator:
    """The estimator registered as name.

    Raises:
        ValueError: unknown name; lists the registered ones and the closest.
    """
    return KL_ESTIMATORS.get(name)


# Each estimator takes log_ratio = log pi_ref(x) - log pi(x) for x ~ pi
# (Schulman 2020, "Approximating KL Divergence", r = pi_ref / pi).


@register_kl_estimator("k1")
def k1(log_ratio_BT: Tensor) -> Tensor:
    """k1 = -log r = log pi - log pi_ref: unbiased, high variance, can be negative."""
    return -log_ratio_BT


@register_kl_estimator("k2")
def k2(log_ratio_BT: Tensor) -> Tensor:
    """k2 = (log r)^2 / 2: biased, low variance, >= 0."""
    return 0.5 * log_ratio_BT.square()


@register_kl_estimator("k3")
def k3(log_ratio_BT: Tensor) -> Tensor:
    """k3 = (r - 1) - log r: unbiased, low variance, >= 0 (GRPO's choice)."""
    return torch.expm1(log_ratio_BT) - log_ratio_BT


def kl_divergence(
    logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, estimator: str = "k3"
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on the sampled tokens.

    Args:
        logp_BT: [B, T] log pi of the sampled tokens (with or without grad).
        ref_logp_BT: [B, T] log pi_ref of the same tokens.
        mask_BT: [B, T] bool, True on loss tokens.
        estimator: "k1", "k2" or "k3".

    Returns:
        [B, T] float32, 0 outside the mask; the log ratio is clamped to
        +-MAX_LOG_RATIO.
    """
    fn = get_kl_estimator(estimator)
    mask = mask_BT.bool()
    # Mask before the estimator so garbage at padding never reaches exp().
    log_ratio = torch.where(mask, ref_logp_BT.float() - logp_BT.float(), 0.0)
    return torch.where(mask, fn(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)), 0.0)


def kl_in_reward(rewards_N: Tensor, kl_NT: Tensor, mask_NT: Tensor, *, kl_coef: float) -> Tensor:
    """Sequence rewards minus the KL penalty summed over each sequence's loss tokens.

    r'_n = r_n - kl_coef * sum_t mask_nt * kl_nt (the `kl_in_reward=True` mode,
    e.g. for REINFORCE++). Compute kl_NT with `kl_divergence(old_logp, ref_logp,
    mask, estimator)` from the trainer's old log-probs, without gradient: the
    penalty is part of the reward, not a differentiable term. For GAE put it
    on each token instead: `advantages.token_level_rewards(..., kl_NT=...)`.

    Args:
        rewards_N: [N] float outcome rewards.
        kl_NT: [N, T] per-token KL estimates.
        mask_NT: [N, T] bool loss mask.
        kl_coef: weight of the penalty.

    Returns:
        [N] float32 penalised rewards.
    """
    kl_N = torch.where(mask_NT.bool(), kl_NT.float(), 0.0).sum(-1)
    return rewards_N.float() - kl_coef * kl_N.detach()
