"""Trajectory -> TrainBatch: alignment, sorting, micro-batches, normaliser invariance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_engine.algorithms import LossInputs, loss_normalizer, policy_loss_fn
from hybrid_engine.algorithms.aggregation import LOSS_AGG_MODES
from hybrid_engine.config import AlgorithmConfig
from hybrid_engine.trajectory import Trajectory, collate_trajectories, micro_batch_bounds

PAD = 0


def _traj(prompt_len: int, response_len: int, seed: int, *, env_token: bool = False) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    mask = [True] * response_len
    if env_token and response_len:
        mask[response_len // 2] = False  # a tool token in the middle of the response
    return Trajectory(
        prompt_ids=torch.randint(1, 100, (prompt_len,), generator=g).tolist(),
        response_ids=torch.randint(1, 100, (response_len,), generator=g).tolist(),
        rollout_logp=(-torch.rand(response_len, generator=g)).tolist(),
        advantages=torch.randn(response_len, generator=g),
        loss_mask=mask,
        reward=float(seed),
        group_id=seed // 2,
    )


def _trajs(n: int = 9) -> list[Trajectory]:
    lens = [(3, 5), (7, 1), (2, 12), (4, 0), (5, 5), (1, 9), (6, 3), (2, 2), (8, 8)]
    return [_traj(p, r, i, env_token=i % 3 == 0) for i, (p, r) in enumerate(lens[:n])]


def test_alignment_of_response_fields():
    t = Trajectory(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11],
                   rollout_logp=[-0.1, -0.2, -0.3, -0.4], advantages=[1.0, 2.0, 3.0, 4.0],
                   loss_mask=[True, True, False, True], ref_logp=[-1.0, -2.0, -3.0, -4.0])
    short = Trajectory(prompt_ids=[1], response_ids=[2], rollout_logp=[-0.5], advantages=[0.5])
    with pytest.raises(ValueError, match="ref_logp"):
        collate_trajectories([t, short], pad_id=PAD)  # ref_logp on some trajectories only
    short.ref_logp = [-9.0]
    b = collate_trajectories([short, t], pad_id=PAD)
    assert b.order_B.tolist() == [1, 0]  # longest first
    assert b.tokens_BT.tolist() == [[5, 6, 7, 8, 9, 10, 11], [1, 2, 0, 0, 0, 0, 0]]
    assert b.attention_mask_BT[0].all() and b.attention_mask_BT[1].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert b.position_ids_BT[1].tolist() == list(range(7))
    # Column 3 + j holds response token j; its fields refer to predicting that token.
    assert b.loss_mask_BT[0].tolist() == [False] * 3 + [True, True, False, True]
    assert b.rollout_logp_BT[0, 3:].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert b.advantages_BT[0, 3:].tolist() == [1.0, 2.0, 0.0, 4.0]  # zeroed on the env token
    assert b.ref_logp_BT[0, 3:].tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert b.loss_mask_BT[1].tolist() == [False, True] + [False] * 5
    assert b.advantages_BT[1].tolist() == [0.0, 0.5] + [0.0] * 5
    assert b.old_logp_BT is None and b.prompt_lens_B.tolist() == [3, 1]
    assert b.seq_lens_B.tolist() == [7, 2] and b.num_loss_tokens == 4
    back = b.per_trajectory(b.ref_logp_BT)
    assert back[0].tolist() == [-9.0] and back[1].tolist() == [-1.0, -2.0, -3.0, -4.0]


def test_trajectory_defaults_and_errors():
    t = Trajectory(prompt_ids=[1], response_ids=[2, 3], rollout_logp=[0.0, 0.0])
    assert t.loss_mask == [True, True] and t.degenerate is False and t.info == {"degenerate": False}
    t.info["degenerate"] = True
    assert t.degenerate
    b = collate_trajectories([t], pad_id=PAD)
    assert b.advantages_BT.abs().sum() == 0 and b.ref_logp_BT is None  # not filled yet
    with pytest.raises(ValueError, match="prompt_ids"):
        Trajectory(prompt_ids=[], response_ids=[2], rollout_logp=[0.0])
    with pytest.raises(ValueError, match="rollout_logp"):
        Trajectory(prompt_ids=[1], response_ids=[2], rollout_logp=[0.0, 0.0])
    with pytest.raises(ValueError, match="advantages"):
        collate_trajectories([dataclasses.replace(t, advantages=[1.0])], pad_id=PAD)
    with pytest.raises(ValueError, match="at least one"):
        collate_trajectories([], pad_id=PAD)
    with pytest.raises(ValueError, match="not both"):
        collate_trajectories([t], pad_id=PAD, micro_batch_size=1, max_tokens_per_micro_batch=8)


def test_micro_batch_bounds():
    lens = [10, 9, 5, 5, 4, 1]
    assert micro_batch_bounds(lens) == ((0, 6),)
    assert micro_batch_bounds(lens, micro_batch_size=4) == ((0, 4), (4, 6))
    # Greedy padded budget: rows * first (longest) row length <= 20; a row longer than it alone.
    assert micro_batch_bounds(lens, max_tokens=20) == ((0, 2), (2, 6))
    assert micro_batch_bounds(lens, max_tokens=8) == ((0, 1), (1, 2), (2, 3), (3, 4), (4, 6))
    assert micro_batch_bounds([], micro_batch_size=2) == ()
    with pytest.raises(ValueError):
        micro_batch_bounds(lens, micro_batch_size=0)


def test_micro_batches_are_trimmed_sorted_slices():
    trajs = _trajs()
    b = collate_trajectories(trajs, pad_id=PAD, micro_batch_size=3)
    assert b.seq_lens_B.tolist() == sorted(b.seq_lens_B.tolist(), reverse=True)
    mbs = list(b.micro_batches())
    assert [mb.num_seqs for mb in mbs] == [3, 3, 3]
    for (start, end), mb in zip(b.bounds, mbs):
        width = int(b.seq_lens_B[start])
        assert mb.tokens_BT.shape == (end - start, width)
        assert torch.equal(mb.tokens_BT, b.tokens_BT[start:end, :width])
        assert not b.attention_mask_BT[start:end, width:].any()  # only padding cut
    # Sorting bounds the padding: compare with the same split of the unsorted list.
    unsorted = sum(3 * max(t.num_tokens for t in trajs[i:i + 3]) for i in range(0, 9, 3))
    assert b.padding_fraction() < 1 - int(b.seq_lens_B.sum()) / unsorted
    assert b.padding_fraction() < 0.2
    packed = list(b.micro_batches(max_tokens=32))
    assert all(mb.tokens_BT.numel() <= 32 for mb in packed)
    assert sum(mb.num_seqs for mb in packed) == 9
    empty = b.empty_like()
    assert empty.num_seqs == 1 and not empty.loss_mask_BT.any() and not empty.advantages_BT.any()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_membership_does_not_change_the_loss(mode):
    trajs = _trajs()
    cfg = AlgorithmConfig(loss_agg=mode, loss_agg_constant=16.0, kl_coef=0.1)
    loss_fn = policy_loss_fn(cfg)
    g = torch.Generator().manual_seed(0)

    b = collate_trajectories(trajs, pad_id=PAD)
    shape = b.tokens_BT.shape
    logp_BT = -torch.rand(shape, generator=g)  # stands in for the policy's log-probs
    b = dataclasses.replace(b, ref_logp_BT=-torch.rand(shape, generator=g),
                            old_logp_BT=logp_BT + 0.1 * torch.randn(shape, generator=g))
    norm = loss_normalizer(b.loss_mask_BT, mode, constant=16.0)  # of the WHOLE batch

    def total(**split) -> torch.Tensor:
        out = torch.zeros(())
        for start, end in micro_batch_bounds(b.seq_lens_B.tolist(), **split):
            mb = b.rows(start, end)
            lp = logp_BT[start:end, : mb.tokens_BT.shape[1]]
            out = out + loss_fn(LossInputs(logp_BT=lp, advantages_BT=mb.advantages_BT,
                                           mask_BT=mb.loss_mask_BT, old_logp_BT=mb.old_logp_BT,
                                           ref_logp_BT=mb.ref_logp_BT), norm)[0]
        return out

    whole = loss_fn(LossInputs(logp_BT=logp_BT, advantages_BT=b.advantages_BT,
                               mask_BT=b.loss_mask_BT, old_logp_BT=b.old_logp_BT,
                               ref_logp_BT=b.ref_logp_BT))[0]
    for split in ({"micro_batch_size": 1}, {"micro_batch_size": 4}, {"max_tokens": 25}):
        torch.testing.assert_close(total(**split), whole, rtol=1e-6, atol=1e-7)


def test_values_returns_and_token_versions_are_typed_fields_that_survive_json():
    """Core data between roles travels in typed fields (and a checkpoint that kept
    them under info loads into them)."""
    import json

    from hybrid_engine.trajectory import Trajectory, trajectory_from_json, trajectory_to_json

    t = Trajectory(prompt_ids=[1], response_ids=[2, 3], rollout_logp=[-0.5, -0.25],
                   values=[0.5, 1.0], returns=[1.0, 1.0], token_versions=[3, 4])
    back = trajectory_from_json(json.loads(json.dumps(trajectory_to_json(t))))
    assert (back.values, back.returns, back.token_versions) == ([0.5, 1.0], [1.0, 1.0], [3, 4])
    old = trajectory_to_json(Trajectory(prompt_ids=[1], response_ids=[2], rollout_logp=[0.0]))
    old["info"].update(values=[0.5], returns=[1.0], token_versions=[7])
    del old["values"], old["returns"], old["token_versions"]
    loaded = trajectory_from_json(old)
    assert (loaded.values, loaded.returns, loaded.token_versions) == ([0.5], [1.0], [7])
    assert set(loaded.info) == {"degenerate"}
