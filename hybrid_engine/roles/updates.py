"""PPO's updates per rollout: epochs x shuffled mini-batches, one optimizer step each.

Job: turn one RL step's trajectories into `train.ppo_epochs` x
`train.mini_batches_per_rollout` optimizer steps of a learner (the policy
trainer, the critic), as verl's ppo_epochs / mini-batches, TRL's
num_iterations and OpenRLHF's max_epochs do:

    plan = update_plan(len(trajs), mini_batches=M, epochs=E, seed=...)
    for indices in plan:                  # E * M optimizer steps
        step_fn([trajs[i] for i in indices], last=indices is plan[-1])
    metrics = combine_updates(per_update)

Each mini-batch is spread over the data-parallel ranks like a whole step
(`batch_slices.local_batch`), so every rank takes part in every optimizer step and
the loss of a mini-batch is normalised over that mini-batch only.

Old log-probs (`policy_updates`): before the first of several updates, the
trainer's no-grad log-probs of every trajectory under the current weights
(the rollout's, right after the sync) are stored on the trajectories
(`Trajectory.old_logp`), computed exactly once per step. With a single update
they would equal the current ones, so none are computed (no extra forward:
the ratio is 1 in value, as in GRPO without PPO updates). With
`algorithm.behaviour_logp='rollout'` the loss takes the engine's log-probs
instead and no forward is ever paid (`losses._behaviour_logp`); the
rollout/trainer mismatch metrics then come from the first update alone (its
mini-batch), the only one whose weights have not moved this step.

Invariant: the plan depends only on (count, knobs, seed), so every rank
builds the same one; with one update the plan is the identity (the step is
exactly the single-update step of earlier rounds). The LR schedule advances
once per RL step (at the last update), so `train.num_steps` and
`warmup_steps` count RL steps whatever the number of updates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from hybrid_engine.algorithms.losses import metric_weight
from hybrid_engine.parallel.batch_slices import gather_response_field, train_batch_of

if TYPE_CHECKING:
    from hybrid_engine.config import RunConfig, TrainConfig
    from hybrid_engine.roles.trainer import Trainer
    from hybrid_engine.trajectory import Trajectory

__all__ = ["combine_updates", "compute_old_logp", "num_updates", "policy_updates", "run_updates",
           "update_plan"]

# Per-update metrics that add up over a step's updates; lr is the last one's;
# *_max / *_min are extremes; every other metric is the mean over the updates
# (one measured on a subset of the tokens: weighted by its count, `metric_weight`).
_SUMMED = frozenset({"tokens", "num_micro_batches", "skipped", "train_step_s",
                     "num_loss_tokens"})
_LAST = frozenset({"lr"})


def update_plan(num: int, *, mini_batches: int, epochs: int, seed: int) -> list[list[int]]:
    """Trajectory indices of each optimizer step of one RL step.

    For each epoch, a permutation of range(num) (torch.randperm from one
    generator seeded with seed) cut into min(mini_batches, num) contiguous,
    nearly equal mini-batches. One update in all: [range(num)] unshuffled.

    Raises:
        ValueError: num, mini_batches or epochs < 1.
    """
    if num < 1 or mini_batches < 1 or epochs < 1:
        raise ValueError(f"need num, mini_batches, epochs >= 1, got {num}, {mini_batches}, {epochs}")
    m = min(mini_batches, num)
    if m * epochs == 1:
        return [list(range(num))]
    g = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(epochs):
        perm = torch.randperm(num, generator=g).tolist()
        plan += [perm[num * j // m : num * (j + 1) // m] for j in range(m)]
    return plan


def num_updates(num: int, train_cfg: TrainConfig) -> int:
    """Optimizer steps `update_plan` takes for num trajectories."""
    return min(train_cfg.mini_batches_per_rollout, num) * train_cfg.ppo_epochs


def combine_updates(per_update: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its updates' (see _SUMMED / _LAST), plus
    optimizer_steps: the updates whose step was taken (not skipped)."""
    if not per_update:
        return {}
    out: dict[str, float] = {}
    for key in per_update[0]:
        values = [m[key] for m in per_update if key in m]
        wkey = metric_weight(key)
        if key in _SUMMED:
            out[key] = float(sum(values))
        elif key in _LAST:
            out[key] = values[-1]
        elif wkey != "num_tokens":  # a subset's mean: updates without its tokens do not count
            ws = [(m[key], m[wkey]) for m in per_update if key in m and m.get(wkey, 0.0) > 0]
            if key.endswith(("_max", "_min")):
                out[key] = (max if key.endswith("_max") else min)((v for v, _ in ws), default=0.0)
            else:
                out[key] = sum(v * w for v, w in ws) / max(sum(w for _, w in ws), 1.0)
        elif key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    out["optimizer_steps"] = float(sum(not m.get("skipped", 0.0) for m in per_update))
    return out


def run_updates(
    trajs: Sequence[Trajectory], train_cfg: TrainConfig, seed: int,
    step_fn: Callable[[list[Trajectory], bool], dict[str, float]],
) -> dict[str, float]:
    """Calls step_fn(mini_batch, last) for every update of the plan; combined metrics."""
    plan = update_plan(len(trajs), mini_batches=train_cfg.mini_batches_per_rollout,
                       epochs=train_cfg.ppo_epochs, seed=seed)
    per_update = [step_fn([trajs[i] for i in idx], n == len(plan) - 1)
                  for n, idx in enumerate(plan)]
    return combine_updates(per_update)


def compute_old_logp(trainer: Trainer, trajs: Sequence[Trajectory], pad_id: int,
                     cfg: RunConfig) -> None:
    """Stores every trajectory's old_logp: the trainer's log-probs under its current
    weights, each rank computing its slice, gathered (collective over the trainer's group)."""
    batch, idx = train_batch_of(trajs, trainer.data_group, pad_id=pad_id, train=cfg.train)
    logp_BT, _ = trainer.compute_logprobs(batch)
    for t, v in zip(trajs, gather_response_field(trajs, idx, batch, logp_BT, trainer.data_group),
                    strict=True):
        t.old_logp = v


def policy_updates(
    trainer: Trainer, trajs: Sequence[Trajectory], cfg: RunConfig, pad_id: int,
    step_fn: Callable[[list[Trajectory], bool], dict[str, float]],
) -> dict[str, float]:
    """The policy's updates of one RL step (collective over the trainer's group).

    Old log-probs are computed first when more than one update follows and
    algorithm.behaviour_logp is 'trainer'; otherwise any stale old_logp is
    cleared (the loss then uses the current or the rollout's log-probs).

    Args:
        trainer: the policy trainer (its step seeds the shuffle).
        trajs: the step's trajectories, the same list on every rank.
        cfg: the run config (train.ppo_epochs, train.mini_batches_per_rollout).
        pad_id: padding id of training batches.
        step_fn: one optimizer step on (mini-batch trajectories, last update?).

    Returns:
        The combined metrics (`combine_updates`).
    """
    several = num_updates(len(trajs), cfg.train) > 1
    if several and cfg.algorithm.behaviour_logp == "trainer":
        compute_old_logp(trainer, trajs, pad_id, cfg)
    else:
        for t in trajs:
            t.old_logp = None
        if several:
            step_fn = _mismatch_from_first(step_fn)
    return run_updates(trajs, cfg.train, cfg.seed * 1_000_003 + trainer.step, step_fn)


def _mismatch_from_first(
    step_fn: Callable[[list[Trajectory], bool], dict[str, float]],
) -> Callable[[list[Trajectory], bool], dict[str, float]]:
    """step_fn whose updates after the first drop their mismatch_* metrics: with no
    old log-probs the mismatch is measured on the update's own forward, and only
    the first update's weights are the ones the batch was sampled with (up to
    staleness); later ones have moved, which would count the policy's change
    within this step as engine/trainer numerics (and trip the alarm)."""
    seen = [False]

    def step(mini: list[Trajectory], last: bool) -> dict[str, float]:
        m = step_fn(mini, last)
        if seen[0]:
            m = {k: v for k, v in m.items() if not k.startswith("mismatch_")}
        seen[0] = True
        return m

    return step
