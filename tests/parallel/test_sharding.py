"""train.sharding=auto (parallel/sharding.py): the memory estimate per layout, the
choice by budget, and the checks of shard_group_size against the trainer ranks.
The choice inside a real 2-rank job is tested in tests/policy/test_memory.py."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.config import apply_overrides
from hybrid_engine.config.recipes import get_recipe
from hybrid_engine.models.tiny import PRESETS, hf_config
from hybrid_engine.parallel.sharding import (
    choose,
    estimate,
    resolve_train_config,
    shard_group_size,
)
from hybrid_engine.reshard.layouts import hf_shapes, model_dims

GIB = 2**30
CPU = torch.device("cpu")
DIMS = model_dims(hf_config(PRESETS["qwen2-180m"]))
P = sum(r * c for r, c in hf_shapes(DIMS).values())


def w1(**over) -> object:
    """bench_step's W1 job (recipe tiny_grpo_debug, bf16 rollout) with fp32 compute."""
    return apply_overrides(get_recipe("tiny_grpo_debug"), {
        "model.compute_dtype": "float32", "model.rollout_dtype": "bfloat16",
        "rollout.num_samples_per_prompt": 4,
        "train.prompts_per_step": 4, "train.sharding": "auto", **over})


def test_the_estimate_counts_what_each_layout_holds() -> None:
    cfg = w1()
    assert 180e6 < P < 183e6
    full, grad_op, rep = (estimate(s, DIMS, cfg, 2, colocated=True, cuda=False)
                          for s in ("full", "grad_op", "replicate"))
    assert rep.states == 4 * P * 4 and grad_op.states == full.states == 4 * P * 4 // 2
    assert rep.gathered == grad_op.gathered == P * 4 > full.gathered  # fp32 compute
    assert full.activations == rep.activations > 0
    assert rep.resident == P * 2 // 2 + GIB // 4  # bf16 weights over T=2, 0.25 GiB KV cache
    assert full.total < grad_op.total < rep.total
    bf16 = estimate("replicate", DIMS, w1(**{"model.compute_dtype": "bfloat16"}), 2,
                    colocated=True, cuda=False)
    assert bf16.gathered == P * 2
    released = estimate("replicate", DIMS, w1(**{"memory.release": "true"}), 2,
                        colocated=True, cuda=False)
    assert released.resident == P * 2 // 2  # CPU: the KV cache goes, the weights stay
    assert estimate("replicate", DIMS, cfg, 2, colocated=False, cuda=False).resident == 0
    ckpt = estimate("full", DIMS, w1(**{"train.activation_checkpointing": True}), 2,
                    colocated=True, cuda=False)
    assert ckpt.activations < full.activations
    # eager attention keeps each layer's scores (fp32) and probabilities (bf16):
    # 8 sequences a rank, one micro-batch of 8 x 128 tokens, rows of 128
    eager, sdpa = (estimate("full", DIMS, w1(**{"model.compute_dtype": "bfloat16",
                                                "model.attention": a}), 2,
                            colocated=True, cuda=False) for a in ("eager", "sdpa"))
    assert eager.activations - sdpa.activations == 1024 * DIMS.num_layers * DIMS.num_heads * 128 * 6


def test_the_first_phase_adds_the_states_the_built_trainer_lacks() -> None:
    """memory.release=auto's estimate before anything is measured: gradients and AdamW's
    moments (the parameters exist already), gathered copies, whole gradients where
    they are more than the states' (not under replicate) and activations."""
    cfg = w1()
    full, rep = (estimate(s, DIMS, cfg, 2, colocated=True, cuda=False)
                 for s in ("full", "replicate"))
    assert rep.params == P * 4 and full.params == P * 4 // 2
    assert rep.first_phase_growth == 3 * P * 4 + P * 4 + rep.activations
    assert full.first_phase_growth == (3 * P * 4 // 2 + full.gathered + full.whole_grad
                                       + full.activations)
    lora = estimate("replicate", DIMS, w1(**{"model.lora_rank": 8}), 2, colocated=True,
                    cuda=False)
    assert lora.first_phase_growth == lora.states - lora.params + lora.gathered + lora.activations
    assert lora.first_phase_growth < rep.first_phase_growth - 2 * P * 4


def test_lora_counts_a_frozen_base_and_the_adapters_states() -> None:
    """model.lora_rank: the base in compute dtype with no gradient or AdamW state,
    the adapters (r (in + out) per targeted weight) with all of theirs."""
    over = {"model.compute_dtype": "bfloat16", "model.lora_rank": 8,
            "model.lora_target_modules": ("q_proj", "down_proj")}
    shapes = hf_shapes(DIMS)
    adapters = sum(8 * (r + c) for n, (r, c) in shapes.items()
                   if n.endswith(("q_proj.weight", "down_proj.weight")))
    assert adapters == DIMS.num_layers * 8 * (2 * DIMS.hidden + DIMS.hidden + DIMS.intermediate)
    rep = estimate("replicate", DIMS, w1(**over), 2, colocated=True, cuda=False)
    full = estimate("full", DIMS, w1(**over), 2, colocated=True, cuda=False)
    assert rep.states == P * 2 + 4 * adapters * 4 and rep.whole_grad == adapters * 4
    assert full.states == (P * 2 + 4 * adapters * 4) // 2
    plain = estimate("replicate", DIMS, w1(**{"model.compute_dtype": "bfloat16"}), 2,
                     colocated=True, cuda=False)
    assert rep.total < plain.total - 3 * P * 4  # most of 16 bytes per parameter gone


def test_auto_picks_replicate_for_the_180m_model_on_two_ranks_with_24_gib() -> None:
    budget = int(0.9 * 24 * GIB / 2)  # memory.budget x RAM / ranks
    est, why = choose(DIMS, w1(), 2, budget, colocated=True)
    assert est.sharding == "replicate" and "fits the budget of 10.80 GiB" in why


def test_auto_falls_back_by_memory_to_grad_op_then_full() -> None:
    cfg = w1()
    grad_op = estimate("grad_op", DIMS, cfg, 2, colocated=True, cuda=False).total
    full = estimate("full", DIMS, cfg, 2, colocated=True, cuda=False).total
    est, why = choose(DIMS, cfg, 2, grad_op, colocated=True)
    assert est.sharding == "grad_op" and "replicate: " in why and "does not fit" in why
    assert choose(DIMS, cfg, 2, full, colocated=True)[0].sharding == "full"
    est, why = choose(DIMS, cfg, 2, full - 1, colocated=True)  # nothing fits: least memory
    assert est.sharding == "full" and why.startswith("nothing fits")


def test_auto_considers_hybrid_only_with_a_group_size() -> None:
    cfg = w1(**{"train.shard_group_size": 2})
    hybrid = estimate("hybrid", DIMS, cfg, 4, colocated=True, cuda=False, shard_group_size=2)
    assert hybrid.states == 4 * P * 4 // 2 and hybrid.shard_group_size == 2
    est, _ = choose(DIMS, cfg, 4, hybrid.total, colocated=True)
    assert (est.sharding, est.shard_group_size) == ("hybrid", 2)
    assert choose(DIMS, w1(), 4, hybrid.total, colocated=True)[0].sharding == "grad_op"


def test_auto_with_training_tp_chooses_among_the_fsdp2_layouts_by_a_tp_ranks_share() -> None:
    """train.tensor_parallel_size=2 on 4 ranks: only grad_op and full (FSDP2 across the
    TP groups) are candidates; the weights TP splits (attention and MLP matrices, q/k/v
    biases) are sharded over all 4 ranks, the rest (embeddings, norms) over the 2 of
    one TP rank; the gathered layers are one TP rank's share, the batch rows split
    over the 2 data-parallel ranks; shard_group_size is the ranks of one TP rank."""
    cfg, tp = w1(), w1(**{"train.tensor_parallel_size": 2})
    plain, split = (estimate("grad_op", DIMS, c, 4, colocated=False, cuda=False) for c in (cfg, tp))
    shapes = hf_shapes(DIMS)
    layer = sum(r * c for n, (r, c) in shapes.items() if n.startswith("model.layers.0."))
    q = DIMS.num_layers * (layer - 2 * DIMS.hidden)  # a layer less its two norms
    assert plain.states == 4 * P * 4 // 4
    assert split.states == 4 * (q // 4 + (P - q) // 2) * 4
    assert plain.gathered - split.gathered == q // 2 * 4
    assert split.activations > plain.activations  # twice the rows per rank
    est, _ = choose(DIMS, tp, 4, 1 << 50, colocated=True)
    assert est.sharding == "grad_op"  # replicate fits the budget, but is not a candidate
    assert choose(DIMS, tp, 4, 1, colocated=True)[0].sharding == "full"
    assert shard_group_size(resolve_train_config(tp, DIMS, 4, colocated=True, device=CPU,
                                                 budget=1 << 50), 4) == 2


def test_resolve_gives_a_concrete_layout_and_checks_the_group_size() -> None:
    import torch

    cpu = torch.device("cpu")
    cfg = w1()
    t = resolve_train_config(cfg, DIMS, 2, colocated=True, device=cpu, budget=10 * GIB)
    assert (t.sharding, shard_group_size(t, 2)) == ("replicate", 1)
    t = resolve_train_config(cfg, DIMS, 2, colocated=True, device=cpu, budget=GIB)
    assert (t.sharding, shard_group_size(t, 2)) == ("full", 2)
    fixed = w1(**{"train.sharding": "grad_op"})
    assert resolve_train_config(fixed, DIMS, 2, colocated=True, device=cpu) is fixed.train
    hybrid = w1(**{"train.sharding": "hybrid", "train.shard_group_size": 2})
    t = resolve_train_config(hybrid, DIMS, 4, colocated=True, device=cpu)
    assert shard_group_size(t, 4) == 2
    for trainers in (2, 3):  # a group of all ranks is grad_op; 2 does not divide 3
        with pytest.raises(ValueError, match="shard_group_size=2 must divide the"):
            resolve_train_config(hybrid, DIMS, trainers, colocated=True, device=cpu)
    with pytest.raises(ValueError, match="sharding=hybrid needs train.shard_group_size >= 2"):
        w1(**{"train.sharding": "hybrid"})
