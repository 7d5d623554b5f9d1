"""What a sandboxed run leaves behind: its processes and its files (see `tools.sandbox`).

Job: `kill_until_gone(pgid=, uid=)` SIGKILLs the live processes of a process
group or of a real uid until none is left; `remove_files_of(uid, folders)`
removes the entries uid made directly in folders.

Invariant: only processes that match when they are signalled are signalled (a
pidfd pins each one while it is checked: a reused pid is never hit); Linux /proc
only (elsewhere nothing is found).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["kill_until_gone", "remove_files_of"]


def kill_until_gone(*, pgid: int | None = None, uid: int | None = None,
                     timeout_s: float = 0.5) -> None:
    """SIGKILLs the live processes of a group or a real uid until none is left
    (or timeout_s passes). A pidfd pins each one while it is checked, so a pid
    reused meanwhile is never signalled."""
    deadline = time.monotonic() + timeout_s
    while (pids := _live_pids(pgid, uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone already
                continue
            try:
                if _is_of(pid, pgid, uid):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)


def _live_pids(pgid: int | None, uid: int | None) -> list[int]:
    """Pids of the live processes of a group or a real uid (Linux /proc; [] elsewhere)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(n) for n in names if n.isdigit() and _is_of(int(n), pgid, uid)]


def _is_of(pid: int, pgid: int | None, uid: int | None) -> bool:
    """Whether pid is alive (not a zombie) and in group pgid, of real uid uid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        if fields[0] in "ZX" or (pgid is not None and int(fields[2]) != pgid):
            return False
        if uid is not None:
            status = Path(f"/proc/{pid}/status").read_text()
            return int(status.split("\nUid:", 1)[1].split()[0]) == uid
    except (OSError, IndexError, ValueError):
        return False
    return True


def remove_files_of(uid: int, folders: Sequence[str]) -> None:
    """Removes what uid created directly in each of folders (world-writable ones,
    where a run without a private tmpfs can write)."""
    for d in folders:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
            except OSError:
                pass
