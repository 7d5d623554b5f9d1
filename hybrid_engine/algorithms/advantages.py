"""Advantage estimators: rewards (and values) -> advantages, in a name registry.

Job: one pure, vectorized function per estimator named in
`AlgorithmConfig.advantage`, plus the helpers that move rewards and
advantages between the sequence and the token level. No model code, no
torch.distributed: the controller gathers the rewards of a whole step first.

Two calling conventions; each registry entry records which one it follows
(`AdvantageEstimator.per_token`) so the controller stays algorithm-agnostic:

- outcome estimators (grpo, drgrpo, rloo, reinforce_pp), one scalar reward per
  sequence: `est(rewards_GK) -> advantages_GK`. Sequence n of the flattened
  batch is group n // K, sample n % K (`rewards_GK.reshape(-1)`). Turn the
  result into per-token advantages with
  `broadcast_to_tokens(advantages_GK.reshape(-1), loss_mask_NT)`.
- token estimators (gae), per-token rewards and a value model:
  `est(rewards_BT, values_BT, mask_BT, gamma=..., lam=...) -> (advantages_BT,
  returns_BT)`; build rewards_BT with `token_level_rewards`.

Invariant: advantages are finite for every input, and exactly 0 where there
is no learning signal: a group whose rewards are all equal, and every token
outside the loss mask.

Shape legend: G groups (prompts), K samples per group, N = G * K sequences,
B sequences of a batch, T token positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hybrid_engine.names import Registry

__all__ = [
    "ADVANTAGES",
    "AdvantageEstimator",
    "broadcast_to_tokens",
    "drgrpo",
    "gae",
    "get_advantage",
    "grpo",
    "register_advantage",
    "reinforce_pp",
    "rloo",
    "token_level_rewards",
]


@dataclass(frozen=True, slots=True)
class AdvantageEstimator:
    """A registry entry: the function and how to call it.

    Attributes:
        name: registry name (the value of `AlgorithmConfig.advantage`).
        fn: the estimator; calling the entry calls it.
        per_token: False: `fn(rewards_GK) -> advantages_GK`; True:
            `fn(rewards_BT, values_BT, mask_BT, *, gamma, lam) -> (advantages_BT, returns_BT)`.
        min_group_size: smallest K it accepts (2 for group baselines).
    """

    name: str
    fn: Callable[..., Any]
    per_token: bool
    min_group_size: int

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator")


def register_advantage(
    name: str, *, per_token: bool = False, min_group_size: int = 1
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: registers an estimator under name; returns it unchanged."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        ADVANTAGES.add(name, AdvantageEstimator(name, fn, per_token, min_group_size))
        return fn

    return deco


def get_advantage(name: str) -> AdvantageEstimator:
    """The estimator registered as name (callable; see AdvantageEstimator).

    Raises:
        ValueError: unknown name; lists the registered ones and the closest.
    """
    return ADVANTAGES.get(name)


# --------------------------------------------------------------------------
# Outcome estimators: rewards_GK -> advantages_GK
# --------------------------------------------------------------------------


def _check_groups(rewards_GK: Tensor, name: str, min_group_size: int) -> None:
    if rewards_GK.dim() != 2:
        raise ValueError(
            f"{name}: rewards_GK must be [num_groups, K], got shape {tuple(rewards_GK.shape)}"
        )
    k = rewards_GK.shape[1]
    if k < min_group_size:
        raise ValueError(
            f"{name} needs K >= {min_group_size} samples per prompt: its baseline is the "
            f"other samples of the group, and a group of one has none (got K={k}); "
            f"sample more per prompt or use 'reinforce_pp', whose baseline is the batch"
        )


def _all_equal_GK(rewards_GK: Tensor) -> Tensor:
    """[G, 1] bool: the group's rewards are all equal (no signal)."""
    return rewards_GK.amax(-1, keepdim=True) == rewards_GK.amin(-1, keepdim=True)


def _group_baseline(rewards_GK: Tensor, std_normalize: bool, eps: float) -> Tensor:
    r = rewards_GK.float()
    adv = r - r.mean(-1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    # Equal rewards: the mean can differ from them by rounding; force exact 0.
    return adv.masked_fill(_all_equal_GK(r), 0.0)


@register_advantage("grpo", min_group_size=2)
def grpo(rewards_GK: Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath).

    A_gk = (r_gk - mean_k r_g) / (std_k r_g + eps), std with Bessel's
    correction (as torch.std, TRL and verl). Groups with equal rewards get 0.

    Args:
        rewards_GK: [G, K] float, one reward per sampled completion.
        std_normalize: divide by the group std (False: Dr.GRPO).
        eps: added to the std.

    Returns:
        [G, K] float32 advantages.

    Raises:
        ValueError: rewards_GK is not 2-D, or K < 2.
    """
    _check_groups(rewards_GK, "grpo", 2)
    return _group_baseline(rewards_GK, std_normalize, eps)


@register_advantage("drgrpo", min_group_size=2)
def drgrpo(rewards_GK: Tensor) -> Tensor:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training").

    A_gk = r_gk - mean_k r_g: GRPO without the std division, which biases
    updates toward too-easy and too-hard prompts. Pair it with
    loss_agg="constant" (sum / (num_seqs * max_tokens)), the paper's fix of
    the length bias of per-sequence token means.

    Args:
        rewards_GK: [G, K] float.

    Returns:
        [G, K] float32 advantages.

    Raises:
        ValueError: rewards_GK is not 2-D, or K < 2.
    """
    _check_groups(rewards_GK, "drgrpo", 2)
    return _group_baseline(rewards_GK, False, 0.0)


@register_advantage("rloo", min_group_size=2)
def rloo(rewards_GK: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantage (Ahmadian et al. 2024, "Back to Basics").

    A_gk = r_gk - mean_{j != k} r_gj = K / (K - 1) * (r_gk - mean_j r_gj).

    Args:
        rewards_GK: [G, K] float.

    Returns:
        [G, K] float32 advantages.

    Raises:
        ValueError: rewards_GK is not 2-D, or K < 2.
    """
    _check_groups(rewards_GK, "rloo", 2)
    k = rewards_GK.shape[1]
    return _group_baseline(rewards_GK, False, 0.0) * (k / (k - 1))


@register_advantage("reinforce_pp")
def reinforce_pp(rewards_GK: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ advantage (Hu 2025): global batch normalisation of rewards.

    A = (r - mean_batch r) / (std_batch r + eps) over every element of
    rewards_GK (any K, including 1), std with Bessel's correction. Fold a KL
    penalty into the rewards first with `kl.kl_in_reward`. OpenRLHF
    normalises token-level discounted returns instead; with gamma = 1 and the
    KL summed into the sequence reward the two differ only in weighting the
    batch statistics by length. A batch of one, or of equal rewards, gets 0.

    Args:
        rewards_GK: [G, K] (or any shape) float.

    Returns:
        float32 advantages, same shape.
    """
    r = rewards_GK.float()
    if r.numel() < 2:
        return torch.zeros_like(r)
    adv = (r - r.mean()) / (r.std() + eps)
    return adv.masked_fill(r.amax() == r.amin(), 0.0)


# --------------------------------------------------------------------------
# Token level: GAE, and moving between sequence and token level
# --------------------------------------------------------------------------


@register_advantage("gae", per_token=True)
@torch.no_grad()
def gae(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation for PPO (Schulman et al. 2016).

    Over the loss tokens t_1 < t_2 < ... < t_n of a row (mask_BT True):
        delta_i = r_{t_i} + gamma * V_{t_{i+1}} - V_{t_i}   (V_{t_{n+1}} = 0: terminal)
        A_{t_i} = delta_i + gamma * lam * A_{t_{i+1}},   R_{t_i} = A_{t_i} + V_{t_i}.
    Convention: positions outside the mask (padding, and environment/tool
    tokens of multi-turn episodes) are not steps of the recursion: it jumps
    from one policy token to the next, so a tool response costs no discount
    and its tokens get advantage 0 and return 0. Their rewards and values are
    ignored: put the outcome reward on the last loss token (token_level_rewards).
    A truncated response is treated as terminal too.

    Args:
        rewards_BT: [B, T] float per-token rewards.
        values_BT: [B, T] float value-model predictions (no gradient taken).
        mask_BT: [B, T] bool, True on policy (loss) tokens.
        gamma: discount factor in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        (advantages_BT, returns_BT), float32, 0 outside the mask.
    """
    r, v, mask = rewards_BT.float(), values_BT.float(), mask_BT.bool()
    adv = torch.zeros_like(r)
    next_value = r.new_zeros(r.shape[0])
    next_adv = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        m = mask[:, t]
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = torch.where(mask, adv + v, 0.0)
    return adv, returns


def broadcast_to_tokens(adv_N: Tensor, mask_NT: Tensor) -> Tensor:
    """Per-sequence advantages -> per-token advantages on the loss tokens.

    Args:
        adv_N: [N] float (e.g. `advantages_GK.reshape(-1)`).
        mask_NT: [N, T] bool, True on loss tokens.

    Returns:
        [N, T] float32: adv_N[n] on row n's loss tokens, 0 elsewhere.
    """
    return torch.where(mask_NT.bool(), adv_N.float()[:, None], 0.0)


def token_level_rewards(
    rewards_N: Tensor,
    mask_NT: Tensor,
    *,
    kl_NT: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Outcome rewards placed on each row's last loss token, minus a per-token KL.

    r_nt = rewards_N[n] * [t is the last loss token of row n] - kl_coef * kl_nt * mask_nt
    (the per-token KL-in-reward of PPO-RLHF, Ouyang et al. 2022). The input of
    `gae`. Rows without loss tokens get all zeros.

    Args:
        rewards_N: [N] float outcome rewards.
        mask_NT: [N, T] bool loss mask.
        kl_NT: [N, T] per-token KL estimate (kl.kl_divergence of old vs ref logp), or None.
        kl_coef: weight of the KL penalty.

    Returns:
        [N, T] float32 token rewards.
    """
    mask = mask_NT.bool()
    is_last = mask & (mask.cumsum(-1) == mask.sum(-1, keepdim=True))
    out = torch.where(is_last, rewards_N.float()[:, None], 0.0)
    if kl_NT is not None:
        out = out - kl_coef * torch.where(mask, kl_NT.float(), 0.0)
    return out
