"""Per-rank slices of a step's trajectories, placeholder rows, and gathering results back."""

from __future__ import annotations

import torch

from hybrid_engine.testing import run_ranks
from hybrid_engine.trajectory import Trajectory


def _trajs(n: int) -> list[Trajectory]:
    return [Trajectory(prompt_ids=[1] * (1 + i % 2), response_ids=list(range(2 + i)),
                       rollout_logp=[-0.5] * (2 + i)) for i in range(n)]


def _rank(n: int) -> dict:
    import torch.distributed as dist

    from hybrid_engine.parallel.batch_slices import gather_response_field, local_batch, scatter_response_field

    trajs = _trajs(n)
    batch, idx = local_batch(trajs, None, pad_id=0, micro_batch_size=2)
    # A per-token "result": 100 * trajectory index + column, computed on this rank only.
    x_BT = torch.zeros(batch.tokens_BT.shape)
    for b, i in enumerate(batch.order_B.tolist()):
        if len(idx):
            x_BT[b] = 100 * idx[i] + torch.arange(x_BT.shape[1])
    got = gather_response_field(trajs, idx, batch, x_BT, None)
    back = scatter_response_field(batch, idx, got)
    return {"idx": list(idx), "loss_tokens": batch.num_loss_tokens, "got": [g.tolist() for g in got],
            "roundtrip": bool(torch.equal(torch.where(batch.loss_mask_BT, back, 0),
                                          torch.where(batch.loss_mask_BT, x_BT, 0))),
            "rank": dist.get_rank()}


def test_slices_cover_every_trajectory_once_and_gather_in_order() -> None:
    out = run_ranks(_rank, 3, 4, timeout=60)
    assert [r["idx"] for r in out] == [[0], [1], [2, 3]]
    for r in out:
        assert r["roundtrip"]
        # Trajectory i's response starts at column P_i: values 100 i + P_i + j.
        for i, g in enumerate(r["got"]):
            p = 1 + i % 2
            assert g == [100 * i + p + j for j in range(2 + i)]


def test_an_empty_slice_gets_a_placeholder_without_loss_tokens() -> None:
    out = run_ranks(_rank, 3, 2, timeout=60)
    assert [r["idx"] for r in out] == [[], [0], [1]]
    assert out[0]["loss_tokens"] == 0 and out[1]["loss_tokens"] > 0
    assert all(len(r["got"]) == 2 for r in out)
