"""Resumable training state: the policy (and critic) with their optimizers, the
schedules, step counts, every rank's RNG states and the controller's `extra`.

Job: `save_training_state` writes it with torch.distributed.checkpoint (every
rank its own shards) into an atomic folder (`folders.commit`);
`load_training_state` restores it in place, checking first that the folder is
complete and undamaged and that the model has the checkpoint's shapes. Its
meta.json also records what the run was made from (`origin.run_origin`), which
`preflight` checks on --resume before any engine starts.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from hybrid_engine.checkpoint.folders import (WRITE_ERRORS, Group, agree, check_complete,
                                              commit, group_rank, tmp_folder)
from hybrid_engine.checkpoint.origin import folder_digest, run_origin, weights_digest
from hybrid_engine.parallel.params import reshard_all

if TYPE_CHECKING:
    from hybrid_engine.roles.critic import Critic
    from hybrid_engine.roles.trainer import Trainer

__all__ = ["load_training_state", "save_training_state", "weights_digest"]

logger = logging.getLogger(__name__)

# Trainable parameters only (a LoRA policy's adapters, not its frozen base); strict
# off so the frozen ones are not missed on load (`_check_shapes` checks the rest).
_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _check_base(path: Path, saved: dict | None, trainer: Trainer) -> None:
    """A LoRA checkpoint resumes only on the base it was trained on, and only into a
    LoRA policy (and a full one only into a full one)."""
    lora = getattr(trainer, "lora", False)
    if saved is not None and not lora:
        raise ValueError(f"{path} holds LoRA adapters, but this run has model.lora_rank=0: "
                         "resume with the model settings the run started with")
    if saved is None and lora:
        raise ValueError(f"{path} holds a fully trained model, but this run trains LoRA "
                         "adapters (model.lora_rank > 0): resume with model.lora_rank=0")
    if saved is not None and saved["sha256"] != folder_digest(trainer.model_path):
        raise ValueError(f"{path} holds LoRA adapters of the base model {saved['path']!r}, "
                         f"whose weights differ from those of model.path="
                         f"{trainer.model_path!r}: resume with that base model")


def _check_shapes(path: Path, state: dict[str, Any]) -> None:
    """Every model tensor to load has the checkpoint's shape (else: another model)."""
    saved = dcp.FileSystemReader(path / "dcp").read_metadata().state_dict_metadata
    for section in ("model", "critic_model"):
        for name, t in state.get(section, {}).items():
            md = saved.get(f"{section}.{name}")
            shape = tuple(getattr(md, "size", ()) or ())
            if md is None or shape != tuple(t.shape):
                raise ValueError(
                    f"{path} was saved from a model of another shape: {name} is "
                    f"{list(shape) if md is not None else 'absent'} there, {list(t.shape)} "
                    "here; resume with the model.path the run started with"
                )


# --------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------


def _dcp_state(trainer: Trainer | None, critic: Critic | None) -> dict[str, Any]:
    """The DCP state dict of the roles this rank holds: sharded model and optimizer
    state of the policy ("model", "optim") and of the critic ("critic_model",
    "critic_optim"); under group colocation the two come from different ranks.

    Both roles keep their FSDP root resharded outside a step, so the
    optimizer's DTensors are the module's (the trainer's guard)."""
    state: dict[str, Any] = {}
    if trainer is not None:
        reshard_all(trainer.module)
        state["model"], state["optim"] = _state_dicts(trainer.module, trainer.optimizer)
    if critic is not None:
        reshard_all(critic.module)
        state["critic_model"], state["critic_optim"] = _state_dicts(critic.module,
                                                                    critic.optimizer)
    return state


def _state_dicts(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """DCP's model and optimizer state dicts, leaving the optimizer as it was. An
    optimizer that has not stepped yet has no state, so `get_state_dict` makes it
    by one zero-gradient step at lr 0, which leaves AdamW's step count at 1: the
    next real update would use the second step's bias correction. Set back to 0
    (the moments are zero), it updates as a fresh optimizer would, and the
    checkpoint holds step 0. Frozen parameters (a LoRA base) are left out: the
    base model's folder holds them."""
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(module, optimizer, options=_OPTIONS)
    if fresh:
        for st in optimizer.state.values():  # the same tensors as optim_sd's
            if torch.is_tensor(st.get("step")):
                st["step"].zero_()
    return model_sd, optim_sd


def _write_state(folder: Path, trainer: Trainer | None, critic: Critic | None,
                 extra: dict | None, path: Path, group: Group) -> None:
    """Collective over group: every rank writes its DCP shards and RNG file, the
    group's rank 0 meta.json.

    Leaves folder without the COMPLETE marker (that is `_commit`'s job). A
    write failure on any rank raises CheckpointWriteError on every rank."""
    rank, err = group_rank(group), None
    if rank == 0:
        try:
            (folder / "rng").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err = e
    agree(err, folder, path, group)
    try:  # DCP hands every rank's write failure to every rank
        dcp.save(_dcp_state(trainer, critic), checkpoint_id=folder / "dcp", process_group=group)
    except (CheckpointException, OSError) as e:
        err = e
    agree(err, folder, path, group)
    try:
        _write_rest(folder, _meta(trainer, critic, extra, group), group)
    except WRITE_ERRORS as e:
        err = e
    agree(err, folder, path, group)


def _meta(trainer: Trainer | None, critic: Critic | None, extra: dict | None,
          group: Group) -> dict | None:
    """meta.json's content on the group's rank 0 (None elsewhere): the policy's
    from rank 0 (every placement trains there), the critic's from the ranks
    holding it (collective over group: they may be other ranks)."""
    mine: dict[str, Any] = {}
    err = None
    try:
        if trainer is not None and group_rank(group) == 0:  # the digests read the weights once
            mine.update(step=trainer.step, scheduler=trainer.scheduler.state_dict(),
                        lora_base=_base_of(trainer), origin=_origin(trainer))
        if critic is not None:
            mine["critic"] = {"step": critic.step, "scheduler": critic.scheduler.state_dict()}
    except WRITE_ERRORS as e:  # raised after the gather: every rank reaches the next agree
        err = e
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)  # small: steps and schedules
    if err is not None:
        raise err
    if group_rank(group) != 0:
        return None
    meta = {"world_size": len(parts), "critic": None, "extra": extra}
    for part in reversed(parts):  # rank 0's own values last: they win
        meta.update(part)
    return meta


def _write_rest(folder: Path, meta: dict | None, group: Group) -> None:
    """This rank's RNG file; the group's rank 0 also meta.json."""
    rank = group_rank(group)
    buf = io.BytesIO()  # serialised first: a failed file write then says why (errno),
    torch.save(_rng_state(), buf)  # where torch.save to a path says "inline_container.cc"
    (folder / "rng" / f"rank{rank}.pt").write_bytes(buf.getbuffer())
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def _base_of(trainer: Trainer) -> dict | None:
    """A LoRA policy's base model (which the checkpoint does not hold): its folder
    and the SHA-256 of its weight files; None for a fully trained policy."""
    if not getattr(trainer, "lora", False):
        return None
    return {"path": str(trainer.model_path), "sha256": folder_digest(trainer.model_path)}


def _origin(trainer: Trainer) -> dict | None:
    """`origin.run_origin` of the policy's model (None, with a warning, when its
    folder cannot be read any more: the save goes on, a resume then cannot check)."""
    try:
        return run_origin(str(trainer.model_path), _lora_rank(trainer))
    except (OSError, ValueError) as e:
        logger.warning("checkpoint: the model the run was made from is not recorded: %s", e)
        return None


def _lora_rank(trainer: Trainer) -> int:
    """The rank of a LoRA policy's adapters; 0 for a fully trained policy."""
    if not getattr(trainer, "lora", False):
        return 0
    from hybrid_engine.parallel.lora import ADAPTER_NAME, lora_modules

    return next((layer.r[ADAPTER_NAME] for _, layer in lora_modules(trainer.module)), 0)


def save_training_state(
    path: str | os.PathLike,
    *,
    trainer: Trainer | None,
    critic: Critic | None = None,
    extra: dict | None = None,
    group: Group,
) -> None:
    """Writes a resumable checkpoint of the policy (and critic) to path, atomically.

    Collective over group: the trainer's (`Trainer.group`: the ranks the
    placement trains on), or under group colocation the whole world (None), the
    policy's ranks passing the trainer and the critic's the critic. Each rank
    writes only its own shards; path may already hold an older checkpoint,
    which is replaced.

    Args:
        path: the checkpoint folder (on a file system all ranks share).
        trainer: the policy trainer (module, optimizer, scheduler, step) on the
            ranks that hold it (rank 0 among them), else None.
        critic: the value model on the ranks that hold it, if the run has one.
        extra: controller state (JSON-able), taken from rank 0.
        group: the ranks that write together (`Trainer.group`; None: the default group).

    Raises:
        CheckpointWriteError: on every rank, if a write failed on any rank (the
            message names the rank and says when the disk is full); nothing is
            left at `<path>.tmp-*` and an older checkpoint at path is intact.
    """
    path = Path(path)
    tmp = tmp_folder(path, group)
    _write_state(tmp, trainer, critic, extra, path, group)
    commit(tmp, path, group, manifest=True)


def load_training_state(
    path: str | os.PathLike, *, trainer: Trainer | None, critic: Critic | None = None,
    group: Group,
) -> dict | None:
    """Restores a checkpoint written by `save_training_state` in place.

    Collective over group, as for the save. The roles must be freshly built with
    the same model and config. Model and optimizer state reshard to any rank
    count (DCP); RNG states are restored only when the rank count matches
    (else a warning).

    Args:
        path: a complete checkpoint folder.
        trainer: the policy trainer to fill, on the ranks that hold it.
        critic: the critic to fill, on the ranks that hold it; some rank of group
            must hold one iff the checkpoint has one.
        group: as for the save.

    Returns:
        The `extra` dict passed to save (None if none was).

    Raises:
        ValueError: path is not a complete checkpoint, a file differs from its
            MANIFEST.json entry, critic presence differs, or the checkpoint holds
            a model of another shape.
    """
    path = Path(path)
    check_complete(path, group)
    meta = json.loads((path / "meta.json").read_text())
    if trainer is not None:
        _check_base(path, meta.get("lora_base"), trainer)
    _check_critic(path, meta, critic, group)
    state = _dcp_state(trainer, critic)
    _check_shapes(path, state)
    dcp.load(state, checkpoint_id=path / "dcp", process_group=group)
    if trainer is not None:
        set_state_dict(trainer.module, trainer.optimizer, options=_OPTIONS,
                       model_state_dict=state["model"], optim_state_dict=state["optim"])
        trainer.scheduler.load_state_dict(meta["scheduler"])
        trainer.step = meta["step"]
    if critic is not None:
        set_state_dict(critic.module, critic.optimizer, options=_OPTIONS,
                       model_state_dict=state["critic_model"],
                       optim_state_dict=state["critic_optim"])
        critic.scheduler.load_state_dict(meta["critic"]["scheduler"])
        critic.step = meta["critic"]["step"]
    if meta["world_size"] == dist.get_world_size(group):
        _set_rng_state(torch.load(path / "rng" / f"rank{group_rank(group)}.pt", weights_only=True))
    elif group_rank(group) == 0:
        logger.warning("checkpoint %s was written by %d ranks, loading on %d: RNG states "
                       "not restored", path, meta["world_size"], dist.get_world_size(group))
    return meta["extra"]


def _check_critic(path: Path, meta: dict, critic: Critic | None, group: Group) -> None:
    """The run has a critic (on some rank of group) iff the checkpoint holds one."""
    held = critic is not None
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, held, group=group)
        held = any(every)
    if (meta["critic"] is None) == held:
        raise ValueError(f"{path}: checkpoint has critic={meta['critic'] is not None}, "
                         f"but critic={'given' if held else 'None'}")
