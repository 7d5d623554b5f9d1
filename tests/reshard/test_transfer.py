"""ReshardExecutor on real gloo ranks: bit-exact vs the independent layout, minimal bytes."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.testing import run_ranks

_SLOW = pytest.mark.slow
CASES = [(2, 2), (4, 2), pytest.param(2, 1, marks=_SLOW), pytest.param(4, 1, marks=_SLOW),
         pytest.param(4, 4, marks=_SLOW)]


def _full_tensors(shapes, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(r, c, generator=g) for n, (r, c) in shapes.items()}


def _run_executor(spec_name: str, tp: int, wire: str, bucket_elems: int) -> dict:
    import torch.distributed as dist

    from hybrid_engine.reshard.layouts import model_dims
    from hybrid_engine.models.tiny import hf_config
    from hybrid_engine.reshard.plan import build_plan, shard_rows
    from hybrid_engine.reshard.transfer import ReshardExecutor
    from tests.reshard.test_plan import SPECS, _expected

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = model_dims(hf_config(SPECS[spec_name]))
    plan = build_plan(dims, world, tp, bucket_elems=bucket_elems)
    full = _full_tensors(plan.hf_shapes, seed=7)
    sources = {n: t[slice(*shard_rows(t.shape[0], world, rank))].clone() for n, t in full.items()}
    dtype = getattr(torch, wire)
    targets = {t.name: torch.zeros(t.shape, dtype=dtype) for t in plan.targets[rank]}
    ex = ReshardExecutor(plan, rank, wire_dtype=dtype)
    stats = ex.run(sources, targets)
    want = _expected(full, dims, tp, rank % tp)
    mismatched = [n for n in want if not torch.equal(targets[n], want[n].to(dtype))]
    # A second run (tables and buffers reused) gives the same result.
    for t in targets.values():
        t.zero_()
    ex.run(sources, targets)
    mismatched += [f"rerun:{n}" for n in want if not torch.equal(targets[n], want[n].to(dtype))]
    return {"mismatched": mismatched, "bytes_received": stats.bytes_received,
            "min_bytes": plan.elements_received(rank) * targets[next(iter(targets))].element_size(),
            "num_buckets": stats.num_buckets, "buffer_bytes": ex.buffer_bytes,
            "bucket_bytes": bucket_elems * torch.empty((), dtype=dtype).element_size()}


@pytest.mark.parametrize("world,tp", CASES)
@pytest.mark.parametrize("spec", ["qwen2", pytest.param("llama-kv1-tied", marks=_SLOW)])
def test_executor_matches_layout_bit_for_bit(world, tp, spec):
    outs = run_ranks(_run_executor, world, spec, tp, "bfloat16", 4000, timeout=120)
    for r, o in enumerate(outs):
        assert o["mismatched"] == [], f"rank {r}: {o['mismatched'][:5]}"
        assert o["bytes_received"] == o["min_bytes"]
        assert o["num_buckets"] > 1 or o["bytes_received"] <= o["bucket_bytes"]
        assert o["buffer_bytes"] <= 2 * o["bucket_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["qwen3-kv1", "qwen2-mha-tied"])
def test_executor_fp32_wire_other_architectures(spec):
    outs = run_ranks(_run_executor, 4, spec, 2, "float32", 1 << 20, timeout=120)
    for r, o in enumerate(outs):
        assert o["mismatched"] == [] and o["bytes_received"] == o["min_bytes"], r
