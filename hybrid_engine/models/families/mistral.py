"""Mistral: Llama's tensors under vLLM's Mistral class; config.sliding_window
windows every layer in HF's mask and in vLLM's attention alike."""

from __future__ import annotations

from hybrid_engine.models.spec import ModelSpec, register


class Mistral(ModelSpec):
    architecture = "MistralForCausalLM"
    name = "Mistral"


register(Mistral())
