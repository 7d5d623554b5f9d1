"""Qwen3: q_norm and k_norm; no o_proj bias in vLLM."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


class Qwen3(ModelSpec):
    architecture = "Qwen3ForCausalLM"
    name = "Qwen3"
    qk_norm = True
    tiny_arch, config_class = "qwen3", "Qwen3Config"

    def check(self, config: Any) -> None:
        if getattr(config, "attention_bias", False):
            # HF's Qwen3 gives o_proj a bias too; vLLM's Qwen3 has none and would drop it.
            raise ValueError("Qwen3 with attention_bias=True is not supported: vLLM's Qwen3 "
                             "has no o_proj bias, so rollouts would not use the trained weights")


register(Qwen3())
