"""Separate placement (`placement=separate`) under torchrun: ranks 0..M-1 only
train, the last rollout.num_ranks only roll out, the controller unchanged.

References: the colocated run with the same trainer world and the same vLLM
replicas, with GPU sleep emulated (identical per-step metrics: same samples, same
updates, so no colocated phase sampled discarded weights) and the naive
sync (identical runs)."""

from __future__ import annotations

import pytest

from tests.policy.runs import rows as _rows
from tests.policy.runs import stable as _stable
from tests.policy.runs import train as _train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Plain GRPO with FSDP2 trainers is the TP=2 test's run below; these two add to it.
ALGORITHMS = {
    # A reference and a critic: built on the trainer ranks, mirrored to the rollout ranks.
    "ppo-kl": ("--algorithm.advantage=gae", "--algorithm.kl_coef=0.05"),
    # The replicated layout (DDP, plain parameters) on the trainer ranks: verified syncs
    # from whole local tensors, each rollout rank served by one trainer.
    "grpo-replicate": ("--train.sharding=replicate",),
}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_separate_equals_colocated_with_the_same_trainers_and_replicas(
        model_dir, reward_file, tmp_path, algorithm) -> None:
    """4 ranks (2 train, 2 single-rank vLLM replicas) vs 2 colocated ranks
    (FSDP2 over 2, two TP=1 replicas): the same samples and updates."""
    sep, col = tmp_path / "separate", tmp_path / "colocated"
    extra = ALGORITHMS[algorithm]
    _train(model_dir, reward_file, sep, 4, "--placement=separate", "--rollout.num_ranks=2",
           "--rollout.tensor_parallel_size=1", *extra)
    _train(model_dir, reward_file, col, 2, "--rollout.tensor_parallel_size=1", *extra)
    rows_sep, rows_col = _rows(sep), _rows(col)
    if algorithm == "ppo-kl":  # the reference and the critic really ran
        assert all("kl" in r and "critic/vf_loss" in r for r in rows_sep[1:]), rows_sep[1].keys()
    assert [r["step"] for r in rows_sep] == [0, 1, 2, 3]
    assert all(r["skipped_degenerate"] == 0.0 for r in rows_sep[1:])  # every step trained
    assert [_stable(r) for r in rows_sep] == [_stable(r) for r in rows_col]
    # The rollout ranks received their whole weights; the trainers released nothing.
    assert all(r["sync_bytes_received"] > 0 and r["mem_released_bytes"] == 0 for r in rows_sep[1:])
    assert (sep / "final" / "COMPLETE").is_file()


def test_separate_tp2_verified_sync_equals_naive(model_dir, reward_file, tmp_path) -> None:
    """3 ranks: rank 0 trains, ranks 1-2 run one TP=2 engine. Every sync is
    verified bit for bit (sync.verify) and receives the planner's minimum;
    the naive sync gives the same run. (Resuming a separate run: tests/policy/
    test_async.py and the killed rollout ranks of tests/test_faults.py.)"""
    import torch

    from hybrid_engine.reshard.layouts import model_dims
    from hybrid_engine.models.tiny import PRESETS, hf_config
    from hybrid_engine.reshard.plan import build_plan

    args = ("--placement=separate", "--rollout.num_ranks=2", "--rollout.tensor_parallel_size=2")
    ours, naive = tmp_path / "ours", tmp_path / "naive"
    _train(model_dir, reward_file, ours, 3, *args, "--sync.verify=true")
    _train(model_dir, reward_file, naive, 3, *args, "--sync.method=naive")
    rows = _rows(ours)
    assert all(r["skipped_degenerate"] == 0.0 for r in rows[1:])
    assert [_stable(r) for r in rows] == [_stable(r) for r in _rows(naive)]
    plan = build_plan(model_dims(hf_config(PRESETS["tiny"])), 3, 2, num_trainers=1)
    itemsize = torch.empty((), dtype=torch.float32).element_size()  # the recipe's rollout dtype
    for r in rows[1:]:
        assert r["sync_bytes_received"] == plan.elements_received(1) * itemsize
        assert r["sync_bytes_local"] == 0
        assert r["mismatch_abs_max"] < 1e-4  # fp32: the engine samples the trained weights
