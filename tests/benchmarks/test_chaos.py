"""The fault injector (benchmarks/chaos.py) on one seeded random-moment SIGKILL of
a real 2-rank run: the job down within 60 s, no process, port or
/dev/shm entry left after the resume, no damaged checkpoint, and the resume
reproduces the uninterrupted run's per-step metrics. `make chaos` runs 20."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def test_random_moment_kills_recover(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kills=1", "--seed=3", "--steps=4",
                           f"--out-dir={tmp_path}", f"--work-dir={tmp_path}"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\n".join(ln for ln in proc.stdout.splitlines() if ln.startswith("[chaos]")))
    assert result["trials"] == 1
    assert result["passed"] == 1, json.dumps(result["rows"], indent=1)
    assert proc.returncode == 0
    assert list(tmp_path.glob("chaos_*.md"))
