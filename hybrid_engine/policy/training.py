"""What the policy does the same under either placement.

Job: turn the engine's completions into trajectories, sample greedily for
evaluation, and run the policy's updates of one RL step on the trainer
(`policy_train`: train.ppo_epochs x train.mini_batches_per_rollout
optimizer steps, `roles.updates`), for `policy.colocated` and
`policy.separate` alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hybrid_engine.algorithms.losses import LossFn, StepLoss, step_loss
from hybrid_engine.algorithms.mismatch import with_mismatch_metrics
from hybrid_engine.parallel.batch_slices import train_batch_of
from hybrid_engine.roles.updates import policy_updates
from hybrid_engine.trajectory import TrainBatch, Trajectory

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig
    from hybrid_engine.roles.trainer import Trainer
    from hybrid_engine.rollout.engine import Completions

__all__ = ["completions_to_trajectories", "logprob_samples", "sampling_overrides", "policy_loss",
           "policy_step", "policy_train", "refuse_parked_partials", "train_batch"]


def logprob_samples(cfg: RunConfig) -> int | None:
    """Completions per prompt group whose sampled-token log-probs the engine asks
    vLLM for: all (None) when training reads them (algorithm.behaviour_logp=rollout,
    a rollout_correction, kl_in_reward) or samples may be stale (async_rollout.max_staleness > 0:
    partial rollouts, in-flight updates, the drift split); else
    rollout.mismatch_sample, for the mismatch monitor alone. Building a log-prob
    entry per sampled token is host work on vLLM's critical path."""
    alg = cfg.algorithm
    if (alg.behaviour_logp == "rollout" or alg.rollout_correction != "none"
            or (alg.kl_in_reward and alg.kl_coef > 0) or cfg.async_rollout.max_staleness > 0):
        return None
    return cfg.rollout.mismatch_sample


def refuse_parked_partials(state: dict | None) -> None:
    """A policy that keeps no partial rollouts refuses a checkpoint that parked some.

    Raises:
        ValueError: state holds parked partial rollouts (it is not None).
    """
    if state is not None:
        raise ValueError("this checkpoint holds parked partial rollouts, which only "
                         "placement=colocated keeps: resume it colocated")


def completions_to_trajectories(out: Completions) -> list[Trajectory]:
    """One Trajectory per completion, prompt-major, group_id = prompt index."""
    return [
        Trajectory(prompt_ids=list(out.prompt_ids[i // out.num_samples]), response_ids=list(toks),
                   rollout_logp=list(lps), group_id=i // out.num_samples)
        for i, (toks, lps) in enumerate(zip(out.token_ids, out.logprobs, strict=True))
    ]


@contextlib.contextmanager
def sampling_overrides(rollout: Any, sampling: Mapping[str, Any] | None) -> Iterator[None]:
    """Inside: rollout (anything with a RolloutConfig `cfg`) samples with those
    RolloutConfig fields replaced (e.g. {"top_k": 1}: greedy), else as configured."""
    cfg = rollout.cfg
    if sampling:
        rollout.cfg = dataclasses.replace(cfg, **sampling)
    try:
        yield
    finally:
        rollout.cfg = cfg


def train_batch(trajs: Sequence[Trajectory] | TrainBatch, pad_id: int, cfg: RunConfig,
                trainer: Trainer) -> tuple[TrainBatch, range | None]:
    """This rank's TrainBatch of the step's trajectories (its slice over the
    trainer's group) and their indices; a TrainBatch is passed through (indices None)."""
    if isinstance(trajs, TrainBatch):
        return trajs, None
    return train_batch_of(trajs, trainer.data_group, pad_id=pad_id, train=cfg.train)


def policy_loss(cfg: RunConfig, loss: StepLoss | LossFn | None,
                entropy_grad: bool | None) -> StepLoss:
    """The StepLoss a train_step uses: loss as given (an Algorithm's `loss`), a bare
    LossFn with the config's aggregation, or None: the config's (`step_loss`);
    entropy_grad, when given, replaces its entropy term."""
    if not isinstance(loss, StepLoss):
        loss = step_loss(cfg.algorithm, cfg.rollout.max_tokens, loss)
    return loss if entropy_grad is None else dataclasses.replace(loss, entropy_grad=entropy_grad)


def policy_step(trainer: Trainer, batch: TrainBatch, loss: StepLoss, *,
                advance_lr: bool = True, before_update: Callable[[], None] | None = None,
                ) -> dict[str, float]:
    """One optimizer step of the policy trainer on this rank's batch (collective
    over its group), loss.fn wrapped to also report the rollout/trainer
    mismatch; before_update as in `Trainer.train_step`."""
    return trainer.train_step(
        batch, with_mismatch_metrics(loss.fn), loss_agg=loss.agg,
        loss_agg_constant=loss.agg_constant, entropy_grad=loss.entropy_grad,
        advance_lr=advance_lr, before_update=before_update)


def policy_train(trainer: Trainer, cfg: RunConfig, trajs: Sequence[Trajectory] | TrainBatch,
                 pad_id: int, loss: StepLoss | LossFn | None,
                 entropy_grad: bool | None, *, before_update: Callable[[], None] | None = None,
                 ) -> dict[str, float]:
    """The policy's updates of one RL step (collective over the trainer's group):
    `updates.policy_updates` on trajectories (train.ppo_epochs x
    train.mini_batches_per_rollout optimizer steps); one step on a TrainBatch.
    loss: see `policy_loss`; before_update: called before each optimizer step
    (`Trainer.train_step`)."""
    step_loss_ = policy_loss(cfg, loss, entropy_grad)
    if isinstance(trajs, TrainBatch):
        return policy_step(trainer, trajs, step_loss_, before_update=before_update)
    missing = sum(t.advantages is None for t in trajs)
    if missing:  # collate would train them with zero advantages: nothing but the LR moves
        raise ValueError(f"train_step: {missing} of {len(trajs)} trajectories have no advantages "
                         "(set them, e.g. with Algorithm.compute_advantages, first)")

    def step(mini: list[Trajectory], last: bool) -> dict[str, float]:
        batch, _ = train_batch(mini, pad_id, cfg, trainer)
        return policy_step(trainer, batch, step_loss_, advance_lr=last,
                           before_update=before_update)

    return policy_updates(trainer, trajs, cfg, pad_id, step)
