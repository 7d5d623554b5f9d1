"""Gemma 2: four norms a layer (norms scale by 1 + weight, embeddings by
sqrt(hidden), in the forward of HF and vLLM alike, so the stored weights copy
as they are); attention and final logits soft-capped, which HF's eager
attention, the trainer's chunked log-probs and vLLM apply alike."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


def gemma_tiny_config(t: Any, rope: dict) -> dict:
    """Gemma 2 and 3: windowed and global layers take turns, GELU MLP."""
    window = t.sliding_window or t.max_position_embeddings
    return dict(
        sliding_window=window, query_pre_attn_scalar=t.resolved_head_dim,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=[("sliding_attention" if t.sliding_window and i % 2 == 0
                      else "full_attention") for i in range(t.num_layers)])


class Gemma2(ModelSpec):
    architecture = "Gemma2ForCausalLM"
    name = "Gemma 2"
    ffn_norms = True
    tiny_arch, config_class = "gemma2", "Gemma2Config"
    norm_centre = 0.0
    windowed = True

    def check(self, config: Any) -> None:
        if getattr(config, "attention_bias", False):
            raise ValueError(f"{self.name} with attention_bias=True is not supported")
        if not getattr(config, "tie_word_embeddings", True):
            raise ValueError("Gemma 2 with tie_word_embeddings=False is not supported: vLLM's "
                             "Gemma 2 has no lm_head of its own")


    def tiny_check(self, t: Any) -> None:
        if not t.tie_word_embeddings:
            raise ValueError("gemma2 ties its embeddings (vLLM's Gemma 2 has no separate "
                             "lm_head): set tie_word_embeddings=True")

    def tiny_config(self, t: Any, rope: dict) -> dict:
        """Soft-capped attention and logits (t.attn_softcap, t.final_softcap)."""
        return gemma_tiny_config(t, rope) | dict(
            rope_parameters=rope, attn_logit_softcapping=t.attn_softcap,
            final_logit_softcapping=t.final_softcap)


register(Gemma2())
