"""Resharding plan: exact coverage, minimal bytes, bounded buckets.

The expected vLLM TP layout is built here independently from full HF tensors
with head-shaped views (a second formulation of vLLM's weight loaders); the
plan is executed on id-valued tensors so every element's origin is checked.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hybrid_engine.reshard.layouts import ModelDims, model_dims, tp_layout
from hybrid_engine.models.tiny import TinyModelSpec, hf_config
from hybrid_engine.reshard.plan import build_plan

SPECS = {
    "qwen2": TinyModelSpec(arch="qwen2", vocab_size=1000),
    "llama-kv1-tied": TinyModelSpec(arch="llama", num_kv_heads=1, tie_word_embeddings=True),
    "qwen3-kv1": TinyModelSpec(arch="qwen3", num_kv_heads=1, vocab_size=1001),
    "qwen2-mha-tied": TinyModelSpec(arch="qwen2", num_kv_heads=4, tie_word_embeddings=True),
    "llama-bias": TinyModelSpec(arch="llama", attention_bias=True, vocab_size=1000),
    "mistral-kv1": TinyModelSpec(arch="mistral", num_kv_heads=1, sliding_window=8),
    "phi3-fused": TinyModelSpec(arch="phi3", vocab_size=1001),
    "granite-kv1": TinyModelSpec(arch="granite", num_kv_heads=1),
    "gemma-kv1-tied-hd64": TinyModelSpec(arch="gemma", num_kv_heads=1, sliding_window=8,
                                         tie_word_embeddings=True, head_dim=64),
    "gemma2-kv1-tied": TinyModelSpec(arch="gemma2", num_kv_heads=1, sliding_window=8,
                                     tie_word_embeddings=True),
    # experts that do not divide the ranks: 6 over 4 shard as 2, 2, 2, 0; 5 over 2 as 3, 2
    "qwen3_moe-e6": TinyModelSpec(arch="qwen3_moe", num_experts=6, intermediate_size=64),
    "mixtral-e5-tied": TinyModelSpec(arch="mixtral", num_experts=5, experts_per_token=1,
                                     intermediate_size=96, tie_word_embeddings=True),
}


def _dims(name: str) -> ModelDims:
    return model_dims(hf_config(SPECS[name]))


def _id_tensors(d: ModelDims, shapes) -> dict[str, torch.Tensor]:
    """Every HF element gets a unique id (float64 holds them exactly)."""
    out, base = {}, 1
    for name, (r, c) in shapes.items():
        out[name] = torch.arange(base, base + r * c, dtype=torch.float64).view(r, c)
        base += r * c
    return out


def _split_fused(full: dict[str, torch.Tensor], d: ModelDims) -> dict[str, torch.Tensor]:
    """Phi-3's fused HF tensors as the separate ones they stack (q, k, v; gate, up)."""
    out, i = dict(full), d.intermediate
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    for n, t in full.items():
        if n.endswith("qkv_proj.weight"):
            a = n.removesuffix("qkv_proj.weight")
            out[a + "q_proj.weight"], out[a + "k_proj.weight"] = t[:q], t[q:q + kv]
            out[a + "v_proj.weight"] = t[q + kv:]
        elif n.endswith("gate_up_proj.weight"):
            m = n.removesuffix("gate_up_proj.weight")
            out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = t[:i], t[i:]
    return out


def _expected(full: dict[str, torch.Tensor], d: ModelDims, tp: int, r: int) -> dict[str, torch.Tensor]:
    """vLLM's TP-local tensors from full HF tensors, by head-shaped slicing."""
    hd, out, full = d.head_dim, {}, _split_fused(full, d)
    qh = d.num_heads // tp
    rep = max(1, tp // d.num_kv_heads)
    kv_heads = (list(range(r * d.num_kv_heads // tp, (r + 1) * d.num_kv_heads // tp))
                if d.num_kv_heads >= tp else [r // rep])

    def heads(t, hs):  # rows of the given heads
        return t.view(-1, hd, t.shape[1])[hs].reshape(-1, t.shape[1])

    def vocab(t):
        padded = -(-d.vocab // 64) * 64
        full_pad = torch.cat([t, torch.zeros(padded - d.vocab, t.shape[1], dtype=t.dtype)])
        return full_pad.chunk(tp)[r]

    out["model.embed_tokens.weight"] = vocab(full["model.embed_tokens.weight"])
    for i in range(d.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in ("weight", "bias") if d.qkv_bias else ("weight",):
            q = heads(full[a + f"q_proj.{suffix}"], list(range(r * qh, (r + 1) * qh)))
            k = heads(full[a + f"k_proj.{suffix}"], kv_heads)
            v = heads(full[a + f"v_proj.{suffix}"], kv_heads)
            out[a + f"qkv_proj.{suffix}"] = torch.cat([q, k, v])
        out[a + "o_proj.weight"] = full[a + "o_proj.weight"].chunk(tp, dim=1)[r]
        if d.o_bias:  # RowParallelLinear's bias: whole on every rank
            out[a + "o_proj.bias"] = full[a + "o_proj.bias"]
        if d.moe:
            out.update(_expected_experts(full, d, tp, r, m))
        else:
            out[m + "gate_up_proj.weight"] = torch.cat(
                [full[m + "gate_proj.weight"].chunk(tp)[r], full[m + "up_proj.weight"].chunk(tp)[r]])
            out[m + "down_proj.weight"] = full[m + "down_proj.weight"].chunk(tp, dim=1)[r]
        ffn = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                  *(ffn if d.ffn_norms else ())):
            out[f"model.layers.{i}.{n}"] = full[f"model.layers.{i}.{n}"]
        if d.qk_norm:
            out[a + "q_norm.weight"] = full[a + "q_norm.weight"]
            out[a + "k_norm.weight"] = full[a + "k_norm.weight"]
    out["model.norm.weight"] = full["model.norm.weight"]
    if not d.tied:
        out["lm_head.weight"] = vocab(full["lm_head.weight"])
    return out


def _expected_experts(full, d: ModelDims, tp: int, r: int, m: str) -> dict[str, torch.Tensor]:
    """vLLM's FusedMoE w13 [E, 2I/T, H] and w2 [E, H, I/T] of TP rank r (2-D), and the router."""
    e, i = d.num_experts, d.intermediate
    gate_up = full[m + "experts.gate_up_proj"].view(e, 2 * i, d.hidden)
    down = full[m + "experts.down_proj"].view(e, d.hidden, i)
    w13 = torch.cat([gate_up[:, :i].chunk(tp, dim=1)[r], gate_up[:, i:].chunk(tp, dim=1)[r]], dim=1)
    w2 = down.chunk(tp, dim=2)[r]
    v = m.replace(".mlp.", ".block_sparse_moe.") if d.arch == "MixtralForCausalLM" else m
    return {v + "gate.weight": full[m + "gate.weight"],
            v + "experts.routed_experts.w13_weight": w13.reshape(-1, d.hidden),
            v + "experts.routed_experts.w2_weight": w2.reshape(-1, w2.shape[2])}


def _execute(plan, full, rank: int) -> dict[str, torch.Tensor]:
    """Runs the plan for one destination rank with plain slicing."""
    out = {t.name: torch.zeros(t.shape, dtype=torch.float64) for t in plan.targets[rank]}
    blocks = plan.local[rank] + [b for bk in plan.buckets for b in bk if b.dst_rank == rank]
    for b in blocks:
        t = full[b.hf_name]
        (s0, s1), (c0, c1) = plan.source_block(b.hf_name, b.src_rank)
        assert b.src_row + b.rows <= s1 - s0, f"{b.hf_name}: rank {b.src_rank} lacks the rows"
        assert b.cols[1] <= c1 - c0, f"{b.hf_name}: rank {b.src_rank} lacks the columns"
        src = t[s0 + b.src_row : s0 + b.src_row + b.rows, c0 + b.cols[0] : c0 + b.cols[1]]
        dst = out[b.target][b.dst_row : b.dst_row + b.rows, b.dst_col : b.dst_col + src.shape[1]]
        assert torch.count_nonzero(dst) == 0, f"{b.target}: block overlaps an earlier one"
        dst.copy_(src)
    return out


def _needed_ids(got: dict, want: dict, g: int) -> torch.Tensor:
    """Asserts that rank g got exactly vLLM's tensors want; the ids of the elements
    it needs (padding rows, zero, aside)."""
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"rank {g}: {name}"
    ids = torch.cat([w.reshape(-1) for w in want.values()])
    return ids[ids > 0]


def _owner(ids: torch.Tensor, full, world: int, units=None) -> torch.Tensor:
    """Rank owning each id's row under FSDP2 Shard(0) over world ranks (with
    shard groups of S ranks: the owner's position in its group). units: rows per
    index of a 3-D tensor's first dim (MoE experts), which Shard(0) splits."""
    owner = torch.full(ids.shape, -1, dtype=torch.int64)
    for name, t in full.items():
        lo, hi = t[0, 0].item(), t[-1, -1].item()
        sel = (ids >= lo) & (ids <= hi)
        if sel.any():
            unit = (units or {}).get(name, 1)
            index = ((ids[sel] - lo) // t.shape[1]).long() // unit
            chunk = -(-t.shape[0] // unit // world)
            owner[sel] = index // chunk
    return owner


CASES = [(s, n, t) for s in SPECS for n in (1, 2, 4) for t in sorted({1, 2, n}) if n % t == 0]


@pytest.mark.parametrize("spec,world,tp", CASES)
def test_plan_builds_vllm_layout_with_minimal_bytes(spec, world, tp):
    d = _dims(spec)
    plan = build_plan(d, world, tp, bucket_elems=20000)  # small: forces splits and many buckets
    full = _id_tensors(d, plan.hf_shapes)
    for g in range(world):
        ids = _needed_ids(_execute(plan, full, g), _expected(full, d, tp, g % tp), g)
        # Minimal bytes: the rank receives exactly the needed elements it does not own.
        not_owned = int((_owner(ids, full, world, plan.row_units) != g).sum())
        assert plan.elements_received(g) == not_owned
        assert plan.elements_received(g) <= plan.naive_elements_received(g)
    assert sum(plan.elements_sent(g) for g in range(world)) == sum(
        plan.elements_received(g) for g in range(world))


@pytest.mark.parametrize("world,tp,train_tp", [(2, 2, 1), (4, 2, 1), (4, 4, 1), (4, 2, 2),
                                               (4, 1, 4)])
def test_buckets_bound_every_ranks_volume(world, tp, train_tp):
    d = _dims("qwen2")
    limit = 5000
    plan = build_plan(d, world, tp, bucket_elems=limit, train_tp=train_tp)
    assert len(plan.buckets) > 3
    for i, bucket in enumerate(plan.buckets):
        for g in range(world):
            assert sum(b.numel for b in plan.sends(i, g)) <= limit
            assert sum(b.numel for b in plan.recvs(i, g)) <= limit
        assert all(b.src_rank != b.dst_rank for b in bucket)
    # Unbounded buckets: one per group (embeddings, each layer, head), same blocks.
    one = build_plan(d, world, tp, bucket_elems=1 << 40, train_tp=train_tp)
    assert [bk[0].group for bk in one.buckets] == sorted({b.group for bk in one.buckets for b in bk})
    assert all(len({b.group for b in bk}) == 1 for bk in plan.buckets + one.buckets)
    assert sum(b.numel for bk in one.buckets for b in bk) == sum(b.numel for bk in plan.buckets for b in bk)


@pytest.mark.parametrize("spec", ["qwen2", "qwen3_moe-e6"])
def test_buckets_hold_their_bound_down_to_one_row_and_refuse_below(spec):
    """Separate placement, 1 trainer sending to 8 rollout ranks: one row of a
    parameter goes to every destination at once. Down to the largest such row
    every rank's volume per bucket stays under the bound; below it the plan is
    refused in one line."""
    d, kw = _dims(spec), dict(num_trainers=1)
    whole = build_plan(d, 9, 2, bucket_elems=1 << 40, **kw)
    row = max(b.numel // b.rows * 8 for bk in whole.buckets for b in bk)  # a row x 8 destinations
    for limit in (row, 2 * row):
        plan = build_plan(d, 9, 2, bucket_elems=limit, **kw)
        for i in range(len(plan.buckets)):
            assert all(sum(b.numel for b in plan.sends(i, g)) <= limit and
                       sum(b.numel for b in plan.recvs(i, g)) <= limit for g in range(9))
        assert len(plan.buckets) > 3
    with pytest.raises(ValueError, match="is smaller than one row of .*raise sync.bucket_mb"):
        build_plan(d, 9, 2, bucket_elems=row // 2, **kw)


def test_sends_and_recvs_pair_up_in_the_same_order():
    plan = build_plan(_dims("qwen3-kv1"), 4, 2, bucket_elems=4000)
    for i in range(len(plan.buckets)):
        for src, dst in itertools.permutations(range(4), 2):
            sent = [b for b in plan.sends(i, src) if b.dst_rank == dst]
            recv = [b for b in plan.recvs(i, dst) if b.src_rank == src]
            assert sent == recv


def test_full_tp_on_two_ranks_receives_far_less_than_all_gather():
    """T = N = 2 on the 180M preset: column-parallel rows mostly stay local."""
    from hybrid_engine.models.tiny import PRESETS

    d = model_dims(hf_config(PRESETS["qwen2-180m"]))
    plan = build_plan(d, 2, 2)
    for g in range(2):
        ratio = plan.naive_elements_received(g) / plan.elements_received(g)
        assert ratio > 1.9, ratio
        assert plan.elements_received(g) < plan.target_elements(g)


SEPARATE = [("qwen2", 2, 1, 1), ("llama-kv1-tied", 3, 1, 2), ("qwen3-kv1", 4, 2, 2),
            ("qwen2-mha-tied", 4, 2, 1), ("qwen2", 5, 1, 4), ("qwen3-kv1", 4, 3, 1),
            ("qwen3_moe-e6", 6, 4, 2)]


@pytest.mark.parametrize("spec,world,trainers,tp", SEPARATE)
def test_separate_plan_moves_each_rollout_ranks_whole_shard(spec, world, trainers, tp):
    """Ranks 0..M-1 hold the FSDP2 shards, M..N-1 the vLLM weights: no local
    block, a rollout rank receives every element of its TP shard exactly once
    (from the trainer rank owning its row), a trainer rank receives nothing."""
    d = _dims(spec)
    plan = build_plan(d, world, tp, bucket_elems=20000, num_trainers=trainers)
    assert plan.num_sources == trainers and not any(plan.local)
    full = _id_tensors(d, plan.hf_shapes)
    total = sum(r * c for r, c in plan.hf_shapes.values())
    for g in range(world):
        if g < trainers:
            assert plan.targets[g] == [] and plan.elements_received(g) == 0
            assert not [b for bk in plan.buckets for b in bk if b.dst_rank == g]
            continue
        ids = _needed_ids(_execute(plan, full, g), _expected(full, d, tp, (g - trainers) % tp), g)
        assert plan.elements_received(g) == ids.numel()
        assert (_owner(ids, full, trainers, plan.row_units) < trainers).all()
        assert plan.naive_elements_received(g) == total  # naive: every full tensor
    senders = {b.src_rank for bk in plan.buckets for b in bk}
    assert senders == set(range(trainers))
    assert sum(plan.elements_sent(g) for g in range(world)) == sum(
        plan.elements_received(g) for g in range(world))


LAYOUTS = [("qwen2", 2, 1, 1), ("qwen2", 2, 2, 1), ("llama-kv1-tied", 4, 2, 1),
           ("qwen3-kv1", 4, 2, 2), ("qwen2-mha-tied", 4, 4, 2), ("llama-bias", 4, 1, 2),
           ("mixtral-e5-tied", 4, 2, 2), ("qwen3_moe-e6", 4, 1, 1)]


@pytest.mark.parametrize("spec,world,tp,shard", LAYOUTS)
def test_replicated_and_hybrid_sources_move_only_what_the_group_lacks(spec, world, tp, shard):
    """train.sharding=replicate (S=1) / hybrid (S ranks per shard group): every
    rank holds rows shard_rows(rows, S, g % S); a rank receives exactly the
    elements of its vLLM weights that it does not hold, all from its own shard
    group -- replicate: nothing at all, every block local."""
    d = _dims(spec)
    plan = build_plan(d, world, tp, bucket_elems=20000, shard_group_size=shard)
    assert plan.shard_group_size == shard
    full = _id_tensors(d, plan.hf_shapes)
    for g in range(world):
        got = _execute(plan, full, g)
        want = _expected(full, d, tp, g % tp)
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {g}: {name}"
        ids = torch.cat([w.reshape(-1) for w in want.values()])
        ids = ids[ids > 0]
        held = _owner(ids, full, shard, plan.row_units) == g % shard
        assert plan.elements_received(g) == int((~held).sum())
        group = range(g // shard * shard, (g // shard + 1) * shard)
        assert all(b.src_rank in group for b in plan.local[g]) and all(
            b.src_rank in group for bk in plan.buckets for b in bk if b.dst_rank == g)
    if shard == 1:
        assert plan.buckets == [] and all(plan.elements_received(g) == 0 for g in range(world))


@pytest.mark.parametrize("world,trainers,tp,shard", [(4, 2, 1, 1), (6, 4, 2, 2), (8, 4, 1, 2)])
def test_separate_plan_spreads_rollout_ranks_over_replicated_groups(world, trainers, tp, shard):
    """Separate placement with M/S shard groups: each rollout rank gets its whole TP
    shard from one group, and the groups take the rollout ranks in turn."""
    d = _dims("qwen3-kv1")
    plan = build_plan(d, world, tp, bucket_elems=20000, num_trainers=trainers,
                      shard_group_size=shard)
    full = _id_tensors(d, plan.hf_shapes)
    served = [0] * (trainers // shard)
    for g in range(trainers, world):
        got = _execute(plan, full, g)
        want = _expected(full, d, tp, (g - trainers) % tp)
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {g}: {name}"
        assert plan.elements_received(g) == sum(int((w > 0).sum()) for w in want.values())
        groups = {b.src_rank // shard for bk in plan.buckets for b in bk if b.dst_rank == g}
        assert len(groups) == 1
        served[groups.pop()] += 1
    assert max(served) - min(served) <= 1 and min(served) >= 1, served


def _chunk(t: torch.Tensor, k: int, i: int, dim: int = 0) -> torch.Tensor:
    """torch.chunk(t, k, dim)[i], empty where torch.chunk returns fewer than k chunks."""
    parts = t.chunk(k, dim)
    return parts[i] if i < len(parts) else t.narrow(dim, t.shape[dim], 0)


def _tp_sources(full, d: ModelDims, g: int, dp: int, ttp: int, units) -> dict[str, torch.Tensor]:
    """Rank g = d * ttp + t's local tensors under TP x FSDP2 training, from torch.chunk
    alone (`parallel.tensor_parallel`'s layout, written independently of the plan):
    q (k, v when the KV heads divide ttp) and gate/up split by rows, o and down
    by columns, then FSDP2 rows over the dp ranks of TP rank t."""
    dd, t = divmod(g, ttp)
    col = ("q_proj.",) + (("k_proj.", "v_proj.") if d.num_kv_heads % ttp == 0 else ())
    col += ("gate_proj.weight", "up_proj.weight")
    out = {}
    for name, w in full.items():
        if ".layers." in name and any(f".{c}" in name for c in col):
            w = _chunk(w, ttp, t)
        elif name.endswith(("o_proj.weight", "mlp.down_proj.weight")):
            w = _chunk(w, ttp, t, 1)
        u = units.get(name, 1)
        out[name] = _chunk(w.view(-1, u, w.shape[1]), dp, dd).reshape(-1, w.shape[1])
    return out


def _execute_from(plan, local, rank: int) -> dict[str, torch.Tensor]:
    """Runs the plan for one destination, each block read from its source's local tensor."""
    out = {t.name: torch.zeros(t.shape, dtype=torch.float64) for t in plan.targets[rank]}
    for b in plan.local[rank] + [b for bk in plan.buckets for b in bk if b.dst_rank == rank]:
        src = local[b.src_rank][b.hf_name]
        assert b.src_row + b.rows <= src.shape[0] and b.cols[1] <= src.shape[1], b
        dst = out[b.target][b.dst_row : b.dst_row + b.rows, b.dst_col : b.dst_col + b.cols[1] - b.cols[0]]
        assert torch.count_nonzero(dst) == 0, f"{b.target}: block overlaps an earlier one"
        dst.copy_(src[b.src_row : b.src_row + b.rows, b.cols[0] : b.cols[1]])
    return out


TRAIN_TP = [(s, w, m, ttp, tp) for s in ("qwen2", "llama-kv1-tied", "qwen3_moe-e6", "mixtral-e5-tied")
            for w, m, ttp, tp in [(4, None, 2, 1), (4, None, 2, 2), (4, None, 2, 4), (4, None, 4, 1),
                                  (4, None, 4, 2), (4, None, 4, 4), (6, 4, 2, 2), (6, 2, 2, 1)]]


@pytest.mark.parametrize("spec,world,trainers,ttp,tp", TRAIN_TP)
def test_tp_training_sources_reshard_with_minimal_bytes(spec, world, trainers, ttp, tp):
    """Training TP ttp x FSDP2 (train.tensor_parallel_size) into vLLM TP tp, colocated
    and separate: every destination gets exactly vLLM's tensors, each block read
    from its source's own torch.chunk block, and receives exactly the elements it
    needs and does not hold itself (separate: every element it needs)."""
    d = _dims(spec)
    plan = build_plan(d, world, tp, bucket_elems=4000, num_trainers=trainers, train_tp=ttp)
    full = _id_tensors(d, plan.hf_shapes)
    m = trainers or world
    local = {g: _tp_sources(full, d, g, m // ttp, ttp, plan.row_units) for g in range(m)}
    first = 0 if trainers is None else trainers  # the first rank holding an engine
    for g in range(first, world):
        ids = _needed_ids(_execute_from(plan, local, g),
                          _expected(full, d, tp, (g - first) % tp), g)
        held = torch.cat([t.reshape(-1) for t in local[g].values()]) if g in local else ids[:0]
        assert plan.elements_received(g) == int((~torch.isin(ids, held)).sum())
    assert sum(plan.elements_sent(g) for g in range(world)) == sum(
        plan.elements_received(g) for g in range(world))


def test_tp_training_matching_the_rollouts_tp_moves_only_the_data_parallel_rows():
    """Training TP = rollout TP, colocated: a rank's split weights are its vLLM
    shard's rows already (columns for o and down); it receives only the rows
    of its TP slab that its FSDP2 peers hold, and the unsplit tensors' rows."""
    d = _dims("qwen2")
    same = build_plan(d, 4, 2, train_tp=2)
    plain = build_plan(d, 4, 2)
    assert all(same.elements_received(g) < plain.elements_received(g) for g in range(4))
    one = build_plan(d, 2, 2, train_tp=2)  # one rank per TP rank: every split weight in place
    split = {n for n in one.hf_shapes if ".layers." in n and "norm" not in n}
    assert not any(b.hf_name in split for bk in one.buckets for b in bk)


def test_bad_sizes_are_rejected():
    d = _dims("qwen2")
    with pytest.raises(ValueError, match="must divide the world size 4"):
        build_plan(d, 4, 3)
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        tp_layout(d, 8, 0)
    with pytest.raises(ValueError, match="bucket size must be positive"):
        build_plan(d, 2, 2, bucket_elems=0)
    with pytest.raises(ValueError, match="must divide the rollout ranks 3"):
        build_plan(d, 4, 2, num_trainers=1)
    with pytest.raises(ValueError, match="1 <= trainer ranks < world size 4"):
        build_plan(d, 4, 1, num_trainers=4)
    with pytest.raises(ValueError, match="shard group size 3 must divide the 4 source ranks"):
        build_plan(d, 4, 1, shard_group_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the 4 trainer"):
        build_plan(d, 4, 1, train_tp=3)
    with pytest.raises(ValueError, match="shards over the 2 ranks of each TP rank"):
        build_plan(d, 4, 1, train_tp=2, shard_group_size=4)


def test_unsupported_architecture_lists_supported_ones():
    class Cfg:
        architectures = ["GPT2LMHeadModel"]
        model_type = "gpt2"

    from hybrid_engine.models.spec import supported

    with pytest.raises(ValueError, match=f"^unsupported architecture 'GPT2LMHeadModel'; "
                                         f"supported: {', '.join(supported())}$"):
        model_dims(Cfg())
    assert "Qwen2ForCausalLM" in supported() and "MixtralForCausalLM" in supported(moe=True)


def test_every_block_carries_its_targets_group():
    d = _dims("qwen3-kv1")
    plan = build_plan(d, 4, 2, bucket_elems=3000)  # small: many split blocks
    group_of = {n: g for g, names in enumerate(plan.groups) for n in names}
    blocks = [b for bk in plan.buckets for b in bk] + [b for loc in plan.local for b in loc]
    assert all(b.group == group_of[b.target] for b in blocks)
    assert plan.groups[0] == ["model.embed_tokens.weight"] and len(plan.groups) == d.num_layers + 2


def _assert_restriction(whole, mine, r: int) -> None:
    """mine (rank r's plan) holds exactly whole's blocks of r, in the same buckets
    and order."""
    assert len(mine.buckets) == len(whole.buckets) and mine.bucket_groups == whole.bucket_groups
    for i in range(len(whole.buckets)):
        assert mine.sends(i, r) == whole.sends(i, r) and mine.recvs(i, r) == whole.recvs(i, r)
        assert all(r in (b.src_rank, b.dst_rank) for b in mine.buckets[i])
    assert mine.local[r] == whole.local[r]
    assert not any(mine.local[g] for g in range(whole.world_size) if g != r)


@pytest.mark.parametrize("spec", ["qwen3-kv1", "qwen3_moe-e6", "mixtral-e5-tied", "phi3-fused"])
@pytest.mark.parametrize("world,tp,trainers,shard", [
    (4, 2, None, None), (4, 4, None, None), (4, 2, None, 2), (4, 2, None, 1),  # colocated
    (6, 2, 2, None), (8, 2, 4, 2), (6, 2, 2, 1),                             # separate
    (4, 2, None, "tp2"), (4, 1, None, "tp4"), (6, 2, 4, "tp2")])              # training TP
def test_each_ranks_plan_is_the_whole_plan_restricted_to_it(spec, world, tp, trainers, shard):
    """`build_plan(rank=r)` lists only r's blocks, yet equals the whole plan's
    restricted to r: the same buckets, the same blocks in the same order."""
    from hybrid_engine.reshard.plan import rank_plans

    d, kw = _dims(spec), dict(bucket_elems=2000, num_trainers=trainers, shard_group_size=shard)
    if isinstance(shard, str):  # "tp<t>": training TP t, FSDP2 across
        kw.update(shard_group_size=None, train_tp=int(shard[2:]))
        if spec == "phi3-fused":  # no TP plan for its fused tensors
            with pytest.raises(ValueError, match="Phi-3 cannot train with train.tensor_para"):
                build_plan(d, world, tp, **kw)
            return
    whole = build_plan(d, world, tp, **kw)
    for r, mine in enumerate(rank_plans(d, world, tp, range(world), **kw)):
        _assert_restriction(whole, mine, r)
    _assert_restriction(whole, build_plan(d, world, tp, rank=1, **kw), 1)


def test_each_ranks_adapter_plan_is_the_whole_plan_restricted_to_it():
    from hybrid_engine.reshard.adapters import LoraDims

    lora = LoraDims(rank=3, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"))
    d = _dims("qwen3-kv1")
    whole = build_plan(d, 4, 2, bucket_elems=800, lora=lora)
    for r in range(4):
        _assert_restriction(whole, build_plan(d, 4, 2, bucket_elems=800, lora=lora, rank=r), r)


@pytest.mark.parametrize("spec", ["qwen2", "qwen3_moe-e6", "mixtral-e5-tied"])
def test_layers_planned_once_give_the_plan_planned_layer_by_layer(spec, monkeypatch):
    """Decoder layers equal to layer 0 but for names reuse its buckets and
    blocks (`buckets.twins`); the plan equals the one cut and listed layer by
    layer, whole and per rank."""
    from hybrid_engine.reshard import plan as plan_mod

    d, kw = _dims(spec), dict(bucket_elems=2000, shard_group_size=2)
    twinned = [build_plan(d, 4, 2, **kw), build_plan(d, 4, 2, rank=1, **kw)]
    found, real = [], plan_mod.twins

    def alone(geo, groups, prefixes):  # noqa: ANN001, ANN202 - no group reuses another's
        found.append(real(geo, groups, prefixes))
        return list(range(len(groups)))

    monkeypatch.setattr(plan_mod, "twins", alone)
    apart = [build_plan(d, 4, 2, **kw), build_plan(d, 4, 2, rank=1, **kw)]
    assert found[0] == [0, *[1] * d.num_layers, d.num_layers + 1] and d.num_layers >= 2
    for a, b in zip(twinned, apart, strict=True):
        assert a.buckets == b.buckets and a.local == b.local and a.bucket_groups == b.bucket_groups
