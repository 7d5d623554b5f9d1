"""benchmarks/bench_step.py --quick runs end to end: phase times from real jobs,
a table, the result file and chart, and the JSON keys the report reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def test_bench_step_quick(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--quick",
                           f"--out-dir={tmp_path}", f"--cache-dir={tmp_path / 'models'}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = result["configs"]
    assert [(r["preset"], r["world_size"], r["placement"]) for r in rows] == [
        ("tiny", 1, "colocated"), ("tiny", 2, "colocated"), ("tiny", 2, "separate")]
    for r in rows:
        assert {"generate_s", "score_s", "train_s", "sync_s", "step_s", "tok_s"} <= r.keys()
        assert r["steps_trained"] == r["steps_timed"] == 2  # every timed step trained and synced
        assert r["generate_s"] > 0 and r["train_s"] > 0 and r["sync_s"] > 0
        phases = r["generate_s"] + r["score_s"] + r["train_s"] + r["sync_s"]
        assert abs(r["step_s"] - phases) < 1e-6  # 2 timed steps: medians are means, they add up
    md = next(tmp_path.glob("step_cpu_*.md")).read_text()
    assert "| tiny | 0.6M | 2 | colocated | 2 |" in md and "| tiny | 0.6M | 2 | separate | 1 |" in md
    assert (tmp_path / Path(result["chart"]).name).stat().st_size > 0
