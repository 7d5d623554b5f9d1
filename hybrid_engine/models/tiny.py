"""Random-init HF model folders (Qwen2, Llama, Qwen3, Mistral, Phi-3, Gemma 2 and 3,
Qwen3-MoE, Mixtral) for tests and benchmarks.

``write_tiny_model(path, spec)`` writes ``model.safetensors``,
``config.json``, ``generation_config.json`` and the tokenizer files of
``hybrid_engine.models.tokenizer``; nothing is fetched from a hub. A
Mixture-of-Experts folder stores one tensor per expert and projection, as
published checkpoints do (`models.experts`). The folder
loads with ``AutoModelForCausalLM.from_pretrained`` (no missing or unexpected
keys) and with vLLM.

Invariant protected: the weights are a pure function of the spec. Each tensor
is drawn from its own generator, seeded from ``TinyModelSpec.seed`` and the tensor's
name, so the same spec gives a byte-identical ``model.safetensors``, and a
tensor's values do not depend on which other tensors exist (a tied and an
untied model share their embedding).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from hybrid_engine.models.experts import checkpoint_tensors
from hybrid_engine.models.spec import hf_param_shapes as shapes_of
from hybrid_engine.models.spec import model_dims, tiny_archs, tiny_spec
from hybrid_engine.models.tokenizer import (
    EOS_TOKEN_ID,
    build_tokenizer,
    tokenizer_vocab_size,
    write_tokenizer_files,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "ARCHS",
    "PRESETS",
    "TinyModelSpec",
    "VLLM_CPU_HEAD_DIMS",
    "build_tokenizer",
    "hf_config",
    "hf_param_shapes",
    "random_state_dict",
    "write_tiny_model",
]

ARCHS = tiny_archs()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM 0.32's CPU attention accepts (others fail at the first
forward with "Unsupported CPU attention configuration")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelSpec:
    """Shape and init of a random-init decoder-only model."""

    arch: str = "qwen2"
    """The family, by its tiny name (`models.spec.ModelSpec.tiny_arch`: ARCHS):
    e.g. "qwen2", "llama", "gemma" (Gemma 3's text model: with sliding_window,
    every other layer windowed), "gemma2" (its attention and final logits
    soft-capped: attn_softcap, final_softcap), or a Mixture-of-Experts
    ("qwen3_moe", "mixtral") with num_experts experts of width
    intermediate_size in every layer."""
    hidden_size: int = 128
    """Model width. The default gives head_dim 32: vLLM's CPU attention only
    supports head sizes in VLLM_CPU_HEAD_DIMS (64 / 4 heads = 16 fails)."""
    num_layers: int = 2
    """Number of decoder layers."""
    num_heads: int = 4
    """Number of query heads."""
    num_kv_heads: int = 2
    """Number of key/value heads (GQA); must divide num_heads; may be 1."""
    intermediate_size: int = 256
    """Width of the SwiGLU MLP (MoE: of each expert)."""
    num_experts: int = 6
    """qwen3_moe and mixtral: routed experts per layer."""
    experts_per_token: int = 2
    """qwen3_moe and mixtral: experts each token is routed to (top-k)."""
    vocab_size: int = 1000
    """Model vocabulary (embedding rows); >= the tokenizer's id count,
    need not be a multiple of 64. Ids past the tokenizer's are never produced
    by encoding but may be sampled."""
    tie_word_embeddings: bool = False
    """Share embed_tokens and lm_head; the file then has no lm_head.weight."""
    max_position_embeddings: int = 512
    """Longest supported sequence (also the tokenizer's model_max_length)."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_heads. Some families may not
    set another value (vLLM's Qwen2 ignores config.head_dim)."""
    seed: int = 0
    """Seed of the weights; same spec -> byte-identical safetensors."""
    init_std: float = 0.02
    """Std of the normal init of every matrix and bias."""
    norm_std: float = 0.0
    """Std of the norm weights around their neutral value (1, or the family's
    `norm_centre`; 0: all at it, as HF inits them). Tests of weight movement
    set it, so a norm swapped with another shows."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    attention_bias: bool = False
    """Families that allow it (llama): q/k/v and o_proj biases (config.attention_bias)."""
    sliding_window: int | None = None
    """Windowed families (mistral, gemma2, gemma): each token attends to itself and
    the sliding_window - 1 tokens before it (config.sliding_window; gemma: in
    layers 0, 2, 4, ...); None = full causal attention."""
    attn_softcap: float = 50.0
    """gemma2: attention logits capped to (-cap, cap) by cap * tanh(x / cap)
    (config.attn_logit_softcapping; Gemma 2's is 50)."""
    final_softcap: float = 30.0
    """gemma2: the output logits capped the same way (config.final_logit_softcapping;
    Gemma 2's is 30)."""
    words: tuple[str, ...] = ()
    """Texts the tokenizer encodes as one token each (`models.tokenizer.build_tokenizer`);
    () = a byte-level tokenizer only."""
    dtype: str = "float32"
    """Storage dtype of the safetensors file: "float32" or "bfloat16" (drawn in
    fp32 then rounded, so a bf16 file is the rounded fp32 one)."""

    def __post_init__(self) -> None:
        family = tiny_spec(self.arch)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        if self.vocab_size < (ids := tokenizer_vocab_size(self.words)):
            raise ValueError(f"vocab_size={self.vocab_size} < tokenizer size {ids}")
        if self.attention_bias and not family.attention_bias:
            raise ValueError(f"attention_bias is an option of {_archs('attention_bias')} only "
                             "(qwen2 always has q/k/v biases; vLLM's qwen3 has no o_proj bias)")
        if self.sliding_window is not None and (not family.windowed or self.sliding_window < 1):
            raise ValueError(f"sliding_window is an option of {_archs('windowed')} only, >= 1")
        family.tiny_check(self)
        if family.moe and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"need 1 <= experts_per_token <= num_experts, got "
                             f"{self.experts_per_token} and {self.num_experts}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")

    @property
    def resolved_head_dim(self) -> int:
        """head_dim, or hidden_size // num_heads when it is None."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """Number of parameters (a tied embedding counted once)."""
        return sum(math.prod(s) for s in hf_param_shapes(self).values())


PRESETS: dict[str, TinyModelSpec] = {
    # ~0.5M params: unit tests.
    "tiny": TinyModelSpec(),
    # ~15M params: integration tests that want non-trivial GEMMs.
    "small": TinyModelSpec(
        arch="qwen2",
        hidden_size=384,
        num_layers=4,
        num_heads=6,
        num_kv_heads=2,
        intermediate_size=1536,
        vocab_size=8192,
        max_position_embeddings=2048,
    ),
    # ~181M params (Qwen2-style, head_dim 64, GQA 3:1): benchmarks.
    "qwen2-180m": TinyModelSpec(
        arch="qwen2",
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=4096,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # ~180M params, nearly all in the decoder (vocab 512): the job measured
    # against a colocated peer (hidden 896, 12 layers, 14 heads, 2 KV heads,
    # intermediate 4864), used by bench_peer and bench_step's peer-sized runs.
    "qwen2-180m-v512": TinyModelSpec(
        arch="qwen2",
        hidden_size=896,
        num_layers=12,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        vocab_size=512,
        max_position_embeddings=4096,
    ),
}
"""Named specs; use ``dataclasses.replace(PRESETS[name], ...)`` for variants."""


def _archs(flag: str) -> str:
    """The tiny names of the families whose spec sets flag."""
    return ", ".join(a for a in ARCHS if getattr(tiny_spec(a), flag))


def hf_param_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the checkpoint, in a fixed order.

    Names are those of ``<Arch>ForCausalLM.state_dict()`` (`models.spec.hf_param_shapes`
    of the config's dims); with tied embeddings there is no ``lm_head.weight``.

    Args:
        spec: the model.

    Returns:
        Ordered ``{name: shape}``.
    """
    return shapes_of(model_dims(hf_config(spec)))


def hf_config(spec: TinyModelSpec) -> PreTrainedConfig:
    """The transformers config of ``spec`` (its family's `config_class`, with the
    family's own keys: `ModelSpec.tiny_config`).

    Args:
        spec: the model.

    Returns:
        A config with ``architectures`` set, eos/bos/pad = the tokenizer's EOS.
    """
    import transformers

    family = tiny_spec(spec.arch)
    extra = {"attention_bias": True} if spec.attention_bias else {}
    extra.update(family.tiny_config(spec, {"rope_type": "default", "rope_theta": spec.rope_theta}))
    return getattr(transformers, family.config_class)(
        **extra,
        architectures=[family.architecture],
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.resolved_head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        dtype=spec.dtype,
    )


def _init_tensor(name: str, shape: tuple[int, ...], spec: TinyModelSpec) -> torch.Tensor:
    # Per-tensor seed: values depend only on (seed, name), not on draw order.
    gen = torch.Generator().manual_seed((spec.seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
    if name.endswith("norm.weight"):
        centre = tiny_spec(spec.arch).norm_centre
        if spec.norm_std == 0:
            return torch.full(shape, centre)
        return torch.empty(shape).normal_(centre, spec.norm_std, generator=gen)
    return torch.empty(shape).normal_(0.0, spec.init_std, generator=gen)


def random_state_dict(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """Draws the weights of ``spec`` (the tensors ``write_tiny_model`` saves).

    Args:
        spec: the model; ``TinyModelSpec.dtype`` is the dtype of the returned tensors.

    Returns:
        ``{hf_name: tensor}`` in ``hf_param_shapes`` order.
    """
    dtype = _DTYPES[spec.dtype]
    return {n: _init_tensor(n, s, spec).to(dtype) for n, s in hf_param_shapes(spec).items()}


def write_tiny_model(path: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Writes a random-init HF model folder.

    Files: ``model.safetensors`` (deterministic bytes), ``config.json``,
    ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``
    and ``tiny_spec.json`` (the spec, for humans and for reproduction).

    Args:
        path: the folder; created if missing, existing files overwritten.
        spec: shape, init and seed of the model.

    Returns:
        The folder, as a ``Path``.
    """
    from transformers import GenerationConfig

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = random_state_dict(spec)
    if (family := tiny_spec(spec.arch)).moe:
        state = checkpoint_tensors(family.model_type, state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_config(spec).save_pretrained(folder)
    GenerationConfig(
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID
    ).save_pretrained(folder)
    write_tokenizer_files(folder, model_max_length=spec.max_position_embeddings, words=spec.words)
    spec_json = json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True)
    (folder / "tiny_spec.json").write_text(spec_json + "\n")
    return folder
