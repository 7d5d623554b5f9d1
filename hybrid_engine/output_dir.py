"""A run's output folder: one job at a time, and nothing half-written from a dead one.

Job: `OutputDir(path)` takes an exclusive flock on `out/.lock` from rank 0 for
the job's life (a second job on the folder is refused, not interleaved; the
kernel drops the lock when the process dies, so a crash leaves no stale
lock); `sweep_unfinished` removes the folders a dead job's save or export
left (`<name>.tmp-*`) and puts back a complete folder moved aside by a commit
that died between its renames; `clear` moves an earlier run's outputs
aside (--overwrite), deleted once the new job is built and put back if it is
not; `unlock` releases the folder; a job that failed to start leaves
it as it found it (the lock file it made removed, and the folder too when
the job made it and wrote nothing else).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import IO

import torch.distributed as dist

__all__ = ["OUTPUTS", "OutputDir", "lock_output_dir", "restore_cleared", "sweep_unfinished"]

log = logging.getLogger("hybrid_engine.train")

# What a run writes into its folder (cleared by --overwrite), besides .lock.
OUTPUTS = ("checkpoints", "final", "final_adapter", "tb", "metrics.jsonl", "metrics.png",
           "samples.jsonl", "config.yaml")
OVERWRITTEN = ".overwritten"  # where --overwrite keeps them until the new job has started


class OutputDir:
    """The folder at path, locked for this job (collective: every rank makes one)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._new = _new_folders(self.path)  # what mkdir will make: path and its new parents
        self._had_lock = (self.path / ".lock").exists()
        self._lock: IO[str] | None = lock_output_dir(self.path)  # before anything is touched

    def sweep_unfinished(self) -> None:
        """Rank 0: `sweep_unfinished` of this folder (the lock is held)."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            sweep_unfinished(self.path)

    def clear(self) -> None:
        """--overwrite: rank 0 moves an earlier run's outputs aside, into
        `.overwritten/` (collective); `drop_cleared` deletes them once the job is
        built, and a job that fails to start puts them back (`unlock`)."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            aside = self.path / OVERWRITTEN
            aside.mkdir(exist_ok=True)
            for name in OUTPUTS:
                if (self.path / name).exists():
                    os.replace(self.path / name, aside / name)
        if dist.is_initialized():
            dist.barrier()

    def drop_cleared(self) -> None:
        """Rank 0 deletes what `clear` moved aside: the new run has started."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(self.path / OVERWRITTEN, ignore_errors=True)

    def unlock(self, *, remove_if_unused: bool = False) -> None:
        """Releases the lock; with remove_if_unused (the job failed to start), the
        lock file goes too when this job made it, and so do the folder and the
        parents this job made when nothing else is in them."""
        if self._lock is None:
            return
        if remove_if_unused:
            restore_cleared(self.path)  # rank 0 holds the lock; a no-op elsewhere
        if remove_if_unused and not self._had_lock:
            # Unlinked while held: a job that opens the path now gets a new file
            # (`lock_output_dir` checks it locked the file at the path).
            (self.path / ".lock").unlink(missing_ok=True)
        self._lock.close()  # closing the file releases the flock
        self._lock = None
        if remove_if_unused:
            for folder in self._new:  # innermost first; rmdir refuses one that is not empty
                with contextlib.suppress(OSError):
                    folder.rmdir()


def restore_cleared(out: Path) -> None:
    """Puts back what an --overwrite moved aside for a job that did not start (it
    failed, or died, before `drop_cleared`); what that job wrote goes first."""
    aside = out / OVERWRITTEN
    if not aside.is_dir():
        return
    for moved in sorted(aside.iterdir()):
        target = out / moved.name
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
        os.replace(moved, target)
    aside.rmdir()
    log.warning("put back the earlier run's outputs in %s: the job that was to overwrite "
                "them did not start", out)


def sweep_unfinished(out: Path) -> None:
    """Removes the unfinished folders an earlier job on out left when it died
    mid-save or mid-export (`<name>.tmp-*`; never loaded, see `checkpoint/folders.py`).
    A `<name>.old-*` whose `<name>` is gone (a death between the two renames of
    a commit) is the previous complete folder: it is moved back, not removed.
    An earlier run's outputs that an --overwrite moved aside and its job never
    started are put back (`restore_cleared`).
    Call with out's lock held, so no running job owns them."""
    restore_cleared(out)
    for folder in (out, out / "checkpoints"):
        if not folder.is_dir():
            continue
        for old in sorted(folder.glob("*.old-*")):
            base = old.with_name(old.name.split(".old-")[0])
            if not base.exists():
                os.replace(old, base)
                log.warning("restored %s from %s (a save died between its renames)", base, old)
            else:
                shutil.rmtree(old, ignore_errors=True)
        for tmp in sorted(folder.glob("*.tmp-*")):
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("removed %s: an earlier job's unfinished save or export", tmp)


def _new_folders(path: Path) -> list[Path]:
    """path and those of its parents that do not exist yet, innermost first."""
    new, p = [], path.absolute()
    while not p.exists() and p != p.parent:
        new.append(p)
        p = p.parent
    return new


def _open_locked(path: Path) -> IO[str] | None:
    """The lock file at path, opened and flocked (exclusive, without waiting);
    None when another job holds it. A file unlinked between the open and the
    flock (a job that failed to start removes the one it made) is not the one
    at path: it is opened again."""
    while True:
        f = path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        try:
            here = os.stat(path)
        except FileNotFoundError:
            here = None
        held = os.fstat(f.fileno())
        if here is not None and (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino):
            return f
        f.close()


def lock_output_dir(out: Path) -> IO[str] | None:
    """Rank 0 takes an exclusive flock on out/.lock for the job's life (the
    kernel drops it when the process dies, so a crash leaves no stale lock);
    collective under a process group: every rank raises the same ValueError
    when another job holds it. Returns the open lock file (rank 0) or None."""
    held, msg = None, ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        f = _open_locked(out / ".lock")
        if f is None:
            f = (out / ".lock").open("a+")
            f.seek(0)
            who = f.read().strip() or "another job"
            f.close()
            msg = (f"output_dir={str(out)!r} is in use by a running job ({who}): wait for it "
                   "to end, or pass another --output_dir")
        else:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
            held = f
    box = [msg]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ValueError(box[0])
    return held
