"""Atomic checkpoint folders: the commit, its manifest and the run's step folders.

Job: a folder at `path` is either absent or complete. All ranks write into
`<path>.tmp-<token>` (`tmp_folder`); `commit` then checksums the files between
the ranks (MANIFEST.json: every file's size and CRC-32), writes the
`COMPLETE` marker and renames the folder into place. `checkpoint_problem`
re-reads the files against the manifest, so a truncated, missing or
bit-flipped file is named before anything loads it. A write that fails on any
rank fails on every rank with one `CheckpointWriteError` (`agree`) and the
half-written folder is removed. A run keeps its checkpoints as `step_<n>`
folders (`step_checkpoints`, `latest_checkpoint`, `prune_checkpoints`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["COMPLETE_MARKER", "MANIFEST", "WRITE_ERRORS", "CheckpointWriteError", "agree",
           "check_complete", "checkpoint_problem", "commit", "group_rank", "latest_checkpoint",
           "prune_checkpoints", "step_checkpoint_path", "step_checkpoints", "tmp_folder"]

COMPLETE_MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"


Group = dist.ProcessGroup | None
"""The ranks that write a folder together (None: the default group): the
placement's group of the roles the folder holds."""


def group_rank(group: Group) -> int:
    """This process's rank in group."""
    return dist.get_rank(group)


def tmp_folder(path: Path, group: Group) -> Path:
    """`<path>.tmp-<token>`, the same on every rank of group (its rank 0 draws the token)."""
    token = [uuid.uuid4().hex[:12] if group_rank(group) == 0 else None]
    dist.broadcast_object_list(token, group=group, group_src=0)
    return path.with_name(f"{path.name}.tmp-{token[0]}")


class CheckpointWriteError(RuntimeError):
    """A save failed on some rank (full disk, I/O error); raised on every rank.
    The half-written folder is gone and the previous checkpoint is intact."""


_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# What a failed write raises: torch.save says only "[enforce fail at
# inline_container.cc] unexpected pos", safetensors "I/O error: ... (os error 28)".
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


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


def agree(err: BaseException | None, tmp: Path, path: Path, group: Group) -> None:
    """Collective over group: raises CheckpointWriteError on every rank if any rank failed
    (rank 0 removes tmp first); returns normally on all ranks otherwise."""
    mine = None
    if err is not None:
        failed_rank, what, full = _failure(err)
        free = shutil.disk_usage(tmp.parent).free / 2**20
        mine = (failed_rank, what, full or _probe_write(tmp.parent) or free < 64, free)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    failed = [(r, f) for r, f in enumerate(every) if f is not None]
    if not failed:
        return
    if group_rank(group) == 0:
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


def _my_share(folder: Path, names: list[str], group: Group) -> dict[str, list[int]]:
    """[bytes, crc32] of this rank's share of names (every N-th file, so ranks
    read in parallel on a file system they share)."""
    n, r = dist.get_world_size(group), group_rank(group)
    return {name: [(folder / name).stat().st_size, _crc32(folder / name)]
            for name in names[r::n]}


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def commit(tmp: Path, path: Path, group: Group, *, manifest: bool = False) -> None:
    """Collective over group: barrier, then rank 0 marks tmp complete and renames it to path.

    With manifest, the ranks first checksum tmp's files between them and rank
    0 writes MANIFEST.json. An existing folder at path is moved aside first
    and deleted after the rename, so path holds either the old or the new
    complete checkpoint. A failure on any rank raises CheckpointWriteError
    on every rank and removes tmp."""
    dist.barrier(group=group)
    err = None
    try:
        sums = _my_share(tmp, _files(tmp), group) if manifest else {}
    except OSError as e:
        err, sums = e, {}
    shares: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, sums, group=group)
    if group_rank(group) == 0 and err is None:
        try:
            if manifest:
                table = {k: v for share in shares for k, v in share.items()}
                (tmp / MANIFEST).write_text(json.dumps(dict(sorted(table.items())), indent=0))
            (tmp / COMPLETE_MARKER).write_text("ok\n")
        except OSError as e:
            err = e
    agree(err, tmp, path, group)
    if group_rank(group) == 0:
        old = None
        if path.exists():
            old = path.with_name(f"{path.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    dist.barrier(group=group)


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


def checkpoint_problem(path: str | os.PathLike, *, group: Group = None) -> str | None:
    """Why path is not a sound checkpoint, or None: not complete, or a file
    missing, truncated or changed since it was written (MANIFEST.json).

    Collective over group (default: the default group) when a process group is
    up: each rank reads every N-th file and all agree on the answer. A
    checkpoint written before manifests existed is taken as sound.
    """
    path = Path(path)
    collective = dist.is_initialized()
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


def check_complete(path: Path, group: Group) -> None:
    """Collective over group: raises ValueError unless path is a complete, undamaged checkpoint."""
    if not (path / COMPLETE_MARKER).is_file():
        raise ValueError(
            f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker): the save "
            "was interrupted or the path is wrong; load an earlier checkpoint"
        )
    problem = checkpoint_problem(path, group=group)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is damaged: {problem}; load an earlier checkpoint")


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
