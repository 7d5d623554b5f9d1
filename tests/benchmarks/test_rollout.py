"""benchmarks/bench_rollout.py --quick end to end: one pair of torchrun jobs of 2
ranks (colocated HybridActor, standalone VLLMRollout), each engine given the KV
cache its memory budget leaves; the JSON summary and the result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rollout.py"


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs the benchmark; on the deadline kills it and every job it started."""
    proc = subprocess.Popen([sys.executable, str(BENCH), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        out, err = proc.communicate()
        pytest.fail(f"bench_rollout did not finish within {timeout:.0f} s\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_bench_rollout_quick(tmp_path) -> None:
    out = _run(["--quick", f"--out-dir={tmp_path / 'results'}",
                f"--cache-dir={tmp_path / 'models'}"], timeout=480)
    assert out.returncode == 0, out.stderr[-4000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])  # the last stdout line
    keys = {"model_params", "world_size", "nproc", "tp", "num_prompts", "num_samples",
            "max_tokens", "colocated_tok_s", "standalone_tok_s", "colocated_tok_s_iqr",
            "standalone_tok_s_iqr", "ratio", "paired_ratio", "ratio_ci", "jobs", "repeats",
            "device_budget_bytes", "trainer_state_bytes", "engine_weight_bytes",
            "kv_cache_bytes", "kv_tokens", "kv_seqs", "workload_block_tokens_at_once"}
    assert keys <= s.keys()
    assert s["world_size"] == 2 and s["tp"] == 2 and s["model_params"] > 0
    assert s["jobs"] == 1 and s["repeats"] == 3
    assert all(len(job) == 3 for m in ("colocated", "standalone") for job in s["tok_s_jobs"][m])
    # Headline: ratio of the medians, with a paired bootstrap CI around it.
    assert s["colocated_tok_s"] > 0 and s["standalone_tok_s"] > 0
    assert s["ratio"] == pytest.approx(s["colocated_tok_s"] / s["standalone_tok_s"])
    lo, hi = s["ratio_ci"]
    assert 0 < lo <= hi
    # The memory plan: the colocated KV is what the budget leaves beside the
    # trainer state (fp32 params + AdamW m, v: 12 bytes/param / N) and the bf16
    # engine weights (/ T).
    n = s["model_params"]
    assert s["trainer_state_bytes"] == 12 * n // 2 and s["engine_weight_bytes"] == 2 * n // 2
    kv = s["kv_cache_bytes"]
    assert kv["colocated"] == s["device_budget_bytes"] - s["trainer_state_bytes"] - s["engine_weight_bytes"]
    assert kv["standalone"] == s["device_budget_bytes"] - s["engine_weight_bytes"]
    # vLLM got those sizes to the block (not rounded to whole GiB).
    block_bytes = s["kv_bytes_per_token"] * s["block_size"]
    for m in ("colocated", "standalone"):
        assert s["kv_storage_bytes"][m] == s["kv_blocks"][m] * block_bytes
        assert kv[m] - block_bytes < s["kv_storage_bytes"][m] <= kv[m]
    # The colocated KV binds (fewer sequences at once than the workload has),
    # the standalone one holds every sequence at once.
    assert s["kv_tokens"]["colocated"] < s["workload_block_tokens_at_once"] <= s["kv_tokens"]["standalone"]
    assert s["kv_seqs"]["colocated"] < s["kv_seqs"]["standalone"] == s["workload_seqs_per_engine"]
    # Every rank returned the same Completions, and the negligible train step
    # left the weights alone: both kinds of job sampled the same tokens.
    assert s["same_on_all_ranks"] and s["same_tokens"]
    files = list((tmp_path / "results").glob("rollout_*_quick.md"))
    assert len(files) == 1
    text = files[0].read_text()
    assert "Command: `python benchmarks/bench_rollout.py --quick" in text
    assert "colocated/standalone [95% CI]" in text and "Memory plan per rank: budget" in text
