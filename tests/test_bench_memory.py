"""benchmarks/bench_memory.py --quick: every mode runs on 2 ranks; colocation
really releases the KV cache before training and the resident mode does not;
under separate placement each role holds only its own layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def test_bench_memory_quick(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_memory.py"), "--quick",
                           f"--out-dir={tmp_path}", f"--cache-dir={tmp_path / 'models'}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    phases = {(r["mode"], r["phase"]): r for r in result["phases"]}
    kv = phases[("colocated", "generate")]["kv_cache_bytes"]
    assert kv > 0 and result["released_bytes_per_rank"] == kv
    assert phases[("colocated", "train")]["kv_cache_bytes"] == 0
    assert phases[("resident", "train")]["kv_cache_bytes"] == kv
    # The release shows in the process's memory, not only in the accounting.
    saved = phases[("resident", "train")]["peak_rss_bytes"] - phases[("colocated", "train")]["peak_rss_bytes"]
    assert saved > 0.5 * kv
    train, rollout = "separate (train ranks)", "separate (rollout ranks)"
    for ph in ("generate", "train"):
        assert phases[(train, ph)]["kv_cache_bytes"] == 0 == phases[(train, ph)]["engine_weights_bytes"]
        assert phases[(rollout, ph)]["kv_cache_bytes"] == kv
        assert phases[(rollout, ph)]["trainer_params_bytes"] == 0
    # One trainer rank holds the whole model's shards: twice a colocated rank's.
    assert phases[(train, "train")]["trainer_params_bytes"] == 2 * phases[("colocated", "train")][
        "trainer_params_bytes"]
    assert list(tmp_path.glob("memory_*.png")) and list(tmp_path.glob("memory_*.md"))
