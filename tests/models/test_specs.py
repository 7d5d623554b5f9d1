"""models/spec.py and models/families/: one file per family, its dims, its refusals."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest

from hybrid_engine.models import families
from hybrid_engine.models.spec import (MODEL_SPECS, hf_param_shapes, model_dims, spec_for,
                                       supported, tiny_archs, tiny_spec)
from hybrid_engine.models.tiny import TinyModelSpec, hf_config


def _tiny(arch: str) -> TinyModelSpec:
    return TinyModelSpec(arch=arch, tie_word_embeddings=arch == "gemma2")


def test_every_family_is_one_file_that_registers_one_spec() -> None:
    modules = sorted(m.name for m in pkgutil.iter_modules(families.__path__))
    owners = sorted(type(MODEL_SPECS.get(a)).__module__.rsplit(".", 1)[1] for a in supported())
    assert owners == modules and len(modules) >= 10
    for name in modules:  # importing a family again registers nothing twice
        importlib.import_module(f"{families.__name__}.{name}")
    assert len(supported()) == len(modules) == len(set(tiny_archs()))
    assert supported(moe=True) == ["MixtralForCausalLM", "Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("arch", tiny_archs())
def test_each_familys_tiny_model_reads_back_as_its_spec(arch: str) -> None:
    """The tiny config names the family's architecture, and its dims carry the
    family's features; the HF shapes follow them."""
    spec = tiny_spec(arch)
    config = hf_config(_tiny(arch))
    d = model_dims(config)
    assert spec_for(config) is spec and d.arch == spec.architecture
    assert (d.qk_norm, d.fused, d.ffn_norms, d.moe, d.moe_block) == (
        spec.qk_norm, spec.fused, spec.ffn_norms, spec.moe, spec.moe_block)
    shapes = hf_param_shapes(d)
    assert ("model.layers.0.self_attn.q_norm.weight" in shapes) == spec.qk_norm
    assert ("model.layers.0.self_attn.qkv_proj.weight" in shapes) == spec.fused
    assert ("model.layers.0.mlp.experts.gate_up_proj" in shapes) == spec.moe


def test_granite_multipliers_reach_the_config_and_its_refusals_are_one_line() -> None:
    config = hf_config(_tiny("granite"))
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling,
            config.attention_multiplier) == (12.0, 0.22, 8.0, 1 / 32)
    d = model_dims(config)
    assert dataclasses.replace(d, arch="LlamaForCausalLM") == model_dims(hf_config(_tiny("llama")))
    for key, value, reason in [("bias", True, "`bias` are not supported"),
                               ("logit_scale", 2.0, "logit_scale != 1"),
                               ("layer_types", ["full_attention"] * 2, "layer_types"),
                               ("attention_sinks", True, "attention_sinks")]:
        bad = hf_config(_tiny("granite"))
        setattr(bad, key, value)
        with pytest.raises(ValueError, match=reason):
            model_dims(bad)


def test_a_config_without_a_spec_is_refused_naming_the_supported_ones() -> None:
    class NoArch:
        architectures = None
        model_type = "gpt2"

    with pytest.raises(ValueError, match=f"names no architecture.*{supported()[-1]}"):
        model_dims(NoArch())

    class Shared:
        architectures = ["Qwen2MoeForCausalLM"]

    with pytest.raises(ValueError, match="with shared experts is not supported .*supported MoE: "
                                         "MixtralForCausalLM, Qwen3MoeForCausalLM"):
        model_dims(Shared())
    with pytest.raises(ValueError, match="arch must be one of"):
        TinyModelSpec(arch="gpt2")
