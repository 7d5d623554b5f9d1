"""train.sharding: the training layout a job runs, `auto` chosen by memory.

Job: turn `train.sharding` (+ `shard_group_size`) into a concrete layout for
M trainer ranks, checking it against M, and for `auto` estimate what each
layout holds per rank during a training step and take the first that fits
the budget beside the rollout's resident share, in order of communication:

    replicate   one all-reduce of the gradients per step (DDP)
    hybrid      (only when shard_group_size is set) gather + reduce-scatter
                within a group, an all-reduce of 1/S of the gradient across
    grad_op     one all-gather + one reduce-scatter per layer per step
    full        those per micro-batch, plus a second all-gather in backward

Per-rank estimate (P parameters, m master / c compute bytes per element, S
the ranks one copy is sharded over: M full/grad_op, 1 replicate):

    states      4 P m / S       parameters, gradients, AdamW's two moments
                                (TP t: the Q elements TP splits over all M ranks,
                                the rest over the M / t of one TP rank)
                                (LoRA, A adapter elements: (P c + 4 A m) / S,
                                and whole grad A m)
    gathered    P c             every layer's parameters, gathered for the step
                                (full: the root group and two layers)
    whole grad  P m             gradients accumulated unsharded over the
                                step's micro-batches (full: one layer's)
    activations one micro-batch (at most a rank's sequences at max_model_len):
                tokens x L x (10 h + 4 I) x c (activation checkpointing:
                tokens x L x h x c + one layer), plus the fused vocabulary
                step's backward (chunk x vocab x (8 + c)), plus under eager
                attention (`model.attention`) its fp32 scores and c probabilities:
                tokens x L x heads x row width x (4 + c)
    resident    colocated: the engine's weights (P / T in the rollout dtype)
                and, on CPU unless memory.release=true, its KV cache (on GPU
                the engine sizes its KV cache from what the trainer leaves)

The first training phase adds states - parameters + gathered + whole grad
(replicate: none beyond the states) + activations: memory.release=auto's
estimate before it has measured anything (`first_phase_estimate`).

The budget is `memory.budget` x RAM / ranks on this machine (GPU:
x the device's memory), the smallest over the ranks (every rank decides
the same). The estimate is a bound for choosing, not an accounting: the
choice and its numbers are logged on rank 0.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybrid_engine.parallel.precision import (resolve_attention, resolve_compute_dtype,
                                              resolve_rollout_dtype)
from hybrid_engine.reshard.layouts import ModelDims, hf_shapes, model_dims, train_splits

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from hybrid_engine.config import ModelConfig, RunConfig, TrainConfig

__all__ = ["LayoutEstimate", "budget_bytes", "check_shard_group", "choose", "estimate",
           "first_phase_estimate", "model_dims_at", "resolve_alone", "resolve_train_config",
           "shard_group_size"]

log = logging.getLogger(__name__)

_ITEMSIZE = {"float32": 4, "bfloat16": 2}
_GIB = 2**30


@dataclass(frozen=True, slots=True)
class LayoutEstimate:
    """Bytes one trainer rank holds in a training step under a layout."""

    sharding: str
    shard_group_size: int
    states: int
    gathered: int
    whole_grad: int
    activations: int
    resident: int
    params: int = 0  # of states: what the built trainer holds before its first step

    @property
    def total(self) -> int:
        return self.states + self.gathered + self.whole_grad + self.activations + self.resident

    @property
    def first_phase_growth(self) -> int:
        """What the first training phase adds to the built trainer: the rest of its
        states (gradients, AdamW's moments), gathered copies and activations
        (replicate's whole gradients are its states' gradients: counted once)."""
        whole = 0 if self.sharding == "replicate" else self.whole_grad
        return self.states - self.params + self.gathered + whole + self.activations

    def describe(self) -> str:
        parts = (f"{self.states / _GIB:.2f} states + {self.gathered / _GIB:.2f} gathered + "
                 f"{self.whole_grad / _GIB:.2f} whole gradients + {self.activations / _GIB:.2f} "
                 f"activations + {self.resident / _GIB:.2f} rollout resident")
        return f"{self.sharding}: {self.total / _GIB:.2f} GiB ({parts})"


def _layer_numel(shapes: dict[str, tuple[int, int]], prefix: str) -> int:
    return sum(r * c for n, (r, c) in shapes.items() if n.startswith(prefix))


def estimate(sharding: str, dims: ModelDims, cfg: RunConfig, trainers: int, *,
             colocated: bool, cuda: bool, shard_group_size: int = 0) -> LayoutEstimate:
    """The per-rank estimate above for one concrete layout."""
    shapes = hf_shapes(dims)
    p = sum(r * c for r, c in shapes.values())
    layer = _layer_numel(shapes, "model.layers.0.")
    root = p - dims.num_layers * layer
    tp = cfg.train.tensor_parallel_size  # TP splits `split` elements over all ranks, the
    splits = train_splits(dims, tp)
    split = sum(r * c for n, (r, c) in shapes.items() if n in splits)
    layer -= split // dims.num_layers * (tp - 1) // tp  # rest over the tp's dp ranks only
    compute = resolve_compute_dtype(cfg.model.compute_dtype, "cuda" if cuda else "cpu")
    m, c = _ITEMSIZE[cfg.model.master_dtype], _ITEMSIZE[compute]
    size = {"replicate": 1, "hybrid": shard_group_size}.get(sharding, trainers)
    if sharding == "full":
        gathered, whole = (root + 2 * layer) * c, layer * m
    else:  # with TP: a TP rank's share of the layers
        gathered, whole = (root + dims.num_layers * layer) * c, (root + dims.num_layers * layer) * m
    t = cfg.train
    rows = -(-t.prompts_per_step * cfg.rollout.num_samples_per_prompt // (trainers // tp))
    tokens = min(t.max_tokens_per_micro_batch or t.micro_batch_size * cfg.rollout.max_model_len,
                 rows * cfg.rollout.max_model_len)  # a micro-batch holds at most a rank's rows
    per_layer = 10 * dims.hidden + 4 * dims.intermediate
    if t.activation_checkpointing:
        act = tokens * (dims.num_layers * dims.hidden + per_layer) * c
    else:
        act = tokens * dims.num_layers * per_layer * c
    if resolve_attention(cfg, "cuda" if cuda else "cpu") == "eager":  # its scores, per head
        layers = 1 if t.activation_checkpointing else dims.num_layers
        act += tokens * layers * dims.num_heads * min(cfg.rollout.max_model_len, tokens) * (4 + c)
    # the fused vocabulary step's backward: two fp32 [chunk, vocab] buffers and one in c
    act += min(t.logits_chunk_tokens, tokens) * dims.vocab * (8 + c)
    resident = 0
    if colocated:
        release = cfg.memory.release == "true"
        rollout = resolve_rollout_dtype(cfg.model.rollout_dtype, "cuda" if cuda else "cpu")
        weights = p * _ITEMSIZE[rollout] // cfg.rollout.tensor_parallel_size
        kv = 0 if cuda or release else int(cfg.memory.kv_cache_gib * _GIB)
        resident = (0 if cuda and release else weights) + kv
    held = split // size + (p - split) // (size // tp)  # of the master weights, per rank
    states, params = 4 * held * m, held * m
    if cfg.model.lora_rank:  # the frozen base in c, the adapters' states and gradients in m
        a = _adapter_numel(shapes, cfg.model.lora_rank, cfg.model.lora_target_modules)
        states, whole, params = (p * c + 4 * a * m) // size, a * m, (p * c + a * m) // size
    return LayoutEstimate(sharding, size, states, gathered, whole, act, resident, params)


def _adapter_numel(shapes: dict[str, tuple[int, int]], rank: int, targets: tuple[str, ...]) -> int:
    """Elements of the LoRA adapters: r (in + out) per targeted weight."""
    return sum(rank * (r + c) for n, (r, c) in shapes.items()
               if n.endswith(".weight") and n.rsplit(".", 2)[-2] in targets)


def _candidates(trainers: int, shard_group_size: int, tp: int) -> list[tuple[str, int]]:
    if tp > 1:  # TP inside, FSDP2 across
        return [("grad_op", trainers), ("full", trainers)]
    out = [("replicate", 1)]
    if shard_group_size:
        out.append(("hybrid", shard_group_size))
    return out + [("grad_op", trainers), ("full", trainers)]


def choose(dims: ModelDims, cfg: RunConfig, trainers: int, budget: int, *, colocated: bool,
           cuda: bool = False) -> tuple[LayoutEstimate, str]:
    """sharding=auto: the first candidate whose estimate fits budget (bytes per rank),
    else `full` (the least memory); returns it and the reason, for the log."""
    ests = [estimate(name, dims, cfg, trainers, colocated=colocated, cuda=cuda,
                     shard_group_size=size)
            for name, size in _candidates(trainers, cfg.train.shard_group_size,
                                          cfg.train.tensor_parallel_size)]
    for i, e in enumerate(ests):
        if e.total <= budget:
            skipped = "; ".join(f"{x.describe()} does not fit" for x in ests[:i])
            why = f"{e.describe()} fits the budget of {budget / _GIB:.2f} GiB per rank"
            return e, why + (f" ({skipped})" if skipped else "")
    return ests[-1], (f"nothing fits the budget of {budget / _GIB:.2f} GiB per rank "
                      f"({ests[-1].describe()}); full needs the least")


def first_phase_estimate(cfg: RunConfig, train: TrainConfig, dims: ModelDims, trainers: int, *,
                         cuda: bool) -> int:
    """Bytes the first training phase adds on a colocated rank under the resolved
    layout `train` (`LayoutEstimate.first_phase_growth`): memory.release=auto's
    decision before anything is measured."""
    est = estimate(train.sharding, dims, replace(cfg, train=train), trainers, colocated=True,
                   cuda=cuda, shard_group_size=train.shard_group_size)
    return est.first_phase_growth


def model_dims_at(model_path: str) -> ModelDims:
    """ModelDims of a local HF folder (its config.json only)."""
    from transformers import AutoConfig

    return model_dims(AutoConfig.from_pretrained(model_path))


def shard_group_size(cfg: TrainConfig, trainers: int) -> int:
    """Ranks one copy of the weights is sharded over, for a resolved cfg (with TP in
    training: the ranks of one TP rank)."""
    return {"replicate": 1, "hybrid": cfg.shard_group_size}.get(
        cfg.sharding, trainers // cfg.tensor_parallel_size)


def budget_bytes(memory_budget: float, device: torch.device, local_ranks: int) -> int:
    """memory_budget x RAM / local_ranks (CPU), or x the device's memory (GPU)."""
    if device.type == "cuda":
        return int(memory_budget * torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(memory_budget * psutil.virtual_memory().total / max(local_ranks, 1))


def check_shard_group(cfg: TrainConfig, trainers: int) -> None:
    """Raises ValueError unless train.shard_group_size (when used) fits the trainer ranks."""
    size = cfg.shard_group_size
    if cfg.sharding in ("hybrid", "auto") and size and not (1 < size < trainers
                                                              and trainers % size == 0):
        raise ValueError(
            f"train.shard_group_size={size} must divide the {trainers} trainer rank(s) and "
            f"lie strictly between 1 and {trainers} (sharding={cfg.sharding}; a group of "
            f"all ranks is grad_op, of one rank replicate)")


def resolve_train_config(cfg: RunConfig, dims: ModelDims, trainers: int, *, colocated: bool,
                         device: torch.device, budget: int | None = None,
                         group: ProcessGroup | None = None) -> TrainConfig:
    """cfg.train with a concrete sharding (and shard_group_size) for `trainers` ranks.

    Collective for sharding=auto with torch.distributed up (every rank of `group`,
    None = the default group, calls it: the smallest budget decides). budget
    overrides the machine's (bytes per rank; tests).

    Raises:
        ValueError: shard_group_size does not fit the trainer ranks.
    """
    t = cfg.train
    check_shard_group(t, trainers)
    if t.sharding != "auto":
        return t
    if budget is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()
                                   if dist.is_initialized() else 1))
        budget = budget_bytes(cfg.memory.budget, device, local)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            box = torch.tensor([budget], dtype=torch.int64,
                               device=device if device.type == "cuda" else "cpu")
            dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group)
            budget = int(box.item())
    est, why = choose(dims, cfg, trainers, budget, colocated=colocated,
                      cuda=device.type == "cuda")
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        log.info("train.sharding=auto chose %s: %s", est.sharding, why)
    size = est.shard_group_size if est.sharding == "hybrid" else 0
    return replace(t, sharding=est.sharding, shard_group_size=size)


def resolve_alone(model_path: str, train: TrainConfig, model: ModelConfig, group: ProcessGroup,
                  device: torch.device) -> TrainConfig:
    """`train` with sharding=auto resolved for a trainer built on its own (no engine
    on its devices), over the ranks of `group`, at the default memory.budget
    (collective over `group`)."""
    from hybrid_engine.config import RunConfig

    cfg = RunConfig(model=replace(model, path=model_path), train=train)
    return resolve_train_config(cfg, model_dims_at(model_path), dist.get_world_size(group),
                                colocated=False, device=device, group=group)
