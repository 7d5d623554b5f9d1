"""benchmarks/bench_plan.py: its quick run end to end (fresh processes build the
7B / 8-rank plan whole, for ranks 0 and 7 and as the cluster view, and check every rank's against the
whole, under FSDP2 and with training TP 4) writes the table and a last JSON line that agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_plan_quick_times_one_build(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_plan.py"), "--quick",
                           "--check", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                          check=True)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    whole, first, final, cluster = last["rows"]
    assert [r["plan"] for r in last["rows"]] == ["whole", "rank 0", "rank 7", "cluster view"]
    assert all((r["model"], r["world"], r["tp"]) == ("qwen2.5-7b", 8, 4) for r in last["rows"])
    assert whole["buckets"] == first["buckets"] == final["buckets"] == cluster["buckets"] > 0
    assert cluster["remote_blocks"] is None  # no block listed
    assert 0 < first["remote_blocks"] < whole["remote_blocks"]  # only rank 0's
    assert last["checked"] == {"qwen2.5-7b/8/4/full": True,
                               "qwen2.5-7b/8/4/full + training TP": True}
    text = Path(last["result"]).read_text()
    assert f"| qwen2.5-7b | 8 | 4 | rank 0 | {first['seconds'][0]:.2f} " in text
    assert ("restricted to it: qwen2.5-7b/8/4/full yes, qwen2.5-7b/8/4/full + training TP yes."
            in text)
    assert "| qwen2.5-7b | 8 | 4 | cluster view | " in text and "| - | - |" in text
