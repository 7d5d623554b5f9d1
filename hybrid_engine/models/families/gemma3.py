"""Gemma 3's text model: Gemma 2's layout with q_norm and k_norm; windowed and
global layers alternate, each with its RoPE base; no soft-capping (vLLM's
Gemma 3 drops the attention cap, and released Gemma 3 models have none)."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.families.gemma2 import gemma_tiny_config
from hybrid_engine.models.spec import ModelSpec, register


class Gemma3(ModelSpec):
    architecture = "Gemma3ForCausalLM"
    name = "Gemma 3"
    qk_norm = True
    ffn_norms = True
    tiny_arch, config_class = "gemma", "Gemma3TextConfig"
    norm_centre = 0.0
    windowed = True

    def check(self, config: Any) -> None:
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, key, None) is not None:
                raise ValueError(f"Gemma 3 with {key}={getattr(config, key)} is not supported: "
                                 "vLLM's Gemma 3 does not apply an attention cap, and released "
                                 "Gemma 3 models have neither")
        if getattr(config, "attention_bias", False):
            raise ValueError(f"{self.name} with attention_bias=True is not supported")


    def tiny_config(self, t: Any, rope: dict) -> dict:
        """Each layer type its RoPE."""
        return gemma_tiny_config(t, rope) | dict(
            rope_parameters={"sliding_attention": rope, "full_attention": rope})


register(Gemma3())
