"""Resumable training checkpoints (sharded DCP) and HF export of the policy.

Job: `save_training_state` / `load_training_state` write and restore
everything a run needs to continue as if it had never stopped: the FSDP2
policy and its AdamW state (torch.distributed.checkpoint, every rank writing
its own shards), the LR schedule and step count, the critic's model,
optimizer and schedule when there is one, every rank's RNG states, and the
controller's JSON-able `extra`. `export_hf` writes the policy as a plain HF
folder that `AutoModelForCausalLM.from_pretrained` loads.

Invariant (atomic commit): a folder at `path` is a complete checkpoint. All
ranks write into `<path>.tmp-<token>`; after a barrier rank 0 writes the
`COMPLETE` marker, then renames the folder to `path`. A crash at any point
before that leaves only a `.tmp-` folder (no marker), which
`load_training_state` rejects with a ValueError; a previous checkpoint at
another path is never touched.

Integrity: `_commit` also writes MANIFEST.json (every file's size and CRC-32,
computed by the ranks in parallel). `checkpoint_problem` re-reads the files
against it, so a truncated, missing or bit-flipped shard is named before
anything loads it; the run's resume then falls back to the checkpoint before
(`job.JobCheckpointer`). A save that fails on any rank (full disk, I/O error)
fails on every rank with one `CheckpointWriteError` that says why, and the
half-written folder is removed: the previous checkpoint stays the newest.

Layout of a checkpoint folder:
    dcp/            DCP shards + metadata: "model", "optim" (+ "critic_model",
                    "critic_optim"), keyed by HF parameter names
    rng/rank{r}.pt  torch CPU (+ CUDA), python `random` and numpy states of rank r
    meta.json       world size, trainer step + scheduler (+ critic's), extra
    MANIFEST.json   {file: [bytes, crc32]} of every file above
    COMPLETE        written last
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import random
import shutil
import uuid
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule

from hybrid_engine.parallel.dist import train_group
from hybrid_engine.parallel.fsdp import full_tensor, reshard_all, sharded_named_parameters

if TYPE_CHECKING:
    from hybrid_engine.roles.critic import Critic
    from hybrid_engine.roles.trainer import Trainer

__all__ = [
    "COMPLETE_MARKER",
    "CheckpointWriteError",
    "checkpoint_problem",
    "export_hf",
    "latest_checkpoint",
    "load_training_state",
    "prune_checkpoints",
    "save_training_state",
    "step_checkpoint_path",
    "step_checkpoints",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


# --------------------------------------------------------------------------
# Atomic folders
# --------------------------------------------------------------------------


def _rank() -> int:
    """This process's rank in the train group (the group checkpoints run over)."""
    return dist.get_rank(train_group())


def _tmp_folder(path: Path) -> Path:
    """`<path>.tmp-<token>`, the same on every rank (rank 0 draws the token)."""
    token = [uuid.uuid4().hex[:12] if _rank() == 0 else None]
    dist.broadcast_object_list(token, group=train_group(), group_src=0)
    return path.with_name(f"{path.name}.tmp-{token[0]}")


class CheckpointWriteError(RuntimeError):
    """A save failed on some rank (full disk, I/O error); raised on every rank.
    The half-written folder is gone and the previous checkpoint is intact."""


_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# What a failed write raises: torch.save says only "[enforce fail at
# inline_container.cc] unexpected pos", safetensors "I/O error: ... (os error 28)".
_WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def _failure(e: BaseException) -> tuple[int | None, str, bool]:
    """The rank that failed when known (DCP hands every rank each rank's
    exception), one line for the failure, and whether it says the disk is full
    (torch.save's error has no errno, only text)."""
    rank = None
    if isinstance(e, CheckpointException) and e.failures:
        rank, first = next(iter(sorted(e.failures.items())))
        e = first[0] if isinstance(first, tuple) else first
    text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    full = getattr(e, "errno", None) in _NO_SPACE or any(
        s in text for s in ("No space left", "File too large", "Disk quota", "os error 28"))
    return rank, text, full


def _probe_write(folder: Path) -> bool:
    """Whether a 1 MiB write into folder fails for lack of space now (DCP's
    torch.save into a file stream reports a full disk only as "unexpected pos")."""
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        probe.write_bytes(bytes(1 << 20))
    except OSError as e:
        return e.errno in _NO_SPACE
    finally:
        probe.unlink(missing_ok=True)
    return False


def _agree(err: BaseException | None, tmp: Path, path: Path) -> None:
    """Collective: raises CheckpointWriteError on every rank if any rank failed
    (rank 0 removes tmp first); returns normally on all ranks otherwise."""
    mine = None
    if err is not None:
        failed_rank, what, full = _failure(err)
        free = shutil.disk_usage(tmp.parent).free / 2**20
        mine = (failed_rank, what, full or _probe_write(tmp.parent) or free < 64, free)
    every: list[Any] = [None] * dist.get_world_size(train_group())
    dist.all_gather_object(every, mine, group=train_group())
    failed = [(r, f) for r, f in enumerate(every) if f is not None]
    if not failed:
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    # The message is built from gathered values only: every rank's is the same.
    rank, (failed_rank, what, _, free) = failed[0]
    rank = rank if failed_rank is None else failed_rank
    if "inline_container" in what:  # torch.save's only words for a short write
        what = "a file write was cut short"
    if any(f[2] for _, f in failed):
        what = f"no space left on device ({free:.0f} MiB free under {tmp.parent}): {what}"
    raise CheckpointWriteError(
        f"could not write checkpoint {path}: rank {rank}: {what}; the half-written folder "
        "was removed and the previous checkpoint is intact"
    ) from err


def _crc32(f: Path) -> int:
    crc = 0
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _my_share(folder: Path, names: list[str]) -> dict[str, list[int]]:
    """[bytes, crc32] of this rank's share of names (every N-th file, so ranks
    read in parallel on a file system they share)."""
    n, r = dist.get_world_size(train_group()), _rank()
    return {name: [(folder / name).stat().st_size, _crc32(folder / name)]
            for name in names[r::n]}


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _commit(tmp: Path, path: Path, *, manifest: bool = False) -> None:
    """Collective: barrier, then rank 0 marks tmp complete and renames it to path.

    With manifest, the ranks first checksum tmp's files between them and rank
    0 writes MANIFEST.json. An existing folder at path is moved aside first
    and deleted after the rename, so path holds either the old or the new
    complete checkpoint. A failure on any rank raises CheckpointWriteError
    on every rank and removes tmp."""
    dist.barrier(group=train_group())
    err = None
    try:
        sums = _my_share(tmp, _files(tmp)) if manifest else {}
    except OSError as e:
        err, sums = e, {}
    shares: list[Any] = [None] * dist.get_world_size(train_group())
    dist.all_gather_object(shares, sums, group=train_group())
    if _rank() == 0 and err is None:
        try:
            if manifest:
                table = {k: v for share in shares for k, v in share.items()}
                (tmp / MANIFEST).write_text(json.dumps(dict(sorted(table.items())), indent=0))
            (tmp / COMPLETE_MARKER).write_text("ok\n")
        except OSError as e:
            err = e
    _agree(err, tmp, path)
    if _rank() == 0:
        old = None
        if path.exists():
            old = path.with_name(f"{path.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    dist.barrier(group=train_group())


def _problem_in(folder: Path, names: list[str], table: dict[str, list[int]]) -> str | None:
    for name in names:
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        size, crc = table[name]
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
        if _crc32(f) != crc:
            return f"{name} does not match its checksum"
    return None


def checkpoint_problem(path: str | os.PathLike, *, group: Any = None) -> str | None:
    """Why path is not a sound checkpoint, or None: not complete, or a file
    missing, truncated or changed since it was written (MANIFEST.json).

    Collective over group (default: the train group) when a process group is
    up: each rank reads every N-th file and all agree on the answer. A
    checkpoint written before manifests existed is taken as sound.
    """
    path = Path(path)
    collective = dist.is_initialized()
    if collective and group is None:
        group = train_group()
    n, r = (dist.get_world_size(group), dist.get_rank(group)) if collective else (1, 0)
    if not (path / COMPLETE_MARKER).is_file():
        problem = f"no {COMPLETE_MARKER} marker"
    elif not (path / MANIFEST).is_file():
        problem = None
    else:
        try:
            table = json.loads((path / MANIFEST).read_text())
            problem = _problem_in(path, sorted(table)[r::n], table)
        except (OSError, ValueError) as e:
            problem = f"{MANIFEST} unreadable ({e})"
    if collective:
        every: list[Any] = [None] * n
        dist.all_gather_object(every, problem, group=group)
        problem = next((p for p in every if p is not None), None)
    return problem


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


def _check_complete(path: Path) -> None:
    """Collective: raises ValueError unless path is a complete, undamaged checkpoint."""
    if not (path / COMPLETE_MARKER).is_file():
        raise ValueError(
            f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker): the save "
            "was interrupted or the path is wrong; load an earlier checkpoint"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is damaged: {problem}; load an earlier checkpoint")


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


def _dcp_state(trainer: Trainer, critic: Critic | None) -> dict[str, Any]:
    """The DCP state dict: sharded model and optimizer state of the policy (and critic).

    Both roles keep their FSDP root resharded outside a step, so the
    optimizer's DTensors are the module's (the trainer's guard)."""
    reshard_all(trainer.module)
    model_sd, optim_sd = _state_dicts(trainer.module, trainer.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
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
    checkpoint holds step 0."""
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(module, optimizer)
    if fresh:
        for st in optimizer.state.values():  # the same tensors as optim_sd's
            if torch.is_tensor(st.get("step")):
                st["step"].zero_()
    return model_sd, optim_sd


def _write_state(
    folder: Path, trainer: Trainer, critic: Critic | None, extra: dict | None, path: Path
) -> None:
    """Collective: every rank writes its DCP shards and RNG file, rank 0 meta.json.

    Leaves folder without the COMPLETE marker (that is `_commit`'s job). A
    write failure on any rank raises CheckpointWriteError on every rank."""
    rank, err = _rank(), None
    if rank == 0:
        try:
            (folder / "rng").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err = e
    _agree(err, folder, path)
    try:  # DCP hands every rank's write failure to every rank
        dcp.save(_dcp_state(trainer, critic), checkpoint_id=folder / "dcp",
                 process_group=train_group())
    except (CheckpointException, OSError) as e:
        err = e
    _agree(err, folder, path)
    try:
        _write_rest(folder, trainer, critic, extra)
    except _WRITE_ERRORS as e:
        err = e
    _agree(err, folder, path)


def _write_rest(folder: Path, trainer: Trainer, critic: Critic | None, extra: dict | None) -> None:
    """This rank's RNG file; rank 0 also meta.json."""
    rank = _rank()
    buf = io.BytesIO()  # serialised first: a failed file write then says why (errno),
    torch.save(_rng_state(), buf)  # where torch.save to a path says "inline_container.cc"
    (folder / "rng" / f"rank{rank}.pt").write_bytes(buf.getbuffer())
    if rank == 0:
        meta = {
            "world_size": dist.get_world_size(train_group()),
            "step": trainer.step,
            "scheduler": trainer.scheduler.state_dict(),
            "critic": None if critic is None else {
                "step": critic.step, "scheduler": critic.scheduler.state_dict()},
            "extra": extra,
        }
        (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def save_training_state(
    path: str | os.PathLike,
    *,
    trainer: Trainer,
    critic: Critic | None = None,
    extra: dict | None = None,
) -> None:
    """Writes a resumable checkpoint of the policy (and critic) to path, atomically.

    Collective over the train group (`dist.train_group`: every rank unless
    placement is separate). Each rank writes
    only its own shards; path may already hold an older checkpoint, which is
    replaced.

    Args:
        path: the checkpoint folder (on a file system all ranks share).
        trainer: the policy trainer (module, optimizer, scheduler, step).
        critic: the value model, if the run has one.
        extra: controller state (JSON-able), taken from rank 0.

    Raises:
        CheckpointWriteError: on every rank, if a write failed on any rank (the
            message names the rank and says when the disk is full); nothing is
            left at `<path>.tmp-*` and an older checkpoint at path is intact.
    """
    path = Path(path)
    tmp = _tmp_folder(path)
    _write_state(tmp, trainer, critic, extra, path)
    _commit(tmp, path, manifest=True)


def load_training_state(
    path: str | os.PathLike, *, trainer: Trainer, critic: Critic | None = None
) -> dict | None:
    """Restores a checkpoint written by `save_training_state` in place.

    Collective. The roles must be freshly built with the same model and
    config. Model and optimizer state reshard to any rank count (DCP); RNG
    states are restored only when the rank count matches (else a warning).

    Args:
        path: a complete checkpoint folder.
        trainer: the policy trainer to fill.
        critic: the critic to fill; must be given iff the checkpoint has one.

    Returns:
        The `extra` dict passed to save (None if none was).

    Raises:
        ValueError: path is not a complete checkpoint, a file differs from its
            MANIFEST.json entry, critic presence differs, or the checkpoint holds
            a model of another shape.
    """
    path = Path(path)
    _check_complete(path)
    meta = json.loads((path / "meta.json").read_text())
    if (meta["critic"] is None) != (critic is None):
        raise ValueError(f"{path}: checkpoint has critic={meta['critic'] is not None}, "
                         f"but critic={'given' if critic is not None else 'None'}")
    state = _dcp_state(trainer, critic)
    _check_shapes(path, state)
    dcp.load(state, checkpoint_id=path / "dcp", process_group=train_group())
    set_state_dict(trainer.module, trainer.optimizer,
                   model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer.scheduler.load_state_dict(meta["scheduler"])
    trainer.step = meta["step"]
    if critic is not None:
        set_state_dict(critic.module, critic.optimizer, model_state_dict=state["critic_model"],
                       optim_state_dict=state["critic_optim"])
        critic.scheduler.load_state_dict(meta["critic"]["scheduler"])
        critic.step = meta["critic"]["step"]
    if meta["world_size"] == dist.get_world_size(train_group()):
        _set_rng_state(torch.load(path / "rng" / f"rank{_rank()}.pt", weights_only=True))
    elif _rank() == 0:
        logger.warning("checkpoint %s was written by %d ranks, loading on %d: RNG states "
                       "not restored", path, meta["world_size"], dist.get_world_size(train_group()))
    return meta["extra"]


# --------------------------------------------------------------------------
# HF export
# --------------------------------------------------------------------------


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
                      max_shard_bytes: int) -> Exception | None:
    """Collective: all-gathers one parameter at a time; rank 0 buffers at most
    about one shard of full tensors and writes it. A write error stops rank
    0's writing but not its part in the gathers; it is returned."""
    is_writer = _rank() == 0
    weight_map: dict[str, str] = {}
    buf: dict[str, Tensor] = {}
    buf_bytes, num_shards = 0, 0
    for name, param in sharded_named_parameters(module):
        full = full_tensor(param)
        if not is_writer:
            continue
        t = full.detach().to("cpu", dtype=dtype or full.dtype).contiguous()
        if buf and buf_bytes + t.nbytes > max_shard_bytes:
            num_shards += 1
            try:
                _write_shard(folder, buf, num_shards, weight_map)
            except _WRITE_ERRORS as e:
                return _drain(module, name, e)
            buf, buf_bytes = {}, 0
        buf[name] = t
        buf_bytes += t.nbytes
    if not is_writer:
        return None
    try:
        _write_last(folder, buf, num_shards, weight_map)
    except _WRITE_ERRORS as e:
        return e
    return None


def _drain(module: FSDPModule, after: str, err: Exception) -> Exception:
    """Takes part in the gathers of every parameter after `after` (rank 0,
    once its writing failed), so the other ranks' collectives still match."""
    names = [n for n, _ in sharded_named_parameters(module)]
    for _, param in list(sharded_named_parameters(module))[names.index(after) + 1:]:
        full_tensor(param)
    return err


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
) -> None:
    """Writes the policy as a HF folder that `AutoModelForCausalLM.from_pretrained` loads.

    Collective. Parameters are all-gathered one at a time (`full_tensor()`)
    and only rank 0 keeps them, at most about max_shard_bytes at once. Names
    are the HF checkpoint names; a tied lm_head is one parameter, written
    once as the embedding (no lm_head.weight), as HF expects. The folder is
    committed atomically like a checkpoint (COMPLETE marker, rename).

    Args:
        path: destination folder (replaced if it exists).
        model: a Trainer or a root FSDPModule from `fsdp.build_fsdp_model`.
        hf_config_source: the HF folder the model was built from: config.json
            (dtype updated), tokenizer and generation config are copied from it.
        dtype: dtype of the written weights; None keeps the parameters' (master) dtype.
        max_shard_bytes: split the weights into indexed files past this size.
    """
    from transformers import AutoConfig

    module = model.module if hasattr(model, "module") else model
    reshard_all(module)  # the guard: a forward without backward leaves the root unsharded
    path, source = Path(path), Path(hf_config_source)
    tmp = _tmp_folder(path)
    err = None
    if _rank() == 0:
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            err = e
    _agree(err, tmp, path)
    err = _gather_and_write(module, tmp, dtype, max_shard_bytes)
    if _rank() == 0 and err is None:
        try:
            config = AutoConfig.from_pretrained(source)
            config.dtype = dtype or next(module.parameters()).dtype
            config.save_pretrained(tmp)
            _copy_side_files(source, tmp)
        except _WRITE_ERRORS as e:
            err = e
    _agree(err, tmp, path)
    _commit(tmp, path)


# --------------------------------------------------------------------------
# A run's checkpoint folder: step_<n> subfolders, newest k kept
# --------------------------------------------------------------------------

_STEP_PREFIX = "step_"


def step_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every complete `step_<n>` checkpoint under root, oldest first."""
    root = Path(root)
    found = []
    for p in root.glob(f"{_STEP_PREFIX}*") if root.is_dir() else ():
        tail = p.name[len(_STEP_PREFIX):]
        if tail.isdigit() and (p / COMPLETE_MARKER).is_file():
            found.append((int(tail), p))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under root, or None."""
    found = step_checkpoints(root)
    return found[-1][1] if found else None


def step_checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """root/step_<step, 8 digits>."""
    return Path(root) / f"{_STEP_PREFIX}{step:08d}"


def prune_checkpoints(root: str | os.PathLike, keep: int) -> list[Path]:
    """Deletes all but the newest keep complete checkpoints (rank 0 deletes;
    collective-free). Incomplete `.tmp-` folders are left for inspection.

    Returns:
        The folders deleted (on every rank, computed the same way).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    doomed = [p for _, p in step_checkpoints(root)[:-keep]]
    if not dist.is_initialized() or dist.get_rank() == 0:
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
    return doomed
