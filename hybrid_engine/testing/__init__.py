"""Runs code on N real ranks in fresh processes, for tests and benchmarks.

Invariant: nothing here can hang its caller. Every run has a deadline; on an
error, a crash or the deadline, every rank's process group is killed and the
caller gets an exception naming the rank(s) with their traceback and log tail.

- `run_ranks(fn, world_size, ...)`: fn(*args) on each of N spawned ranks with
  torch.distributed initialised (gloo by default, free TCP port); returns the
  list of per-rank results.
- `run_in_subprocess(fn, ...)`: fn(*args) in one fresh process, no process
  group. vLLM must run this way in tests: it takes over torch.set_num_threads,
  destroys the default process group when the engine is deleted, and names its
  shared-memory segments per job.
- `run_torchrun(argv, nproc, ...)`: a script or module under
  `torchrun --standalone --nproc_per_node=N`.
- `run_job(argv, nproc, ...)`: `hybrid-engine ARGV` on N ranks forked as
  run_ranks' are, with torchrun's environment (no torchrun).
- `run_nodes(argv, nnodes, nproc_per_node, ...)`: `torchrun --nnodes`, one
  agent per "node" on this machine, each later node in its own PID namespace.

fn must be importable by name (a module-level function). Ranks fork from a
server that has imported torch, transformers and vLLM once (`_PRELOAD`), so a
rank starts in well under a second instead of spending ~10 s of CPU on those
imports; each rank then gets the caller's environment as it is at the call,
plus its own variables, before fn's module is imported. Only an env var that
those preloaded libraries read at import time keeps the value it had when the
server started (the first run of this process).
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from hybrid_engine.parallel.dist import free_port  # re-exported: tests import it from here

__all__ = ["RankError", "free_port", "kill_tree", "processes_mentioning", "run_cli", "run_in_subprocess",
           "run_job", "run_nodes", "run_ranks", "run_torchrun", "separate_pid_namespaces"]

_LOG_TAIL_CHARS = 4000
# What every rank imports: the fork server imports it once (multiprocessing's
# forkserver start method), every rank forks from it with these loaded.
_PRELOAD = ["torch", "torch.distributed", "transformers", "vllm.entrypoints.llm",
            "hybrid_engine.testing"]


class RankError(RuntimeError):
    """One or more ranks failed, crashed or did not finish in time."""


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-_LOG_TAIL_CHARS:]


def _worker(
    fn_ref: tuple[str, str], rank: int, world_size: int, args: tuple, env: dict[str, str],
    backend: str | None, log_path: str, results: Any,
) -> None:
    os.setpgrp()  # a Ctrl-C at the terminal reaches the parent, which cleans up
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()  # the caller's environment now, not the fork server's
    os.environ.update(env)
    # On the deadline the parent sends SIGUSR1 before SIGKILL: the rank then
    # writes every thread's stack to its log, showing where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        if backend is not None:
            import torch.distributed as dist

            if backend == "nccl":  # one GPU per rank, as torchrun + set_device does
                torch.cuda.set_device(int(env["LOCAL_RANK"]))
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        fn = getattr(importlib.import_module(fn_ref[0]), fn_ref[1])
        # Plain pickle: the queue's own pickler would pass tensors through
        # shared-memory fds that die with this process.
        out = pickle.dumps(fn(*args))
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown after a reported result
        pass


def _fn_ref(fn: Callable[..., Any]) -> tuple[str, str]:
    module, name = fn.__module__, fn.__qualname__
    if "<" in name or "." in name:
        raise ValueError(f"{name} must be a module-level function to run in a fresh process")
    if module == "__main__":
        raise ValueError("functions defined in __main__ cannot be imported by child processes")
    return module, name


def kill_tree(pid: int) -> None:
    """SIGKILLs pid and all its descendants, including ones in other sessions
    (torchrun starts its workers with start_new_session)."""
    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains text (a job's output
    folder, a script path): what a test expects to be gone after a job ends."""
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if text in " ".join(p.info["cmdline"] or [])]


def _dump_stacks(ranks: Mapping[int, mp.process.BaseProcess], logs: Path) -> None:
    """Asks live ranks to write their stacks to their logs (see _worker) and
    waits, at most 2 s, until every such log has grown."""
    pending = {}
    for r, p in ranks.items():
        if not (p.is_alive() and p.pid is not None):
            continue
        log = logs / f"rank{r}.log"
        size = log.stat().st_size if log.exists() else 0
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        pending[log] = size
    deadline = time.monotonic() + 2.0
    while pending and time.monotonic() < deadline:
        pending = {f: n for f, n in pending.items() if not (f.exists() and f.stat().st_size > n)}
        time.sleep(0.02)  # polling the logs, not waiting for a guess


def _kill(procs: Sequence[mp.process.BaseProcess], grace_s: float = 0.0) -> None:
    """Kills every rank's process tree, after up to grace_s for them to exit on
    their own: a rank that has sent its result still runs multiprocessing's
    finalizers, which unlink its named semaphores (its reward pool's); killed
    there, they stay in /dev/shm, since its resource tracker is the server's
    and outlives it."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            kill_tree(p.pid)
    for p in procs:
        p.join(timeout=10)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = "gloo",
    env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
    preload: bool = True,
) -> list[Any]:
    """Runs fn(*args) on world_size fresh ranks and returns their results by rank.

    Args:
        fn: module-level function; return value must be picklable.
        world_size: number of ranks (processes).
        timeout: seconds for the whole run; past it every rank is killed.
        backend: torch.distributed backend, or None for no process group;
            "nccl" first binds each rank to GPU LOCAL_RANK (`torch.cuda.set_device`).
        env: extra environment for every rank (RANK, WORLD_SIZE, LOCAL_RANK,
            MASTER_ADDR, MASTER_PORT and OMP_NUM_THREADS are set here unless given).
        log_dir: where each rank's stdout+stderr goes (rank{r}.log); a
            temporary folder when None.
        preload: fork the ranks from the server that imported `_PRELOAD`;
            False spawns bare interpreters (for a check of what fn imports).

    Raises:
        RankError: a rank raised (its traceback is in the message), exited
            without a result, or the run passed its deadline.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    fn_ref = _fn_ref(fn)
    ctx = _context(preload)
    results = ctx.Queue()
    port = free_port()
    tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="he_ranks_")
    logs = Path(log_dir if log_dir is not None else tmp.name)
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker,
                args=(fn_ref, rank, world_size, args, _rank_env(rank, world_size, port, env),
                      backend, str(logs / f"rank{rank}.log"), results),
                daemon=False,  # ranks may start processes of their own
            )
            p.start()
            procs.append(p)
        out = _collect(procs, results, world_size, timeout, logs)
        _kill(procs, grace_s=30.0)  # every rank sent its result: let it finish exiting
        return out
    finally:
        _kill(procs)
        if tmp is not None:
            tmp.cleanup()


def _context(preload: bool) -> Any:
    """multiprocessing's forkserver with `_PRELOAD` (preload), else spawn."""
    ctx = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_env(rank: int, world_size: int, port: int,
              env: Mapping[str, str] | None) -> dict[str, str]:
    """A rank's whole environment: the caller's now, its rank variables, env."""
    threads = max(1, (os.cpu_count() or 1) // world_size)
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads), **(env or {})}


def _collect(procs, results, world_size: int, timeout: float, logs: Path) -> list[Any]:
    deadline = time.monotonic() + timeout
    outs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    grace_end: float | None = None  # after a first error, wait briefly for others
    while len(outs) + len(errors) < world_size:
        now = time.monotonic()
        if now > deadline or (grace_end is not None and now > grace_end):
            break
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            for r, p in enumerate(procs):  # died without a result (segfault, kill)
                if r not in outs and r not in errors and not p.is_alive():
                    try:  # its result may still be in flight through the queue
                        rank, status, payload = results.get(timeout=1.0)
                    except queue.Empty:
                        errors[r] = f"exited with code {p.exitcode} without a result"
                        break
                    (outs if status == "ok" else errors)[rank] = payload
                    break
            else:
                continue
        else:
            (outs if status == "ok" else errors)[rank] = payload
        if errors and grace_end is None:
            grace_end = time.monotonic() + 5.0
    if not errors and len(outs) == world_size:
        return [pickle.loads(outs[r]) for r in range(world_size)]
    missing = [r for r in range(world_size) if r not in outs and r not in errors]
    _dump_stacks({r: procs[r] for r in missing}, logs)
    _kill(procs)
    parts = []
    if errors:  # dicts keep arrival order: the first error is the root cause
        first = next(iter(errors))
        parts.append(f"rank {first} failed first")
        if len(errors) > 1:
            parts.append(f"rank(s) {sorted(set(errors) - {first})} failed after it")
    if missing and not errors:
        parts.append(f"rank(s) {missing} did not finish within {timeout:.0f} s")
    elif missing:
        parts.append(f"rank(s) {missing} stopped after the failure")
    lines = ["; ".join(parts)]
    for r in errors:
        lines.append(f"--- rank {r} ---\n{errors[r]}")
    for r in sorted(set(missing) | set(errors)):
        tail = _tail(logs / f"rank{r}.log")
        if tail:
            lines.append(f"--- rank {r} log (tail) ---\n{tail}")
    raise RankError("\n".join(lines))


def run_in_subprocess(
    fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
    env: Mapping[str, str] | None = None, preload: bool = True,
) -> Any:
    """Runs fn(*args) in one fresh process without a process group; returns its
    result (preload: as in `run_ranks`)."""
    return run_ranks(fn, 1, *args, timeout=timeout, backend=None, env=env, preload=preload)[0]


def run_torchrun(
    argv: Sequence[str], nproc: int, *, timeout: float = 300.0,
    env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
    check: bool = True, master_port: int | None = None, launcher: str = "torchrun",
) -> subprocess.CompletedProcess[str]:
    """Runs `torchrun --standalone --nproc_per_node=nproc ARGV...` and returns its output
    (with master_port: a fixed `--master_addr=127.0.0.1 --master_port=PORT`
    launch instead of --standalone, torchrun's run id then "none"; with
    launcher="hybrid_engine.launch": torchrun under that module).

    argv is what follows torchrun's own flags: a script path and its
    arguments, or ["-m", "module", ...]. Raises RankError on the deadline (the
    whole process tree is killed) and, if check, on a non-zero exit, with the
    output tail. stdout and stderr come merged, in `.stdout`.
    """
    where = (["--standalone"] if master_port is None else
             ["--master_addr=127.0.0.1", f"--master_port={master_port}"])
    module = {"torchrun": "torch.distributed.run", "hybrid_engine.launch": "hybrid_engine.launch"}
    if launcher not in module:
        raise ValueError(f"launcher must be one of {sorted(module)}, got {launcher!r}")
    cmd = [sys.executable, "-m", module[launcher], *where, f"--nproc_per_node={nproc}", *argv]
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    done = _run_tree(cmd, "torchrun", timeout=timeout, env={**threads, **(env or {})}, cwd=cwd,
                     merge=True)
    if check and done.returncode != 0:
        raise RankError(f"torchrun exited with code {done.returncode}: {' '.join(cmd)}\n"
                        f"{done.stdout[-_LOG_TAIL_CHARS:]}")
    return done


def separate_pid_namespaces() -> bool:
    """Whether this machine lets an unprivileged process start one in a new user,
    PID and mount namespace (`unshare -Urpf --mount-proc`), which `run_nodes`
    uses so its second "node" sees its own pids only, as another host would."""
    try:
        return subprocess.run(["unshare", "-Urpf", "--mount-proc", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_nodes(
    argv: Sequence[str], nnodes: int, nproc_per_node: int, *, timeout: float = 300.0,
    env: Mapping[str, str] | None = None, pid_namespaces: bool = True,
) -> list[subprocess.CompletedProcess[str]]:
    """Runs ARGV under `torchrun --nnodes=nnodes` on this machine: one torchrun
    agent per "node", all started at once, meeting at a c10d rendezvous on
    localhost, nproc_per_node ranks each (torchrun gives the first node to
    join global ranks 0..P-1, and so on). With pid_namespaces, every node but
    the first runs in its own PID namespace (`separate_pid_namespaces`), so its
    ranks and the others' cannot see each other's processes, as on two hosts.

    argv is what follows torchrun's own flags (a script and its arguments, or
    ["-m", "module", ...]). Returns each agent's output, stdout and stderr
    merged. Raises RankError on the deadline, after killing every agent's tree.
    """
    port = free_port()
    base = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc_per_node}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=nodes{port}", *argv]
    isolate = ["unshare", "-Urpf", "--mount-proc"] if pid_namespaces else []
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (nnodes * nproc_per_node)))}
    procs = [subprocess.Popen([*(isolate if n else []), *base], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**os.environ, **threads, **(env or {})})
             for n in range(nnodes)]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(0.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_tree(proc.pid)
        tails = "\n".join(f"--- node {n}\n{(p.communicate()[0] or '')[-_LOG_TAIL_CHARS // nnodes:]}"
                          for n, p in enumerate(procs))
        raise RankError(f"{nnodes} torchrun agents did not finish within {timeout:.0f} s: "
                        f"{' '.join(base)}\n{tails}") from None
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outs)]


def run_job(
    argv: Sequence[str], nproc: int, *, timeout: float = 300.0,
    env: Mapping[str, str] | None = None, check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Runs `hybrid-engine ARGV...` (e.g. ["train", ...]) on nproc real ranks as
    torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT, one process
    each), but forked from `run_ranks`' preloaded server: a launch costs a
    fork instead of each rank's ~10 s of CPU importing torch and vLLM. What the
    job does is the same; what torchrun itself does (its agent, the launcher
    watch, its exit codes on a fault) is tested through `run_torchrun`.

    Returns the ranks' output (rank 0's log, then rank 1's, ...) in `.stdout` and
    the first non-zero exit code (1 for a rank that raised: its traceback ends
    `.stdout`). Raises RankError if check and a rank failed, or on the deadline.
    """
    from torch.distributed import TCPStore

    # The rendezvous store lives here, as torchrun's agent holds it: it outlives
    # rank 0, which may exit while another rank still reads it (`cli._say_once`).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", **(env or {})}
    logs = tempfile.TemporaryDirectory(prefix="he_job_")
    try:
        try:
            codes = run_ranks(_cli_main, nproc, list(argv), timeout=timeout, backend=None,
                              env=env, log_dir=logs.name)
            error = ""
        except RankError as e:
            if check:
                raise
            codes, error = [1], f"{e}\n"
        out = "".join(_read_log(Path(logs.name) / f"rank{r}.log") for r in range(nproc))
    finally:
        logs.cleanup()
        del store
    code = next((c for c in codes if c), 0)
    cmd = ["hybrid-engine", *argv]
    if check and code:
        raise RankError(f"hybrid-engine exited with code {code}: {' '.join(cmd)}\n"
                        f"{out[-_LOG_TAIL_CHARS:]}")
    return subprocess.CompletedProcess(cmd, code, out + error, "")


def _cli_main(argv: list[str]) -> int:
    """One rank of `run_job`: the console script's main, its exit code returned."""
    from hybrid_engine import cli

    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _run_tree(cmd: list[str], name: str, *, timeout: float, env: Mapping[str, str],
              cwd: str | os.PathLike | None = None,
              merge: bool) -> subprocess.CompletedProcess[str]:
    """Runs cmd in its own session with env added to ours; on the deadline kills
    its whole process tree and raises RankError naming it with the output's
    tail. merge: stderr into stdout."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=cwd,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                            env={**os.environ, **env}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise RankError(f"{name} did not finish within {timeout:.0f} s: {' '.join(cmd)}\n"
                        f"{(out + (err or ''))[-_LOG_TAIL_CHARS:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err or "")


def run_cli(argv: Sequence[str], *, timeout: float = 300.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs `hybrid-engine ARGV...` (as `python -m hybrid_engine.cli`, e.g.
    ["train", "--nproc", "2", ...]) and returns it with stdout and stderr
    apart. Raises RankError on the deadline (the whole process tree is killed)."""
    return _run_tree([sys.executable, "-m", "hybrid_engine.cli", *argv], "hybrid-engine",
                     timeout=timeout, env=env or {}, merge=False)
