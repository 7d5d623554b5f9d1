"""benchmarks/bench_lora.py --quick: the adapter mode's whole colocated steps on 2
ranks; each sync receives the planner's minimum (a part of the adapters, nothing
of the base), and the table and result file are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_bench_lora_quick(tmp_path) -> None:
    from hybrid_engine.config.sections import LORA_TARGETS
    from hybrid_engine.models.tiny import PRESETS, hf_config
    from hybrid_engine.reshard.adapters import LoraDims, adapter_shapes
    from hybrid_engine.reshard.layouts import model_dims

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_lora.py"), "--quick",
                           f"--out-dir={tmp_path}", f"--cache-dir={tmp_path / 'models'}"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row = result["rows"]["adapter"]
    assert list(result["rows"]) == ["adapter"] and row["sync_s"]["n"] == 2
    adapters = sum(r * c for r, c in adapter_shapes(
        model_dims(hf_config(PRESETS["tiny"])), LoraDims(16, LORA_TARGETS)).values())
    assert 0 < row["sync_bytes"] == row["bytes_min"] < 2 * adapters  # bf16 on the wire
    assert row["tok_s"]["min"] > 0 and row["peak_rss"]["min"] > 0
    text = Path(result["result_file"]).read_text()
    assert "| adapter |" in text and "sync MB/rank" in text
