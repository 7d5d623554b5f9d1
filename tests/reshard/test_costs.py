"""reshard/costs.py and `hybrid-engine plan`: traffic by node, the time floor, refusals.

The plan's bytes and messages against the executor on real ranks are in
test_transfer.py (test_plan_command_counts_what_the_executor_moves).
"""

from __future__ import annotations

import json

import pytest

from hybrid_engine import scale
from hybrid_engine.cli import _parser
from hybrid_engine.models.tiny import hf_config
from hybrid_engine.reshard.costs import RankTraffic, plan_traffic, time_floor
from hybrid_engine.reshard.layouts import model_dims
from hybrid_engine.reshard.plan import build_plan
from tests.reshard.test_plan import SPECS


def _plan(world: int, tp: int, **kw):  # noqa: ANN003, ANN202
    return build_plan(model_dims(hf_config(SPECS["qwen2"])), world, tp, bucket_elems=3000, **kw)


@pytest.mark.parametrize("world,tp,dpn", [(4, 2, 2), (4, 1, 1), (8, 2, 4), (4, 4, 4)])
def test_traffic_splits_every_block_by_node(world, tp, dpn):
    plan = _plan(world, tp)
    traffic = plan_traffic(plan, dpn, itemsize=2)
    for g, t in enumerate(traffic):
        want = {True: 0, False: 0}
        for bk in plan.buckets:
            for b in bk:
                if b.dst_rank == g:
                    want[b.src_rank // dpn != g // dpn] += 2 * b.numel
        assert (t.recv_intra, t.recv_inter) == (want[False], want[True])
        assert t.received == 2 * plan.elements_received(g)
        assert t.sent_intra + t.sent_inter == 2 * plan.elements_sent(g)
        assert t.local == 2 * sum(b.numel for b in plan.local[g])
        assert t.messages == sum(len({b.src_rank for b in bk if b.dst_rank == g}) for bk in plan.buckets)
    if dpn == world:
        assert all(t.recv_inter == 0 for t in traffic)
    if dpn == 1:
        assert all(t.recv_intra == 0 for t in traffic)


@pytest.mark.parametrize("spec", ["qwen2", "qwen3_moe-e6", "mixtral-e5-tied"])
@pytest.mark.parametrize("world,tp,dpn,shard", [(4, 2, 2, None), (8, 2, 4, 4), (8, 4, 2, 2),
                                                (4, 1, 1, 1), (6, 2, 3, 3), (8, 2, 4, "tp2"),
                                                (8, 4, 2, "tp4")])
def test_cluster_traffic_from_the_buckets_alone_is_the_whole_plans(spec, world, tp, dpn, shard):
    """`hybrid-engine plan`'s cluster view, in closed form from the cut buckets
    (no block listed), counts what the whole plan's blocks do, rank by rank
    ("tp<t>": training TP t x FSDP2)."""
    from hybrid_engine.reshard.costs import cluster_traffic
    from hybrid_engine.reshard.plan import cut_buckets

    d = model_dims(hf_config(SPECS[spec]))
    kw = dict(bucket_elems=3000, shard_group_size=shard)
    if isinstance(shard, str):
        kw.update(shard_group_size=None, train_tp=int(shard[2:]))
    want = plan_traffic(build_plan(d, world, tp, **kw), dpn, itemsize=2)
    assert cluster_traffic(cut_buckets(d, world, tp, **kw), dpn, itemsize=2) == want
    assert any(t.local for t in want) and any(t.messages for t in want) == (shard != 1)


def test_floor_is_the_busiest_link_of_the_busiest_rank():
    a = RankTraffic(0, recv_intra=900, recv_inter=100, sent_intra=450, sent_inter=200)
    b = RankTraffic(1, recv_intra=100, recv_inter=50)
    assert a.seconds(intra_bps=100, inter_bps=10) == 20.0  # inter: max(100, 200) / 10
    assert a.seconds(intra_bps=10, inter_bps=100) == 90.0  # intra: max(900, 450) / 10
    assert time_floor([a, b], intra_gbps=8e-9 * 10, inter_gbps=8e-9 * 100) == pytest.approx(90.0)
    with pytest.raises(ValueError, match="devices per node must divide"):
        plan_traffic(_plan(4, 2), 3, itemsize=2)


def plan_cli(argv: list[str]) -> int:
    """`hybrid-engine plan ARGV` in this process: the CLI's own parser, then the command
    (`cli.main` would also quiet the libraries through this process's environment,
    which later subprocesses of the session inherit)."""
    return scale.run(_parser().parse_args(["plan", *argv]))


def _plan_cli(capsys, *args: str) -> tuple[int, str, str]:  # noqa: ANN001
    code = plan_cli(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def config_json(tmp_path):  # noqa: ANN001, ANN201
    hf_config(SPECS["qwen2"]).save_pretrained(tmp_path / "m")
    return str(tmp_path / "m" / "config.json")


def test_plan_command_prints_the_busiest_rank_and_the_floor(capsys, config_json):
    base = ["--config", config_json, "--nodes", "2", "--devices-per-node", "2", "--tp", "2"]
    code, out, _ = _plan_cli(capsys, *base, "--json")
    rep = json.loads(out)
    assert code == 0 and rep["world"] == 4 and len(rep["per_rank"]) == 4
    busiest = rep["per_rank"][rep["busiest_rank"]]
    assert rep["floor_s"] == RankTraffic(**busiest).seconds(3600e9 / 8, 400e9 / 8)
    assert rep["naive_received_max"] > max(r["recv_intra"] + r["recv_inter"] for r in rep["per_rank"])
    # a slower NIC: the same bytes, a proportionally longer floor (all of it off node)
    slow = json.loads(_plan_cli(capsys, *base, "--json", "--link-gbps", "40")[1])
    assert slow["per_rank"] == rep["per_rank"] and slow["floor_s"] == pytest.approx(10 * rep["floor_s"])
    # one node: every byte on the node's links, so --intra-gbps sets the floor
    node = ["--config", config_json, "--nodes", "1", "--devices-per-node", "4", "--tp", "2", "--json"]
    fast, slow_intra = (json.loads(_plan_cli(capsys, *node, "--intra-gbps", g)[1]) for g in ("3600", "360"))
    assert all(r["recv_inter"] == 0 for r in fast["per_rank"])
    assert slow_intra["floor_s"] == pytest.approx(10 * fast["floor_s"]) and fast["floor_s"] > 0
    fp32 = json.loads(_plan_cli(capsys, *base, "--json", "--dtype", "float32")[1])
    assert [r["recv_inter"] for r in fp32["per_rank"]] == [2 * r["recv_inter"] for r in rep["per_rank"]]
    code, text, _ = _plan_cli(capsys, *base)  # the table, from the folder as well as the file
    assert code == 0 and f"busiest (r{rep['busiest_rank']})" in text
    assert f"time floor of one sync: {rep['floor_s']:.3f} s" in text
    folder = json.loads(_plan_cli(capsys, *base[:1], str(config_json)[: -len("/config.json")],
                                  *base[2:], "--json")[1])
    assert folder == rep


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "must divide num_attention_heads"),
    (["--nodes", "2", "--devices-per-node", "3", "--tp", "4"], "must divide the world size 6"),
    (["--nodes", "2", "--devices-per-node", "2", "--sharding", "hybrid", "--shard-group-size", "3"],
     "shard group size 3 must divide"),
    (["--nodes", "0"], "must be positive"),
    (["--nodes", "1", "--devices-per-node", "4", "--train-tp", "3"],
     "train.tensor_parallel_size=3 must divide the 4 trainer"),
    (["--train-tp", "8"], "does not divide the 4 attention heads"),
    (["--nodes", "2", "--devices-per-node", "2", "--train-tp", "2", "--sharding", "hybrid"],
     "--sharding full, not hybrid"),
])
def test_plan_command_refuses_sizes_that_do_not_fit(capsys, config_json, args, message):
    code, out, err = _plan_cli(capsys, "--config", config_json, *args)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: ") and message in err


def test_plan_command_with_training_tp(capsys, config_json):
    """--train-tp t: the sources are TP x FSDP2 blocks (shard groups of N / t ranks), and
    with t equal to the rollout's TP on one rank per TP rank every split weight is in
    place: only the unsplit tensors' rows move (the embeddings', whose vLLM shards
    are vocabulary rows, are local too)."""
    node = ["--config", config_json, "--nodes", "1", "--devices-per-node", "2", "--tp", "2",
            "--json"]
    plain, same = (json.loads(_plan_cli(capsys, *node, *extra)[1])
                   for extra in ([], ["--train-tp", "2"]))
    assert (same["train_tp"], same["shard_group_size"]) == (2, 1)
    assert all(r["recv_intra"] == 0 and r["local"] > 0 for r in same["per_rank"])
    assert min(r["recv_intra"] for r in plain["per_rank"]) > 0
    four = json.loads(_plan_cli(capsys, "--config", config_json, "--nodes", "2",
                                "--devices-per-node", "2", "--tp", "2", "--train-tp", "2",
                                "--json")[1])
    assert four["world"] == 4 and four["shard_group_size"] == 2
    assert 0 < max(r["recv_intra"] + r["recv_inter"] for r in four["per_rank"])
    assert "training TP 2" in _plan_cli(capsys, *node[:-1], "--train-tp", "2")[1]


def test_plan_reads_the_architecture_from_model_type_alone(capsys, tmp_path):
    """A config.json with only model_type plans as transformers' causal LM of that type."""
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama"}))
    code, out, err = _plan_cli(capsys, "--config", str(tmp_path / "llama.json"))
    assert code == 0 and "floor of one sync" in out, err


def test_plan_command_refuses_a_bad_config(capsys, tmp_path):
    cfg = hf_config(SPECS["qwen2"]).to_dict()
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "gpt2.json").write_text(json.dumps(cfg))
    (tmp_path / "nomodel.json").write_text("{}")
    (tmp_path / "text.json").write_text(json.dumps({**cfg, "hidden_size": "abc"}))
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert"}))
    for path, message in [(tmp_path / "gpt2.json", "unsupported architecture"),
                          (tmp_path / "text.json", "field 'hidden_size': TypeError"),
                          (tmp_path / "bert.json", "unsupported architecture 'BertLMHeadModel'"),
                          (tmp_path / "nomodel.json", "no model_type"),
                          (tmp_path / "missing.json", "not a readable JSON config")]:
        code, out, err = _plan_cli(capsys, "--config", str(path))
        assert code == 2 and err.count("\n") == 1 and message in err, err
