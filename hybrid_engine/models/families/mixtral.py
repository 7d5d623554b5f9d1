"""Mixtral: Mistral's attention (unwindowed) and routed experts in every layer;
vLLM names the MoE block `block_sparse_moe`."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


class Mixtral(ModelSpec):
    architecture = "MixtralForCausalLM"
    name = "Mixtral"
    moe = True
    moe_block = "block_sparse_moe"
    tiny_arch = model_type = "mixtral"
    config_class = "MixtralConfig"

    def experts(self, config: Any) -> tuple[int, int]:
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError("Mixtral with a sliding_window is not supported")
        return config.num_local_experts, config.intermediate_size


    def tiny_config(self, t: Any, rope: dict) -> dict:
        return super().tiny_config(t, rope) | dict(num_local_experts=t.num_experts,
                                                   num_experts_per_tok=t.experts_per_token)


register(Mixtral())
