"""benchmarks/bench_data.py runs end to end on a small file: its table, the last
JSON line's keys and every loader's report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_bench_data_quick(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_data.py"), "--quick",
                           "--rows", "4000", "--ranks", "1", "--jobs", "2",
                           f"--out-dir={tmp_path}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| ranks | loader |")
    result = json.loads(lines[-1])
    assert result["rows"] == 4000 and result["file_mib"] > 0 and result["floor_s"] > 0
    runs = result["runs"]
    assert [(r["mode"], r["cache"]) for r in runs] == [("ours", "cold"), ("ours", "warm"),
                                                      ("baseline", "-")]
    assert [r["jobs"] for r in runs] == [1, 2, 2]  # --jobs repeats the warm runs only
    assert all(0 < r["seconds_min_job"] <= r["seconds_max"] <= r["seconds_max_job"]
               and r["peak_mib_max"] >= 0 for r in runs)
    assert list(tmp_path.glob("data_*_quick.md"))
