"""Names and cleanup of vLLM-CPU's shared-memory segments (/dev/shm/he<port>-...).

Job: give each job's segments a unique prefix (`prefix`), remove a job's own
segments when its engine shuts down (`unlink_job_segments`) or its rank
aborts (`unlink_in_use`: also vLLM's message-queue ring buffers this rank
maps, which a dead peer may have created), and remove the segments of jobs
that died without shutting down (`sweep_orphans`: a rank killed by SIGKILL
cannot unlink anything; each such job leaves 8 MB per TP pair).
`vllm_compat.isolate_cpu_shm_names` applies the prefix to vLLM's segment names.

A segment is an orphan when it carries our prefix (he<digits>-), belongs to this user,
no live process maps it (/proc/<pid>/maps), and either the launcher whose pid
its name carries is gone or it is older than `min_age_s` (a live job creates
and maps its segment at once; the age covers that gap). The name also carries
the PID namespace it was made in: a segment of another namespace (a container
sharing this /dev/shm, `docker --ipc=host`) is never ours to judge, since
neither its launcher's pid nor the processes that map it are visible here. The same sweep, by
age alone, removes the ring buffers of vLLM's message queues (`psm_*`) and
Python's named semaphores (`sem.mp-*`) that killed ranks leave: both are
mapped for as long as any process uses them (`sweep_foreign_orphans`).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

__all__ = ["FOREIGN", "leftovers", "prefix", "sweep_foreign_orphans", "sweep_orphans", "unlink_in_use",
           "unlink_job_segments"]

SHM = Path("/dev/shm")
# prefix() + vLLM's name; groups: the launcher's pid, its PID namespace
_OURS = re.compile(r"he\d+-(\d+)-n(\d+)-.+")
FOREIGN = re.compile(r"psm_[0-9a-f]+|sem\.mp-.+")  # vLLM's shm ring buffers, Python's semaphores


def prefix() -> str:
    """MASTER_PORT (unique among live jobs), the launcher's pid (the ranks of one
    host share their parent, torchrun's agent; a relaunch on the same port is a
    new process, so it meets no leftover segment of a killed launch that the
    sweep's age limit still spares) and PID namespace (where that pid means
    something), and torchrun's run id (random per launch with --standalone)."""
    port = os.environ.get("MASTER_PORT", str(os.getpid()))
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    base = f"he{port}-{os.getppid()}-n{pid_namespace()}-"
    return base if run == "none" else f"{base}{run[:8]}-"


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say)."""
    try:
        return int(os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def sweep_foreign_orphans(min_age_s: float = 60.0) -> list[str]:
    """Unlinks `psm_*` and `sem.mp-*` entries of this user that no live process
    maps and that are older than min_age_s; returns their names."""
    return sweep_orphans(min_age_s, pattern=FOREIGN)


def unlink_job_segments() -> None:
    """Removes this job's segments (mappings stay valid until unmapped)."""
    for f in SHM.glob(f"{prefix()}*"):
        f.unlink(missing_ok=True)


def unlink_in_use(root: Path = SHM, maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Unlinks the segments of ours and vLLM's (`psm_*`, `sem.mp-*`) that this
    process maps: for a rank about to leave a job that ends abnormally, whose
    peers (dead ones too) shared them. Mappings stay valid until unmapped.
    Returns the names removed."""
    names = set()
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith(f"{root}/") and not path.endswith(" (deleted)"):
            name = path[len(str(root)) + 1:]
            if _OURS.fullmatch(name) or FOREIGN.fullmatch(name):
                names.add(name)
    for name in names:
        (root / name).unlink(missing_ok=True)
        if name.startswith("psm_"):
            _untrack(name)
    return sorted(names)


def _untrack(name: str) -> None:
    """Tells Python's resource tracker that shared-memory segment `name` is gone
    (Python < 3.13 registers every segment a process creates or attaches, and
    its tracker warns at exit about each one still registered)."""
    from multiprocessing import resource_tracker

    if getattr(resource_tracker._resource_tracker, "_fd", None) is not None:  # running here
        resource_tracker.unregister(f"/{name}", "shared_memory")


def leftovers(since: float, root: Path = SHM) -> list[str]:
    """Our segments and vLLM's (`psm_*`, `sem.mp-*`) under root created since
    `since` (a time.time()) that no live process maps: what jobs that ended
    since then left behind."""
    found = []
    for f in root.iterdir():
        if _OURS.fullmatch(f.name) or FOREIGN.fullmatch(f.name):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            if st.st_ctime >= since:
                found.append((f.name, (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)))
    mapped = _mapped_files() if found else set()
    return sorted(name for name, key in found if key not in mapped)


def _mapped_files() -> set[tuple[int, int, int]]:
    """(device major, device minor, inode) of every file mapped by a process whose
    maps this user can read (our segments are 0600: only our own processes can map
    them). Compared by inode, not path, so a symlinked or bind-mounted /dev/shm
    still matches; processes in another PID namespace are not seen."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # exited meanwhile, or another user's process
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and fields[4] != "0":
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                mapped.add((major, minor, int(fields[4])))
    return mapped


def sweep_orphans(min_age_s: float = 60.0, root: Path = SHM, *, pattern: re.Pattern = _OURS,
                  changed_after: float | None = None) -> list[str]:
    """Unlinks our segments under root that no live process maps; returns their names.

    pattern / changed_after: other segments instead (names matching pattern,
    changed since that time): the test session uses them for vLLM's own `psm_*`
    ring buffers that its killed ranks leave, which are not ours by name.
    """
    uid, now, here = os.getuid(), time.time(), pid_namespace()
    old = []
    for f in root.iterdir():
        match = pattern.fullmatch(f.name)
        if not match or (pattern is _OURS and int(match.group(2)) != here):
            continue
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        recent = changed_after is None or st.st_ctime >= changed_after
        dead = pattern is _OURS and not _alive(int(match.group(1)))
        if st.st_uid == uid and (dead or now - st.st_mtime >= min_age_s) and recent:
            old.append((f, (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)))
    if not old:
        return []
    mapped = _mapped_files()
    removed = []
    for f, key in old:
        if key not in mapped:
            f.unlink(missing_ok=True)
            removed.append(f.name)
    return removed
