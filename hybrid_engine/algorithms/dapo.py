"""DAPO data-side extras (Yu et al. 2025): dynamic sampling and overlong shaping.

Job: the two DAPO techniques that act on rewards rather than on the loss
(clip-higher is `clip_high > clip_low` in `losses`; token-level aggregation is
`loss_agg="token_mean"`):

- dynamic sampling: groups whose K rewards are all equal carry no gradient
  under a group baseline (every advantage is 0); the controller drops them and
  keeps sampling until the batch holds enough informative groups.
- overlong reward shaping: a linear penalty for responses that run into the
  last `buffer` tokens before the length limit.

Invariant: pure functions of rewards and lengths; no state, no sampling.

Shape legend: G groups, K samples per group, N sequences.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["filter_degenerate_groups", "overlong_penalty"]


def filter_degenerate_groups(rewards_GK: Tensor, *, atol: float = 0.0) -> tuple[Tensor, int]:
    """Which groups carry signal: max - min of their rewards exceeds atol.

    A group whose rewards are all equal (all correct, all wrong) is degenerate:
    its group-relative advantages are all 0. K = 1 makes every group
    degenerate; only use this with group baselines (grpo, drgrpo, rloo).

    Args:
        rewards_GK: [G, K] float.
        atol: rewards within atol of each other count as equal (default exact).

    Returns:
        (keep_G, num_degenerate): [G] bool True for informative groups, and the
        number of degenerate ones (a Python int: this synchronises with the device).
    """
    keep_G = (rewards_GK.amax(-1) - rewards_GK.amin(-1)) > atol
    return keep_G, int((~keep_G).sum())


def overlong_penalty(
    lengths_N: Tensor, *, max_len: int, buffer: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), to add to the reward.

    penalty = penalty_factor * clip(((max_len - buffer) - len) / buffer, -1, 0):
    0 up to max_len - buffer tokens, then linear down to -penalty_factor at
    max_len, and -penalty_factor beyond.

    Args:
        lengths_N: [N] int or float response lengths in tokens.
        max_len: L_max, the response length limit (e.g. rollout.max_tokens).
        buffer: L_cache, tokens before max_len where the penalty ramps; 0 < buffer <= max_len.
        penalty_factor: penalty at and past max_len (DAPO uses 1).

    Returns:
        [N] float32 penalties in [-penalty_factor, 0].

    Raises:
        ValueError: buffer outside (0, max_len].
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    ramp = ((max_len - buffer) - lengths_N.float()) / buffer
    return penalty_factor * ramp.clamp(-1.0, 0.0)
