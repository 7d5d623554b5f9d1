"""The supported-model contract (`reshard.layouts.check_model`): what is rejected,
with a one-line reason, before any engine starts; Llama's attention_bias is
supported (its layout is checked bit for bit in test_plan / test_transfer and
against vLLM's own loaders in tests/roles/test_sync.py)."""

from __future__ import annotations

import dataclasses
import math
import json
import time

import pytest

from hybrid_engine.models.tiny import TinyModelSpec, hf_config, hf_param_shapes
from hybrid_engine.reshard.layouts import ModelDims, check_model, hf_shapes, model_dims, tp_layout
from hybrid_engine.reshard.plan import build_plan


def test_a_padded_vocabulary_tp_does_not_divide_is_rejected() -> None:
    # vocab 1000 is padded to 1024 by vLLM; T=3 would cover 1023 of its rows.
    dims = ModelDims("LlamaForCausalLM", 2, 96, 3, 3, 32, 210, 1000, False, False, False)
    with pytest.raises(ValueError, match=r"must divide the vocabulary as vLLM pads it: "
                                         r"vocab_size=1000 -> 1024"):
        build_plan(dims, 3, 3)
    build_plan(dims, 3, 1)  # T=1 splits nothing


@pytest.mark.parametrize(("changes", "reason"), [
    (dict(arch="qwen3"), "Qwen3 with attention_bias=True is not supported"),
    (dict(arch="llama", bias=True), "Llama configs with `bias`"),
    (dict(arch="llama", qkv_bias=False), "a `qkv_bias` other than attention_bias"),
    (dict(arch="llama", mlp_bias=True), "mlp_bias=True is not supported"),
])
def test_bias_layouts_vllm_would_load_differently_are_rejected(changes, reason) -> None:
    config = hf_config(TinyModelSpec(arch=changes.pop("arch")))
    config.attention_bias = True
    for k, v in changes.items():
        setattr(config, k, v)
    with pytest.raises(ValueError, match=reason):
        check_model(config, 1)


def test_llama_attention_bias_is_in_the_layout() -> None:
    spec = TinyModelSpec(arch="llama", attention_bias=True)
    dims = check_model(hf_config(spec), 2)
    assert dims.qkv_bias and dims.o_bias
    shapes = hf_shapes(dims)
    assert {n: (s[0], s[1] if len(s) > 1 else 1) for n, s in hf_param_shapes(spec).items()} == shapes
    assert shapes["model.layers.0.self_attn.o_proj.bias"] == (spec.hidden_size, 1)
    plain = model_dims(hf_config(TinyModelSpec(arch="llama")))
    assert not plain.qkv_bias and not plain.o_bias


def test_mistral_is_llamas_layout_and_keeps_its_window() -> None:
    """vLLM's Mistral class holds Llama's parameters: the same layout on every
    TP rank; the window is attention's business (tests/models/test_tiny.py)."""
    mistral = check_model(hf_config(TinyModelSpec(arch="mistral", sliding_window=8)), 2)
    llama = model_dims(hf_config(TinyModelSpec(arch="llama")))
    assert mistral.arch == "MistralForCausalLM"
    assert dataclasses.replace(mistral, arch=llama.arch) == llama
    assert all(tp_layout(mistral, 2, r) == tp_layout(llama, 2, r) for r in range(2))
    assert hf_config(TinyModelSpec(arch="mistral", sliding_window=8)).sliding_window == 8
    with pytest.raises(ValueError, match="sliding_window is an option of gemma2, gemma, mistral only"):
        TinyModelSpec(arch="llama", sliding_window=8)


def test_gemma_3_and_2_add_their_norms_replicated_and_gemma_3_refuses_soft_capping() -> None:
    """Gemma 3 is Qwen3's layout (q_norm/k_norm) plus pre/post-feedforward norms,
    whole on every TP rank; HF's file and the layout agree on every shape."""
    spec = TinyModelSpec(arch="gemma", sliding_window=8, num_kv_heads=1, tie_word_embeddings=True)
    config = hf_config(spec)
    gemma = check_model(config, 2)
    assert gemma.arch == "Gemma3ForCausalLM" and gemma.qk_norm and gemma.ffn_norms and gemma.tied
    assert config.layer_types == ["sliding_attention", "full_attention"]
    shapes = hf_shapes(gemma)
    assert {n: (r * c,) for n, (r, c) in shapes.items()} == \
        {n: (s[0] * (s[1] if len(s) > 1 else 1),) for n, s in hf_param_shapes(spec).items()}
    for r in range(2):
        norms = {t.name: t for t in tp_layout(gemma, 2, r) if "feedforward_layernorm" in t.name}
        assert len(norms) == 2 * spec.num_layers
        assert all(t.shape == (spec.hidden_size, 1) and t.segments[0].rows == (0, spec.hidden_size)
                   for t in norms.values())
    qwen3 = model_dims(hf_config(dataclasses.replace(spec, arch="qwen3", sliding_window=None)))
    assert dataclasses.replace(gemma, arch=qwen3.arch, ffn_norms=False) == qwen3
    for key, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                       ("attention_bias", True)):
        bad = hf_config(spec)
        setattr(bad, key, value)
        with pytest.raises(ValueError, match=f"Gemma 3 with {key}="):
            model_dims(bad)
    # Gemma 2: Gemma 3's layout without q/k norms; its caps are followed, not refused.
    spec2 = dataclasses.replace(spec, arch="gemma2", attn_softcap=5.0, final_softcap=3.0)
    gemma2 = check_model(hf_config(spec2), 2)
    assert gemma2.arch == "Gemma2ForCausalLM" and gemma2.ffn_norms and not gemma2.qk_norm
    assert dataclasses.replace(gemma2, arch=gemma.arch, qk_norm=True) == gemma
    assert all(tp_layout(gemma2, 2, r) == [t for t in tp_layout(gemma, 2, r)
                                           if "_norm." not in t.name or "layernorm" in t.name]
               for r in range(2))
    bad = hf_config(spec2)
    bad.attention_bias = True
    with pytest.raises(ValueError, match="Gemma 2 with attention_bias=True"):
        model_dims(bad)


def test_moe_layouts_stack_the_experts_and_refuse_what_they_lack() -> None:
    """Qwen3-MoE and Mixtral: HF's fused experts seen 2-D, sharded by whole experts
    (row units), into vLLM's stacked w13 / w2 with the router whole; the layout
    equals Qwen3's / Mistral's outside the MLP."""
    from hybrid_engine.reshard.layouts import row_units

    for arch, dense in (("qwen3_moe", "qwen3"), ("mixtral", "mistral")):
        spec = TinyModelSpec(arch=arch, num_experts=5, intermediate_size=64)
        moe = check_model(hf_config(spec), 2)
        assert moe.moe and moe.num_experts == 5 and moe.intermediate == 64
        shapes = hf_shapes(moe)
        assert {n: (r * c,) for n, (r, c) in shapes.items()} == \
            {n: (math.prod(s),) for n, s in hf_param_shapes(spec).items()}
        units = row_units(moe)
        assert units["model.layers.1.mlp.experts.gate_up_proj"] == 2 * 64
        assert units["model.layers.1.mlp.experts.down_proj"] == spec.hidden_size
        plain = model_dims(hf_config(dataclasses.replace(spec, arch=dense)))
        names = {t.name for t in tp_layout(moe, 2, 1)}
        block = "block_sparse_moe" if arch == "mixtral" else "mlp"
        assert {f"model.layers.0.{block}.gate.weight",
                f"model.layers.0.{block}.experts.routed_experts.w13_weight"} <= names
        assert {n for n in names if ".mlp." not in n and block not in n} == \
            {t.name for t in tp_layout(plain, 2, 1) if ".mlp." not in t.name}
    bad = [("mlp_only_layers", [0], "dense layers among the MoE ones"),
           ("decoder_sparse_step", 2, "dense layers among the MoE ones"),
           ("shared_expert_intermediate_size", 64, "with shared experts is not supported")]
    for key, value, reason in bad:
        config = hf_config(TinyModelSpec(arch="qwen3_moe"))
        setattr(config, key, value)
        with pytest.raises(ValueError, match=reason):
            model_dims(config)
    mixtral = hf_config(TinyModelSpec(arch="mixtral"))
    mixtral.sliding_window = 8
    with pytest.raises(ValueError, match="Mixtral with a sliding_window"):
        model_dims(mixtral)
    with pytest.raises(ValueError, match="exceeds the 2 experts"):
        check_model(hf_config(TinyModelSpec(arch="qwen3_moe", num_experts=2,
                                            experts_per_token=1)), 4)
    with pytest.raises(ValueError, match="moe_intermediate_size=66"):
        check_model(hf_config(TinyModelSpec(arch="qwen3_moe", intermediate_size=66)), 4)


def _actor_on(folder: str) -> dict:
    import sys

    from hybrid_engine.policy.colocated import HybridActor

    t0 = time.perf_counter()
    try:
        HybridActor.from_pretrained(folder)
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "s": time.perf_counter() - t0, "vllm_imported": "vllm" in sys.modules}


@pytest.mark.slow
def test_hybrid_actor_refuses_an_unsupported_model_before_building_anything(tmp_path) -> None:
    from hybrid_engine.models.tiny import write_tiny_model
    from hybrid_engine.testing import run_in_subprocess

    folder = write_tiny_model(tmp_path / "m", TinyModelSpec(arch="qwen3"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    out = run_in_subprocess(_actor_on, str(folder), timeout=120, preload=False)  # no vLLM yet
    assert "Qwen3 with attention_bias=True is not supported" in out["error"]
    assert out["s"] < 5 and not out["vllm_imported"], out  # no trainer, no engine
