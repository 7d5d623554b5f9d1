"""Where every LoRA adapter tensor lands on a vLLM tensor-parallel rank.

Job: the adapter counterpart of `layouts.tp_layout`, for `sync.lora=adapter`.
vLLM's LoRA manager takes each adapter tensor whole on every TP rank and
slices it itself (`slice_lora_a` / `slice_lora_b` of its LoRA layers), so a
rank's target is the whole tensor, of which it reads only this part:

| adapted module | lora_A [r, in] | lora_B [out, r] |
| --- | --- | --- |
| q_proj | all | rows of the rank's q heads |
| k_proj, v_proj | all | rows of the rank's kv heads (one replicated head when num_kv < T) |
| gate_proj, up_proj | all | rows r/T of the intermediate dimension |
| o_proj | columns of the rank's q heads | all |
| down_proj | columns r/T of the intermediate dimension | all |

The segments list exactly that part; the rest of the target stays zero and
is never read. So the plan (`plan.build_plan(..., lora=...)`) moves only the
adapter elements a rank reads and does not own. Names are PEFT's saved names
without its `base_model.model.` prefix:
`model.layers.<i>.self_attn.q_proj.lora_A.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_engine.reshard.layouts import ModelDims, Segment, TargetParam, check_tp, kv_heads

__all__ = ["LoraDims", "adapter_layout", "adapter_shapes"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")  # vLLM slices their lora_A's columns


@dataclass(frozen=True, slots=True)
class LoraDims:
    """The adapters' shape facts: rank r and the adapted modules (HF names)."""

    rank: int
    targets: tuple[str, ...]


def _module(d: ModelDims, i: int, name: str) -> tuple[str, int, int]:
    """(HF module path, out features, in features) of one adapted linear."""
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    out_in = {"q_proj": (q, d.hidden), "k_proj": (kv, d.hidden), "v_proj": (kv, d.hidden),
              "o_proj": (d.hidden, q), "gate_proj": (d.intermediate, d.hidden),
              "up_proj": (d.intermediate, d.hidden), "down_proj": (d.hidden, d.intermediate)}
    if name not in out_in:
        raise ValueError(f"no LoRA layout for module {name!r}; known: {', '.join(out_in)}")
    kind = "self_attn" if name in _ATTENTION else "mlp"
    return f"model.layers.{i}.{kind}.{name}", *out_in[name]


def adapter_shapes(d: ModelDims, lora: LoraDims) -> dict[str, tuple[int, int]]:
    """Every adapter tensor as (rows, cols), layer by layer in the targets' order."""
    out = {}
    for i in range(d.num_layers):
        for name in lora.targets:
            path, n_out, n_in = _module(d, i, name)
            out[f"{path}.lora_A.weight"] = (lora.rank, n_in)
            out[f"{path}.lora_B.weight"] = (n_out, lora.rank)
    return out


def _part(d: ModelDims, name: str, tp: int, r: int, n: int) -> tuple[int, int]:
    """[start, end) of the n-long sliced dimension that TP rank r reads."""
    if name in ("k_proj", "v_proj"):
        k0, k1 = kv_heads(d, tp, r)
        return k0 * d.head_dim, k1 * d.head_dim
    return r * n // tp, (r + 1) * n // tp


def adapter_layout(d: ModelDims, lora: LoraDims, tp: int, r: int) -> list[TargetParam]:
    """The adapter tensors on TP rank r of tp: whole shapes, with segments covering
    the part vLLM's LoRA layer on that rank reads (module doc's table)."""
    check_tp(d, tp)
    out = []
    for i in range(d.num_layers):
        for name in lora.targets:
            path, n_out, n_in = _module(d, i, name)
            a, b = f"{path}.lora_A.weight", f"{path}.lora_B.weight"
            if name in _ROW_PARALLEL:
                c0, c1 = _part(d, name, tp, r, n_in)
                a_seg = Segment(a, (0, lora.rank), (c0, c1), 0, c0)
                b_seg = Segment(b, (0, n_out), (0, lora.rank), 0)
            else:
                r0, r1 = _part(d, name, tp, r, n_out)
                a_seg = Segment(a, (0, lora.rank), (0, n_in), 0)
                b_seg = Segment(b, (r0, r1), (0, lora.rank), r0)
            out.append(TargetParam(a, (lora.rank, n_in), (a_seg,)))
            out.append(TargetParam(b, (n_out, lora.rank), (b_seg,)))
    return out
