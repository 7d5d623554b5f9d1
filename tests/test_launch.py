"""hybrid_engine.launch without ranks: how it reads a process's SIGTERM handler,
and `train --nproc`'s refusals, which come before any rank starts. The launched
paths (SIGTERM and SIGKILL to the launcher, Ctrl-C to `train --nproc`) are in
tests/test_faults.py and tests/test_train_cli.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hybrid_engine.launch import catches_sigterm, main


def test_catches_sigterm_reads_the_handler_mask() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys, time\n"
         "sys.stdin.readline()\n"
         "signal.signal(signal.SIGTERM, lambda *a: None)\n"
         "print('ok', flush=True)\n"
         "time.sleep(60)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        assert not catches_sigterm(child.pid)  # Python catches SIGINT, not SIGTERM, by default
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ok\n"
        assert catches_sigterm(child.pid)
    finally:
        child.kill()
        child.wait()


def test_help_and_no_arguments(capsys) -> None:
    assert main(["--help"]) == 0
    assert "torchrun with a clean stop" in capsys.readouterr().out
    assert main([]) == 2


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybrid_engine.cli", "train", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.parametrize(("args", "expected"), [
    (("--nproc", "0"), "--nproc must be >= 1"),
    (("--nproc", "2", "--train.lrr=1e-4"), "did you mean 'train.lr'"),
])
def test_train_nproc_refuses_bad_input_before_any_rank(args, expected) -> None:
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [next(ln for ln in proc.stderr.splitlines()
                                             if ln.startswith("error: "))], proc.stderr
    assert expected in proc.stderr and "torch.distributed.run" not in proc.stderr


def test_train_nproc_under_a_launched_world_is_refused() -> None:
    proc = _cli("--nproc", "2", RANK="0", WORLD_SIZE="1")
    assert proc.returncode == 2 and "already one of a launched world" in proc.stderr, proc.stderr
