"""benchmarks/bench_sync.py runs end to end on the tiny model: three sync
methods interleaved over fresh jobs, the acceptance keys of the last JSON
line, CIs, bytes in each method's wire dtype, and the result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

ACCEPTANCE = ("model_params", "world_size", "tp", "ours_s", "naive_s", "naive_bucketed_s",
              "floor_s", "transfer_s", "repack_s", "bytes_received_per_rank",
              "bytes_min_per_rank", "naive_bytes_received_per_rank",
              "naive_bucketed_bytes_received_per_rank", "peak_extra_bytes",
              "ours_over_floor_ci", "best_naive_over_ours_ci", "jobs", "repeats", "rows")


def test_bench_sync_tiny(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_sync.py"), "--quick",
                           "--sizes", "tiny", "--jobs", "1", "--repeats", "3",
                           f"--out-dir={tmp_path}", f"--cache-dir={tmp_path / 'models'}"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| model |")  # the table comes first
    r = json.loads(lines[-1])
    assert set(ACCEPTANCE) <= r.keys(), set(ACCEPTANCE) - r.keys()
    assert (r["world_size"], r["tp"], r["jobs"], r["repeats"]) == (2, 2, 1, 3)
    for key in ("ours_over_floor_ci", "best_naive_over_ours_ci", "naive_over_ours_ci",
                "naive_bucketed_over_ours_ci"):
        low, high = r[key]
        assert 0 < low <= high, (key, r[key])
    assert r["ours_s"] > 0 and r["floor_s"] > 0
    assert r["transfer_s"] + r["repack_s"] <= r["ours_s"]
    # Every kept repeat of every method adds up (the slowest rank's record).
    row = r["rows"][-1]
    for method, jobs in row["per_repeat"].items():
        assert len(jobs) == 1 and all(len(job) == 3 for job in jobs), method
        for rep in (x for job in jobs for x in job):
            assert rep["transfer"] + rep["repack"] <= rep["total"], (method, rep)
    # Bytes: ours receives exactly the plan's minimum; naive moves fp32 full
    # tensors (twice the bytes of bf16), the bucketed naive bf16 padded parts.
    assert r["bytes_received_per_rank"] == r["bytes_min_per_rank"] > 0
    assert (r["naive_wire_dtype"], r["naive_bucketed_wire_dtype"]) == ("float32", "bfloat16")
    bucketed, naive = r["naive_bucketed_bytes_received_per_rank"], r["naive_bytes_received_per_rank"]
    assert naive // 2 <= bucketed < naive
    assert r["best_naive"] in ("naive", "naive_bucketed")
    assert r["best_naive_s"] == min(r["naive_s"], r["naive_bucketed_s"])
    assert r["peak_extra_bytes"] > 0 and r["naive_bucketed_buffer_bytes"] > 0
    assert {"latency_s", "a2a_gb_s", "copy_gb_s"} <= r["floor_fit"][0].keys()
    md = Path(r["result_file"])
    assert md.parent == tmp_path and md.exists()
    text = md.read_text()
    assert "| tiny | 0.6M | 2 | 2 | 1 x 3 |" in text and "```json" in text
