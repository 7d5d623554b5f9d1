"""The sandbox (tools/sandbox.py, tools/sandbox_init.py): every case returns within
its timeout + 1 s, leaves no process and no file outside its directory, and never
raises for what the code does: an infinite loop, 1 GB of output, a fork bomb,
10 GB of allocation, writing outside its directory, opening a network
connection, a syntax error, an exception. Each runs twice where the test runs as
root: with the namespaces this host permits, and with none (what a container
without CAP_SYS_ADMIN gets: its own uid only). Real processes, real limits, small
values (timeouts of 1 s, a process limit of 16)."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hybrid_engine.tools.sandbox import NAMESPACES, SandboxLimits, SandboxResult, run_python

LIMITS = SandboxLimits(timeout_s=1.0, memory_mb=512, output_kb=64, processes=16)
ROOT = os.geteuid() == 0


def _reachable(python: str) -> bool:
    """Whether any uid may search every directory above python (the sandbox's own
    uid runs it where no mount namespace can make it reachable)."""
    parts = Path(os.path.realpath(python)).parents
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in parts)


def _python_without_namespaces() -> str:
    for python in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(python) and _reachable(python):
            return python
    pytest.skip("no interpreter every uid can reach (needed without a mount namespace)")


@pytest.fixture(params=["namespaces", "uid only"])
def mode(request) -> dict:
    """run_python's arguments of each way to run."""
    if request.param == "namespaces":
        return {"namespaces": NAMESPACES}
    if not ROOT:
        pytest.skip("without namespaces only root has a uid of its own to drop to")
    return {"namespaces": (), "python": _python_without_namespaces()}


def _permits_network_namespaces() -> bool:
    """Whether a process like the sandbox's supervisor may unshare the network."""
    probe = ("import ctypes, os, sys\n"
             "if os.geteuid() != 0 and ctypes.CDLL(None).unshare(0x10000000):\n"
             "    sys.exit(1)\n"
             "sys.exit(ctypes.CDLL(None).unshare(0x40000000) != 0)")
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


def _live_pids_with_home(home: str) -> list[int]:
    """Live processes whose environment has HOME=home: every process of one run."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[0]
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if state not in "ZX" and f"HOME={home}".encode() in env:
            out.append(int(name))
    return out


def _run(code: str, mode: dict, limits: SandboxLimits = LIMITS, **kw) -> SandboxResult:
    """run_python, then the invariants: within timeout + 1 s, no process left (by
    its working directory, and by its uid), its working directory removed. The
    code's first line of output (or a traceback) names its working directory."""
    start = time.monotonic()
    result = run_python("import os; print(os.getcwd())\n" + code, limits=limits, **mode, **kw)
    assert time.monotonic() - start <= limits.timeout_s + 1.0, result
    [workdir] = set(re.findall(r"/[\w/]*hybrid_engine_sandbox_\w+", result.stdout + result.stderr))
    assert not os.path.exists(workdir)
    assert _live_pids_with_home(workdir) == []
    if result.uid is not None:
        assert _live_pids_of(result.uid) == []
    return result


def _live_pids_of(uid: int) -> list[int]:
    """Live processes of real uid."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[0]
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        if state not in "ZX" and int(status.split("\nUid:")[1].split()[0]) == uid:
            out.append(int(name))
    return out


def test_a_program_runs_with_its_stdin_in_a_scrubbed_environment(mode) -> None:
    code = ("import sys; print(sys.stdin.read().upper()); print(sorted(os.environ)); "
            "print('HOSTNAME' in os.environ, os.environ['HOME'] == os.getcwd())")
    os.environ["HE_SANDBOX_SECRET"] = "x"
    try:
        result = _run(code, mode, stdin="hello\n")
    finally:
        del os.environ["HE_SANDBOX_SECRET"]
    lines = result.stdout.splitlines()
    assert result.ok and lines[1] == "HELLO"
    assert "HE_SANDBOX_SECRET" not in lines[3] and lines[-1] == "False True"
    assert ("uid" in result.isolation) == ROOT and (result.uid is not None) == ROOT


def test_an_infinite_loop_is_killed_at_the_timeout(mode) -> None:
    result = _run("while True:\n    pass", mode)
    assert result.timed_out and result.exit_code is None and not result.ok
    assert result.wall_s >= LIMITS.timeout_s


def test_a_gigabyte_of_output_is_cut_at_the_limit(mode) -> None:
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)"
    result = _run(code, mode)
    assert result.truncated and not result.timed_out and result.exit_code is None
    assert len(result.stdout) + len(result.stderr) == LIMITS.output_kb * 1024


def test_a_fork_bomb_stops_at_the_process_limit_and_dies_whole(mode) -> None:
    code = ("import os\nwhile True:\n    try:\n        if os.fork() == 0 and os.getpid() % 3 == 0:"
            "\n            os.setsid()\n    except OSError:\n        pass")
    result = _run(code, mode)
    assert result.timed_out


def test_the_process_limit_counts_a_runs_processes(mode) -> None:
    code = ("import time\nn = 0\nfor _ in range(10):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n"
            "    n += 1\nprint(n)")
    result = _run(code, mode, limits=SandboxLimits(timeout_s=2.0, processes=4))
    assert result.ok and result.stdout.split()[-1] == "3"  # 4 with the program itself


def test_ten_gigabytes_of_allocation_fail_fast(mode) -> None:
    result = _run("b = bytearray(10 << 30)", mode)
    assert result.exit_code == 1 and "MemoryError" in result.stderr and not result.timed_out


def test_nothing_is_written_outside_its_directory(mode, tmp_path) -> None:
    tag = f"he_sandbox_{uuid.uuid4().hex}"
    targets = [f"/tmp/{tag}", f"/var/tmp/{tag}", f"/dev/shm/{tag}", str(tmp_path / tag),
               str(Path(__file__).parent / tag), f"/{tag}"]
    code = (f"targets = {targets!r} + [os.path.join(os.path.dirname(os.getcwd()), {tag!r} + "
            "'_parent')]\nfor t in targets:\n    try:\n        os.makedirs(t)\n"
            "        open(os.path.join(t, 'f'), 'w').write('x')\n    except OSError:\n"
            "        pass\nprint(json.dumps(targets))\nopen('inside', 'w').write('x')\n"
            "print(os.listdir('.'))")
    result = _run("import json\n" + code, mode)
    assert result.ok, result
    assert "inside" in result.stdout
    for target in json.loads(result.stdout.splitlines()[1]):
        assert not os.path.exists(target), target


def test_a_network_connection_fails_where_the_network_is_isolated(mode) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), "
                "timeout=0.5).close()\n    print('connected')\nexcept OSError as e:\n"
                "    print('refused', e.errno)")
        result = _run(code, mode)
        assert result.ok
        if mode["namespaces"] and not _permits_network_namespaces():
            assert "network" not in result.isolation
            pytest.skip("this host refuses network namespaces (the result says so)")
        assert ("network" in result.isolation) == bool(mode["namespaces"])
        if "network" in result.isolation:
            assert "refused" in result.stdout
            with pytest.raises(BlockingIOError):
                server.accept()
        else:
            assert "connected" in result.stdout  # honest: the host's network


def test_a_syntax_error_and_an_exception_are_results(mode) -> None:
    result = _run("def f(:\n    pass", mode)
    assert result.exit_code == 1 and "SyntaxError" in result.stderr
    result = _run("raise ValueError('boom')", mode)
    assert result.exit_code == 1 and "ValueError: boom" in result.stderr
    result = _run("os.kill(os.getpid(), 9)", mode)
    assert result.exit_code is None and result.signal == 9


def test_the_standard_library_and_installed_packages_import() -> None:
    result = _run("import json, sqlite3, numpy\nprint(numpy.arange(3).sum())",
                  {"namespaces": NAMESPACES})
    assert result.ok and result.stdout.split()[-1] == "3"


def test_a_missing_interpreter_is_a_sandbox_error() -> None:
    from hybrid_engine.tools.sandbox import SandboxError

    with pytest.raises(SandboxError, match="could not start"):
        run_python("print(1)", python="/nonexistent/python3")


@pytest.mark.skipif(not ROOT, reason="runs a caller of another uid: needs root")
def test_an_unprivileged_caller_gets_a_user_namespace_of_its_own() -> None:
    """As a plain user the sandbox cannot change uid: where the OS permits, its own
    user namespace holds the process limit, the network and the private dirs."""
    python = _python_without_namespaces()  # the caller's, reachable by its uid
    if subprocess.run([python, "-c", "import sys; sys.exit(sys.version_info < (3, 10))"]
                      ).returncode:
        pytest.skip(f"{python} is older than the package's Python 3.10")
    tag = f"he_sandbox_{uuid.uuid4().hex}"
    script = (
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
        "from hybrid_engine.tools.sandbox import SandboxLimits, run_python\n"
        "bomb = 'import os\\nwhile True:\\n    try:\\n        os.fork()\\n"
        "    except OSError:\\n        pass'\n"
        "r = run_python(bomb, limits=SandboxLimits(timeout_s=1, processes=8))\n"
        f"w = run_python('open(\"/tmp/{tag}\", \"w\").write(\"x\")\\nimport socket\\n"
        "socket.create_connection((\"1.1.1.1\", 53), timeout=0.5)')\n"
        "print(json.dumps([r.timed_out, r.isolation, w.isolation, w.exit_code, w.stderr]))\n")
    uid = 0x6FFF0000 + os.getpid() % 0x10000  # no account's
    start = time.monotonic()
    out = subprocess.run(
        [python, "-c", f"import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); "
         f"os.execv({python!r}, ['python3', '-c', {script!r}])"],
        capture_output=True, text=True, timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"})
    if "Invalid argument" in out.stderr and "setgid" in out.stderr:
        pytest.skip(f"this host's user namespace does not map uid {uid}")
    assert out.returncode == 0, out.stderr
    timed_out, bomb_iso, write_iso, code, stderr = json.loads(out.stdout)
    if "user" not in bomb_iso:
        pytest.skip(f"this host refuses unprivileged user namespaces (isolation {bomb_iso})")
    assert timed_out and time.monotonic() - start < 10
    assert {"user", "network", "pid", "mount"} <= set(write_iso)
    assert code == 1 and "OSError" in stderr  # the connection
    assert not os.path.exists(f"/tmp/{tag}")
    assert _live_pids_of(uid) == []
