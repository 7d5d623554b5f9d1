"""Where every HF weight lands in vLLM's tensor-parallel layout, per architecture.

Job: for a HF decoder config and a TP rank r of T, list vLLM's parameters on
that rank (names, local shapes) and, for each, the pieces of HF tensors that
fill it: `Segment(hf_name, rows, cols, dst_row, dst_col)`. This mirrors vLLM's
own weight loaders (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding / ParallelLMHead):

| vLLM parameter | rank r of T holds |
| --- | --- |
| qkv_proj.weight/bias | q rows of r's heads, then k, then v rows of r's kv heads (a kv head is replicated on T/num_kv ranks when num_kv < T) |
| gate_up_proj.weight | rows r/T of gate, then rows r/T of up |
| (Phi-3) qkv_proj, gate_up_proj | the same rows, read from HF's fused tensor at the q / k / v and gate / up offsets |
| o_proj, down_proj .weight | all rows, columns r/T |
| o_proj.bias (Llama attention_bias) | all of it (vLLM adds it on TP rank 0 only) |
| embed_tokens, lm_head .weight | rows [r*Vp/T, (r+1)*Vp/T) of the vocab padded to Vp (multiple of 64); padding rows zero |
| norms, q_norm/k_norm | replicated |
| (Gemma 2, 3) pre_/post_feedforward_layernorm | replicated |
| (MoE) experts.w13_weight [E, 2I/T, H] | per expert: rows r/T of its gate, then rows r/T of its up |
| (MoE) experts.w2_weight [E, H, I/T] | per expert: all rows, columns r/T |
| (MoE) mlp.gate.weight (the router) | replicated |

Architectures: Qwen2 (q/k/v biases; vLLM derives head_dim from hidden / heads
and ignores config.head_dim), Llama (optional attention_bias, o_proj's
included), Qwen3 (q_norm/k_norm), Mistral (Llama's tensors under vLLM's
Mistral class; config.sliding_window windows every layer in HF's mask and in
vLLM's attention alike, through its cache config), Phi-3 (HF's own fused
`qkv_proj` [q; k; v] and `gate_up_proj` [gate; up]: a vLLM rank's rows come
from one HF tensor at those offsets, as vLLM's loader splits it), Gemma 3's
text model (q_norm/k_norm and four norms a layer; its norms scale by 1 +
weight and its embeddings by sqrt(hidden) in the forward of HF and vLLM
alike, so the stored weights copy as they are; windowed and global layers
alternate, each with its RoPE base; no soft-capping), Gemma 2 (Gemma 3's
layout without q_norm/k_norm; its attention and final logits soft-capped,
which HF's eager attention, the trainer's chunked log-probs and vLLM apply
alike), and two Mixture-of-Experts families:
Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's, unwindowed). Their
experts are HF's fused tensors `mlp.experts.gate_up_proj` [E, 2I, H] (an
expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I],
seen 2-D as [E*2I, H] and [E*H, I]; FSDP2 shards them by whole experts, so
their *row unit* (`row_units`) is 2I and H rows. vLLM stacks them as
FusedMoE's w13 and w2, tensor parallel over I (no expert parallelism).

Invariant: every tensor is seen as 2-D (a 1-D tensor of n is [n, 1]); the
segments of a parameter never overlap and, with the zero padding rows, cover
it exactly; segment rows/cols are ranges of the FULL HF tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelDims",
    "Segment",
    "TargetParam",
    "check_model",
    "check_tp",
    "hf_shapes",
    "kv_heads",
    "model_dims",
    "row_units",
    "tp_layout",
]

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM",
                           "MistralForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
_SHARED_EXPERT_ARCHITECTURES = ("Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM",
                                "DeepseekV3ForCausalLM", "Llama4ForCausalLM",
                                "Qwen3NextForCausalLM", "Glm4MoeForCausalLM")
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class Segment(NamedTuple):
    """Rows [r0, r1) x cols [c0, c1) of HF tensor hf_name, placed at (dst_row, dst_col)."""

    hf_name: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    dst_row: int
    dst_col: int = 0


@dataclass(frozen=True, slots=True)
class TargetParam:
    """One vLLM parameter on one TP rank: local 2-D shape and its segments."""

    name: str
    shape: tuple[int, int]
    segments: tuple[Segment, ...]


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The shape facts of a HF config that the layout depends on."""

    arch: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False
    fused: bool = False
    """HF stores qkv_proj and gate_up_proj fused (Phi-3)."""
    ffn_norms: bool = False
    """pre_feedforward_layernorm and post_feedforward_layernorm (Gemma 3)."""
    num_experts: int = 0
    """Routed experts of every MoE layer (0: a dense model); `intermediate` is
    then each expert's width."""

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


def model_dims(config: Any) -> ModelDims:
    """Reads ModelDims from a transformers config (or anything with its fields).

    Raises:
        ValueError: the architecture is not supported (lists the supported ones).
    """
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else ""
    if arch in _SHARED_EXPERT_ARCHITECTURES or getattr(config, "shared_expert_intermediate_size", 0):
        raise ValueError(f"{arch or config.model_type}: a Mixture-of-Experts with shared experts "
                         "is not supported (the resharding planner has no layout for them); "
                         f"supported MoE: {', '.join(MOE_ARCHITECTURES)}")
    if not arch:
        raise ValueError(f"the config (model_type {getattr(config, 'model_type', None)!r}) names "
                         "no architecture: add \"architectures\": [one of "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}]")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    heads = config.num_attention_heads
    # vLLM's Qwen2 derives head_dim from hidden/heads and ignores config.head_dim.
    head_dim = config.hidden_size // heads
    if arch != "Qwen2ForCausalLM" and getattr(config, "head_dim", None):
        head_dim = config.head_dim
    attention_bias = bool(getattr(config, "attention_bias", False))
    if arch == "Qwen3ForCausalLM" and attention_bias:
        # HF's Qwen3 gives o_proj a bias too; vLLM's Qwen3 has none and would drop it.
        raise ValueError("Qwen3 with attention_bias=True is not supported: vLLM's Qwen3 has "
                         "no o_proj bias, so rollouts would not use the trained weights")
    if arch == "LlamaForCausalLM" and (
            getattr(config, "bias", False)
            or bool(getattr(config, "qkv_bias", attention_bias)) != attention_bias):
        # vLLM reads these legacy flags; HF's Llama only knows attention_bias.
        raise ValueError("Llama configs with `bias` or a `qkv_bias` other than attention_bias "
                         "are not supported (HF and vLLM would build different biases)")
    qkv_bias = arch == "Qwen2ForCausalLM" or attention_bias
    o_bias = arch == "LlamaForCausalLM" and attention_bias
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    rope = getattr(config, "rope_parameters", None) or {}
    if arch == "Phi3ForCausalLM" and (rope.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("Phi-3 with partial_rotary_factor != 1 is not supported")
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        _check_gemma(config, arch)
    experts, intermediate = _experts(config, arch) if arch in MOE_ARCHITECTURES else (
        0, config.intermediate_size)
    return ModelDims(
        arch=arch, num_layers=config.num_hidden_layers, hidden=config.hidden_size,
        num_heads=heads, num_kv_heads=config.num_key_value_heads or heads, head_dim=head_dim,
        intermediate=intermediate, vocab=config.vocab_size,
        tied=bool(config.tie_word_embeddings), qkv_bias=qkv_bias,
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
        o_bias=o_bias, fused=arch == "Phi3ForCausalLM",
        ffn_norms=arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
        num_experts=experts,
    )


def _experts(config: Any, arch: str) -> tuple[int, int]:
    """(experts, each expert's width) of a supported MoE config; what of it the
    layout cannot follow, refused in one line."""
    if arch == "MixtralForCausalLM":
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError("Mixtral with a sliding_window is not supported")
        return config.num_local_experts, config.intermediate_size
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise ValueError("Qwen3-MoE with dense layers among the MoE ones (mlp_only_layers, "
                         "decoder_sparse_step != 1) is not supported")
    if not getattr(config, "num_experts", 0) or not getattr(config, "moe_intermediate_size", 0):
        raise ValueError("a Qwen3-MoE config needs num_experts and moe_intermediate_size")
    return config.num_experts, config.moe_intermediate_size


def _check_gemma(config: Any, arch: str) -> None:
    """What of a Gemma 2 or 3 config the engine cannot follow, refused in one line.
    Gemma 2's soft-capping is followed (the trainer's eager attention and chunked
    log-probs apply it, as vLLM does); Gemma 3's is not: vLLM's Gemma 3 drops the
    attention cap, and released Gemma 3 models have none."""
    name = "Gemma 2" if arch == "Gemma2ForCausalLM" else "Gemma 3"
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if name == "Gemma 3" and getattr(config, key, None) is not None:
            raise ValueError(f"Gemma 3 with {key}={getattr(config, key)} is not supported: "
                             "vLLM's Gemma 3 does not apply an attention cap, and released "
                             "Gemma 3 models have neither")
    if getattr(config, "attention_bias", False):
        raise ValueError(f"{name} with attention_bias=True is not supported")
    if name == "Gemma 2" and not getattr(config, "tie_word_embeddings", True):
        raise ValueError("Gemma 2 with tie_word_embeddings=False is not supported: vLLM's "
                         "Gemma 2 has no lm_head of its own")


def check_model(config: Any, tp: int) -> ModelDims:
    """The supported-model contract in one place: architecture, bias flags, tied
    embeddings, heads, MLP and padded vocabulary against the rollout's TP size.
    Runs before any engine starts (preflight, HybridActor, build_plan).

    Returns:
        The model's ModelDims.

    Raises:
        ValueError: a one-line reason.
    """
    d = model_dims(config)
    check_tp(d, tp)
    return d


def hf_shapes(d: ModelDims) -> dict[str, tuple[int, int]]:
    """Every HF parameter as a 2-D shape (1-D tensors as [n, 1]), in file order."""
    out: dict[str, tuple[int, int]] = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    for i in range(d.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d.hidden, 1)
        if d.fused:
            out[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, d.hidden)
        else:
            out[p + "self_attn.q_proj.weight"] = (q, d.hidden)
            out[p + "self_attn.k_proj.weight"] = (kv, d.hidden)
            out[p + "self_attn.v_proj.weight"] = (kv, d.hidden)
        if d.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q, 1)
            out[p + "self_attn.k_proj.bias"] = (kv, 1)
            out[p + "self_attn.v_proj.bias"] = (kv, 1)
        if d.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d.head_dim, 1)
            out[p + "self_attn.k_norm.weight"] = (d.head_dim, 1)
        out[p + "self_attn.o_proj.weight"] = (d.hidden, q)
        if d.o_bias:
            out[p + "self_attn.o_proj.bias"] = (d.hidden, 1)
        out[p + "post_attention_layernorm.weight"] = (d.hidden, 1)
        if d.ffn_norms:
            out[p + "pre_feedforward_layernorm.weight"] = (d.hidden, 1)
            out[p + "post_feedforward_layernorm.weight"] = (d.hidden, 1)
        if d.moe:  # HF's fused experts, seen 2-D (see row_units)
            out[p + "mlp.gate.weight"] = (d.num_experts, d.hidden)
            out[p + "mlp.experts.gate_up_proj"] = (d.num_experts * 2 * d.intermediate, d.hidden)
            out[p + "mlp.experts.down_proj"] = (d.num_experts * d.hidden, d.intermediate)
            continue
        if d.fused:
            out[p + "mlp.gate_up_proj.weight"] = (2 * d.intermediate, d.hidden)
        else:
            out[p + "mlp.gate_proj.weight"] = (d.intermediate, d.hidden)
            out[p + "mlp.up_proj.weight"] = (d.intermediate, d.hidden)
        out[p + "mlp.down_proj.weight"] = (d.hidden, d.intermediate)
    out["model.norm.weight"] = (d.hidden, 1)
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, d.hidden)
    return out


def row_units(d: ModelDims) -> dict[str, int]:
    """HF tensors whose 2-D rows FSDP2 shards in groups (Shard(0) of a 3-D tensor
    splits its first dim): name -> rows per dim-0 index. The others: 1."""
    if not d.moe:
        return {}
    out = {}
    for i in range(d.num_layers):
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = 2 * d.intermediate
        out[f"model.layers.{i}.mlp.experts.down_proj"] = d.hidden
    return out


def check_tp(d: ModelDims, tp: int) -> None:
    """Raises ValueError unless tp splits the heads and the MLP evenly."""
    if d.num_heads % tp or d.intermediate % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide num_attention_heads={d.num_heads} "
            f"and {'moe_' if d.moe else ''}intermediate_size={d.intermediate}"
        )
    if d.moe and tp > d.num_experts:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {d.num_experts} experts "
                         "(vLLM refuses it)")
    if d.num_kv_heads % tp and tp % d.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and num_key_value_heads={d.num_kv_heads}: "
            "one must divide the other"
        )
    padded = -(-d.vocab // VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the vocabulary as vLLM pads it: "
            f"vocab_size={d.vocab} -> {padded} (a multiple of {VOCAB_PADDING})"
        )


def kv_heads(d: ModelDims, tp: int, r: int) -> tuple[int, int]:
    """[first, last) kv head of TP rank r (one replicated head when num_kv < T)."""
    if d.num_kv_heads >= tp:
        n = d.num_kv_heads // tp
        return r * n, (r + 1) * n
    h = r // (tp // d.num_kv_heads)
    return h, h + 1


def _qkv(d: ModelDims, tp: int, r: int, prefix: str, suffix: str, cols: int) -> TargetParam:
    nq = d.num_heads // tp * d.head_dim
    k0, k1 = (h * d.head_dim for h in kv_heads(d, tp, r))
    nkv = k1 - k0
    if d.fused:  # HF's qkv_proj: all q rows, then all k rows, then all v rows
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        fused = f"{prefix}qkv_proj.{suffix}"
        segs = (Segment(fused, (r * nq, (r + 1) * nq), (0, cols), 0),
                Segment(fused, (q + k0, q + k1), (0, cols), nq),
                Segment(fused, (q + kv + k0, q + kv + k1), (0, cols), nq + nkv))
        return TargetParam(fused, (nq + 2 * nkv, cols), segs)
    segs = (
        Segment(f"{prefix}q_proj.{suffix}", (r * nq, (r + 1) * nq), (0, cols), 0),
        Segment(f"{prefix}k_proj.{suffix}", (k0, k1), (0, cols), nq),
        Segment(f"{prefix}v_proj.{suffix}", (k0, k1), (0, cols), nq + nkv),
    )
    return TargetParam(f"{prefix}qkv_proj.{suffix}", (nq + 2 * nkv, cols), segs)


def _vocab(name: str, hf_name: str, d: ModelDims, tp: int, r: int) -> TargetParam:
    padded = -(-d.vocab // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = padded // tp
    v0, v1 = r * per_rank, min((r + 1) * per_rank, d.vocab)
    segs = (Segment(hf_name, (v0, v1), (0, d.hidden), 0),) if v1 > v0 else ()
    return TargetParam(name, (per_rank, d.hidden), segs)


def _full(name: str, rows: int, cols: int) -> TargetParam:
    return TargetParam(name, (rows, cols), (Segment(name, (0, rows), (0, cols), 0),))


def _layer(d: ModelDims, tp: int, r: int, i: int) -> Iterator[TargetParam]:
    p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    yield _full(p + "input_layernorm.weight", d.hidden, 1)
    yield _qkv(d, tp, r, a, "weight", d.hidden)
    if d.qkv_bias:
        yield _qkv(d, tp, r, a, "bias", 1)
    if d.qk_norm:
        yield _full(a + "q_norm.weight", d.head_dim, 1)
        yield _full(a + "k_norm.weight", d.head_dim, 1)
    nq = d.num_heads // tp * d.head_dim
    yield TargetParam(a + "o_proj.weight", (d.hidden, nq),
                      (Segment(a + "o_proj.weight", (0, d.hidden), (r * nq, (r + 1) * nq), 0),))
    if d.o_bias:
        yield _full(a + "o_proj.bias", d.hidden, 1)
    yield _full(p + "post_attention_layernorm.weight", d.hidden, 1)
    if d.ffn_norms:
        yield _full(p + "pre_feedforward_layernorm.weight", d.hidden, 1)
        yield _full(p + "post_feedforward_layernorm.weight", d.hidden, 1)
    if d.moe:
        yield from _experts_layout(d, tp, r, m)
        return
    ni = d.intermediate // tp
    gate, up = ((m + "gate_up_proj.weight",) * 2 if d.fused else
                (m + "gate_proj.weight", m + "up_proj.weight"))
    u0 = d.intermediate if d.fused else 0  # HF's gate_up_proj: gate rows, then up rows
    yield TargetParam(m + "gate_up_proj.weight", (2 * ni, d.hidden), (
        Segment(gate, (r * ni, (r + 1) * ni), (0, d.hidden), 0),
        Segment(up, (u0 + r * ni, u0 + (r + 1) * ni), (0, d.hidden), ni),
    ))
    yield TargetParam(m + "down_proj.weight", (d.hidden, ni),
                      (Segment(m + "down_proj.weight", (0, d.hidden), (r * ni, (r + 1) * ni), 0),))


def _experts_layout(d: ModelDims, tp: int, r: int, m: str) -> Iterator[TargetParam]:
    """An MoE layer: the router, then vLLM's stacked experts (HF's fused tensors,
    2-D: expert e's gate rows start at e*2I, its up rows at e*2I + I). vLLM
    names them `<block>.gate.weight` and `<block>.experts.routed_experts.w13_weight`
    / `w2_weight`, its Mixtral block being `block_sparse_moe`."""
    v = m.replace(".mlp.", ".block_sparse_moe.") if d.arch == "MixtralForCausalLM" else m
    yield TargetParam(v + "gate.weight", (d.num_experts, d.hidden),
                      (Segment(m + "gate.weight", (0, d.num_experts), (0, d.hidden), 0),))
    e_n, i_n, ni = d.num_experts, d.intermediate, d.intermediate // tp
    gate_up, down = m + "experts.gate_up_proj", m + "experts.down_proj"
    if tp == 1:  # gate and up rows of every expert are contiguous
        segs: tuple[Segment, ...] = (Segment(gate_up, (0, e_n * 2 * i_n), (0, d.hidden), 0),)
    else:
        cols = (0, d.hidden)
        segs = tuple(Segment(gate_up, rows, cols, dst) for rows, dst in _expert_rows(e_n, i_n, ni, r))
    yield TargetParam(v + "experts.routed_experts.w13_weight", (e_n * 2 * ni, d.hidden), segs)
    yield TargetParam(v + "experts.routed_experts.w2_weight", (e_n * d.hidden, ni),
                      (Segment(down, (0, e_n * d.hidden), (r * ni, (r + 1) * ni), 0),))


@functools.cache
def _expert_rows(e_n: int, i_n: int, ni: int, r: int) -> tuple[tuple[tuple[int, int], int], ...]:
    """TP rank r's (HF rows, dst_row) of every expert's gate and up rows in w13
    (the same for every layer)."""
    return tuple(((e * 2 * i_n + half * i_n + r * ni, e * 2 * i_n + half * i_n + (r + 1) * ni),
                  e * 2 * ni + half * ni) for e in range(e_n) for half in (0, 1))


def tp_layout(d: ModelDims, tp: int, r: int) -> list[TargetParam]:
    """vLLM's parameters on TP rank r of tp, with the HF segments that fill them.

    With tied embeddings vLLM's lm_head shares embed_tokens' parameter, so it
    is not listed.
    """
    check_tp(d, tp)
    if not 0 <= r < tp:
        raise ValueError(f"TP rank {r} out of range for tensor_parallel_size={tp}")
    out = [_vocab("model.embed_tokens.weight", "model.embed_tokens.weight", d, tp, r)]
    for i in range(d.num_layers):
        out.extend(_layer(d, tp, r, i))
    out.append(_full("model.norm.weight", d.hidden, 1))
    if not d.tied:
        out.append(_vocab("lm_head.weight", "lm_head.weight", d, tp, r))
    return out
