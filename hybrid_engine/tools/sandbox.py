"""Untrusted Python in a separate, limited process: where the `python` tool and the
`code` reward run a model's code.

Job: `run_python(code, stdin=, limits=)` runs code as `main.py` in a fresh
working directory and returns a `SandboxResult` (stdout, stderr, how it ended,
whether it timed out or its output was cut, the isolation in effect).
`Sandbox(limits, url)` is what the config builds: `run` calls `run_python`, or,
with a url, `run_remote`, which posts the code to a SandboxFusion-compatible
`/run_code` service.

A run (the child side is `tools/sandbox_init.py`):

    limits     CPU seconds, address space, file size, processes (per uid, or
               per user namespace), open files, no core files; the wall clock
               and the output size are enforced here
    isolation  where the OS permits: its own network namespace (loopback only,
               down), pid namespace (killing its pid 1 kills every process of
               the run), mount namespace (private tmpfs on the working
               directory and on /tmp, /var/tmp, /dev/shm, /run/lock); as root,
               its own uid and no groups, no new privileges
    env        PATH, LANG, HOME and TMPDIR (the working directory), a fixed
               hash seed, one BLAS/OpenMP thread: nothing of the caller's
    after      the whole process group is killed, processes left by a run
               without a pid namespace are killed by uid, files it left in a
               world-writable directory without a mount namespace are removed
               (`tools.sandbox_cleanup`), and the working directory is deleted

Not isolated: the filesystem stays readable (it is not a container), there is
no syscall filter (seccomp), and without namespaces the network is the host's
(`SandboxResult.isolation` says what was in effect).

Invariant: a local run returns within limits.timeout_s + 1 s, and leaves no
process and no file behind; a failure of the sandbox itself (not of the code)
is a `SandboxError`.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import hybrid_engine.tools.sandbox_init as sandbox_init
from hybrid_engine.tools.sandbox_cleanup import kill_until_gone, remove_files_of

__all__ = ["NAMESPACES", "REQUEST_SLACK_S", "Sandbox", "SandboxError", "SandboxLimits",
           "SandboxResult", "run_python", "run_remote"]

_INIT = Path(sandbox_init.__file__)

NAMESPACES = ("network", "pid", "mount")
"""The namespaces a run asks for (each where the OS permits)."""


class SandboxError(RuntimeError):
    """The sandbox could not run the code (not an error of the code)."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """What one run may use.

    Fields:
        timeout_s: wall-clock seconds; past them every process of the run is
            killed (CPU seconds are limited to the same, rounded up).
        memory_mb: address space of each process, MiB.
        output_kb: stdout + stderr, KiB; past it the run is stopped and its
            output cut there.
        processes: processes and threads at once (its own uid's, or its own
            user namespace's).
        file_mb: the largest file it may write, MiB (also each private tmpfs).
        open_files: file descriptors per process.
    """

    timeout_s: float = 5.0
    memory_mb: int = 1024
    output_kb: int = 256
    processes: int = 32
    file_mb: int = 16
    open_files: int = 256

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in self.__slots__ if not getattr(self, k) > 0]
        if bad:
            raise ValueError(f"sandbox limits must be positive, got {', '.join(bad)}")

    def child(self) -> dict[str, int]:
        """The limits `sandbox_init` sets, in its units."""
        return {"cpu_s": math.ceil(self.timeout_s), "memory_bytes": self.memory_mb << 20,
                "file_bytes": self.file_mb << 20, "processes": self.processes,
                "open_files": self.open_files}


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """How one run ended.

    Fields:
        stdout, stderr: its output (UTF-8, undecodable bytes replaced), cut at
            limits.output_kb together.
        exit_code: the program's exit status; None when a signal, the timeout
            or the output limit ended it.
        signal: the signal that ended it (SIGKILL past the CPU limit), or None.
        timed_out: it ran past limits.timeout_s and was killed.
        truncated: its output passed limits.output_kb; it was killed then.
        wall_s: seconds from start to the end of the cleanup.
        isolation: in effect: "uid" (its own), "network", "pid", "mount",
            "user" (a user namespace), or "remote" (a sandbox service).
        uid: the program's uid (None: the caller's).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    truncated: bool = False
    wall_s: float = 0.0
    isolation: tuple[str, ...] = ()
    uid: int | None = None

    @property
    def ok(self) -> bool:
        """It ran to the end and exited 0."""
        return self.exit_code == 0 and not self.timed_out and not self.truncated


def _env(workdir: str) -> dict[str, str]:
    """The program's whole environment: nothing of the caller's."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _interpreter_paths(python: str) -> list[str]:
    """What the program's interpreter reads: its folder and its prefixes (stdlib,
    venv); for another interpreter than this one, the folder above its bin/."""
    here = os.path.dirname(os.path.realpath(python))
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        return [os.path.dirname(here)]
    paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
    return sorted(paths | {here})


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               python: str = "", namespaces: tuple[str, ...] = NAMESPACES) -> SandboxResult:
    """Runs code in a sandboxed process (see the module docstring).

    Args:
        code: the program, run as `main.py` in a fresh working directory
            (`python -s -u`: the standard library and the interpreter's installed
            packages import).
        stdin: its standard input.
        limits: what it may use.
        python: the interpreter ('' = this one, sys.executable).
        namespaces: those to ask for (fewer: what a host that refuses them gets).

    Raises:
        SandboxError: the sandbox itself failed (the interpreter cannot be
            started as the sandbox's uid, a namespace step failed).
    """
    start = time.monotonic()
    python = python or sys.executable
    workdir = tempfile.mkdtemp(prefix="hybrid_engine_sandbox_")
    proc, report_r, report = None, -1, {}
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8", errors="surrogatepass")
        Path(workdir, sandbox_init.STDIN_NAME).write_text(stdin, encoding="utf-8",
                                                          errors="surrogatepass")
        report_r, report_w = os.pipe()
        args = {"workdir": workdir, "python": python, "parent": os.getpid(),
                "report_fd": report_w, "limits": limits.child(), "env": _env(workdir),
                "interpreter_paths": _interpreter_paths(python), "namespaces": namespaces}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_INIT), json.dumps(args)], cwd=workdir,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=_env(workdir), start_new_session=True, pass_fds=(report_w,))
        except OSError as e:
            raise SandboxError(f"the sandbox could not start: {e}") from e
        finally:
            os.close(report_w)
        out, err, report, timed_out, truncated = _collect(proc, report_r, limits, start)
    finally:
        if report_r >= 0:
            os.close(report_r)
        _clean_up(proc, report, workdir)
    return _result(out, err, report, timed_out, truncated, limits, time.monotonic() - start)


def _collect(proc: subprocess.Popen, report_fd: int, limits: SandboxLimits, start: float
             ) -> tuple[bytes, bytes, dict, bool, bool]:
    """Reads stdout, stderr and the reports until the program's processes end, the
    wall clock runs out or the output passes its limit: (stdout, stderr, the
    reports merged, timed out, truncated)."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(),
            report_fd: bytearray()}
    cap, deadline = limits.output_kb * 1024, start + limits.timeout_s
    timed_out = truncated = False
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            # Once init and the supervisor are gone, take what is buffered and stop:
            # a process that escaped the group may hold the pipes open.
            ended = report_fd not in sel.get_map()
            events = sel.select(0 if ended else left)
            if ended and not events:
                break
            for key, _ in events:
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    bufs[key.fd] += chunk
                else:
                    sel.unregister(key.fd)
            if len(bufs[proc.stdout.fileno()]) + len(bufs[proc.stderr.fileno()]) > cap:
                truncated = True
                break
    report: dict = {}
    for line in bytes(bufs[report_fd]).decode(errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except ValueError:  # cut by a kill mid-line
            pass
    out = bytes(bufs[proc.stdout.fileno()][:cap])
    return out, bytes(bufs[proc.stderr.fileno()][:cap - len(out)]), report, timed_out, truncated


def _result(out: bytes, err: bytes, report: dict, timed_out: bool, truncated: bool,
            limits: SandboxLimits, wall_s: float) -> SandboxResult:
    if "error" in report:
        raise SandboxError(report["error"])
    finished = not (timed_out or truncated)
    if finished and "exit" not in report and "signal" not in report:
        raise SandboxError(f"the sandbox ended before the program did: "
                           f"{err.decode(errors='replace')[-2000:]}")
    return SandboxResult(
        stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
        exit_code=report.get("exit") if finished else None,
        signal=report.get("signal") if finished else None, timed_out=timed_out,
        truncated=truncated, wall_s=wall_s, isolation=tuple(report.get("isolation", ())),
        uid=report.get("uid"))


def _clean_up(proc: subprocess.Popen | None, report: dict, workdir: str) -> None:
    """Kills every process of the run and removes every file it left. The
    supervisor is reaped last: until then its pid, which is the group's id and
    makes the uid, cannot be another run's."""
    if proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # Its init's exit ends once the kernel has killed the rest of its pid namespace.
        kill_until_gone(pgid=proc.pid)
        uid, iso = report.get("uid"), report.get("isolation", ())
        if uid is not None and uid >= sandbox_init.UID_BASE:  # its own uid: sweep by it
            if "pid" not in iso:  # what left the group (setsid) is still running
                kill_until_gone(uid=uid)
            if "mount" not in iso:
                remove_files_of(uid, (*sandbox_init.PRIVATE_DIRS, tempfile.gettempdir()))
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
    shutil.rmtree(workdir, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class Sandbox:
    """Where code runs and under which limits (what the env.sandbox_* keys build).

    Fields:
        limits: what one run may use.
        url: '' runs locally (`run_python`); else a SandboxFusion-compatible
            `/run_code` endpoint the code is posted to.
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    url: str = ""

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        """The result of code with stdin, here or at the service.

        Raises:
            SandboxError: the sandbox (or the service) could not run it.
        """
        if not self.url:
            return run_python(code, stdin=stdin, limits=self.limits)
        return run_remote(self.url, code, stdin=stdin, limits=self.limits)


REQUEST_SLACK_S = 10.0
"""Seconds a request to a sandbox service may take beyond the run's own timeout."""


def run_remote(url: str, code: str, *, stdin: str = "",
               limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """The result of code run by a SandboxFusion-compatible service (its run
    limited by limits.timeout_s and memory_mb, its output cut here at output_kb).

        request   POST url {"code", "language": "python", "stdin", "run_timeout",
                  "compile_timeout", "memory_limit_MB"}
        response  {"status": "Success" | "Failed" | "SandboxError", "message",
                  "run_result": {"status": "Finished" | "TimeLimitExceeded" |
                  "Error", "return_code", "stdout", "stderr", ...}}

    Raises:
        SandboxError: the service is unreachable, answers an HTTP error or
            another shape, or reports its own error ("SandboxError", a run
            "Error"); it waited limits.timeout_s + REQUEST_SLACK_S at most.
    """
    body = json.dumps({"code": code, "language": "python", "stdin": stdin,
                       "run_timeout": limits.timeout_s, "compile_timeout": limits.timeout_s,
                       "memory_limit_MB": limits.memory_mb}).encode()
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=limits.timeout_s + REQUEST_SLACK_S) as r:
            reply = json.loads(r.read())
        run = reply.get("run_result") or {}
        status = run.get("status")
    except (OSError, ValueError, AttributeError) as e:  # URLError and timeouts are OSErrors
        raise SandboxError(f"env.sandbox_url={url!r}: {type(e).__name__}: {e}") from e
    if reply.get("status") == "SandboxError" or status not in ("Finished", "TimeLimitExceeded"):
        raise SandboxError(f"env.sandbox_url={url!r} could not run the code: "
                           f"{reply.get('message') or run.get('stderr') or reply}")
    cap = limits.output_kb * 1024
    out, err = (run.get("stdout") or "").encode(), (run.get("stderr") or "").encode()
    timed_out, truncated = status == "TimeLimitExceeded", len(out) + len(err) > cap
    return SandboxResult(
        stdout=out[:cap].decode(errors="replace"),
        stderr=err[:max(cap - len(out), 0)].decode(errors="replace"),
        exit_code=None if timed_out or truncated else run.get("return_code"),
        timed_out=timed_out, truncated=truncated, wall_s=time.monotonic() - start,
        isolation=("remote",))
