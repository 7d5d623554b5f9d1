"""The adapter plan (sync.lora=adapter): what vLLM's LoRA layers read, minimal bytes.

What each TP rank's LoRA layers read of a whole adapter tensor is written here
independently, the way vLLM's `slice_lora_a` / `slice_lora_b` cut it (kv heads
by `tp_rank // num_kv_head_replicas`); the plan runs on id-valued tensors, so
every element a rank reads is checked to come from its own adapter element,
and a rank receives exactly the elements it reads and does not hold.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.reshard.adapters import LoraDims, adapter_layout, adapter_shapes
from hybrid_engine.reshard.plan import build_plan
from tests.reshard.test_plan import _dims, _execute, _id_tensors, _owner

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# An odd rank: A's rows split unevenly over the shard groups (torch.chunk sizes).
LORA = LoraDims(rank=3, targets=ALL)


def vllm_reads(t: torch.Tensor, name: str, d, tp: int, r: int) -> torch.Tensor:
    """The part of whole adapter tensor `t` (named as PEFT saves it) that vLLM's LoRA
    layer on TP rank r of tp reads."""
    module, which = name.split(".")[-3], name.split(".")[-2]
    if tp == 1:
        return t
    if which == "lora_A":
        if module in ("o_proj", "down_proj"):  # RowParallelLinearWithLoRA: input columns
            n = t.shape[1] // tp
            return t[:, r * n:(r + 1) * n]
        return t  # column-parallel layers: lora_A whole
    if module in ("o_proj", "down_proj"):
        return t  # row-parallel: lora_B whole
    if module in ("k_proj", "v_proj"):  # MergedQKVParallelLinearWithLoRA
        replicas = max(1, tp // d.num_kv_heads)
        size = max(1, d.num_kv_heads // tp) * d.head_dim
        shard = r // replicas
        return t[shard * size:(shard + 1) * size]
    n = t.shape[0] // tp  # q heads, gate and up: the rank's 1/tp of the rows
    return t[r * n:(r + 1) * n]


def min_elements(d, lora: LoraDims, world: int, tp: int, shard: int, g: int) -> int:
    """The adapter elements rank g must receive, without the plan: those its TP
    rank reads (`vllm_reads`) in rows its shard group position does not hold."""
    full = _id_tensors(d, adapter_shapes(d, lora))
    ids = torch.cat([vllm_reads(t, n, d, tp, g % tp).reshape(-1) for n, t in full.items()])
    return int((_owner(ids, full, shard) != g % shard).sum())


CASES = [(spec, n, tp, shard) for spec in ("qwen2", "llama-kv1-tied", "qwen3-kv1")
         for n in (2, 4) for tp in (1, 2, 4) if n % tp == 0 for shard in sorted({1, 2, n})]


@pytest.mark.parametrize("spec,world,tp,shard", CASES)
def test_adapter_plan_fills_what_vllm_reads_with_minimal_bytes(spec, world, tp, shard) -> None:
    """N in {2, 4}, T in {1, 2, 4}; train.sharding full (S = N), replicate (S = 1)
    and hybrid (S = 2 of 4)."""
    d = _dims(spec)
    plan = build_plan(d, world, tp, bucket_elems=800, shard_group_size=shard, lora=LORA)
    assert plan.hf_shapes == adapter_shapes(d, LORA)
    assert len(plan.hf_shapes) == 2 * len(ALL) * d.num_layers
    full = _id_tensors(d, plan.hf_shapes)
    for g in range(world):
        got = _execute(plan, full, g)
        assert got.keys() == full.keys()
        for name, whole in full.items():
            want = vllm_reads(whole, name, d, tp, g % tp)
            assert torch.equal(vllm_reads(got[name], name, d, tp, g % tp), want), (g, name)
        # Exactly the elements the rank reads and its shard group position does not hold.
        assert plan.elements_received(g) == min_elements(d, LORA, world, tp, shard, g), g
    if shard == 1:
        assert all(plan.elements_received(g) == 0 for g in range(world))


def test_the_layout_names_every_adapter_of_the_targets_only() -> None:
    """A subset of targets: only their adapters, in PEFT's saved names, whole shapes."""
    d = _dims("qwen2")
    lora = LoraDims(rank=4, targets=("q_proj", "down_proj"))
    layout = adapter_layout(d, lora, 2, 1)
    assert [t.name for t in layout[:4]] == [
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "model.layers.0.self_attn.q_proj.lora_B.weight",
        "model.layers.0.mlp.down_proj.lora_A.weight",
        "model.layers.0.mlp.down_proj.lora_B.weight"]
    assert all(t.shape == adapter_shapes(d, lora)[t.name] for t in layout)
    with pytest.raises(ValueError, match="no LoRA layout for module 'lm_head'"):
        adapter_shapes(d, LoraDims(rank=4, targets=("lm_head",)))
