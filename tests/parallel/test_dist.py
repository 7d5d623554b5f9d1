"""Process-group helpers on 2 real gloo ranks: the collective timeout reaches
groups made after the default one, and a collective whose peer never comes
raises after it instead of hanging."""

from __future__ import annotations

import pytest

from hybrid_engine.testing import run_ranks


def _timeout_case() -> dict:
    import time

    import torch
    import torch.distributed as dist

    from hybrid_engine.parallel.dist import collective_timeouts, set_collective_timeout

    group = dist.new_group([0, 1])  # like vLLM's: torch gives it 30 min, whatever the default's
    before = collective_timeouts()
    set_collective_timeout(2.0)
    out = {"before": sorted(before.values()), "after": sorted(collective_timeouts().values())}
    if dist.get_rank() == 1:
        time.sleep(5)  # a stuck peer: never joins the all_reduce below (alive past rank 0's 2 s)
        return out
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)[:200]
    out["waited_s"] = time.monotonic() - t0
    return out


def test_collective_timeout_covers_every_group() -> None:
    r0, r1 = run_ranks(_timeout_case, 2, timeout=60)
    assert 1800.0 in r0["before"]  # new_group's own default (gloo: 30 min)
    assert r0["after"] == r1["after"] == [2.0, 2.0]  # the default group and the new one
    assert r0["raised"] is not None and "timed out" in r0["raised"].lower(), r0["raised"]
    assert 1.5 < r0["waited_s"] < 6.0


def _ragged_case(model_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from hybrid_engine.config import ModelConfig, TrainConfig
    from hybrid_engine.parallel.dist import all_gather_ragged
    from hybrid_engine.parallel.sharding import resolve_alone

    rank = dist.get_rank()
    out = {}
    for name, dtype in [("f32", torch.float32), ("i64", torch.int64), ("bf16", torch.bfloat16),
                        ("f64", torch.float64)]:
        # rank 0: three rows (one empty), rank 1: none, rank 2: one long row
        rows = {0: [torch.arange(3), torch.arange(0), torch.arange(5) * -1.5],
                1: [], 2: [torch.arange(7) / 3]}[rank]
        out[name] = all_gather_ragged([r.to(dtype) for r in rows])
    out["none"] = all_gather_ragged([])
    try:
        all_gather_ragged([torch.ones(2, dtype=torch.float32 if rank else torch.int64)])
        out["mixed"] = ""
    except ValueError as e:
        out["mixed"] = str(e)
    # train.sharding=auto for a trainer built on ranks 0 and 2 alone: its one
    # collective is over their group (over the world, rank 1 would never join)
    group = dist.new_group([0, 2])
    if rank != 1:
        out["alone"] = resolve_alone(model_dir, TrainConfig(), ModelConfig(), group,
                                     torch.device("cpu")).sharding
    return out


def test_all_gather_ragged_moves_any_rows_as_tensors(tmp_path) -> None:
    """Results between ranks as tensors: every rank gets every rank's rows, in order,
    bit for bit, whatever their count and lengths (none, empty rows) and dtype. In
    the same ranks, a trainer's sharding=auto resolves over its own group."""
    import torch

    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    want = [[torch.arange(3), torch.arange(0), torch.arange(5) * -1.5], [],
            [torch.arange(7) / 3]]
    model = str(write_tiny_model(tmp_path / "tiny", PRESETS["tiny"]))
    results = run_ranks(_ragged_case, 3, model, timeout=120)
    assert [r.get("alone") for r in results] == ["replicate", None, "replicate"]
    for got in results:
        for name, dtype in [("f32", torch.float32), ("i64", torch.int64),
                            ("bf16", torch.bfloat16), ("f64", torch.float64)]:
            rows = got[name]
            assert [len(r) for r in rows] == [3, 0, 1]
            for mine, ref in zip(rows, want, strict=True):
                for a, b in zip(mine, ref, strict=True):
                    assert a.dtype == dtype and torch.equal(a, b.to(dtype)), name
        assert got["none"] == [[], [], []]
        assert "one dtype" in got["mixed"]
