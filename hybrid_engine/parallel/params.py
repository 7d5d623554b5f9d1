"""FSDP2 parameters by their HF names: access, full tensors, rows, and the sharded load.

Job: what every role needs of a model's parameters whatever the training
layout (FSDP2 DTensors sharded on dim 0, or plain replicated tensors): HF
checkpoint names (`hf_name`), this rank's rows (`local_rows`), full tensors,
resharding after a forward without backward, and loading a safetensors
folder so that each rank reads only its own rows (`load_sharded_safetensors`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hybrid_engine.reshard.plan import shard_rows

log = logging.getLogger(__name__)

__all__ = ["LoadStats", "assert_sharded", "full_tensor", "hf_name", "is_adapter",
           "load_sharded_safetensors", "local_block", "local_rows", "reshard_all",
           "sharded_named_parameters"]

_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
_LORA_BASE = ".base_layer"
_PLACEMENTS = ((Shard(0),), (Replicate(), Shard(0)),  # FSDP2, HSDP
               (Shard(0), Shard(1)),  # TP x FSDP2: rowwise (colwise: `_is_colwise`)
               (Shard(0), Replicate()))  # TP x FSDP2: a rowwise bias


def _is_colwise(placements: tuple) -> bool:
    """FSDP2 over a TP colwise split: (_StridedShard(0), Shard(0)) on ("dp", "tp")."""
    return (len(placements) == 2 and isinstance(placements[0], _StridedShard)
            and placements[0].dim == 0 and placements[1] == Shard(0))


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (`parallel/lora.py`): in no base
    checkpoint."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The checkpoint name of a module parameter (activation-checkpoint prefix and
    the `.base_layer` of a LoRA-adapted linear removed; an adapter's name keeps
    its `.lora_A.` / `.lora_B.` part: `parallel/lora.py`)."""
    return name.replace(_CHECKPOINT_PREFIX, "").replace(_LORA_BASE, "")


# --------------------------------------------------------------------------
# Sharded load
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What one rank read from the checkpoint during a sharded load.

    Attributes:
        elements_read: tensor elements read by this rank (its rows only).
        elements_total: elements of all the model's parameters in the file.
        max_rows_read: the most rows read for any one tensor.
    """

    elements_read: int
    elements_total: int
    max_rows_read: int


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint name -> safetensors file, from the index or the single file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{folder} has no model.safetensors(.index.json)")
    with safetensors.safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no iter


def load_sharded_safetensors(model: nn.Module, folder: str | os.PathLike) -> LoadStats:
    """Fills each rank's `Shard(0)` rows of every parameter (but LoRA adapters) from
    the safetensors files.

    Reads only rows `local_rows(param)` of each tensor (file dtype, cast on
    copy). Tied parameters are loaded once, from the name
    `named_parameters` reports (the embedding's). A Mixture-of-Experts
    checkpoint may keep each expert apart (`models.experts`): a rank then
    reads only its experts' tensors.

    Args:
        model: a module whose parameters are DTensors placed as FSDP2 places them.
        folder: the checkpoint folder.

    Returns:
        LoadStats of this rank.

    Raises:
        ValueError: a parameter is missing from the checkpoint or has another
            shape, or any rank read a NaN/inf (checked as the rows load; every
            rank raises, naming the first such tensor).
    """
    files = _tensor_files(Path(folder))
    # (a critic's holder of the backbone has no config of its own; its backbone has)
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    model_type = getattr(config, "model_type", "")
    read = total = max_rows = 0
    nonfinite: str | None = None
    loaded: list[Tensor] = []
    with _OpenFiles() as opened:
        for name, param in sharded_named_parameters(model):
            if is_adapter(name):  # LoRA adapters: initialised, not loaded
                continue
            (start, end), cols = local_block(param)
            local = param.to_local() if isinstance(param, DTensor) else param
            assert local.shape[0] == end - start, (name, local.shape, start, end)
            rows = _read_rows(name, tuple(param.shape), (start, end), cols, files, opened,
                              model_type, folder)
            if end > start:
                with torch.no_grad():
                    local.copy_(rows)
                    if nonfinite is None and not bool(torch.isfinite(local).all()):
                        nonfinite = name
            loaded.append(param)
            read += local.numel()
            total += param.numel()
            max_rows = max(max_rows, end - start)
    _agree_finite(nonfinite, loaded, folder)
    return LoadStats(elements_read=read, elements_total=total, max_rows_read=max_rows)


class _OpenFiles(dict):
    """safetensors file -> its open handle, opened on first use, closed on exit."""

    def get_slice(self, file: Path, key: str):  # noqa: ANN201 - safetensors' slice type
        if file not in self:
            self[file] = safetensors.safe_open(file, "pt")
            self[file].__enter__()
        return self[file].get_slice(key)

    def __enter__(self) -> _OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.values():
            f.__exit__(None, None, None)


def _read_rows(name: str, shape: tuple[int, ...], rows: tuple[int, int],
               cols: tuple[int, int] | None, files: dict[str, Path], opened: _OpenFiles,
               model_type: str, folder: str | os.PathLike) -> Tensor:
    """Rows [start, end) of parameter `name` (columns cols, None: all): its own
    tensor, or its experts' tensors of a per-expert checkpoint concatenated
    (`models.experts.checkpoint_parts`; never split by columns)."""
    from hybrid_engine.models.experts import checkpoint_parts

    start, end = rows
    parts = None if name in files else checkpoint_parts(model_type, name, shape[0])
    key = parts.name if parts is not None and not parts.keys else name
    if parts is None or not parts.keys:
        if key not in files:
            raise ValueError(f"parameter {name} is not in the checkpoint {folder}")
        sl = opened.get_slice(files[key], key)
        if tuple(sl.get_shape()) != shape:
            raise ValueError(f"{name}: file shape {sl.get_shape()} != model {shape}")
        return sl[start:end] if cols is None else sl[start:end, cols[0]:cols[1]]
    missing = [k for keys in parts.keys for k in keys if k not in files]
    if missing:
        raise ValueError(f"parameter {name} is not in the checkpoint {folder} "
                         f"(nor its experts' tensors: {missing[0]} is missing)")
    experts = [torch.cat([opened.get_slice(files[keys[e]], keys[e])[:] for keys in parts.keys])
               for e in range(start, end)]
    if experts and tuple(experts[0].shape) != shape[1:]:
        raise ValueError(f"{name}: an expert's file tensors make {tuple(experts[0].shape)}, "
                         f"the model has {shape[1:]}")
    return torch.stack(experts) if experts else torch.empty(0)


def _agree_finite(nonfinite: str | None, params: list[Tensor], folder: str | os.PathLike) -> None:
    """Every rank of the mesh raises if any rank read a non-finite weight
    (a rank alone raising would leave the others waiting in a collective)."""
    # replicated plain parameters: every rank read the same rows and found the same
    meshes = [p.device_mesh for p in params if isinstance(p, DTensor)]
    mesh = max(meshes, key=lambda m: m.ndim) if meshes else None  # TP: ("dp", "tp")
    bad = [] if nonfinite is None else [nonfinite]
    for dim in range(mesh.ndim if mesh is not None else 0):  # a 2-D mesh: along each dim
        group = mesh.get_group(dim)
        if dist.get_world_size(group) > 1:
            found: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(found, bad[0] if bad else None, group=group)
            bad = [n for n in found if n is not None][:1]
    if bad:
        raise ValueError(f"model folder {str(folder)!r}: {bad[0]} holds NaN or inf values "
                         "(a corrupt or diverged checkpoint); training from it is meaningless")


# --------------------------------------------------------------------------
# Access for the trainer, the reference and the weight sync
# --------------------------------------------------------------------------


def sharded_named_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(checkpoint name, parameter) pairs; tied parameters once. The parameters are
    sharded DTensors, or plain whole tensors in a replicated model (no FSDP).

    Raises:
        AssertionError: a parameter of an FSDP model is not a Shard(0) DTensor
            (see `assert_sharded`).
    """
    fsdp = isinstance(model, FSDPModule)
    for name, param in model.named_parameters():
        _check_param(name, param, fsdp)
        yield hf_name(name), param


def _check_param(name: str, param: Tensor, fsdp: bool) -> None:
    assert not fsdp or (isinstance(param, DTensor) and (
        param.placements in _PLACEMENTS or _is_colwise(param.placements))), (
        f"{name} is a {type(param).__name__}, not a Shard(0) DTensor: the FSDP root is "
        "unsharded (a forward without backward leaves it so); call reshard_all(module)"
    )


def full_tensor(param: Tensor) -> Tensor:
    """The whole parameter: all-gathered from a DTensor (collective), or param itself."""
    return param.full_tensor() if isinstance(param, DTensor) else param


def local_rows(param: Tensor) -> tuple[int, int]:
    """[start, end) rows of the full parameter that this rank's local tensor holds:
    its Shard(0) chunk within its shard group (the mesh's last dim); all of a
    plain (replicated) tensor."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    mesh = param.device_mesh
    dim = mesh.ndim - 1
    return shard_rows(param.shape[0], mesh.size(dim), mesh.get_local_rank(dim))


def local_block(param: Tensor) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """([start, end) rows, [start, end) columns or None for all) of the full
    parameter that this rank's local tensor holds. One mesh dim: `local_rows`.
    On a ("dp", "tp") mesh (`parallel.tensor_parallel`) the TP split comes
    first: colwise, rows chunk(chunk(W, tp)[t], dp)[d]; rowwise, columns
    chunk(W, tp, 1)[t] and rows chunk(W, dp)[d]."""
    if not isinstance(param, DTensor) or param.device_mesh.ndim == 1 \
            or param.placements == (Replicate(), Shard(0)):
        return local_rows(param), None
    mesh, n = param.device_mesh, param.shape[0]
    if param.placements == (Shard(0), Replicate()):  # a rowwise bias: whole on every TP rank
        return shard_rows(n, mesh.size(0), mesh.get_local_rank(0)), None
    d, t = mesh.get_local_rank(0), mesh.get_local_rank(1)
    dp, tp = mesh.size(0), mesh.size(1)
    if _is_colwise(param.placements):
        a, b = shard_rows(n, tp, t)
        start, end = shard_rows(b - a, dp, d)
        return (a + start, a + end), None
    assert param.placements == (Shard(0), Shard(1)), (param.placements, param.shape)
    return shard_rows(n, dp, d), shard_rows(param.shape[1], tp, t)


def reshard_all(model: nn.Module) -> None:
    """Frees every gathered parameter: the root's group (a forward without backward
    leaves it gathered) and, with sharding=grad_op, every layer's too."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def assert_sharded(model: nn.Module) -> None:
    """Asserts every parameter of an FSDP model is registered as its Shard(0)
    DTensor (a replicated model's plain parameters pass).

    After a forward with no backward FSDP2 leaves the root unsharded: the
    module then exposes plain full tensors for embed/norm/lm_head, and
    anything built from `parameters()` (an optimizer, a weight sync, a
    checkpoint) silently holds the wrong tensors.
    """
    fsdp = isinstance(model, FSDPModule)
    for name, param in model.named_parameters():
        _check_param(name, param, fsdp)
