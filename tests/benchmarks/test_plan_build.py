"""benchmarks/bench_plan.py: its quick run end to end (one fresh process builds the
7B / 8-rank plan) writes the table and a last JSON line that agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_plan_quick_times_one_build(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_plan.py"), "--quick",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, check=True)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    (row,) = last["rows"]
    assert (row["model"], row["world"], row["tp"]) == ("qwen2.5-7b", 8, 4)
    assert row["seconds"][0] > 0 and row["remote_blocks"] > 0 and row["buckets"] > 0
    text = Path(last["result"]).read_text()
    assert f"| qwen2.5-7b | 8 | 4 | {row['seconds'][0]:.2f} " in text
