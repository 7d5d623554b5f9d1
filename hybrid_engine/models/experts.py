"""Mixture-of-Experts weights: transformers' fused tensors and the checkpoints' per-expert keys.

Job: transformers 5 holds a MoE layer's experts fused, `mlp.experts.gate_up_proj`
[E, 2I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
[E, H, I]. Published checkpoints store one tensor per expert and projection
(Qwen3-MoE: `mlp.experts.{e}.gate_proj.weight`; Mixtral:
`block_sparse_moe.experts.{e}.w1.weight`, w3 the up and w2 the down projection,
and its router under `block_sparse_moe.gate`). transformers converts between
the two with its checkpoint conversion mapping; this module reads that same
mapping to name, for a model parameter, the checkpoint tensors that make it
(`checkpoint_parts`), so a sharded load reads only the experts a rank holds,
and to write the per-expert form (`checkpoint_tensors`, for tiny models).

Invariant: concatenating the parts' expert e tensors along dim 0 gives row e of
the fused parameter (gate then up for gate_up_proj), for e in [0, E).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["ExpertParts", "checkpoint_parts", "checkpoint_tensors"]


@dataclass(frozen=True, slots=True)
class ExpertParts:
    """The checkpoint keys of one fused expert parameter: `keys[p][e]` is part p
    (gate, up; or down alone) of expert e. `name` alone: a renamed plain tensor."""

    name: str
    keys: tuple[tuple[str, ...], ...] = ()


def _mapping(model_type: str) -> list:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping(model_type) or [])


def _renamed_back(name: str, mapping: list) -> str:
    """A model name under the checkpoint's module names (reverses WeightRenaming)."""
    from transformers.core_model_loading import WeightRenaming

    for rule in mapping:
        if isinstance(rule, WeightRenaming):
            for src, dst in zip(rule.source_patterns, rule.target_patterns, strict=True):
                name = name.replace(dst, src)
    return name


def checkpoint_parts(model_type: str, name: str, num_experts: int) -> ExpertParts | None:
    """Where a checkpoint in the per-expert form keeps model parameter `name`.

    Returns:
        None when transformers' mapping for model_type does not touch name;
        else its keys in the checkpoint's form.
    """
    from transformers.core_model_loading import WeightConverter

    mapping = _mapping(model_type)
    for rule in mapping:
        if not isinstance(rule, WeightConverter) or len(rule.target_patterns) != 1:
            continue
        target = rule.target_patterns[0]
        if name.endswith(target):
            prefix = name[: len(name) - len(target)]
            keys = tuple(tuple(_renamed_back(prefix + src.replace("*", str(e)), mapping)
                               for e in range(num_experts)) for src in rule.source_patterns)
            return ExpertParts(name, keys)
    renamed = _renamed_back(name, mapping)
    return ExpertParts(renamed) if renamed != name else None


def checkpoint_tensors(model_type: str, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state dict in the checkpoints' per-expert form (as
    `save_pretrained` writes it): fused experts split, modules renamed back."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        parts = checkpoint_parts(model_type, name, t.shape[0])
        if parts is None:
            out[name] = t
        elif not parts.keys:
            out[parts.name] = t
        else:
            pieces = t.chunk(len(parts.keys), dim=1)
            for keys, piece in zip(parts.keys, pieces, strict=True):
                for e, key in enumerate(keys):
                    out[key] = piece[e].contiguous()
    return out
