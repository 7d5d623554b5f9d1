"""Which trajectories each data-parallel rank works on, and putting results back.

Job: every rank holds the whole step's trajectories (the rollout gathers
them); the FSDP2 roles (trainer, reference, critic) each process only this
rank's contiguous slice, ranks counted in the role's group (the ranks the
placement gives it: `Trainer.group`, every rank when colocated). `local_batch`
collates that slice, and `gather_response_field` gives every rank of that
group the per-token results of every slice, so the algorithm then runs on
identical data everywhere.

Invariant: a rank whose slice is empty still takes part in every collective:
it gets a one-row batch whose loss mask is all False (a copy of the first
trajectory), which contributes nothing to any loss, normaliser or metric.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from hybrid_engine.parallel.dist import all_gather_ragged
from hybrid_engine.trajectory import TrainBatch, Trajectory, collate_trajectories

if TYPE_CHECKING:
    from hybrid_engine.config import TrainConfig

__all__ = ["gather_response_field", "local_batch", "local_range", "scatter_response_field",
           "train_batch_of"]


Group = dist.ProcessGroup | None  # None: the default group


def _rank_world(group: Group) -> tuple[int, int]:
    """(rank, size) in group; (0, 1) when not distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def local_range(num: int, group: Group) -> range:
    """This rank's contiguous share of num items over group (the first num %
    size ranks get one more)."""
    rank, world = _rank_world(group)
    return range(num * rank // world, num * (rank + 1) // world)


def local_batch(
    trajs: Sequence[Trajectory], group: Group, *, pad_id: int,
    micro_batch_size: int | None = None, max_tokens_per_micro_batch: int | None = None,
) -> tuple[TrainBatch, range]:
    """This rank's trajectories (its slice over group) collated, and their indices in trajs.

    Raises:
        ValueError: trajs is empty.
    """
    if not trajs:
        raise ValueError("local_batch needs at least one trajectory")
    idx = local_range(len(trajs), group)
    mine = [trajs[i] for i in idx]
    if not mine:  # a placeholder row: no loss token, so no contribution
        t = trajs[0]
        mine = [dataclasses.replace(t, loss_mask=[False] * len(t.response_ids), info={})]
    if max_tokens_per_micro_batch is not None:
        micro_batch_size = None
    batch = collate_trajectories(mine, pad_id=pad_id, micro_batch_size=micro_batch_size,
                                 max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    return batch, idx


def train_batch_of(trajs: Sequence[Trajectory], group: Group, *, pad_id: int,
                   train: TrainConfig) -> tuple[TrainBatch, range]:
    """`local_batch` with train's micro-batch bounds (micro_batch_size, or
    max_tokens_per_micro_batch): what the policy, its reference and the critic
    all score and train on."""
    return local_batch(trajs, group, pad_id=pad_id, micro_batch_size=train.micro_batch_size,
                       max_tokens_per_micro_batch=train.max_tokens_per_micro_batch)


def gather_response_field(
    trajs: Sequence[Trajectory], idx: range, batch: TrainBatch, x_BT: Tensor, group: Group,
) -> list[Tensor]:
    """Response-local slices of this rank's [B, T] result for every trajectory of
    the step (collective over group: gathered from its ranks, in trajs' order)."""
    local = [v.detach().cpu().float() for v in batch.per_trajectory(x_BT)][: len(idx)]
    _, world = _rank_world(group)
    if world == 1:
        return local
    out = [v for part in all_gather_ragged(local, group) for v in part]
    if len(out) != len(trajs):
        raise AssertionError(f"gathered {len(out)} rows for {len(trajs)} trajectories")
    return out


def scatter_response_field(batch: TrainBatch, idx: range, values: Sequence[Tensor]) -> Tensor:
    """[B, T] float32 tensor with this rank's trajectories' response-local values
    (values indexed like the step's trajectories) at their batch positions; 0 elsewhere."""
    out = torch.zeros(batch.tokens_BT.shape, dtype=torch.float32)
    if not len(idx):
        return out  # the placeholder row
    spans = zip(batch.order_B.tolist(), batch.prompt_lens_B.tolist(), batch.seq_lens_B.tolist())
    for b, (i, p, s) in enumerate(spans):
        out[b, p:s] = torch.as_tensor(values[idx[i]], dtype=torch.float32)
    return out
