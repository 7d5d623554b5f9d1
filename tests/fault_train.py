"""`hybrid-engine train` with one rank armed to SIGKILL or SIGSTOP itself mid-phase
(test helper).

    HE_FAULT=<phase>:<n>[:<signal>] HE_FAULT_RANK=1 HE_FAULT_STAMP=<file> \\
        torchrun ... tests/fault_train.py train --recipe=... [overrides]

phase: rollout (entering the n-th generate), train (the n-th optimizer step),
sync (the n-th weight sync) or save (the n-th checkpoint commit: shards
written, the folder not yet marked complete). signal: kill (default) or stop
(this rank), or launcher (SIGKILL to its parent, torchrun).
Just before the signal the rank writes time.time() to HE_FAULT_STAMP. Without
HE_FAULT it is the plain CLI.
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
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "launcher": signal.SIGKILL}[how]
    target = os.getppid() if how == "launcher" else os.getpid()
    import hybrid_engine.checkpoint as ckpt
    from hybrid_engine.roles.sync import WeightSync
    from hybrid_engine.roles.trainer import Trainer
    from hybrid_engine.rollout.engine import VLLMRollout

    owner, name = {"rollout": (VLLMRollout, "generate"), "train": (Trainer, "train_step"),
                   "sync": (WeightSync, "sync"), "save": (ckpt, "_commit")}[phase]
    original, calls = getattr(owner, name), [0]

    @functools.wraps(original)
    def armed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == int(n):
            Path(os.environ["HE_FAULT_STAMP"]).write_text(repr(time.time()))
            os.kill(target, sig)
        return original(*args, **kwargs)

    setattr(owner, name, armed)


if __name__ == "__main__":
    _arm()
    from hybrid_engine.cli import main

    sys.exit(main(sys.argv[1:]))
