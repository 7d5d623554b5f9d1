"""Qwen2: q/k/v biases always; vLLM derives head_dim from hidden / heads and
ignores config.head_dim."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


class Qwen2(ModelSpec):
    architecture = "Qwen2ForCausalLM"
    name = "Qwen2"
    tiny_arch, config_class = "qwen2", "Qwen2Config"

    def tiny_check(self, t: Any) -> None:
        if t.head_dim not in (None, t.hidden_size // t.num_heads):
            raise ValueError("qwen2 needs head_dim == hidden_size // num_heads")

    def head_dim(self, config: Any) -> int:
        return config.hidden_size // config.num_attention_heads

    def biases(self, config: Any) -> tuple[bool, bool]:
        return True, False


register(Qwen2())
