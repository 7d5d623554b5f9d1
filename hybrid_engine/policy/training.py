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
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hybrid_engine.algorithms.losses import LossFn, policy_loss_fn
from hybrid_engine.algorithms.mismatch import with_mismatch_metrics
from hybrid_engine.parallel.batch_slices import train_batch_of
from hybrid_engine.roles.updates import policy_updates
from hybrid_engine.trajectory import TrainBatch, Trajectory

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig
    from hybrid_engine.roles.trainer import Trainer
    from hybrid_engine.rollout.engine import Completions

__all__ = ["completions_to_trajectories", "logprob_samples", "sampling_overrides", "policy_step",
           "policy_train", "train_batch"]


def logprob_samples(cfg: RunConfig) -> int | None:
    """Completions per prompt group whose sampled-token log-probs the engine asks
    vLLM for: all (None) when training reads them (algorithm.behaviour_logp=rollout,
    tis_cap, kl_in_reward) or samples may be stale (async_rollout.max_staleness > 0:
    partial rollouts, in-flight updates, the drift split); else
    rollout.mismatch_sample, for the mismatch monitor alone. Building a log-prob
    entry per sampled token is host work on vLLM's critical path."""
    alg = cfg.algorithm
    if (alg.behaviour_logp == "rollout" or alg.tis_cap is not None
            or (alg.kl_in_reward and alg.kl_coef > 0) or cfg.async_rollout.max_staleness > 0):
        return None
    return cfg.rollout.mismatch_sample


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


def train_batch(trajs: Sequence[Trajectory] | TrainBatch, pad_id: int,
                cfg: RunConfig) -> tuple[TrainBatch, range | None]:
    """This rank's TrainBatch of the step's trajectories (and their indices);
    a TrainBatch is passed through (indices None)."""
    if isinstance(trajs, TrainBatch):
        return trajs, None
    return train_batch_of(trajs, pad_id=pad_id, train=cfg.train)


def policy_step(trainer: Trainer, cfg: RunConfig, batch: TrainBatch, loss_fn: LossFn | None,
                entropy_grad: bool | None, *, advance_lr: bool = True) -> dict[str, float]:
    """One optimizer step of the policy trainer on this rank's batch (collective
    over the train group); loss_fn None = `policy_loss_fn(cfg.algorithm)`,
    wrapped to also report the rollout/trainer mismatch."""
    alg = cfg.algorithm
    constant = alg.loss_agg_constant or float(cfg.rollout.max_tokens)
    if loss_fn is None:
        loss_fn = policy_loss_fn(alg, constant=constant if alg.loss_agg == "constant" else None)
    return trainer.train_step(
        batch, with_mismatch_metrics(loss_fn), loss_agg=alg.loss_agg,
        loss_agg_constant=constant if alg.loss_agg == "constant" else None,
        entropy_grad=alg.entropy_coef != 0 if entropy_grad is None else entropy_grad,
        advance_lr=advance_lr)


def policy_train(trainer: Trainer, cfg: RunConfig, trajs: Sequence[Trajectory] | TrainBatch,
                 pad_id: int, loss_fn: LossFn | None,
                 entropy_grad: bool | None) -> dict[str, float]:
    """The policy's updates of one RL step (collective over the train group):
    `updates.policy_updates` on trajectories (train.ppo_epochs x
    train.mini_batches_per_rollout optimizer steps); one step on a TrainBatch."""
    if isinstance(trajs, TrainBatch):
        return policy_step(trainer, cfg, trajs, loss_fn, entropy_grad)
    missing = sum(t.advantages is None for t in trajs)
    if missing:  # collate would train them with zero advantages: nothing but the LR moves
        raise ValueError(f"train_step: {missing} of {len(trajs)} trajectories have no advantages "
                         "(set them, e.g. with Algorithm.compute_advantages, first)")

    def step(mini: list[Trajectory], last: bool) -> dict[str, float]:
        batch, _ = train_batch(mini, pad_id, cfg)
        return policy_step(trainer, cfg, batch, loss_fn, entropy_grad, advance_lr=last)

    return policy_updates(trainer, trajs, cfg, pad_id, step)
