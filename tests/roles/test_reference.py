"""Reference role: frozen, sharded, outside every optimizer, and equal to the initial
policy's log-probs after the policy trained (2 gloo ranks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_engine.config import AlgorithmConfig
from hybrid_engine.testing import run_ranks

VOCAB = 1001  # odd: uneven row shards


def _reference_checks(root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from hybrid_engine.algorithms import policy_loss_fn
    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.models.tiny import TinyModelSpec, write_tiny_model
    from hybrid_engine.roles import base
    from hybrid_engine.roles.reference import Reference
    from hybrid_engine.roles.trainer import Trainer
    from tests.roles.test_trainer import CHUNK, make_trajs, rank_batch

    if dist.get_rank() == 0:
        write_tiny_model(root, TinyModelSpec(arch="qwen2", vocab_size=VOCAB))
    dist.barrier()
    model_cfg = ModelConfig(compute_dtype="float32")
    trainer = Trainer(root, TrainConfig(lr=1e-3, sharding="full"), model_cfg,
                      logits_chunk_tokens=CHUNK)
    reference = Reference(root, model_cfg, logits_chunk_tokens=CHUNK)
    batch = rank_batch(make_trajs(8, VOCAB))
    initial = trainer.compute_logprobs(batch)[0]
    ref_before = reference.score(batch)
    # Train the policy with the KL term in the loss, so ref_logp flows through the step.
    batch = dataclasses.replace(batch, old_logp_BT=initial, ref_logp_BT=ref_before)
    loss_fn = policy_loss_fn(AlgorithmConfig(kl_coef=0.1))
    kls = [trainer.train_step(batch, loss_fn)["kl"] for _ in range(3)]
    policy_after = trainer.compute_logprobs(batch)[0]
    ref_after = reference.score(batch)
    params = list(reference.module.parameters())
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    return dict(
        equal_before=torch.equal(ref_before, initial),
        equal_after=torch.equal(ref_after, initial),
        policy_moved=float((policy_after - initial).abs().max()),
        kls=kls,
        frozen=all(not p.requires_grad and p.grad is None for p in params),
        in_optimizer=any(id(p) in in_optimizer for p in params),
        sharded=all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params),
        has_optimizer=hasattr(reference, "optimizer"),
        read_fraction=reference.load_stats.elements_read / reference.load_stats.elements_total,
        protocols=isinstance(trainer, base.Trainer) and isinstance(reference, base.Reference),
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_reference_checks, 2, str(tmp_path_factory.mktemp("ref")), timeout=180)


def test_reference_is_frozen_and_sharded(two_ranks):
    for out in two_ranks:
        assert out["frozen"] and not out["in_optimizer"] and not out["has_optimizer"]
        assert out["sharded"], "score() left the reference's FSDP root unsharded"
        assert out["read_fraction"] < 0.51  # each rank loaded about half the model
        assert out["protocols"]  # Trainer and Reference satisfy roles.base


def test_reference_equals_initial_policy_after_training(two_ranks):
    for out in two_ranks:
        # Same weights, same code path, same micro-batches: bitwise equal.
        assert out["equal_before"]
        assert out["policy_moved"] > 1e-3
        assert out["equal_after"]
        assert out["kls"][0] == 0.0 and out["kls"][-1] > 0.0


class _Recorder:
    """Stands in for a role's model: records the micro-batches it is asked to score."""

    group = None  # one process: no group

    def __init__(self) -> None:
        self.bounds: list = []

    def score(self, batch):
        self.bounds.append(list(batch.bounds))
        return torch.zeros(batch.tokens_BT.shape)


@pytest.mark.parametrize("max_tokens, bounds", [(None, [(0, 2), (2, 4)]),
                                                (20, [(0, 1), (1, 2), (2, 4)])])
def test_the_scorers_micro_batch_as_training_does(max_tokens, bounds):
    """The reference and critic scorers take train.max_tokens_per_micro_batch as the
    trainer's path does (it replaces micro_batch_size when set)."""
    from types import SimpleNamespace

    from hybrid_engine.config import TrainConfig
    from hybrid_engine.roles.scorers import CriticScorer, ReferenceScorer
    from hybrid_engine.trajectory import Trajectory

    train = TrainConfig(micro_batch_size=2, max_tokens_per_micro_batch=max_tokens)
    trajs = [Trajectory(prompt_ids=[1] * 4, response_ids=[2] * n, rollout_logp=[0.0] * n)
             for n in (12, 10, 4, 3)]
    ref = _Recorder()
    ReferenceScorer(ref, pad_id=0, train_cfg=train).score(trajs)
    critic = _Recorder()
    CriticScorer(SimpleNamespace(values=critic.score, train_cfg=train, group=None), pad_id=0,
                 algorithm_cfg=AlgorithmConfig()).score(trajs)
    assert ref.bounds == critic.bounds == [bounds]
