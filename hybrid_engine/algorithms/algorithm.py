"""The algorithm role: one object the controller calls for advantages and the loss.

Job: bind an `AlgorithmConfig` to the pure functions of this package
(estimator registry, DAPO extras, KL in the reward, policy loss closure) and
expose them through the `roles.base.Algorithm` surface, so the controller
never branches on the algorithm's name:

    algo.compute_advantages(trajs)   fills advantages (+ returns for
                                     GAE), marks degenerate samples, returns metrics
    algo.prompts_wanted(trajs, rounds)  how many more prompts the step should draw
                                     (DAPO dynamic sampling refills; 0 = train now)
    algo.select(trajs)               the samples to train on ([] = skip the step)
    algo.loss                        what the trainer takes (`losses.StepLoss`: the
                                     LossFn, its aggregation, the entropy term)

What the algorithm needs from other roles is declared, not fetched:
`needs_reference` (ref_logp on every trajectory) and `needs_values`
(values, response-local, from a critic).

Invariant: every rank calls it on the same complete list of trajectories and
gets the same result (pure tensor math, no collectives). A sample is
degenerate when its advantages are all exactly zero (no policy-gradient
signal: e.g. a GRPO group whose rewards are equal), or when DAPO dynamic
sampling drops its group.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from hybrid_engine.algorithms.advantages import broadcast_to_tokens, get_advantage, token_level_rewards
from hybrid_engine.algorithms.dapo import filter_degenerate_groups, overlong_penalty
from hybrid_engine.algorithms.kl import kl_divergence, kl_in_reward
from hybrid_engine.algorithms.correction import check_correction
from hybrid_engine.algorithms.losses import StepLoss, step_loss
from hybrid_engine.config import AlgorithmConfig
from hybrid_engine.trajectory import Trajectory

__all__ = ["Algorithm"]

log = logging.getLogger(__name__)


def _pad_rows(rows: Sequence[Sequence[float] | Tensor], dtype: torch.dtype = torch.float32) -> Tensor:
    """Right-pads response-local rows into [N, R_max]."""
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros((len(rows), max(width, 1)), dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


class Algorithm:
    """Advantages and loss from an AlgorithmConfig.

    Args:
        cfg: the algorithm section of the run config.
        num_samples: K, samples per prompt (trajectories arrive prompt-major,
            K consecutive ones per group).
        max_tokens: the rollout's response limit (Dr.GRPO constant default,
            DAPO overlong shaping).
        prompts_per_step: groups a step trains on (dynamic sampling refills up
            to this many groups with signal); None = no target (no refill).
    """

    def __init__(self, cfg: AlgorithmConfig, *, num_samples: int, max_tokens: int,
                 prompts_per_step: int | None = None) -> None:
        self.cfg, self.k, self.max_tokens = cfg, num_samples, max_tokens
        self.prompts_per_step = prompts_per_step
        self.estimator = get_advantage(cfg.advantage)
        if num_samples < self.estimator.min_group_size:
            raise ValueError(f"algorithm.advantage={cfg.advantage!r} needs >= "
                             f"{self.estimator.min_group_size} samples per prompt, got {num_samples}")
        if cfg.dynamic_sampling and num_samples < 2:
            raise ValueError("algorithm.dynamic_sampling keeps the groups whose rewards differ; "
                             "a group of 1 never does, so no step would train: set "
                             f"rollout.num_samples_per_prompt >= 2 (got {num_samples})")
        check_correction(cfg)
        self.loss: StepLoss = step_loss(cfg, max_tokens)
        self.needs_reference = cfg.kl_coef > 0
        self.needs_values = self.estimator.per_token

    def _rewards(self, trajs: Sequence[Trajectory], mask_NT: Tensor) -> tuple[Tensor, Tensor | None]:
        """Sequence rewards after DAPO overlong shaping, and the per-token KL (or None)."""
        rewards_N = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        if self.cfg.overlong_buffer > 0:
            lengths = torch.tensor([sum(t.loss_mask) for t in trajs])
            rewards_N = rewards_N + overlong_penalty(
                lengths, max_len=self.max_tokens, buffer=self.cfg.overlong_buffer,
                penalty_factor=self.cfg.overlong_penalty_factor)
        kl_NT = None
        if self.needs_reference and self.cfg.kl_in_reward:
            missing = sum(t.ref_logp is None for t in trajs)
            if missing:
                raise ValueError(f"kl_in_reward needs ref_logp; {missing} trajectories lack it")
            old = _pad_rows([t.rollout_logp for t in trajs])
            ref = _pad_rows([t.ref_logp for t in trajs])
            kl_NT = kl_divergence(old, ref, mask_NT, self.cfg.kl_estimator)
        return rewards_N, kl_NT

    def compute_advantages(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """Fills every trajectory's advantages and info["degenerate"] (and
        returns for token estimators); returns metrics.

        Raises:
            ValueError: the count is not a multiple of K, or a needed field
                (ref_logp, values) is missing.
        """
        n = len(trajs)
        if n == 0 or n % self.k:
            raise ValueError(f"need a positive multiple of K={self.k} trajectories, got {n}")
        mask_NT = _pad_rows([t.loss_mask for t in trajs], torch.bool)
        rewards_N, kl_NT = self._rewards(trajs, mask_NT)
        metrics: dict[str, float] = {}
        if self.estimator.per_token:
            adv_NT = self._token_advantages(trajs, rewards_N, mask_NT, kl_NT)
        else:
            scored_N = rewards_N if kl_NT is None else kl_in_reward(
                rewards_N, kl_NT, mask_NT, kl_coef=self.cfg.kl_coef)
            adv_NT = broadcast_to_tokens(self.estimator(scored_N.view(-1, self.k)).reshape(-1),
                                         mask_NT)
        # Flat groups by their shaped task rewards (KL left out), as `select` judges them.
        keep_G, num_flat = filter_degenerate_groups(rewards_N.view(-1, self.k))
        drop_N = (~keep_G).repeat_interleave(self.k) if self.cfg.dynamic_sampling else None
        for i, t in enumerate(trajs):
            adv = adv_NT[i, : len(t.response_ids)]
            if drop_N is not None and drop_N[i]:
                adv = torch.zeros_like(adv)
            t.advantages = adv
            t.info["degenerate"] = not bool((adv != 0).any())
        metrics["groups_flat"] = float(num_flat)
        metrics["degenerate_frac"] = sum(t.degenerate for t in trajs) / n
        metrics["advantage_abs_mean"] = float(adv_NT.abs().sum() / mask_NT.sum().clamp(min=1))
        if kl_NT is not None:
            metrics["kl_in_reward"] = float((kl_NT * mask_NT).sum() / mask_NT.sum().clamp(min=1))
        return metrics

    def _token_advantages(self, trajs: Sequence[Trajectory], rewards_N: Tensor, mask_NT: Tensor,
                          kl_NT: Tensor | None) -> Tensor:
        """GAE over values; stores returns (response-local)."""
        if any(t.values is None for t in trajs):
            raise ValueError(f"algorithm.advantage={self.cfg.advantage!r} needs a critic's "
                             "values on every trajectory (Trajectory.values)")
        values_NT = _pad_rows([t.values for t in trajs])
        rewards_NT = token_level_rewards(rewards_N, mask_NT, kl_NT=kl_NT,
                                         kl_coef=self.cfg.kl_coef if kl_NT is not None else 0.0)
        adv_NT, ret_NT = self.estimator(rewards_NT, values_NT, mask_NT, gamma=self.cfg.gamma,
                                        lam=self.cfg.lam)
        for i, t in enumerate(trajs):
            t.returns = ret_NT[i, : len(t.response_ids)]
        return adv_NT

    def _signal_groups(self, trajs: Sequence[Trajectory]) -> Tensor:
        """[G] bool: groups (K consecutive trajectories) whose shaped rewards differ."""
        mask_NT = _pad_rows([t.loss_mask for t in trajs], torch.bool)
        rewards_N = self._rewards(trajs, mask_NT)[0]
        return filter_degenerate_groups(rewards_N.view(-1, self.k))[0]

    def prompts_wanted(self, trajs: Sequence[Trajectory], rounds: int) -> int:
        """How many more prompts the step should generate and score before training.

        0 unless dynamic sampling has a target: then 0 once prompts_per_step
        groups carry signal or max_sampling_rounds rounds are done; else the
        missing count divided by the share of groups with signal so far (all
        prompts_per_step when none had any), at most prompts_per_step.

        Args:
            trajs: every scored trajectory of the step so far (K per prompt).
            rounds: generate rounds done.
        """
        target = self.prompts_per_step
        if not self.cfg.dynamic_sampling or target is None:
            return 0
        signal_G = self._signal_groups(trajs)
        have, drawn = int(signal_G.sum()), signal_G.numel()
        if have >= target:
            return 0
        if rounds >= self.cfg.max_sampling_rounds:
            log.info("dynamic sampling: %d of %d wanted groups carry signal after %d rounds "
                     "(%d groups drawn); training on those (algorithm.max_sampling_rounds)",
                     have, target, rounds, drawn)
            return 0
        if have == 0:
            return target
        return min(target, math.ceil((target - have) * drawn / have))

    def select(self, trajs: Sequence[Trajectory]) -> list[Trajectory]:
        """The trajectories to train on: all of them, except that dynamic sampling
        keeps only the groups with signal (whole: a sample at its group's mean
        stays, as in DAPO), at most the first prompts_per_step of them; [] when
        none carries signal (the step is skipped)."""
        if all(t.degenerate for t in trajs):
            return []
        if not self.cfg.dynamic_sampling:
            return list(trajs)
        keep_G = self._signal_groups(trajs)
        if self.prompts_per_step is not None:
            keep_G &= keep_G.cumsum(0) <= self.prompts_per_step
        keep = keep_G.repeat_interleave(self.k).tolist()
        return [t for t, kept in zip(trajs, keep, strict=True) if kept]
