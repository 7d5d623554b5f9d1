"""`hybrid-engine train` with one rank armed to SIGKILL or SIGSTOP itself mid-phase
(test helper).

    HE_FAULT=<phase>:<n>[:<signal>] HE_FAULT_RANK=1 HE_FAULT_STAMP=<file> \\
        torchrun ... tests/fault_train.py train --recipe=... [overrides]

phase: rollout (entering the n-th generate), train (the n-th optimizer step),
sync (the n-th weight sync), save (the n-th checkpoint commit: shards
written, the folder not yet marked complete), build (the vLLM engine's
construction, at start-up), export (the final HF export) or start (n ignored:
at once, before the CLI runs, i.e. before the rendezvous); on a rank of
placement=grouped's critic group: critic-generate (the n-th collect it waits
in), critic-score (the n-th critic scoring), critic-train (the critic's n-th
update) or critic-sync (the n-th sync it waits in). signal: kill
(default), stop or term (to this rank), launcher or launcher-term (SIGKILL or
SIGTERM to its parent, torchrun), launch or launch-term (SIGKILL or SIGTERM to
torchrun's parent: hybrid_engine.launch when it started torchrun), or fsize (save
only: at the n-th save, before any shard is written, this rank's files may no
longer grow past 64 KiB, RLIMIT_FSIZE, as on a full disk).
Just before the signal the rank writes time.time() to HE_FAULT_STAMP; a SIGTERM
to a launcher is waited for until it has come back to this rank (up to 10 s),
so it lands inside the armed step. Without HE_FAULT it is the plain CLI.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from pathlib import Path


def _arm() -> None:
    fault = os.environ.get("HE_FAULT")
    if not fault or os.environ.get("RANK") != os.environ.get("HE_FAULT_RANK", "1"):
        return
    phase, n, *how = fault.split(":")
    how = how[0] if how else "kill"
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM,
           "launcher": signal.SIGKILL, "launcher-term": signal.SIGTERM,
           "launch": signal.SIGKILL, "launch-term": signal.SIGTERM, "fsize": None}[how]
    if how.startswith("launcher"):
        target = os.getppid()
    elif how.startswith("launch"):
        import psutil

        target = psutil.Process(os.getppid()).ppid()
    else:
        target = os.getpid()
    if phase == "start":
        Path(os.environ["HE_FAULT_STAMP"]).write_text(repr(time.time()))
        os.kill(target, sig)
        time.sleep(0.5)  # the signal has landed before the CLI starts
        return
    from hybrid_engine.checkpoint import export, state
    from hybrid_engine.policy.grouped import GroupedPolicy
    from hybrid_engine.roles.critic import Critic
    from hybrid_engine.roles.scorers import CriticScorer
    from hybrid_engine.roles.sync import WeightSync
    from hybrid_engine.roles.trainer import Trainer
    from hybrid_engine.rollout.engine import VLLMRollout

    owner, name = {"rollout": (VLLMRollout, "generate"), "train": (Trainer, "train_step"),
                   "sync": (WeightSync, "sync"), "save": (state, "commit"),
                   "build": (VLLMRollout, "__init__"), "export": (export, "_gather_and_write"),
                   # a rank of placement=grouped's critic group
                   "critic-generate": (GroupedPolicy, "collect"),
                   "critic-score": (CriticScorer, "score"),
                   "critic-train": (Critic, "train_step"),
                   "critic-sync": (GroupedPolicy, "sync_weights")}[phase]
    if how == "fsize":
        owner, name = state, "_write_state"
    original, calls = getattr(owner, name), [0]

    @functools.wraps(original)
    def armed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == int(n):
            Path(os.environ["HE_FAULT_STAMP"]).write_text(repr(time.time()))
            if sig is None:  # a full disk: writes past the limit fail with EFBIG
                import resource

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
            else:
                os.kill(target, sig)
                if sig == signal.SIGTERM and target != os.getpid():
                    _until_forwarded()
        return original(*args, **kwargs)

    setattr(owner, name, armed)


def _until_forwarded(timeout_s: float = 10.0) -> None:
    """Waits until the SIGTERM sent to a launcher has come back to this rank, so
    it lands inside the armed phase's step, not after the step's stop check (a
    race the launcher's scheduling would otherwise decide)."""
    from hybrid_engine.parallel import signals

    deadline = time.monotonic() + timeout_s
    while signals.requested() is None and time.monotonic() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    _arm()
    from hybrid_engine.cli import run

    run(sys.argv[1:])
