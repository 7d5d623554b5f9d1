"""Roles that live on some ranks of the job, called on every rank.

Job: the controller calls every scorer and learner on every rank (SPMD), but
a placement may build a role on some ranks only (separate: the reference and
the critic on the trainer ranks; grouped: the critic and a reward model on
their own group). These wrappers run each role where it lives and give every
rank its results:

    Mirrored(placement, [Member("reward_model", rm_or_None, "rm_score", per_token=False),
                         Member("reference", scorer_or_None, "ref_logp"),
                         Member("critic", critic_or_None, "values")])
        score(trajs): every role scores on its own ranks first -- roles on
        disjoint groups at the same time: the reward model and the critic
        one after the other while the reference scores -- then each role's
        field is broadcast from the first of its ranks, as one flat float32
        tensor (the response lengths are the same everywhere: no pickling)
    MirroredLearner(placement, "critic", learner_or_None, scores)
        train_step(trajs): the update on its ranks, its metrics broadcast

A role on every rank is called as is, with nothing broadcast. A learner on
some ranks (the critic) reports with its metrics its ranks' own training
seconds (`placement/<role>_train_s`) and, for each role on exactly its ranks
(itself; grouped: a reward model beside it; separate: the reference), the
bytes its scores broadcast (`placement/<role>_bytes`) and its seconds of
scoring (`placement/<role>_score_s`): the work the other group's overlaps. A
role on other ranks (grouped: the reference) reports none, nor does a placed
reward model in a run without a critic."""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from hybrid_engine.parallel.placement import Placement
from hybrid_engine.trajectory import Trajectory

__all__ = ["Member", "Mirrored", "MirroredLearner", "broadcast_field", "broadcast_object", "broadcast_pickled"]


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
            else torch.device("cpu"))


def broadcast_pickled(obj: Any, src: int) -> tuple[Any, int]:
    """(obj of rank src, the bytes of its pickle) on every rank (collective over
    the default group): its size, then its bytes, as two tensor broadcasts."""
    data = pickle.dumps(obj) if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=_device())
    dist.broadcast(size, src=src)
    n = int(size.item())
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_device()) if data
           else torch.empty(n, dtype=torch.uint8, device=_device()))
    dist.broadcast(buf, src=src)
    return (obj if dist.get_rank() == src else pickle.loads(buf.cpu().numpy().tobytes())), n


def broadcast_object(obj: Any, src: int) -> Any:
    """obj of rank src on every rank (collective over the default group)."""
    return broadcast_pickled(obj, src)[0]


def broadcast_field(trajs: Sequence[Trajectory], field: str, src: int, *,
                    per_token: bool = True) -> int:
    """Sets field on every rank's trajs to rank src's values: one flat float32
    broadcast. per_token: a response-local float tensor (R values); else one
    float per trajectory. Returns the bytes broadcast."""
    sizes = [len(t.response_ids) if per_token else 1 for t in trajs]
    if dist.get_rank() == src:
        flat = torch.cat([torch.as_tensor(getattr(t, field), dtype=torch.float32).reshape(-1)
                          for t in trajs]) if trajs else torch.zeros(0)
        if flat.numel() != sum(sizes):
            raise ValueError(f"{field}: {flat.numel()} values for {sum(sizes)} expected")
        flat = flat.to(_device())
    else:
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=_device())
    dist.broadcast(flat, src=src)
    for t, v in zip(trajs, flat.cpu().split(sizes), strict=True):
        setattr(t, field, v if per_token else float(v))
    return flat.numel() * flat.element_size()


class Member(NamedTuple):
    """One role of a `Mirrored`: its name in the placement, its scorer on the
    ranks holding it (else None), the Trajectory field it fills, and whether
    that field holds a value per response token (else one per trajectory)."""

    name: str
    role: Any
    field: str
    per_token: bool = True


class Mirrored:
    """Scorers placed on some ranks, as one scorer every rank calls (see the
    module docstring).

    Args:
        placement: the job's placement.
        members: its `Member`s, in the order they score (on each rank, those it
            holds) and exchange.
    """

    layout = "training"

    def __init__(self, placement: Placement, members: Sequence[Member]) -> None:
        self.placement, self.members = placement, list(members)
        self.bytes = dict.fromkeys((m.name for m in self.members), 0)
        self.seconds = dict.fromkeys((m.name for m in self.members), 0.0)

    def score(self, trajs: Sequence[Trajectory]) -> None:
        for m in self.members:
            if m.role is not None:
                t0 = time.perf_counter()
                m.role.score(trajs)
                self.seconds[m.name] += time.perf_counter() - t0
        for m in self.members:
            ranks = self.placement.ranks[m.name]
            if len(ranks) < self.placement.world:
                self.bytes[m.name] += broadcast_field(trajs, m.field, src=ranks[0],
                                                      per_token=m.per_token)

    def take(self, name: str) -> tuple[int, float]:
        """(bytes broadcast, this rank's seconds scoring) for role name since the
        last call."""
        out = self.bytes[name], self.seconds[name]
        self.bytes[name], self.seconds[name] = 0, 0.0
        return out


class MirroredLearner:
    """A learner placed on some ranks, called on every rank; its metrics come from
    the first of its ranks, with (when it lives on some ranks only) its own
    training seconds, and the bytes broadcast since the last step and the
    scoring seconds of each role on its ranks (see the module docstring).

    Args:
        placement: the job's placement.
        name: its role name.
        role: the learner on the ranks holding it, else None.
        scores: the `Mirrored` that exchanges its scores, for the byte count.
    """

    def __init__(self, placement: Placement, name: str, role: Any, scores: Mirrored) -> None:
        self.placement, self.name, self.role, self.scores = placement, name, role, scores

    def train_step(self, trajs: Sequence[Trajectory]) -> dict[str, float]:
        ranks = self.placement.ranks[self.name]
        # Every member's counts since the last step; those of the roles on this
        # learner's ranks (itself, a reward model beside it) are reported.
        counts = {m.name: self.scores.take(m.name) for m in self.scores.members}
        metrics = None
        if self.role is not None:
            t0 = time.perf_counter()
            metrics = self.role.train_step(trajs)
            if len(ranks) < self.placement.world:
                metrics[f"placement/{self.name}_train_s"] = time.perf_counter() - t0
                for name, (size, score_s) in counts.items():
                    if self.placement.ranks[name] == ranks:
                        metrics[f"placement/{name}_bytes"] = float(size)
                        metrics[f"placement/{name}_score_s"] = score_s
        if len(ranks) == self.placement.world:
            return metrics
        return broadcast_object(metrics, src=ranks[0])
