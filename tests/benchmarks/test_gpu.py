"""benchmarks/bench_gpu.py --cpu --quick runs the GPU benchmark's code end to end on
CPU: measured ceilings, the colocated step phase by phase against its floors,
the generation variants, the profiled train step, the resolved vLLM settings and
the result files; TRL's part is skipped where trl is not importable."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_gpu  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_quick_cpu_mode_measures_every_part(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), "--cpu", "--quick",
         "--out-dir", str(tmp_path / "results"), "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("generate_over_floor", "train_over_floor", "step_over_floor"):
        # A floor is what the work needs at the measured ceilings: nothing runs below it.
        assert math.isfinite(s[key]) and s[key] > 1, (key, s)
    assert "ours_over_trl" not in s  # trl is not a dependency
    md = Path(s["result"])
    assert md.name.startswith("gpu_quick_cpu_") and md.is_file()
    full = json.loads(md.with_suffix(".json").read_text())
    ours = full["ours"]
    assert full["trl"] == {"skipped": "trl is not importable"}
    assert len(ours["steps"]) == 2 and all(r["tokens"] == 4 * 2 * 8 for r in ours["steps"])
    assert all(r["mismatch_abs_mean"] < 0.05 for r in ours["steps"][1:])  # bf16 compute
    assert set(ours["generation"]) == {*bench_gpu.VARIANTS, "ours_gc_off", "ours_2x_sequences"}
    assert all(v["median_tok_s"] > 0 for v in ours["generation"].values())
    assert ours["engine"]["attention_backend"] and "async_scheduling" in ours["engine"]
    assert ours["train_profile"]["wall_s"] > 0 and ours["train_profile"]["top_ops_ms"]
    assert s["in_use_after_gib"]["train"] > 0
    for r in ours["steps"]:  # on CPU a release frees the KV cache; the weights stay
        assert r["released_bytes"] == r["engine_kv_bytes"] > 0 and r["trainer_kept_bytes"] > 0
    kv = [(r["engine_weights_bytes"] + r["engine_kv_bytes"]) / r["engine_kv_bytes"]
          for r in ours["steps"][1:]]
    assert s["engine_over_released"] == pytest.approx(kv[len(kv) // 2])
    assert "| generate |" in md.read_text() and "x floor" in md.read_text()


def test_floors_follow_the_job_and_the_ceilings() -> None:
    """Half the GEMM rate doubles the train floor; the generate floor is the larger
    of the bytes and FLOPs bounds per decode step, times the new tokens."""
    args = bench_gpu._args(["--cpu", "--quick"])
    ceil = {"copy_bytes_s": 1e11, "gemm_flops": 1e12}
    a = bench_gpu.floors(args, ceil)
    b = bench_gpu.floors(args, {**ceil, "gemm_flops": 5e11})
    assert b["train_s"] == pytest.approx(2 * a["train_s"])
    prompts, k, new, _ = bench_gpu.JOBS["quick"]
    spec = bench_gpu._spec(args)
    by_bytes = a["decode_step_bytes"] / ceil["copy_bytes_s"]
    by_flops = 2 * spec.num_params * prompts * k / ceil["gemm_flops"]
    assert a["generate_s"] == pytest.approx(new * max(by_bytes, by_flops))
    assert a["decode_step_bytes"] > 2 * spec.num_params  # the weights plus the KV cache
