"""Gemma 2: four norms a layer (norms scale by 1 + weight, embeddings by
sqrt(hidden), in the forward of HF and vLLM alike, so the stored weights copy
as they are); attention and final logits soft-capped, which HF's eager
attention, the trainer's chunked log-probs and vLLM apply alike."""

from __future__ import annotations

from typing import Any

from hybrid_engine.models.spec import ModelSpec, register


class Gemma2(ModelSpec):
    architecture = "Gemma2ForCausalLM"
    name = "Gemma 2"
    ffn_norms = True

    def check(self, config: Any) -> None:
        if getattr(config, "attention_bias", False):
            raise ValueError(f"{self.name} with attention_bias=True is not supported")
        if not getattr(config, "tie_word_embeddings", True):
            raise ValueError("Gemma 2 with tie_word_embeddings=False is not supported: vLLM's "
                             "Gemma 2 has no lm_head of its own")


register(Gemma2())
