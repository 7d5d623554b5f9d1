"""Tensor parallelism inside the FSDP2 training layout (train.tensor_parallel_size).

Job: split every decoder layer of a model built on the meta device over the
"tp" ranks of a 2-D ("dp", "tp") mesh by its family's TP plan
(`models.spec.ModelSpec.tp_plan`), before FSDP2 shards it over "dp"
(`fsdp.lay_out`); and what a training step over such a mesh needs beside
FSDP2: per-head norm gradients summed over "tp" (`sum_partial_grads`) and one
gradient norm over parameters on both meshes (`clip_grad_norm`).

Layout of a full tensor W on rank (d, t), each split with torch.chunk
semantics, the TP split first (`params.local_block` reads it):

    colwise   rows:  chunk(chunk(W, tp, 0)[t], dp, 0)[d]   (_StridedShard(0), Shard(0))
    rowwise   cols chunk(W, tp, 1)[t], rows chunk(., dp, 0)[d]   (Shard(0), Shard(1))
    the rest  chunk(W, dp, 0)[d] on mesh "dp", alike on every t      (Shard(0),)

Attention heads split over "tp"; HF's attention reshapes by head_dim, so a
rank runs its own heads with no other change. With fewer KV heads than TP
ranks, k_proj and v_proj stay whole on every TP rank and rank t keeps its
KV head's slice of their output, as vLLM does (the slice's gradient is summed
over "tp" in backward). The embedding, the head, the norms and an MoE block
are not split: every TP rank runs them on the same tokens.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hybrid_engine.models.spec import ModelDims

__all__ = ["check_run", "check_tp", "clip_grad_norm", "parallelize", "partial_grad_names",
           "sum_partial_grads"]

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
_KV = ("self_attn.k_proj", "self_attn.v_proj")
_LAYER_PARAM = re.compile(r"^model\.layers\.\d+\.(.+)\.[^.]+$")


def check_tp(d: ModelDims, tp: int, plan: dict[str, str]) -> None:
    """Raises ValueError (one line) where tp cannot split the model d by plan.
    The vocabulary is never split (embedding and head stay whole over "tp")."""
    problems = []
    if d.num_heads % tp:
        problems.append(f"the {d.num_heads} attention heads")
    if d.num_kv_heads % tp and tp % d.num_kv_heads:
        problems.append(f"the {d.num_kv_heads} KV heads (nor do they divide it)")
    if "mlp.gate_proj" in plan and d.intermediate % tp:
        problems.append(f"the MLP's intermediate size {d.intermediate}")
    if problems:
        raise ValueError(f"train.tensor_parallel_size={tp} does not divide "
                         f"{' or '.join(problems)} of {d.arch}")


def check_run(hf_config: Any, tp: int, trainers: int, *, lora: bool, sync_method: str) -> None:
    """Raises ValueError (one line) where train.tensor_parallel_size=tp cannot train
    this model on these trainer ranks (preflight: before any engine or mesh)."""
    if tp == 1:
        return
    if trainers % tp:
        raise ValueError(f"train.tensor_parallel_size={tp} must divide the {trainers} trainer "
                         "rank(s): the mesh is (trainer ranks / TP) x TP")
    if lora:
        raise ValueError(f"train.tensor_parallel_size={tp} does not train LoRA adapters: set "
                         "model.lora_rank=0 or train.tensor_parallel_size=1")
    if sync_method == "naive_bucketed":
        raise ValueError(f"sync.method='naive_bucketed' gathers FSDP2 rows over all ranks; with "
                         f"train.tensor_parallel_size={tp} use sync.method='reshard' or 'naive'")
    from hybrid_engine.models.spec import spec_for

    spec = spec_for(hf_config)
    dims = spec.dims(hf_config)
    check_tp(dims, tp, spec.tp_plan(dims))


class _SumOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _own_kv_head(module: nn.Module, args: tuple, out: Tensor, *, head: int, width: int,
                 group: dist.ProcessGroup) -> Tensor:
    """A whole k_proj/v_proj's forward hook: this TP rank's KV head's columns."""
    return _SumOverTP.apply(out, group)[..., head * width:(head + 1) * width]


def parallelize(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str],
                d: ModelDims) -> None:
    """Splits each of model's decoder layers over tp_mesh by plan (`check_tp` first):
    torch's ColwiseParallel and RowwiseParallel (outputs back to plain local
    tensors), KV heads kept whole when they are fewer than the TP ranks, and
    the attention's GQA repeat factor set for this rank's heads."""
    tp = tp_mesh.size()
    check_tp(d, tp, plan)
    kv_split = d.num_kv_heads % tp == 0
    parts = {path: _STYLES[style] for path, style in plan.items()
             if style in _STYLES and (kv_split or path not in _KV)}
    hook = None if kv_split else functools.partial(
        _own_kv_head, head=tp_mesh.get_local_rank() // (tp // d.num_kv_heads),
        width=d.head_dim, group=tp_mesh.get_group())
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {path: style() for path, style in parts.items()})
        attn = layer.self_attn
        attn.num_key_value_groups = d.num_heads // max(d.num_kv_heads, tp)
        if hook is not None:
            attn.k_proj.register_forward_hook(hook)
            attn.v_proj.register_forward_hook(hook)


def partial_grad_names(names: Iterable[str], plan: dict[str, str]) -> list[str]:
    """The parameters among names (checkpoint names) whose gradient each TP rank
    holds only in part: those of the plan's per-head norms."""
    norms = {path for path, style in plan.items() if style == "head_norm"}
    return [n for n in names if (m := _LAYER_PARAM.match(n)) and m.group(1) in norms]


def sum_partial_grads(params: Iterable[Tensor], group: dist.ProcessGroup) -> None:
    """Sums each parameter's (dp-reduced, local) gradient over the TP group: a
    per-head norm's weight sees only this rank's heads. Call once per step,
    after the last backward."""
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=group)


def clip_grad_norm(params: list[Tensor], max_norm: float) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` over DTensor parameters on more than one
    mesh (torch's stacks the norms, which needs one mesh): the 2-norm over
    every mesh's gradients together, the coefficient applied per gradient.
    Returns the total norm before clipping (a plain tensor)."""
    by_mesh: dict[DeviceMesh, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
    squares = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.tensor(0.0)
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0 and math.isfinite(coef):
        for grads in by_mesh.values():
            for g in grads:
                g.mul_(coef)
    return total
