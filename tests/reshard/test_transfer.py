"""ReshardExecutor on real gloo ranks: bit-exact vs the independent layout, minimal bytes."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_engine.testing import run_ranks

_SLOW = pytest.mark.slow
CASES = [(2, 2), (4, 2), pytest.param(2, 1, marks=_SLOW), pytest.param(4, 1, marks=_SLOW),
         pytest.param(4, 4, marks=_SLOW)]
SPECS_BF16 = ["qwen2", pytest.param("llama-kv1-tied", marks=_SLOW)]
FP32_SPECS = ["qwen3-kv1", "qwen2-mha-tied"]


def _values(params) -> list[tuple]:  # noqa: ANN001
    """The argument tuples of a parametrize list (pytest.param or plain)."""
    return [p.values if hasattr(p, "values") else p if isinstance(p, tuple) else (p,)
            for p in params]


# Every executor case of this file, by world size: (spec, tp, wire dtype, bucket elements).
# Each world size's cases run in one launch of that many ranks (the cases are
# milliseconds; a launch is seconds); each test then checks its own case.
RUNS: dict[int, list[tuple]] = {}
for (_spec,) in _values(SPECS_BF16):
    for _world, _tp in _values(CASES):
        RUNS.setdefault(_world, []).append((_spec, _tp, "bfloat16", 4000))
for (_spec,) in _values(FP32_SPECS):
    RUNS[4].append((_spec, 2, "float32", 1 << 20))
# `hybrid-engine plan` against the executor: full sharding (a case above) and hybrid.
PLAN_CASES = {"full": ("qwen2", 2, "bfloat16", 4000), "hybrid": ("qwen2", 2, "bfloat16", 4000, 2)}
RUNS[4].append(PLAN_CASES["hybrid"])


def _full_tensors(shapes, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(r, c, generator=g) for n, (r, c) in shapes.items()}


def _run_executor(spec_name: str, tp: int, wire: str, bucket_elems: int,
                  shard: int | None = None) -> dict:
    import torch.distributed as dist

    from hybrid_engine.reshard.layouts import model_dims
    from hybrid_engine.models.tiny import hf_config
    from hybrid_engine.reshard.plan import build_plan, shard_rows
    from hybrid_engine.reshard.transfer import ReshardExecutor
    from tests.reshard.test_plan import SPECS, _expected

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = model_dims(hf_config(SPECS[spec_name]))
    plan = build_plan(dims, world, tp, bucket_elems=bucket_elems, shard_group_size=shard)
    full = _full_tensors(plan.hf_shapes, seed=7)
    s = shard or world
    sources = {n: t[slice(*shard_rows(t.shape[0], s, rank % s))].clone() for n, t in full.items()}
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
            "bytes_sent": stats.bytes_sent, "messages": stats.messages_received,
            "min_bytes": plan.elements_received(rank) * targets[next(iter(targets))].element_size(),
            "num_buckets": stats.num_buckets, "buffer_bytes": ex.buffer_bytes,
            "bucket_bytes": bucket_elems * torch.empty((), dtype=dtype).element_size()}


def _run_cases(cases: list[tuple]) -> dict[tuple, dict | str]:
    """Every case on this rank: its result, or its error as text (only its test fails)."""
    import traceback

    out = {}
    for case in cases:
        try:
            out[case] = _run_executor(*case)
        except Exception:  # noqa: BLE001  (reported by the case's test)
            out[case] = traceback.format_exc()
    return out


def _case_of(item) -> tuple[int, tuple] | None:  # noqa: ANN001
    """(world, case) of a collected executor test of this file, else None."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.originalname == "test_executor_matches_layout_bit_for_bit":
        return params["world"], (params["spec"], params["tp"], "bfloat16", 4000)
    if item.originalname == "test_executor_fp32_wire_other_architectures":
        return 4, (params["spec"], 2, "float32", 1 << 20)
    if item.originalname == "test_plan_command_counts_what_the_executor_moves":
        return 4, PLAN_CASES[params["sharding"]]
    return None


@pytest.fixture(scope="module")
def executor_runs(request):  # noqa: ANN001, ANN201
    """world -> every rank's {case: result}: one launch per world size, on first use,
    of the cases this session selected (`-m "not slow"` runs the fast ones only)."""
    selected = {_case_of(item) for item in request.session.items} - {None}
    done: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in done:
            cases = [c for c in RUNS[world] if (world, c) in selected]
            done[world] = run_ranks(_run_cases, world, cases, timeout=180)
        return done[world]

    return get


def _case_outputs(executor_runs, world: int, case: tuple) -> list[dict]:  # noqa: ANN001
    outs = [by_case[case] for by_case in executor_runs(world)]
    for r, o in enumerate(outs):
        assert not isinstance(o, str), f"rank {r} raised:\n{o}"
    return outs


@pytest.mark.parametrize("world,tp", CASES)
@pytest.mark.parametrize("spec", SPECS_BF16)
def test_executor_matches_layout_bit_for_bit(executor_runs, world, tp, spec):
    outs = _case_outputs(executor_runs, world, (spec, tp, "bfloat16", 4000))
    for r, o in enumerate(outs):
        assert o["mismatched"] == [], f"rank {r}: {o['mismatched'][:5]}"
        assert o["bytes_received"] == o["min_bytes"]
        assert o["num_buckets"] > 1 or o["bytes_received"] <= o["bucket_bytes"]
        assert o["buffer_bytes"] <= 2 * o["bucket_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", FP32_SPECS)
def test_executor_fp32_wire_other_architectures(executor_runs, spec):
    outs = _case_outputs(executor_runs, 4, (spec, 2, "float32", 1 << 20))
    for r, o in enumerate(outs):
        assert o["mismatched"] == [] and o["bytes_received"] == o["min_bytes"], r


@pytest.mark.parametrize("sharding", ["full", "hybrid"])
def test_plan_command_counts_what_the_executor_moves(executor_runs, tmp_path, capsys, sharding):
    """`hybrid-engine plan` on 2 "nodes" of 2 gives, per rank, the bytes and messages
    the executor measured on 4 real ranks, and splits them by node."""
    from hybrid_engine.models.tiny import hf_config
    from tests.reshard.test_costs import plan_cli
    from tests.reshard.test_plan import SPECS

    outs = _case_outputs(executor_runs, 4, PLAN_CASES[sharding])
    hf_config(SPECS["qwen2"]).save_pretrained(tmp_path)
    assert plan_cli(["--config", str(tmp_path / "config.json"), "--nodes", "2",
                 "--devices-per-node", "2", "--tp", "2", "--sharding", sharding,
                 "--bucket-mb", str(4000 * 2 / 2**20), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["shard_group_size"] == {"full": 4, "hybrid": 2}[sharding]
    for o, r in zip(outs, rep["per_rank"], strict=True):
        assert o["mismatched"] == []
        assert r["recv_intra"] + r["recv_inter"] == o["bytes_received"] > 0
        assert r["sent_intra"] + r["sent_inter"] == o["bytes_sent"]
        assert r["messages"] == o["messages"] > 0
        # hybrid: a node is a shard group and a TP group, so nothing leaves it
        assert (r["recv_inter"] == 0) == (sharding == "hybrid")


def _fsdp_sync_case(model_dir: str, tp: int) -> dict:
    """A real FSDP2 layout (this rank's Shard(0) rows, on the backend's device: CUDA
    under NCCL) moved by the sync's executor into TP-local tensors beside it,
    compared with the layout sliced from the checkpoint's full tensors. Taken
    right after a forward with no backward, which leaves the root's parameters
    (embed, norm, lm_head) gathered: `sources` must still give this rank's shards."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from hybrid_engine.config import SyncConfig
    from hybrid_engine.parallel.fsdp import build_fsdp_model, dp_mesh
    from hybrid_engine.roles.sync import WeightSync
    from tests.reshard.test_plan import _expected

    rank = dist.get_rank()
    model, _ = build_fsdp_model(model_dir, dp_mesh())
    sync = WeightSync(model.config, SyncConfig(bucket_mb=0.01), tp=tp, wire_dtype=torch.float32)
    targets = {n: torch.full(s, float("nan"), device=sync.device)
               for n, s in sync.target_shapes.items()}
    for n, first in sync.padding_rows.items():  # vocab padding: no block writes it, the sync zeroes it
        targets[n][first:].zero_()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]], device=sync.device))
    stats = sync.executor.run(sync.sources(model), targets)
    full = {n: t.view(t.shape[0], -1) for n, t in load_file(f"{model_dir}/model.safetensors").items()}
    if "lm_head.weight" not in full:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    want = _expected(full, sync.dims, tp, rank % tp)
    got = {n: targets[n].cpu() for n in want}
    return {"device": str(next(iter(targets.values())).device.type),
            "mismatched": [n for n in want if not torch.equal(got[n], want[n])],
            "bytes_received": stats.bytes_received, "buckets": stats.num_buckets,
            "min_bytes": sync.plan.elements_received(rank) * 4}


@pytest.mark.parametrize("backend,world,tp", [
    ("gloo", 2, 2),
    pytest.param("nccl", 1, 1, marks=pytest.mark.gpu),
    pytest.param("nccl", 2, 2, marks=pytest.mark.gpu),
])
def test_fsdp2_layout_syncs_exactly_on_the_backend_device(tmp_path, backend, world, tp):
    from hybrid_engine.models.tiny import write_tiny_model
    from tests.reshard.test_plan import SPECS

    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"gpu: needs {world} CUDA devices, {torch.cuda.device_count()} present")
    model_dir = str(write_tiny_model(tmp_path / "m", SPECS["qwen2"]))
    outs = run_ranks(_fsdp_sync_case, world, model_dir, tp, backend=backend, timeout=240)
    for r, o in enumerate(outs):
        assert o["device"] == ("cuda" if backend == "nccl" else "cpu")
        assert o["mismatched"] == [], f"rank {r}: {o['mismatched'][:5]}"
        assert o["bytes_received"] == o["min_bytes"] and (world == 1 or o["buckets"] > 1)
