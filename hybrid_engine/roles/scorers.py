"""Adapters that let the controller call the reference and the critic on trajectories.

Job: the FSDP2 roles work on TrainBatches of this rank's rows; the
controller works on the step's trajectories (the same list on every rank).
`ReferenceScorer.score` fills every trajectory's ref_logp, `CriticScorer.score`
its values, `CriticScorer.train_step` trains the critic on
their returns (as many updates as the policy's) -- each computing its
slice and gathering the rest.

Invariant: after `score`, every rank's trajectories carry identical values
(gathered), so the algorithm computes identical advantages everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid_engine.config import AlgorithmConfig, TrainConfig
from hybrid_engine.roles.critic import Critic
from hybrid_engine.roles.reference import Reference
from hybrid_engine.parallel.batch_slices import (
    gather_response_field, scatter_response_field, train_batch_of,
)
from hybrid_engine.roles.updates import run_updates
from hybrid_engine.trajectory import Trajectory

__all__ = ["CriticScorer", "ReferenceScorer"]


class ReferenceScorer:
    """Fills ref_logp from a frozen `Reference` (collective), in the training layout."""

    layout = "training"

    def __init__(self, reference: Reference, *, pad_id: int, train_cfg: TrainConfig) -> None:
        self.reference, self.pad_id, self.train_cfg = reference, pad_id, train_cfg

    def score(self, trajs: Sequence[Trajectory]) -> None:
        group = self.reference.group
        batch, idx = train_batch_of(trajs, group, pad_id=self.pad_id, train=self.train_cfg)
        scores = self.reference.score(batch)
        for t, v in zip(trajs, gather_response_field(trajs, idx, batch, scores, group), strict=True):
            t.ref_logp = v


class CriticScorer:
    """The value model: values before the advantages, one update after the policy's;
    both in the training layout."""

    layout = "training"

    def __init__(self, critic: Critic, *, pad_id: int, algorithm_cfg: AlgorithmConfig) -> None:
        self.critic, self.pad_id, self.cfg = critic, pad_id, algorithm_cfg

    def _batch(self, trajs: Sequence[Trajectory]):  # noqa: ANN202
        return train_batch_of(trajs, self.critic.group, pad_id=self.pad_id,
                              train=self.critic.train_cfg)

    def score(self, trajs: Sequence[Trajectory]) -> None:
        batch, idx = self._batch(trajs)
        values = self.critic.values(batch)
        for t, v in zip(trajs, gather_response_field(trajs, idx, batch, values, self.critic.group),
                        strict=True):
            t.values = v

    def train_step(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        """The critic's updates of the step (`updates.run_updates`, its train config's
        ppo_epochs x mini_batches_per_rollout), against the values of `score`: the
        values of the rollout's step, before any update, so the value clip binds."""

        def step(mini: list[Trajectory], last: bool) -> dict[str, float]:
            batch, idx = self._batch(mini)
            returns_BT = scatter_response_field(batch, idx, [t.returns for t in mini])
            old_BT = scatter_response_field(batch, idx, [t.values for t in mini])
            return self.critic.train_step(batch, returns_BT, old_BT, clip=self.cfg.value_clip,
                                          coef=self.cfg.value_coef, advance_lr=last)

        m = run_updates(trajs, self.critic.train_cfg, self.critic.step, step)
        return {f"critic/{k}": v for k, v in m.items()}
