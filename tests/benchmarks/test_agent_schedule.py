"""benchmarks/bench_agent_schedule.py end to end on a tiny workload: one torchrun
job of 2 ranks as one TP-2 engine (the lockstep path), both loops; the checks it
reports hold and the result file is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_agent_schedule.py"


def test_bench_agent_schedule_tiny(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--tp=2", "--num-prompts=2", "--num-samples=2",
         "--max-turns=3", "--tool-ms=20", "--max-tokens=8", "--repeats=1",
         f"--out-dir={tmp_path / 'results'}", f"--cache-dir={tmp_path / 'models'}"],
        capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])  # the last stdout line
    assert (s["world"], s["tp"], s["pairs"]) == (2, 2, 1)
    assert s["same_on_all_ranks"] and s["tokens_equal_between_loops"] == 1
    assert s["speedup"] > 0 and s["episode_engine_steps"] > 0 and s["tool_floor_s"] > 0
    assert 0 <= s["turn_idle_fraction"] <= 1 and 0 <= s["episode_idle_fraction"] <= 1
    result = Path(s["result"])
    assert result.name.startswith("agent_schedule_") and "_tp2_" in result.name
    assert "turn / episode wall time" in result.read_text()
