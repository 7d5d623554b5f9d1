"""The policy as a plain HF folder (`AutoModelForCausalLM.from_pretrained` loads it),
and a LoRA policy's adapters as a PEFT folder (`PeftModel.from_pretrained` loads it).

Job: `export_hf` all-gathers one parameter at a time (LoRA adapters merged
in); only rank 0 keeps full tensors, at most about one safetensors shard at
once, and writes them with the source folder's config and tokenizer files.
`export_adapter` gathers the adapters alone and writes PEFT's two files. Both
commit atomically like a checkpoint (`folders.commit`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from hybrid_engine.checkpoint.folders import (WRITE_ERRORS, Group, agree, commit, group_rank,
                                              tmp_folder)
from hybrid_engine.models.experts import checkpoint_tensors
from hybrid_engine.parallel.lora import adapter_state_dict, lora_config, merged_parameters
from hybrid_engine.parallel.params import full_tensor, reshard_all, sharded_named_parameters

if TYPE_CHECKING:
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.roles.trainer import Trainer

__all__ = ["export_adapter", "export_hf"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _copy_side_files(source: Path, dest: Path) -> None:
    """Copies tokenizer, generation config and other non-weight files (not config.json)."""
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != "config.json" and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, dest / f.name)


def _write_shard(folder: Path, tensors: dict[str, Tensor], index: int,
                 weight_map: dict[str, str]) -> None:
    name = f"model-{index:05d}.safetensors"
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, name))


def _gather_and_write(module: FSDPModule, folder: Path, dtype: torch.dtype | None,
                      max_shard_bytes: int, group: Group) -> Exception | None:
    """Collective: all-gathers one weight at a time (LoRA adapters merged in:
    `lora.merged_parameters`); rank 0 buffers at most about one shard of full
    tensors and writes it. A write error stops rank 0's writing but not its
    part in the gathers (the other ranks' collectives still match); it is
    returned. dtype None: the dtype of the model's first parameter."""
    is_writer, err = group_rank(group) == 0, None
    dtype = dtype or next(module.parameters()).dtype  # merged LoRA weights come in fp32
    model_type = getattr(getattr(module, "config", None), "model_type", "")
    weight_map: dict[str, str] = {}
    buf: dict[str, Tensor] = {}
    buf_bytes, num_shards = 0, 0
    for name, param in merged_parameters(module, sharded_named_parameters(module)):
        full = full_tensor(param)
        if not is_writer or err is not None:
            continue
        t = full.detach().to("cpu", dtype=dtype).contiguous()
        if buf and buf_bytes + t.nbytes > max_shard_bytes:
            num_shards += 1
            try:
                _write_shard(folder, buf, num_shards, weight_map)
            except WRITE_ERRORS as e:
                err = e
                continue
            buf, buf_bytes = {}, 0
        buf.update(checkpoint_tensors(model_type, {name: t}))  # MoE: one tensor per expert
        buf_bytes += t.nbytes
    if not is_writer or err is not None:
        return err
    try:
        _write_last(folder, buf, num_shards, weight_map)
    except WRITE_ERRORS as e:
        return e
    return None


def _write_last(folder: Path, buf: dict[str, Tensor], num_shards: int,
                weight_map: dict[str, str]) -> None:
    """Rank 0: the last buffered shard, and the index when there are several."""
    if num_shards == 0:  # everything fits in one file: the HF single-file layout
        save_file(buf, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    _write_shard(folder, buf, num_shards + 1, weight_map)
    num = num_shards + 1
    renames = {f"model-{i:05d}.safetensors": f"model-{i:05d}-of-{num:05d}.safetensors"
               for i in range(1, num + 1)}
    for old, new in renames.items():
        os.replace(folder / old, folder / new)
    index = {"metadata": {}, "weight_map": {k: renames[v] for k, v in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def export_hf(
    path: str | os.PathLike,
    *,
    model: Trainer | FSDPModule,
    hf_config_source: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    group: Group = None,
) -> None:
    """Writes the policy as a HF folder that `AutoModelForCausalLM.from_pretrained` loads.

    Collective over group. Parameters are all-gathered one at a time
    (`full_tensor()`) and only its rank 0 keeps them, at most about max_shard_bytes at once. Names
    are the HF checkpoint names (a Mixture-of-Experts' fused experts written one
    tensor per expert, as `save_pretrained` does: `models.experts`); a tied lm_head is one parameter, written
    once as the embedding (no lm_head.weight), as HF expects. The folder is
    committed atomically like a checkpoint (COMPLETE marker, rename).

    Args:
        path: destination folder (replaced if it exists).
        model: a Trainer or a root FSDPModule from `fsdp.build_fsdp_model`.
        hf_config_source: the HF folder the model was built from: config.json
            (dtype updated), tokenizer and generation config are copied from it.
        dtype: dtype of the written weights; None keeps the parameters' (master) dtype.
        max_shard_bytes: split the weights into indexed files past this size.
        group: the ranks the model is sharded over (`Trainer.group`); None: the
            default group.
    """
    from transformers import AutoConfig

    module = model.module if hasattr(model, "module") else model
    reshard_all(module)  # the guard: a forward without backward leaves the root unsharded
    path, source = Path(path), Path(hf_config_source)
    tmp = tmp_folder(path, group)
    err = None
    if group_rank(group) == 0:
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            err = e
    agree(err, tmp, path, group)
    err = _gather_and_write(module, tmp, dtype, max_shard_bytes, group)
    if group_rank(group) == 0 and err is None:
        try:
            config = AutoConfig.from_pretrained(source)
            config.dtype = dtype or next(module.parameters()).dtype
            config.save_pretrained(tmp)
            _copy_side_files(source, tmp)
        except WRITE_ERRORS as e:
            err = e
    agree(err, tmp, path, group)
    commit(tmp, path, group)


def export_adapter(path: str | os.PathLike, *, model: Trainer | FSDPModule, lora: ModelConfig,
                   base_model: str, group: Group = None) -> None:
    """Writes a LoRA policy's adapters as a PEFT folder: adapter_config.json (the
    model section's rank, alpha, dropout and targets; base_model_name_or_path =
    base_model) and adapter_model.safetensors in the master dtype, PEFT's names.

    Collective over group (the ranks the model is sharded over; None: the
    default group), as `export_hf`: each adapter is all-gathered; its rank 0
    writes; committed atomically like a checkpoint."""
    module = model.module if hasattr(model, "module") else model
    reshard_all(module)
    tensors = adapter_state_dict(module)
    path = Path(path)
    tmp = tmp_folder(path, group)
    err = None
    if group_rank(group) == 0:
        try:
            tmp.mkdir(parents=True)
            config = lora_config(lora)
            config.base_model_name_or_path = base_model
            config.task_type = "CAUSAL_LM"
            config.save_pretrained(str(tmp))
            save_file({n: t.cpu().contiguous() for n, t in tensors.items()},
                      str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        except WRITE_ERRORS as e:
            err = e
    agree(err, tmp, path, group)
    commit(tmp, path, group)
