"""benchmarks/bench_rollout.py --quick end to end: two torchrun jobs of 2 ranks
(colocated HybridActor, standalone VLLMRollout), the JSON summary, the result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rollout.py"


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
                f"--cache-dir={tmp_path / 'models'}"], timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])  # the last stdout line
    keys = {"model_params", "world_size", "tp", "num_prompts", "num_samples", "max_tokens",
            "colocated_tok_s", "standalone_tok_s", "ratio"}
    assert keys <= summary.keys()
    assert summary["colocated_tok_s"] > 0 and summary["standalone_tok_s"] > 0
    assert summary["ratio"] == pytest.approx(summary["colocated_tok_s"] / summary["standalone_tok_s"])
    assert summary["world_size"] == 2 and summary["tp"] == 2 and summary["model_params"] > 0
    # Every rank returned the same Completions, and the negligible train step
    # left the weights alone: both kinds of job sampled the same tokens.
    assert summary["same_on_all_ranks"] and summary["same_tokens"]
    files = list((tmp_path / "results").glob("rollout_*_quick.md"))
    assert len(files) == 1
    text = files[0].read_text()
    assert "Command: `python benchmarks/bench_rollout.py --quick" in text
    assert "| colocated tok/s |" in text and "vLLM" in text
