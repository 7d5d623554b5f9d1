"""LoRA adapters on the training layout: injected with PEFT, initialised, named, merged.

Job: `add_adapters` puts PEFT's LoRA layers into a HF causal LM built on the
meta device, before it is sharded: each targeted linear keeps its weight as
`<module>.base_layer.weight` (frozen, in the dtype the model was built in)
and gains `<module>.lora_A.default.weight` [r, in] and
`<module>.lora_B.default.weight` [out, r] (trainable, in the adapter dtype).
The layouts then shard or replicate adapters and base alike: every parameter
keeps the `Shard(0)` invariant of `parallel/fsdp.py`. `init_adapters` fills
the adapters once the model is materialised: A as nn.Linear initialises its
weight (Kaiming uniform), B zeros, so the model starts as the base model;
each from a generator seeded by the parameter's name, so every layout and
rank count starts from the same adapters (a rank fills its own rows).
`merged_rows` is a rank's rows of W0 + (alpha / r) B A.

Why PEFT's `inject_adapter_in_model` rather than `get_peft_model`: the model
stays the HF `*ForCausalLM` whose decoder layers, lm_head and parameter names
every layout, the sharded load and the weight sync address; `hf_name` only
drops the `.base_layer` that PEFT inserts.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hybrid_engine.parallel.params import (full_tensor, is_adapter, local_rows,
                                           sharded_named_parameters)

if TYPE_CHECKING:
    from hybrid_engine.config import ModelConfig

__all__ = ["ADAPTER_NAME", "PEFT_PREFIX", "adapter_parameters", "adapter_state_dict",
           "add_adapters", "adapters_disabled", "dropout_active", "init_adapters", "lora_config",
           "lora_modules", "merged_parameters", "merged_rows"]

ADAPTER_NAME = "default"  # PEFT's adapter name: the one adapter a run trains


def add_adapters(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, *,
                 trainable: bool = True) -> nn.Module:
    """Injects LoRA (rank cfg.lora_rank, scale cfg.lora_alpha / r, dropout
    cfg.lora_dropout) into the cfg.lora_target_modules of every decoder layer;
    the base is frozen, the adapters are in dtype and trainable unless not
    trainable. Returns the same model (PEFT mutates it in place)."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(lora_config(cfg), model, adapter_name=ADAPTER_NAME)
    for _, layer in lora_modules(model):
        for holder in (layer.lora_A, layer.lora_B):
            holder.to(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable and is_adapter(name))
    model.eval()  # PEFT's dropout modules start in training mode: scoring never drops
    return model


def lora_config(cfg: ModelConfig) -> Any:
    """PEFT's LoraConfig of the model section's rank, alpha, dropout and targets."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_target_modules))


PEFT_PREFIX = "base_model.model."  # before every name of PEFT's saved adapters


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, parameter) of every adapter, named as PEFT saves it less PEFT_PREFIX
    (`<module>.lora_A.weight`: `reshard.adapters`' names); sharded DTensors, or
    plain tensors in a replicated model."""
    for name, p in sharded_named_parameters(model):
        if is_adapter(name):
            yield name.replace(f".{ADAPTER_NAME}.", "."), p


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters as PEFT saves them (`base_model.model.<module>.lora_A.weight`),
    whole: collective over the model's mesh (each is gathered), every rank gets all."""
    return {PEFT_PREFIX + name: full_tensor(p).detach() for name, p in adapter_parameters(model)}


def lora_modules(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(module name, PEFT LoRA layer) of every adapted linear."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def init_adapters(model: nn.Module) -> None:
    """A: Kaiming uniform (nn.Linear's default), B: zeros, each rank its own rows
    (`parallel.params.local_rows`) of a tensor drawn from a generator seeded by
    the name alone. Call after `fsdp.materialize`."""
    for name, p in sharded_named_parameters(model):
        if not is_adapter(name):
            continue
        full = torch.zeros(p.shape, dtype=torch.float32)
        if ".lora_A." in name:
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        start, end = local_rows(p)
        local = p.to_local() if hasattr(p, "to_local") else p
        with torch.no_grad():
            local.copy_(full[start:end])


@contextlib.contextmanager
def dropout_active(model: nn.Module) -> Iterator[None]:
    """The adapters' dropout on inside the block (a training forward), off
    outside (scoring: log-probs must repeat exactly); the rest of the model
    stays in eval mode."""
    dropouts = [m for _, layer in lora_modules(model) for m in layer.lora_dropout.values()]
    for module in dropouts:
        module.train(True)
    try:
        yield
    finally:
        for module in dropouts:
            module.train(False)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward: every adapter bypassed inside the block. What
    trains stays as it was: PEFT's switch also freezes the adapters, and a
    replicated (DDP) model whose first forward saw nothing trainable would refuse
    to build its gradient buckets."""
    layers = [layer for _, layer in lora_modules(model)]
    trainable = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    for p, flag in trainable:
        p.requires_grad_(flag)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged_parameters(model: nn.Module, named: Iterable[tuple[str, Tensor]],
                      ) -> Iterator[tuple[str, Tensor]]:
    """`named` (a model's (name, parameter) pairs) with the adapters folded in: an
    adapted weight becomes W0 + (alpha / r) B A in fp32 (`merged_rows`: a DTensor
    with W0's placements, or a plain tensor in a replicated model), the adapters
    themselves are left out, everything else passes through. A model without
    adapters yields `named` unchanged. Collective over the model's mesh (each A
    is gathered whole): every rank of it iterates in the same order."""
    from torch.distributed.tensor import DTensor

    adapted, adapters = {}, set()
    for _, layer in lora_modules(model):
        a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
        adapted[id(layer.base_layer.weight)] = (a, b, layer.scaling[ADAPTER_NAME])
        adapters |= {id(a), id(b)}
    for name, p in named:
        if id(p) in adapters:
            continue
        if id(p) in adapted:
            a, b, scale = adapted[id(p)]
            local = p.to_local() if isinstance(p, DTensor) else p
            b_rows = b.to_local() if isinstance(b, DTensor) else b
            rows = merged_rows(local.detach(), full_tensor(a).detach(), b_rows.detach(), scale)
            p = DTensor.from_local(rows, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride()) \
                if isinstance(p, DTensor) else rows
        yield name, p


def merged_rows(base_rows: Tensor, lora_a: Tensor, lora_b_rows: Tensor, scale: float) -> Tensor:
    """Rows of W0 + scale * B A: a rank's rows of the base weight and of B (the
    same rows: both are sharded on the output dimension) and the whole A, in
    fp32 (the caller casts once, to where the weights go)."""
    return base_rows.float() + scale * (lora_b_rows.float() @ lora_a.float())
