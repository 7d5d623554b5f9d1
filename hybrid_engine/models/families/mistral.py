"""Mistral: Llama's tensors under vLLM's Mistral class; config.sliding_window
windows every layer in HF's mask and in vLLM's attention alike."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


class Mistral(ModelSpec):
    architecture = "MistralForCausalLM"
    name = "Mistral"
    tiny_arch, config_class = "mistral", "MistralConfig"
    windowed = True

    def tiny_config(self, t: Any, rope: dict) -> dict:
        return super().tiny_config(t, rope) | {"sliding_window": t.sliding_window}


register(Mistral())
