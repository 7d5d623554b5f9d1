"""Llama: attention_bias gives q/k/v and o_proj biases."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


class Llama(ModelSpec):
    architecture = "LlamaForCausalLM"
    name = "Llama"
    tiny_arch, config_class = "llama", "LlamaConfig"
    attention_bias = True

    def check(self, config: Any) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        if getattr(config, "bias", False) or bool(getattr(config, "qkv_bias", bias)) != bias:
            # vLLM reads these legacy flags; HF's Llama only knows attention_bias.
            raise ValueError("Llama configs with `bias` or a `qkv_bias` other than "
                             "attention_bias are not supported (HF and vLLM would build "
                             "different biases)")

    def biases(self, config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias


register(Llama())
