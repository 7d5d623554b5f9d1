"""Phi-3: HF's own fused `qkv_proj` [q; k; v] and `gate_up_proj` [gate; up];
a vLLM rank's rows come from one HF tensor at those offsets, as vLLM's loader
splits it."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelDims, ModelSpec, register


class Phi3(ModelSpec):
    architecture = "Phi3ForCausalLM"
    name = "Phi-3"
    fused = True
    tiny_arch, config_class = "phi3", "Phi3Config"

    def tiny_check(self, t: Any) -> None:
        if t.head_dim not in (None, t.hidden_size // t.num_heads):
            raise ValueError("phi3 needs head_dim == hidden_size // num_heads")

    def check(self, config: Any) -> None:
        rope = getattr(config, "rope_parameters", None) or {}
        if (rope.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError("Phi-3 with partial_rotary_factor != 1 is not supported")

    def tp_plan(self, d: ModelDims) -> dict[str, str]:
        raise ValueError("Phi-3 cannot train with train.tensor_parallel_size > 1: its fused "
                         "qkv_proj and gate_up_proj would split across q/k/v and gate/up, "
                         "not within each")


register(Phi3())
