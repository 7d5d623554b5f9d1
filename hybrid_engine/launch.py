"""torchrun with a clean stop: `python -m hybrid_engine.launch [torchrun args] ...`.

Takes exactly torchrun's arguments and runs torchrun under them. The one
difference is what a signal does. torchrun answers SIGINT/SIGTERM by
forwarding SIGTERM to its ranks, waiting at most its shutdown timeout (30 s)
and then exiting 1 with a `SignalException` traceback, whatever the ranks
did: that is torch's contract for a signalled launcher. Here SIGINT/SIGTERM go
to the ranks alone; torchrun never sees them. `hybrid-engine train` ranks
treat a signal as "stop after the current step" (parallel/signals.py): every
rank finishes its step, saves when checkpointing is on, exports `final/` and
exits 0, so torchrun, and this launcher, exit 0 with no traceback and no time
limit on the step.

- A rank gets the signal once it has installed its SIGTERM handler (read from
  /proc/PID/status), so a signal during a rank's interpreter start-up is held,
  not lost and not fatal; a rank with no handler after 30 s gets it anyway.
- A second SIGINT/SIGTERM goes to torchrun itself: its usual shutdown (SIGTERM
  to the ranks, SIGKILL after its timeout, exit 1).
- torchrun runs in its own process group, so Ctrl-C in a terminal reaches only
  this launcher, and dies with it (PR_SET_PDEATHSIG): SIGKILL to the launcher
  is SIGKILL to torchrun, whose ranks then leave on their own
  (parallel/watchdog.watch_launcher).

The exit code is torchrun's (128 + N when a signal N ended it).
`hybrid-engine train --nproc N` and `hybrid-engine demo` launch through here
with a report file (`launch_local`): torchrun then runs with its own log and
its failure report (a `ChildFailedError` traceback after every failed run)
written to that file instead of the terminal, so a rank's one `error:` line
is the last word, followed by one line naming the file; the exit code is the
first failed rank's (2 for a run that stopped itself with an error line).
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from hybrid_engine.parallel.signals import restore_handlers

__all__ = ["launch", "launch_local", "main", "torchrun_reporting_to"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
HANDLER_WAIT_S = 30.0  # a rank without a SIGTERM handler after this long gets the signal anyway
_POLL_S = 0.1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (Linux prctl)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def catches_sigterm(pid: int) -> bool:
    """True if process `pid` has a handler for SIGTERM (its SigCgt mask in
    /proc/PID/status); True when that cannot be read (not Linux: no holding)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return True


def _say(msg: str) -> None:
    print(f"hybrid_engine.launch: {msg}", file=sys.stderr, flush=True)


_REPORTING = ("import sys; from hybrid_engine.launch import torchrun_reporting_to; "
              "sys.exit(torchrun_reporting_to(sys.argv[1], sys.argv[2:]))")


def torchrun_reporting_to(report: str, torchrun_args: Sequence[str]) -> int:
    """torchrun in this process, with its log and failure report appended to the
    file `report` instead of stderr. Returns 0, or the exit code of the first
    rank that failed (128 + N for a signal N)."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    handler = logging.FileHandler(report)
    for name in ("torch", "torch.distributed"):  # the two that write to stderr
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            handler.setFormatter(h.formatter)
            logger.removeHandler(h)
        logger.addHandler(handler)
    try:
        run(parse_args(list(torchrun_args)))
    except ChildFailedError as e:
        import traceback

        handler.stream.write(traceback.format_exc())
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        print(f"(torchrun: rank {rank} exited with code {code}; its report: {report}; "
              "--verbose prints it here)", file=sys.stderr, flush=True)
        return 128 - code if code < 0 else code or 1
    finally:
        handler.close()
    return 0


def launch(torchrun_args: Sequence[str], *, env: dict[str, str] | None = None,
           report: str | None = None) -> int:
    """Runs `torchrun *torchrun_args` until it exits; returns its exit code.
    SIGINT/SIGTERM meanwhile go to the ranks (see the module docstring). With
    `report`, torchrun's log and failure report go to that file."""
    import psutil

    cmd = ([sys.executable, "-m", "torch.distributed.run", *torchrun_args] if report is None
           else [sys.executable, "-c", _REPORTING, report, *torchrun_args])
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:  # noqa: ARG001
        received.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in SIGNALS}
    started = time.time()
    try:
        proc = subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=_die_with_parent)
        torchrun = psutil.Process(proc.pid)
        told: set[int] = set()  # ranks that got the first signal
        escalated = False
        first_at = 0.0
        while True:
            try:
                proc.wait(timeout=_POLL_S)  # the loop also wakes for a received signal
                break
            except subprocess.TimeoutExpired:
                pass
            if not received or escalated:
                continue
            if len(received) > 1:
                _say(f"{signal.Signals(received[-1]).name} again: to torchrun (its shutdown: "
                     "SIGTERM to the ranks, SIGKILL after its timeout, exit 1)")
                proc.send_signal(signal.SIGTERM)
                escalated = True
                continue
            first_at = first_at or time.monotonic()
            patient = time.monotonic() - first_at < HANDLER_WAIT_S
            try:
                ranks = torchrun.children()
            except psutil.NoSuchProcess:
                continue
            for rank in ranks:
                if rank.pid in told or (patient and not catches_sigterm(rank.pid)):
                    continue
                try:
                    rank.send_signal(received[0])
                except psutil.NoSuchProcess:
                    continue
                told.add(rank.pid)
                _say(f"{signal.Signals(received[0]).name} to rank pid {rank.pid}: the ranks stop "
                     "after the current step; send it again to stop torchrun at once")
        code = proc.returncode
    finally:
        restore_handlers(previous)
    _sweep_shared_memory(started)
    return 128 - code if code < 0 else code


def _sweep_shared_memory(since: float) -> None:
    """After torchrun is gone: removes what its ranks left in /dev/shm when none
    could (all killed): our segments of dead launchers, and vLLM's ring buffers
    made since `since` that no process maps."""
    from hybrid_engine.rollout import cpu_shm

    cpu_shm.sweep_orphans()
    cpu_shm.sweep_orphans(0.0, pattern=cpu_shm.FOREIGN, changed_after=since)


def launch_local(nproc: int, argv: Sequence[str], *, verbose: bool = False) -> int:
    """`launch` of `torchrun --standalone --nproc_per_node=nproc ARGV`, each rank
    with OMP_NUM_THREADS = cores / nproc unless the environment sets it.
    torchrun's log and failure report go to a temporary file, kept and named
    when the run fails (unless verbose: then to stderr, as torchrun writes them)."""
    import os
    import tempfile

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = ["--standalone", f"--nproc_per_node={nproc}", *argv]
    if verbose:
        return launch(args, env=env)
    fd, report = tempfile.mkstemp(prefix="hybrid-engine-torchrun-", suffix=".log")
    os.close(fd)
    code = launch(args, env=env, report=report)
    if code == 0:
        os.unlink(report)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: `python -m hybrid_engine.launch` with torchrun's arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0].replace("`", "") + "\n\n" + __doc__.split("\n\n", 1)[1],
              end="")
        print("\ntorchrun's own options: python -m torch.distributed.run --help")
        return 0 if args else 2
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
