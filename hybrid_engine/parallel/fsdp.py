"""FSDP2 layout of a HF causal LM, initialised shard by shard from safetensors.

Job: build the training layout of the actor: a transformers causal LM
(Qwen2, Llama, Qwen3) with `fully_shard` on every decoder layer and at the
root, over a 1-D data-parallel DeviceMesh (gloo on CPU, NCCL on CUDA), fp32
(master_dtype) parameters, optional bf16 compute through MixedPrecisionPolicy,
and optional activation checkpointing; or, replicated, the same model under
DDP. The trainer, the reference and the
weight sync all build and read the model through this module.

Invariant: every parameter of a built model is a DTensor placed `Shard(0)`
over the mesh whose local tensor equals rows [start, end) of the checkpoint
tensor, with (start, end) = `shard_rows(dim0, world_size, rank)` (torch.chunk
semantics: ceil-sized chunks, the last ranks may hold fewer or zero rows).
With train.sharding=hybrid the mesh is 2-D, (replicate, shard) = (N/S, S),
the placements `(Replicate(), Shard(0))` (FSDP2's HSDP), and the same holds
with S ranks in place of N, counted within the rank's shard group
(`local_rows`). train.sharding=replicate is no FSDP at all: plain parameters,
whole on every rank, gradients averaged by DDP (`_build_replicated`), bf16
compute by torch.autocast (`compute_autocast`).
Under FSDP no rank ever holds a full parameter during init: the model is built on the
meta device, sharded, materialised shard-only by `to_empty`, then each rank
reads only its own rows from the file (`safe_open(...).get_slice(name)[a:b]`).
`LoadStats` counts what each rank read so callers and tests can check it.

Two layout details callers rely on:
- `lm_head` is replaced by `HiddenStatesHead`, which owns the same `weight`
  Parameter (same name, same tying) but returns the final hidden states: the
  vocab projection is done by the caller in chunks, so full-vocab logits for
  a whole batch never exist (see `trainer.token_logprobs`).
- Parameter names are the HF checkpoint names (`hf_name` strips the
  activation-checkpoint wrapper's prefix).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybrid_engine.reshard.plan import shard_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

__all__ = [
    "DTYPES",
    "SHARDINGS",
    "HiddenStatesHead",
    "LoadStats",
    "apply_fsdp",
    "assert_sharded",
    "build_fsdp_model",
    "compute_autocast",
    "full_tensor",
    "shard_and_load",
    "default_device",
    "dp_mesh",
    "fsdp_mesh",
    "hf_name",
    "init_rotary_buffers",
    "load_sharded_safetensors",
    "local_rows",
    "reshard_all",
    "resolve_model_path",
    "shard_rows",
    "sharded_named_parameters",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHARDINGS = ("full", "grad_op", "replicate", "hybrid")  # TrainConfig.sharding, resolved
_PLACEMENTS = ((Shard(0),), (Replicate(), Shard(0)))
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


# --------------------------------------------------------------------------
# Mesh and row ranges
# --------------------------------------------------------------------------


def default_device() -> torch.device:
    """The current CUDA device when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dp_mesh(device: torch.device | None = None, *, whole_world: bool = False) -> DeviceMesh:
    """A 1-D data-parallel mesh ("dp") over the train group (`dist.train_group`:
    the default group unless placement is separate), or over every rank when
    whole_world (e.g. a reward model that every rank runs).

    Raises:
        ValueError: torch.distributed is not initialised (FSDP2 needs a group;
            use `hybrid_engine.parallel.dist.init_distributed` or `run_ranks`).
    """
    from hybrid_engine.parallel.dist import train_group

    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: FSDP2 needs a process group")
    device = device or default_device()
    group = None if whole_world else train_group()
    if group is not None:
        return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


_MESHES: dict[tuple[tuple[int, ...], int], DeviceMesh] = {}


def fsdp_mesh(dp: DeviceMesh, shard_size: int) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp itself when shard_size is its size, else a 2-D
    (replicate, shard) mesh of the same ranks, shard groups of shard_size consecutive
    ranks (HSDP; shard_size 1 = replicated). Built once per (ranks, size), from
    groups only their members create (it runs on the trainer ranks alone under
    separate placement).

    Raises:
        ValueError: shard_size does not divide the mesh's size.
    """
    world = dp.size()
    if shard_size == world:
        return dp
    if not 1 <= shard_size <= world or world % shard_size:
        raise ValueError(f"shard group size {shard_size} must divide the {world} "
                         "data-parallel ranks")
    ranks = tuple(dp.mesh.flatten().tolist())
    key = (ranks, shard_size)
    if key not in _MESHES:
        grid = torch.tensor(ranks).view(world // shard_size, shard_size)
        r, s = divmod(dp.get_local_rank(), shard_size)
        groups = [dist.new_group(grid[:, s].tolist(), use_local_synchronization=True),
                  dist.new_group(grid[r].tolist(), use_local_synchronization=True)]
        _MESHES[key] = DeviceMesh.from_group(groups, dp.device_type, mesh=grid,
                                             mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def hf_name(name: str) -> str:
    """The checkpoint name of a module parameter (activation-checkpoint prefix removed)."""
    return name.replace(_CHECKPOINT_PREFIX, "")


# --------------------------------------------------------------------------
# Model construction
# --------------------------------------------------------------------------


class HiddenStatesHead(nn.Module):
    """Stands in for `lm_head`: holds its weight [V, H] but returns its input.

    The HF forward then returns the final (normed) hidden states in
    `.logits` (at the positions `logits_to_keep` selects); the caller projects
    them onto the vocabulary chunk by chunk while the FSDP root is unsharded
    (FSDP2 keeps the root's parameters unsharded from its forward until the
    end of backward, so `module.lm_head.weight` is then the full weight).
    """

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden_BTH: Tensor) -> Tensor:
        return hidden_BTH


def _looks_local(model_path: str) -> bool:
    """A path rather than a hub id ("org/name"): absolute, relative to ., ~, or deeper."""
    return (os.path.isabs(model_path) or model_path.startswith((".", "~"))
            or model_path.count("/") >= 2 or os.path.exists(model_path))


def resolve_model_path(model_path: str) -> Path:
    """The local HF folder of model_path (a folder, or a hub id fetched to the HF cache).

    Raises:
        ValueError: a local-looking path that is not a folder with a config.json.
    """
    if os.path.isdir(model_path):
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(f"model folder {model_path!r} has no config.json "
                             "(expected a HF model folder: config.json + *.safetensors)")
        return Path(model_path)
    if _looks_local(model_path):
        raise ValueError(f"model folder {model_path!r} does not exist or is not a folder")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors"]))


def _build_meta_model(folder: Path, dtype: torch.dtype, trust_remote_code: bool) -> PreTrainedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code
        )
    # Same Parameter object: a tied model stays tied (one FSDP parameter, one name).
    model.lm_head = HiddenStatesHead(model.lm_head.weight)
    # RL runs without dropout: train_step and compute_logprobs must agree exactly.
    model.eval()
    return model


def apply_fsdp(
    model: PreTrainedModel, mesh: DeviceMesh, mp: MixedPrecisionPolicy, checkpointing: bool,
    *, reshard_after_forward: bool = True,
) -> None:
    """`fully_shard` on every decoder layer, then the root. reshard_after_forward=False
    (train.sharding=grad_op) keeps each layer's parameters gathered from its forward
    to its backward: one all-gather per layer per pass instead of two."""
    if checkpointing:
        _wrap_checkpointing(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # Root group: embed_tokens, final norm, lm_head (one parameter when tied).
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _wrap_checkpointing(model: PreTrainedModel) -> None:
    """Activation checkpointing: every decoder layer recomputed in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)


def init_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    """Recomputes non-persistent rotary buffers, left uninitialised by to_empty."""
    for module in model.modules():
        if not hasattr(module, "inv_freq"):
            continue
        with torch.device(device):
            fresh = type(module)(module.config)
        for name, buf in fresh.named_buffers(recurse=False):
            setattr(module, name, buf)


def build_fsdp_model(
    model_path: str,
    mesh: DeviceMesh,
    *,
    master_dtype: str = "float32",
    compute_dtype: str = "float32",
    activation_checkpointing: bool = False,
    requires_grad: bool = True,
    trust_remote_code: bool = False,
    sharding: str = "full",
    shard_group_size: int = 0,
    grad_hook: Callable[[nn.Module, dist.ProcessGroup, torch.device], None] | None = None,
) -> tuple[FSDPModule, LoadStats]:
    """Builds the FSDP2 layout of a checkpoint without materialising it anywhere.

    Args:
        model_path: local HF folder (or hub id) with config.json and safetensors.
        mesh: 1-D data-parallel mesh.
        master_dtype: dtype of the sharded parameters (and of gradient reduction).
        compute_dtype: dtype of the all-gathered parameters in forward/backward.
        activation_checkpointing: recompute decoder layers in backward.
        requires_grad: False freezes every parameter (reference model).
        trust_remote_code: passed to transformers.
        sharding: "full" (parameters resharded after each layer's forward),
            "grad_op" (kept gathered until its backward), "replicate" (whole on
            every rank) or "hybrid" (sharded over groups of shard_group_size
            ranks, replicated across them); see TrainConfig.sharding.
        shard_group_size: ranks per shard group (sharding="hybrid" only).
        grad_hook: sharding="replicate": called with the replicated model, its
            process group and device to install a gradient communication hook
            (the trainer's `train.cpu_shm_allreduce`: `rollout/shm_allreduce.py`);
            None: DDP's own all-reduce over the group.

    Returns:
        (model, stats): the root FSDPModule (a HF `*ForCausalLM` whose lm_head
        is a HiddenStatesHead), and what this rank read from the files.
    """
    folder = resolve_model_path(model_path)
    model = _build_meta_model(folder, DTYPES[master_dtype], trust_remote_code)
    model.requires_grad_(requires_grad)
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if sharding == "replicate":
        return _build_replicated(model, folder, mesh, DTYPES[master_dtype],
                                 DTYPES[compute_dtype], activation_checkpointing,
                                 grad_hook)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[compute_dtype], reduce_dtype=DTYPES[master_dtype])
    size = {"hybrid": shard_group_size}.get(sharding, mesh.size())
    stats = shard_and_load(model, folder, fsdp_mesh(mesh, size), mp,
                           checkpointing=activation_checkpointing,
                           reshard_after_forward=sharding == "full")
    return model, stats


def _build_replicated(model: PreTrainedModel, folder: Path, mesh: DeviceMesh,
                      master: torch.dtype, compute: torch.dtype,
                      checkpointing: bool, grad_hook: Callable | None = None,
                      ) -> tuple[nn.Module, LoadStats]:
    """train.sharding=replicate: plain parameters, whole on every rank, gradients
    averaged by DDP (torch's composable `replicate`: buckets all-reduced while
    backward runs, the gradients views of the buckets) and compute_dtype through
    torch.autocast (`compute_autocast`). FSDP2's HSDP with shard groups of one
    rank gives the same semantics but copies every parameter into and out of its
    all-gather buffers and every gradient through its reduce-scatter buffers,
    each step: on the 181M W1 step (2 ranks, bf16 compute, one Xeon) its train
    phase took 2.80 s where this takes 1.83 s (benchmarks/results/
    step_w1_replicate_hsdp_* and step_w1_replicate_ddp_*)."""
    from torch.distributed._composable.replicate import replicate

    if checkpointing:
        _wrap_checkpointing(model)
    device = default_device() if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    model.to_empty(device=device)
    init_rotary_buffers(model, device)
    stats = load_sharded_safetensors(model, folder)
    if any(p.requires_grad for p in model.parameters()):
        # init_sync=False: every rank loaded the same file, nothing to broadcast;
        # broadcast_buffers=False: the only buffers are the rotary tables.
        replicate(model, device_id=device, process_group=mesh.get_group(),
                  init_sync=False, broadcast_buffers=False, gradient_as_bucket_view=True)
        if grad_hook is not None and mesh.size() > 1:
            grad_hook(model, mesh.get_group(), device)
    model.compute_autocast = compute if compute != master else None
    return model, stats


def compute_autocast(model: nn.Module) -> torch.dtype | None:
    """The dtype a forward of model runs under torch.autocast (None: none, the
    parameters' dtype or FSDP2's MixedPrecisionPolicy decides)."""
    return getattr(model, "compute_autocast", None)


def shard_and_load(model: nn.Module, folder: Path, mesh: DeviceMesh, mp: MixedPrecisionPolicy, *,
                   checkpointing: bool = False, device: torch.device | None = None,
                   load_into: nn.Module | None = None,
                   init: Callable[[nn.Module], None] | None = None,
                   reshard_after_forward: bool = True) -> LoadStats:
    """The one FSDP2 construction path of every model we train or score with
    (policy, reference, critic, reward model): a model built on the meta device
    is sharded (`apply_fsdp`), materialised shard-only (`to_empty`), its rotary
    buffers recomputed, its rows read from the safetensors in `folder`.

    Args:
        model: built on the meta device, `.model.layers` its decoder layers.
        device: where the shards live; the mesh's device by default.
        load_into: the module whose parameter names are the checkpoint's
            (a holder of the backbone, for a model that adds its own head).
        init: fills parameters the checkpoint does not have (after the load).

    Returns:
        What this rank read from the files.
    """
    apply_fsdp(model, mesh, mp, checkpointing, reshard_after_forward=reshard_after_forward)
    if device is None:
        device = default_device() if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    model.to_empty(device=device)
    init_rotary_buffers(model, device)
    stats = load_sharded_safetensors(load_into if load_into is not None else model, folder)
    if init is not None:
        with torch.no_grad():
            init(model)
    assert_sharded(model)
    return stats


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
    """Fills each rank's `Shard(0)` rows of every parameter from the safetensors files.

    Reads only rows `local_rows(param)` of each tensor (file dtype, cast on
    copy). Tied parameters are loaded once, from the name
    `named_parameters` reports (the embedding's).

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
    by_file: dict[Path, list[tuple[str, DTensor]]] = {}
    for name, param in sharded_named_parameters(model):
        if name not in files:
            raise ValueError(f"parameter {name} is not in the checkpoint {folder}")
        by_file.setdefault(files[name], []).append((name, param))
    read = total = max_rows = 0
    nonfinite: str | None = None
    for file, params in by_file.items():
        with safetensors.safe_open(file, "pt") as f:
            for name, param in params:
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != tuple(param.shape):
                    raise ValueError(
                        f"{name}: file shape {sl.get_shape()} != model {tuple(param.shape)}"
                    )
                start, end = local_rows(param)
                local = param.to_local() if isinstance(param, DTensor) else param
                assert local.shape[0] == end - start, (name, local.shape, start, end)
                if end > start:
                    with torch.no_grad():
                        local.copy_(sl[start:end])
                        if nonfinite is None and not bool(torch.isfinite(local).all()):
                            nonfinite = name
                read += local.numel()
                total += param.numel()
                max_rows = max(max_rows, end - start)
    _agree_finite(nonfinite, by_file, folder)
    return LoadStats(elements_read=read, elements_total=total, max_rows_read=max_rows)


def _agree_finite(nonfinite: str | None, by_file: dict, folder: str | os.PathLike) -> None:
    """Every rank of the mesh raises if any rank read a non-finite weight
    (a rank alone raising would leave the others waiting in a collective)."""
    params = [p for ps in by_file.values() for _, p in ps]
    # replicated plain parameters: every rank read the same rows and found the same
    mesh = params[0].device_mesh if params and isinstance(params[0], DTensor) else None
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
    assert (isinstance(param, DTensor) and param.placements in _PLACEMENTS) or not fsdp, (
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
