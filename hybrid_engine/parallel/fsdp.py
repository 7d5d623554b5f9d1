"""FSDP2 layout of a HF causal LM, initialised shard by shard from safetensors.

Job: build the training layout of the actor: a transformers causal LM
(every family of `models/families/`) with `fully_shard` on every decoder layer and at the
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
(`local_rows`). With train.tensor_parallel_size the mesh is ("dp", "tp")
(`tp_mesh`): the decoder layers are split over "tp" first
(`parallel.tensor_parallel`), then FSDP2-sharded over "dp"; a rank's block of
each tensor is `params.local_block`'s. train.sharding=replicate is no FSDP at all: plain parameters,
whole on every rank, gradients averaged by DDP (`_build_replicated`), bf16
compute by torch.autocast (`compute_autocast`).
Under FSDP no rank ever holds a full parameter during init: the model is built on
the meta device (`empty_model`), sharded, materialised shard-only
(`materialize`: storage, then the buffers no checkpoint holds, the rotary
tables and an embedding scale, computed by transformers' initialisation),
then each rank reads only its own rows from the file
(`safe_open(...).get_slice(name)[a:b]`).
`LoadStats` counts what each rank read so callers and tests can check it.

Two layout details callers rely on:
- `lm_head` is replaced by `HiddenStatesHead`, which owns the same `weight`
  Parameter (same name, same tying) but returns the final hidden states: the
  vocab projection is done by the caller in chunks, so full-vocab logits for
  a whole batch never exist (see `roles/logprobs.py`).
- Parameter names are the HF checkpoint names (`hf_name` strips the
  activation-checkpoint wrapper's prefix).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from hybrid_engine.parallel.params import LoadStats, assert_sharded, load_sharded_safetensors
from hybrid_engine.parallel.precision import resolve_compute_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from hybrid_engine.config import ModelConfig

log = logging.getLogger(__name__)

__all__ = [
    "DTYPES",
    "SHARDINGS",
    "HiddenStatesHead",
    "apply_fsdp",
    "build_fsdp_model",
    "lay_out",
    "compute_autocast",
    "shard_and_load",
    "default_device",
    "dp_mesh",
    "fsdp_mesh",
    "grid_mesh",
    "tp_mesh",
    "empty_model",
    "materialize",
    "resolve_model_path",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHARDINGS = ("full", "grad_op", "replicate", "hybrid")  # TrainConfig.sharding, resolved
TP_DIMS = ("dp", "tp")  # `tp_mesh`'s dims


# --------------------------------------------------------------------------
# Mesh and row ranges
# --------------------------------------------------------------------------


def default_device() -> torch.device:
    """The current CUDA device when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dp_mesh(group: dist.ProcessGroup | None = None, device: torch.device | None = None,
            ) -> DeviceMesh:
    """A 1-D data-parallel mesh ("dp") over group's ranks (None: every rank of
    the default group); the placement hands each role its group.

    Raises:
        ValueError: torch.distributed is not initialised (FSDP2 needs a group;
            use `hybrid_engine.parallel.dist.init_distributed` or `run_ranks`).
    """
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: FSDP2 needs a process group")
    device = device or default_device()
    if group is not None:
        return DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


_MESHES: dict[tuple[tuple[int, ...], int, tuple[str, str]], DeviceMesh] = {}


def fsdp_mesh(dp: DeviceMesh, shard_size: int) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp itself when shard_size is its size, else a 2-D
    (replicate, shard) mesh of the same ranks, shard groups of shard_size consecutive
    ranks (HSDP; shard_size 1 = replicated).

    Raises:
        ValueError: shard_size does not divide the mesh's size.
    """
    if shard_size == dp.size():
        return dp
    return grid_mesh(dp, shard_size, ("replicate", "shard"), "shard group size")


def tp_mesh(dp: DeviceMesh, tp: int) -> DeviceMesh:
    """The ("dp", "tp") mesh of train.tensor_parallel_size=tp over dp's ranks: TP
    groups of tp consecutive ranks (within a node), FSDP2 across them.

    Raises:
        ValueError: tp does not divide the mesh's size.
    """
    return grid_mesh(dp, tp, ("dp", "tp"), "train.tensor_parallel_size")


def grid_mesh(dp: DeviceMesh, inner: int, names: tuple[str, str], what: str) -> DeviceMesh:
    """dp's ranks as a 2-D mesh (size / inner, inner), groups of inner consecutive
    ranks along the second dim. Built once per (ranks, inner, names), from groups
    only their members create (it runs on the trainer ranks alone under separate
    placement).

    Raises:
        ValueError: inner does not divide dp's size (what names it).
    """
    world = dp.size()
    if not 1 <= inner <= world or world % inner:
        raise ValueError(f"{what} {inner} must divide the {world} data-parallel ranks")
    ranks = tuple(dp.mesh.flatten().tolist())
    key = (ranks, inner, names)
    if key not in _MESHES:
        grid = torch.tensor(ranks).view(world // inner, inner)
        r, s = divmod(dp.get_local_rank(), inner)
        groups = [dist.new_group(grid[:, s].tolist(), use_local_synchronization=True),
                  dist.new_group(grid[r].tolist(), use_local_synchronization=True)]
        _MESHES[key] = DeviceMesh.from_group(groups, dp.device_type, mesh=grid,
                                             mesh_dim_names=names)
    return _MESHES[key]


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
        adapter = os.path.join(model_path, "adapter_config.json")
        if os.path.isfile(adapter) and not os.path.isfile(os.path.join(model_path, "config.json")):
            with open(adapter) as f:
                base = json.load(f).get("base_model_name_or_path")
            raise ValueError(f"model folder {model_path!r} is a PEFT adapter folder over "
                             f"{base!r}, not a model: train with export.merge_lora=true for a "
                             "merged final/, or merge it with PEFT (merge_and_unload)")
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ValueError(f"model folder {model_path!r} has no config.json "
                             "(expected a HF model folder: config.json + *.safetensors)")
        return Path(model_path)
    if _looks_local(model_path):
        raise ValueError(f"model folder {model_path!r} does not exist or is not a folder")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_path, allow_patterns=["*.json", "*.safetensors"]))


def attn_implementation(config: Any, attention: str = "sdpa") -> str:
    """transformers' attention for a model: model.attention resolved
    (`precision.resolve_attention`; "auto" unresolved: SDPA), or eager where the
    model soft-caps its attention logits (attn_logit_softcapping), which HF's SDPA
    path silently leaves out."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager"
    return "sdpa" if attention == "auto" else attention


def _build_meta_model(folder: Path, dtype: torch.dtype, trust_remote_code: bool,
                      attention: str) -> PreTrainedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    with empty_model():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation(config, attention),
            trust_remote_code=trust_remote_code,
        )
    # Same Parameter object: a tied model stays tied (one FSDP parameter, one name).
    model.lm_head = HiddenStatesHead(model.lm_head.weight)
    # The forward returns hidden states, which a final logit cap must not
    # touch: the chunked log-probs apply it to the logits (`roles.logprobs`).
    model.final_logit_softcap = getattr(config, "final_logit_softcapping", None)
    if model.final_logit_softcap is not None:
        model.config.final_logit_softcapping = None
    # RL runs without dropout: train_step and compute_logprobs must agree exactly.
    model.eval()
    return model


def apply_fsdp(
    model: PreTrainedModel, mesh: DeviceMesh, mp: MixedPrecisionPolicy, checkpointing: bool,
    *, reshard_after_forward: bool = True, compile_layers: bool = False,
) -> None:
    """`fully_shard` on every decoder layer, then the root. reshard_after_forward=False
    (train.sharding=grad_op) keeps each layer's parameters gathered from its forward
    to its backward: one all-gather per layer per pass instead of two."""
    if checkpointing:
        _wrap_checkpointing(model)
    if compile_layers:
        _compile_layers(model)
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


def _compile_layers(model: PreTrainedModel) -> None:
    """Regional torch.compile (train.compile), after activation checkpointing and
    before sharding, as torchtitan orders them. `Module.compile` compiles in place,
    so parameter names and FSDP2's and DDP's hooks stay where they were (dynamo
    runs those hooks eagerly). The layers share one code object, so every layer
    reuses its graphs. Shapes are torch's automatic dynamic: the first
    micro-batch's shape compiles static, the first other shape one dynamic graph
    that serves every later length (cold, this compiled faster on CPU than
    all-dynamic or all-static graphs)."""
    for layer in model.model.layers:
        layer.compile()


def empty_model():  # noqa: ANN201 - a context manager
    """Where a model to shard is built: on the meta device (no memory, no init)."""
    return torch.device("meta")


def materialize(model: nn.Module, device: torch.device) -> None:
    """`to_empty` on device (storage for this rank's shards, filled by the load),
    then the buffers no checkpoint holds (rotary tables; an embedding scale)
    computed by transformers' own initialisation (`initialize_weights`), which
    leaves alone every tensor marked initialised: here every parameter.
    A parameter shared by modules (tied embeddings) stays one parameter: on a
    plain module, to_empty gives each module its own tensor, so they are re-tied."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *others in owners.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    for p in model.parameters():
        p._is_hf_initialized = True
    for hf in _hf_models(model):
        hf.initialize_weights()


def _hf_models(module: nn.Module) -> Iterator[nn.Module]:
    """The outermost transformers models in module (itself, or a backbone it holds)."""
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel):
        yield module
        return
    for child in module.children():
        yield from _hf_models(child)


def build_fsdp_model(
    model_path: str,
    mesh: DeviceMesh,
    *,
    master_dtype: str = "float32", compute_dtype: str = "float32",
    activation_checkpointing: bool = False,
    compile_layers: bool = False,  # train.compile: torch.compile each decoder layer
    requires_grad: bool = True, trust_remote_code: bool = False,
    sharding: str = "full",
    shard_group_size: int = 0,
    grad_hook: Callable[[nn.Module, dist.ProcessGroup, torch.device], None] | None = None,
    lora: ModelConfig | None = None,
    attention: str = "sdpa",
) -> tuple[FSDPModule, LoadStats]:
    """Builds the FSDP2 layout of a checkpoint without materialising it anywhere.

    Args:
        model_path: local HF folder (or hub id) with config.json and safetensors.
        mesh: 1-D data-parallel mesh, or a ("dp", "tp") `tp_mesh` (training TP).
        master_dtype: dtype of the sharded parameters (and of gradient reduction).
        compute_dtype: dtype of gathered parameters in forward/backward ("auto": precision.py).
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
        lora: a model config whose LoRA adapters to add (`parallel/lora.py`):
            the base in compute_dtype and frozen, the adapters in master_dtype.
        attention: model.attention ("sdpa", "eager"; `attn_implementation`).

    Returns:
        (model, stats): the root FSDPModule (a HF `*ForCausalLM` whose lm_head
        is a HiddenStatesHead), and what this rank read from the files.
    """
    folder = resolve_model_path(model_path)
    master = DTYPES[master_dtype]
    compute = DTYPES[resolve_compute_dtype(compute_dtype, mesh.device_type)]
    model = _build_meta_model(folder, compute if lora else master, trust_remote_code, attention)
    model.requires_grad_(requires_grad)
    init = None
    if lora is not None:
        from hybrid_engine.parallel.lora import add_adapters, init_adapters

        model, init = add_adapters(model, lora, master, trainable=requires_grad), init_adapters
    return lay_out(model, folder, mesh, master=master, compute=compute, sharding=sharding,
                   shard_group_size=shard_group_size, checkpointing=activation_checkpointing,
                   compile_layers=compile_layers, grad_hook=grad_hook, init=init)


def lay_out(model: nn.Module, folder: Path, mesh: DeviceMesh, *, master: torch.dtype,
            compute: torch.dtype, sharding: str = "full", shard_group_size: int = 0,
            checkpointing: bool = False, compile_layers: bool = False,
            grad_hook: Callable | None = None, init: Callable[[nn.Module], None] | None = None,
            load_into: nn.Module | None = None) -> tuple[nn.Module, LoadStats]:
    """A model built under `empty_model` in one training layout over mesh, its
    rows read from folder: FSDP2 (`shard_and_load`: full, grad_op, hybrid) or
    replicated (`_build_replicated`). The arguments are `build_fsdp_model`'s and
    `shard_and_load`'s. Returns (the model, what this rank read)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if mesh.mesh_dim_names == TP_DIMS:  # `tp_mesh`: TP inside, FSDP2 over "dp"
        if sharding not in ("full", "grad_op") or init is not None:
            raise ValueError(f"train.tensor_parallel_size > 1 needs train.sharding full or "
                             f"grad_op and no LoRA, got sharding={sharding!r}"
                             f"{' with LoRA' * (init is not None)}")
        _split_tp(model, mesh["tp"])
        mesh = mesh["dp"]
    if sharding == "replicate":
        return _build_replicated(model, folder, mesh, master, compute, checkpointing,
                                 grad_hook, init, compile_layers=compile_layers,
                                 load_into=load_into)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=master)
    size = {"hybrid": shard_group_size}.get(sharding, mesh.size())
    stats = shard_and_load(model, folder, fsdp_mesh(mesh, size), mp, init=init,
                           checkpointing=checkpointing, compile_layers=compile_layers,
                           reshard_after_forward=sharding == "full", load_into=load_into)
    return model, stats


def _split_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Its family's TP plan applied to model's decoder layers over mesh
    (`parallel.tensor_parallel`)."""
    from hybrid_engine.models.spec import spec_for
    from hybrid_engine.parallel.tensor_parallel import parallelize

    spec = spec_for(model.config)
    dims = spec.dims(model.config)
    parallelize(model, mesh, spec.tp_plan(dims), dims)


def _build_replicated(model: PreTrainedModel, folder: Path, mesh: DeviceMesh,
                      master: torch.dtype, compute: torch.dtype,
                      checkpointing: bool, grad_hook: Callable | None = None,
                      init: Callable[[nn.Module], None] | None = None, *,
                      compile_layers: bool = False,
                      load_into: nn.Module | None = None) -> tuple[nn.Module, LoadStats]:
    """train.sharding=replicate: plain parameters, whole on every rank, gradients
    averaged by DDP (torch's composable `replicate`: buckets all-reduced while
    backward runs, the gradients views of the buckets) and compute_dtype through
    torch.autocast (`compute_autocast`). FSDP2's HSDP with shard groups of one
    rank gives the same semantics but copies every parameter into and out of its
    all-gather buffers and every gradient through its reduce-scatter buffers,
    each step: on the 181M W1 step (2 ranks, bf16 compute, one Xeon) its train
    phase took 2.80 s where this takes 1.83 s (benchmarks/results/
    step_w1_replicate_hsdp_* and step_w1_replicate_ddp_*). On one rank there is
    nothing to average: the plain module, with no DDP hooks or buckets.
    load_into and init: as in `shard_and_load`."""
    from torch.distributed._composable.replicate import replicate

    if checkpointing:
        _wrap_checkpointing(model)
    if compile_layers:
        _compile_layers(model)
    device = default_device() if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    materialize(model, device)
    stats = load_sharded_safetensors(load_into if load_into is not None else model, folder)
    if init is not None:
        with torch.no_grad():
            init(model)
    if mesh.size() > 1 and any(p.requires_grad for p in model.parameters()):
        # One rank: the plain module (nothing to average). init_sync=False: every rank
        # loaded the same file, nothing to broadcast; broadcast_buffers=False: the only
        # buffers are the rotary tables.
        replicate(model, device_id=device, process_group=mesh.get_group(),
                  init_sync=False, broadcast_buffers=False, gradient_as_bucket_view=True)
        if grad_hook is not None:
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
                   reshard_after_forward: bool = True, compile_layers: bool = False) -> LoadStats:
    """The one FSDP2 construction path of every model we train or score with
    (policy, reference, critic, reward model): a model built on the meta device
    is sharded (`apply_fsdp`), materialised shard-only (`materialize`, its
    buffers computed), its rows read from the safetensors in `folder`.

    Args:
        model: built under `empty_model`, `.model.layers` its decoder layers.
        device: where the shards live; the mesh's device by default.
        load_into: the module whose parameter names are the checkpoint's
            (a holder of the backbone, for a model that adds its own head).
        init: fills parameters the checkpoint does not have (after the load).

    Returns:
        What this rank read from the files.
    """
    apply_fsdp(model, mesh, mp, checkpointing, reshard_after_forward=reshard_after_forward,
               compile_layers=compile_layers)
    if device is None:
        device = default_device() if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    materialize(model, device)
    stats = load_sharded_safetensors(load_into if load_into is not None else model, folder)
    if init is not None:
        with torch.no_grad():
            init(model)
    assert_sharded(model)
    return stats
