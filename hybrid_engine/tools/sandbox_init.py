"""The program that starts one sandboxed Python process (see `tools.sandbox`).

`tools.sandbox.run_python` runs it as `python -I -S sandbox_init.py ARGS` in a
new session, with the program's stdout and stderr as its own. Three processes:

    supervisor  this one: root, or the user with a user namespace of its own.
                Unshares the network, mount and pid namespaces where the OS
                permits; in the mount namespace puts a private tmpfs on the
                working directory and on each of PRIVATE_DIRS, and
                makes the interpreter reachable by the sandbox's uid.
    init        pid 1 of the new pid namespace: waits for the program and
                reports how it ended. When init dies the kernel kills every
                process left in the namespace.
    program     resource limits; as root, its own uid (UID_BASE + the
                supervisor's pid, unique until the caller reaps the
                supervisor, after its cleanup) and no groups; no new
                privileges; killed when init dies. Runs `python -s -u main.py`
                in the working directory, stdin from the file `.stdin`.

Reports, one JSON line each on the report fd: {"isolation": [...], "uid": ...}
before the program starts, then {"exit": code} or {"signal": n}, or
{"error": text} when the sandbox itself failed.

Invariant: the standard library only (it runs before any site-packages), and
none of the user's code runs before its limits and uid are in place.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import stat
import sys
from typing import Any, NoReturn

UID_BASE = 0x70000000
"""The program's uid is UID_BASE + the supervisor's pid: a range no account uses
(systemd documents 0x70000000-0x7FFDFFFF as unused)."""

PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""World-writable directories given a private tmpfs in the mount namespace."""

STDIN_NAME = ".stdin"

_CLONE = {"user": 0x10000000, "network": 0x40000000, "pid": 0x20000000, "mount": 0x00020000}
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 1, 28, 38
_SECBIT_NOROOT_AND_LOCKED = 0b11

try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # no C library to load: no namespaces, no prctl
    _LIBC = None


def _call(name: str, *args: Any) -> bool:
    """libc's name(*args): True on success, False where the OS lacks it.

    Raises:
        OSError: the call exists and failed.
    """
    fn = getattr(_LIBC, name, None)
    if fn is None:
        return False
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return True


def _report(fd: int, **fields: Any) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _call("mount", enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])


def _unshare(names: list[str]) -> set[str]:
    """The namespaces of names this process now has: each one unshared alone, so a
    refusal (seccomp, no capability) costs only that one."""
    done = set()
    for name in names:
        try:
            if _call("unshare", _CLONE[name]):
                done.add(name)
        except OSError:
            pass
    return done


def _own_user_namespace() -> bool:
    """Unprivileged: a user namespace where this process is root (its own uid
    mapped to 0), which lets it unshare and mount the others."""
    uid, gid = os.getuid(), os.getgid()
    if "user" not in _unshare(["user"]):
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                       ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def _program_uid() -> int | None:
    """As root of the host's user namespace (or one that maps many uids), UID_BASE
    + this pid where it is mapped, else nobody (65534) where that is; else None."""
    if os.geteuid() != 0:
        return None
    want = UID_BASE + os.getpid()
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f]
    except OSError:  # not Linux
        return want
    return next((uid for uid in (want, 65534)
                 if any(lo <= uid < lo + n for lo, _, n in ranges)), None)


def _overmount(path: str, keep: list[str], size: int, mode: int) -> None:
    """A fresh tmpfs on path, with each kept path under it bound back from the
    original (so the venv under /tmp, or the interpreter under /root, stays)."""
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
    try:
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},mode={mode:o}")
        for first in sorted({os.path.relpath(p, path).split(os.sep)[0] for p in keep}):
            source, target = f"/proc/self/fd/{fd}/{first}", os.path.join(path, first)
            if os.path.isdir(source):
                os.makedirs(target, exist_ok=True)
            else:
                open(target, "a").close()
            _mount(source, target, None, _MS_BIND | _MS_REC)
    finally:
        os.close(fd)


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def _private_dirs(keep: list[str], size: int) -> None:
    """Mounts stay in this namespace; each world-writable directory is a private
    tmpfs, the paths in keep bound back into it."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    for d in PRIVATE_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            _overmount(d, [p for p in keep if _under(p, d)], size, 0o1777)


def _expose(paths: list[str], size: int) -> None:
    """Makes every directory above paths searchable by any uid: one that is not (a
    root-only /root holding a pyenv) becomes a tmpfs with only those paths bound."""
    for _ in range(64):
        blocked = sorted({a for p in paths for a in _ancestors(p)
                          if not os.stat(a).st_mode & stat.S_IXOTH}, key=len)
        if not blocked:
            return
        _overmount(blocked[0], [p for p in paths if _under(p, blocked[0])], size, 0o755)


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def _isolate(args: dict) -> tuple[set[str], int | None]:
    """Unshares what the OS permits and prepares the working directory: (the
    isolation in effect, the program's uid or None)."""
    iso, wanted = set(), list(args["namespaces"])
    if wanted and os.geteuid() != 0 and _own_user_namespace():
        iso.add("user")
    if os.geteuid() == 0:  # root, in the host's user namespace or in its own
        iso |= _unshare(wanted)
    uid = None if "user" in iso else _program_uid()
    workdir, size = args["workdir"], args["limits"]["file_bytes"]
    with open(os.path.join(workdir, "main.py"), "rb") as f:
        code = f.read()
    with open(os.path.join(workdir, STDIN_NAME), "rb") as f:
        stdin = f.read()
    if "mount" in iso:
        _private_dirs(args["interpreter_paths"], size)
        os.makedirs(workdir, exist_ok=True)
        _mount("tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},mode=700")
        for name, data in (("main.py", code), (STDIN_NAME, stdin)):
            with open(os.path.join(workdir, name), "wb") as f:
                f.write(data)
        if uid is not None:
            _expose(args["interpreter_paths"], size)
    if uid is not None:
        os.chown(workdir, uid, uid)
        iso.add("uid")
    return iso, uid


def _limit(limits: dict, iso: set[str]) -> None:
    """The program's resource limits (soft = hard, except CPU: SIGXCPU, then a
    second later SIGKILL)."""
    cpu = limits["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    # The limit counts a uid's processes (in its user namespace): as its own user,
    # the supervisor and init count too; as the caller's uid, all of the caller's.
    extra = 2 if "user" in iso else 0 if "uid" in iso else _processes_of(os.getuid())
    limits = {**limits, "processes": limits["processes"] + extra}
    for name, key in (("RLIMIT_AS", "memory_bytes"), ("RLIMIT_FSIZE", "file_bytes"),
                      ("RLIMIT_NPROC", "processes"), ("RLIMIT_NOFILE", "open_files")):
        if hasattr(resource, name):
            resource.setrlimit(getattr(resource, name), (limits[key], limits[key]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _processes_of(uid: int) -> int:
    """How many processes (threads included) of real uid run now (Linux /proc)."""
    count = 0
    for name in os.listdir("/proc") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except OSError:
            continue
        if name.isdigit() and int(status.split("\nUid:", 1)[1].split()[0]) == uid:
            count += int(status.split("\nThreads:", 1)[1].split()[0])
    return count


def _program(args: dict, iso: set[str], uid: int | None) -> NoReturn:
    """The forked program: limits, uid, then exec. Never returns."""
    try:
        os.chdir(args["workdir"])
        fd = os.open(STDIN_NAME, os.O_RDONLY)
        os.unlink(STDIN_NAME)
        os.dup2(fd, 0)
        os.close(fd)
        _limit(args["limits"], iso)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        elif "user" in iso:  # root of its own user namespace: exec grants no capabilities
            _call("prctl", _PR_SET_SECUREBITS, _SECBIT_NOROOT_AND_LOCKED, 0, 0, 0)
        _call("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        _call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        python = args["python"]
        os.execve(python, [python, "-s", "-u", "main.py"], args["env"])
    except OSError as e:
        who = f"uid {uid}" if uid is not None else f"uid {os.getuid()}"
        _report(args["report_fd"], error=f"the sandbox could not start {args['python']} as "
                f"{who}: {e} (every directory above it must be searchable by that uid)")
    os._exit(127)


def _init(args: dict, iso: set[str], uid: int | None) -> NoReturn:
    """Pid 1 of the sandbox (or a plain parent without a pid namespace): runs the
    program, reaps orphans, reports how the program ended. Never returns."""
    try:
        _call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if {"pid", "mount"} <= iso:  # its /proc lists the sandbox's processes only
            _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        pid = os.fork()
        if pid == 0:
            _program(args, iso, uid)
        while True:
            got, status = os.waitpid(-1, 0)
            if got == pid:
                break
        ended = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                 else {"exit": os.WEXITSTATUS(status)})
        _report(args["report_fd"], **ended)
    except OSError as e:
        _report(args["report_fd"], error=f"the sandbox's init failed: {e}")
    os._exit(0)


def main() -> None:
    args = json.loads(sys.argv[1])
    report = args["report_fd"]
    _call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != args["parent"]:  # the sandbox died before the line above
        return
    try:
        iso, uid = _isolate(args)
    except OSError as e:
        _report(report, error=f"the sandbox could not isolate the run: {e}")
        return
    _report(report, isolation=sorted(iso), uid=uid)
    os.set_inheritable(report, False)  # the program's exec closes it
    pid = os.fork()
    if pid == 0:
        _init(args, iso, uid)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
