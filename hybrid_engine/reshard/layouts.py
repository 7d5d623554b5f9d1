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
| (fused) qkv_proj, gate_up_proj | the same rows, read from HF's fused tensor at the q / k / v and gate / up offsets |
| o_proj, down_proj .weight | all rows, columns r/T |
| o_proj.bias | all of it (vLLM adds it on TP rank 0 only) |
| embed_tokens, lm_head .weight | rows [r*Vp/T, (r+1)*Vp/T) of the vocab padded to Vp (multiple of 64); padding rows zero |
| norms, q_norm/k_norm | replicated |
| pre_/post_feedforward_layernorm | replicated |
| (MoE) experts.w13_weight [E, 2I/T, H] | per expert: rows r/T of its gate, then rows r/T of its up |
| (MoE) experts.w2_weight [E, H, I/T] | per expert: all rows, columns r/T |
| (MoE) mlp.gate.weight (the router) | replicated |

What differs between families comes from their `ModelDims` (`models.spec`,
one file per family in `models/families/`): q/k/v and o_proj biases, q/k
norms, HF's own fused qkv_proj and gate_up_proj (a vLLM rank's rows read from
one HF tensor at the q / k / v and gate / up offsets, as vLLM's loader splits
it), the feed-forward norms, and routed experts. Experts are HF's fused
tensors `mlp.experts.gate_up_proj` [E, 2I, H] (an expert's gate rows, then its
up rows) and `mlp.experts.down_proj` [E, H, I], seen 2-D as [E*2I, H] and
[E*H, I]; FSDP2 shards them by whole experts, so their *row unit*
(`row_units`) is 2I and H rows. vLLM stacks them as FusedMoE's w13 and w2 in
its MoE block (`ModelDims.moe_block`), tensor parallel over I (no expert
parallelism).

Invariant: every tensor is seen as 2-D (a 1-D tensor of n is [n, 1]); the
segments of a parameter never overlap and, with the zero padding rows, cover
it exactly; segment rows/cols are ranges of the FULL HF tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from hybrid_engine.models.spec import MODEL_SPECS, ModelDims, hf_param_shapes, model_dims

__all__ = [
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
    "train_splits",
]

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
    """Every HF parameter as a 2-D shape, in file order (`models.spec.hf_param_shapes`
    seen 2-D: a 1-D tensor of n as [n, 1], fused experts [E, R, C] as [E*R, C])."""
    return {name: (math.prod(shape[:-1]), shape[-1]) if len(shape) > 1 else (shape[0], 1)
            for name, shape in hf_param_shapes(d).items()}


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


def train_splits(d: ModelDims, train_tp: int) -> dict[str, str]:
    """HF tensor -> "colwise" / "rowwise" for those train.tensor_parallel_size=train_tp
    splits (`parallel.tensor_parallel`, by the family's TP plan): a colwise
    weight and bias by rows, a rowwise weight by columns (its bias is not
    split), k/v not at all when the KV heads are fewer than train_tp."""
    if train_tp == 1:
        return {}
    plan = MODEL_SPECS.get(d.arch).tp_plan(d)
    if d.num_kv_heads % train_tp:
        plan = {k: v for k, v in plan.items() if k not in ("self_attn.k_proj", "self_attn.v_proj")}
    shapes = hf_shapes(d)
    out = {}
    for i in range(d.num_layers):
        for path, style in plan.items():
            kinds = (".weight", ".bias") if style == "colwise" else (".weight",)
            for kind in kinds if style in ("colwise", "rowwise") else ():
                name = f"model.layers.{i}.{path}{kind}"
                if name in shapes:
                    out[name] = style
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
    / `w2_weight`, <block> being `ModelDims.moe_block`."""
    v = m.replace(".mlp.", f".{d.moe_block}.")
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
