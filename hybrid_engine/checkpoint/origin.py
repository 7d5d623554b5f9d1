"""What a run was made from: recorded in every checkpoint, checked on --resume.

Job: `run_origin` describes the model folder a run starts from: its
architecture (config.json's `architectures[0]`), the config values that shape
its weights, the SHA-256 of its weight files (`weights_digest`) with their
sizes and modification times, and its LoRA rank (0: trained fully).
`save_training_state` stores it in meta.json as "origin". `check_resume_model`
compares it with the model a resumed run is given, reading the newest
checkpoint's meta.json alone (no collective, no DCP load), so `preflight`
refuses another model before any engine starts.

Invariant: a folder's digest is computed at most once per process, and not at
all on a resume whose folder still holds the files the checkpoint recorded
(the same folder, names, sizes and modification times): the recorded digest
is taken for it (`folder_digest`), by the check and by the saves after it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from hybrid_engine.checkpoint.folders import latest_checkpoint

__all__ = ["WEIGHT_KEYS", "check_resume_model", "folder_digest", "run_origin", "weights_digest"]

log = logging.getLogger(__name__)

# The config values that decide the weights' names and shapes (None where a config has none).
WEIGHT_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
               "tie_word_embeddings", "num_experts", "num_local_experts")

# (folder, its weight files' [size, mtime_ns] as JSON) -> the SHA-256 a checkpoint recorded.
_RECORDED: dict[tuple[str, str], str] = {}


@functools.cache
def weights_digest(model_path: str) -> str:
    """SHA-256 over a model folder's safetensors files (names and bytes, in name
    order), read in 16 MiB pieces; once per process and folder."""
    from hybrid_engine.parallel.fsdp import resolve_model_path

    digest = hashlib.sha256()
    for file in sorted(resolve_model_path(model_path).glob("*.safetensors")):
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while piece := f.read(16 * 2**20):
                digest.update(piece)
    return digest.hexdigest()


def _files(folder: Path) -> dict[str, list[int]]:
    """{name: [bytes, mtime_ns]} of the folder's safetensors files."""
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(folder.glob("*.safetensors"))}


def _key(folder: Path) -> tuple[str, str]:
    return str(folder), json.dumps(_files(folder))


def folder_digest(model_path: str) -> str:
    """`weights_digest(model_path)`, or the digest a checkpoint recorded for the
    same folder holding the same files (`check_resume_model` notes it)."""
    from hybrid_engine.parallel.fsdp import resolve_model_path

    return _RECORDED.get(_key(resolve_model_path(model_path).resolve())) or weights_digest(
        model_path)


@functools.cache
def _architecture(folder: str) -> tuple[str, dict[str, Any]]:
    """The folder's architecture and its `WEIGHT_KEYS` values (of the text config)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder)
    text = hf.get_text_config()
    arch = (getattr(hf, "architectures", None) or [hf.model_type])[0]
    return arch, {k: getattr(text, k, None) for k in WEIGHT_KEYS}


def _describe(model_path: str, lora_rank: int) -> dict[str, Any]:
    """The origin without its digest (cheap: config.json and file stats)."""
    from hybrid_engine.parallel.fsdp import resolve_model_path

    folder = resolve_model_path(model_path).resolve()
    arch, config = _architecture(str(folder))
    return {"architecture": arch, "config": config, "path": str(model_path),
            "folder": str(folder), "files": _files(folder), "lora_rank": lora_rank}


@functools.cache
def run_origin(model_path: str, lora_rank: int) -> dict[str, Any]:
    """What a checkpoint records of the model its run started from: architecture,
    config (`WEIGHT_KEYS`), path, resolved folder, weight files ([bytes,
    mtime_ns]), sha256 (`folder_digest`) and lora_rank. Once per process (the
    first save): every later save of the run records the same."""
    return {**_describe(model_path, lora_rank), "sha256": folder_digest(model_path)}


def _lora_refusal(out: Path, saved: dict, here: dict) -> str | None:
    """Why a LoRA checkpoint cannot continue as full training, or the reverse,
    or at another rank; None when both train alike."""
    was, now = saved["lora_rank"], here["lora_rank"]
    if was == now:
        return None
    if not now:
        return (f"--resume: the run in {out} trained LoRA adapters (model.lora_rank={was}), "
                "but this run has model.lora_rank=0: resume with "
                f"--model.lora_rank={was} (a LoRA checkpoint cannot continue as full training, "
                "not even with --allow-model-change)")
    if not was:
        return (f"--resume: the run in {out} trained the full model, but this run has "
                f"model.lora_rank={now}: resume with model.lora_rank=0 (a full checkpoint holds "
                "no adapters to continue, not even with --allow-model-change)")
    return (f"--resume: the run in {out} trained LoRA adapters of rank {was}, but this run has "
            f"model.lora_rank={now}: resume with --model.lora_rank={was}")


def _difference(saved: dict, here: dict, model_path: str) -> str | None:
    """What differs between the recorded model and this one (architecture, then
    config values, then weights; hashed only when the rest agree and the folder's
    files are not the recorded ones), or None."""
    if saved["architecture"] != here["architecture"]:
        return "another architecture"
    changed = [f"{k} {saved['config'][k]} there, {v} here"
               for k, v in here["config"].items() if saved["config"].get(k, v) != v]
    if changed:
        return ", ".join(changed)
    if (saved["folder"], saved["files"]) == (here["folder"], here["files"]):
        _RECORDED[_key(Path(here["folder"]))] = saved["sha256"]
        return None
    sha = weights_digest(model_path)
    return None if sha == saved["sha256"] else f"its weights have sha256 {sha[:12]}"


def check_resume_model(out: Path, model_path: str, lora_rank: int, *,
                       allow_change: bool = False) -> None:
    """--resume: the newest checkpoint under out/checkpoints was made from this
    model (its meta.json's "origin"; a checkpoint without one is resumed with a
    warning). LoRA against full training, another LoRA rank or another LoRA base
    is refused; another architecture, config or weights is refused unless
    allow_change, which logs one warning instead (the load still checks shapes).

    Raises:
        ValueError: one sentence naming what differs and how to resume.
    """
    ckpt = latest_checkpoint(out / "checkpoints")
    if ckpt is None:
        return  # `check_output_dir` refuses it
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        saved = json.loads((ckpt / "meta.json").read_text()).get("origin")
    except (OSError, ValueError, AttributeError):
        return  # a damaged checkpoint: the resume names it and loads the one before
    if saved is None:
        if rank0:
            log.warning("--resume: %s does not record the model it was made from, so "
                        "model.path=%r could not be checked against it (the load still checks "
                        "the tensor shapes)", ckpt, model_path)
        return
    here = _describe(model_path, lora_rank)
    refusal = _lora_refusal(out, saved, here)
    if refusal:
        raise ValueError(refusal)
    why = _difference(saved, here, model_path)
    if why is None:
        return
    was = (f"the run in {out} was made from a {saved['architecture']} (model.path="
           f"{saved['path']!r}, weights sha256 {saved['sha256'][:12]}), not the "
           f"{here['architecture']} at model.path={model_path!r} ({why})")
    if saved["lora_rank"]:
        raise ValueError(f"--resume: {was}: its LoRA adapters belong to that base model, resume "
                         "with it (not even --allow-model-change moves adapters to another base)")
    if not allow_change:
        raise ValueError(f"--resume: {was}: resume with its model, or pass "
                         "--allow-model-change to continue with this one on purpose")
    if rank0:
        log.warning("--allow-model-change: %s; continuing with it (every tensor must still have "
                    "the checkpoint's shape)", was)
