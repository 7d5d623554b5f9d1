"""Qwen3-MoE: Qwen3's attention, and routed experts in every layer (HF's fused
`mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I])."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


class Qwen3Moe(ModelSpec):
    architecture = "Qwen3MoeForCausalLM"
    name = "Qwen3-MoE"
    qk_norm = True
    moe = True
    tiny_arch = model_type = "qwen3_moe"
    config_class = "Qwen3MoeConfig"

    def experts(self, config: Any) -> tuple[int, int]:
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise ValueError("Qwen3-MoE with dense layers among the MoE ones (mlp_only_layers, "
                             "decoder_sparse_step != 1) is not supported")
        if not getattr(config, "num_experts", 0) or not getattr(config, "moe_intermediate_size", 0):
            raise ValueError("a Qwen3-MoE config needs num_experts and moe_intermediate_size")
        return config.num_experts, config.moe_intermediate_size


    def tiny_config(self, t: Any, rope: dict) -> dict:
        return super().tiny_config(t, rope) | dict(
            num_experts=t.num_experts, num_experts_per_tok=t.experts_per_token,
            moe_intermediate_size=t.intermediate_size, norm_topk_prob=True)


register(Qwen3Moe())
