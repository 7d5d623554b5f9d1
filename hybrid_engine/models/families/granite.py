"""Granite: Llama's tensors and names, under four multipliers both HF and vLLM
apply in the forward (embeddings, residuals, the attention's softmax scale,
and the logits, which HF divides by logits_scaling: through the trainer's
hidden-states head that division lands on the hidden states, the same logits
since the projection is linear). So the weights copy as Llama's."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


class Granite(ModelSpec):
    architecture = "GraniteForCausalLM"
    name = "Granite"
    tiny_arch, config_class = "granite", "GraniteConfig"

    def check(self, config: Any) -> None:
        if getattr(config, "bias", False):
            # vLLM's Granite gives o_proj a bias for this legacy flag; HF's does not.
            raise ValueError("Granite configs with `bias` are not supported (HF and vLLM would "
                             "build different biases)")
        if getattr(config, "logit_scale", 1.0) != 1.0:
            raise ValueError("Granite with logit_scale != 1 is not supported: vLLM multiplies "
                             "the logits by it, HF does not")
        if getattr(config, "layer_types", None) is not None or getattr(config, "attention_sinks",
                                                                        False):
            # vLLM's Granite then windows layers and adds attention sinks HF's does not have.
            raise ValueError("Granite with layer_types or attention_sinks is not supported")

    def biases(self, config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def tiny_config(self, t: Any, rope: dict) -> dict:
        """Granite 3's multipliers, none of them neutral, so a side that dropped one
        would show."""
        return super().tiny_config(t, rope) | dict(
            embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=1.0 / t.resolved_head_dim, logits_scaling=8.0)


register(Granite())
