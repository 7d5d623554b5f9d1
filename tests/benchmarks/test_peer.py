"""benchmarks/bench_peer.py without the peer (trl is not a dependency): its
arguments, and our variants end to end on the tiny model, with the table, the
ratios and the last JSON line. The peer's own script is run by hand
(benchmarks/peer/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_peer  # noqa: E402


def test_peer_variants_need_a_peer_python_and_counts_must_be_positive(monkeypatch) -> None:
    monkeypatch.delenv("HE_PEER_PYTHON", raising=False)
    with pytest.raises(SystemExit):
        bench_peer._args(["--variants", "trl", "ours"])
    with pytest.raises(SystemExit):
        bench_peer._args(["--variants", "ours", "--jobs", "0"])
    args = bench_peer._args(["--variants", "ours_fast"])
    assert args.variants == ["ours_fast"] and args.peer_python is None
    assert bench_peer._args(["--peer-python", "py"]).variants == list(bench_peer.VARIANTS)


@pytest.mark.vllm
@pytest.mark.slow
def test_our_variants_end_to_end_on_the_tiny_model(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_peer.py"), "--preset", "tiny",
         "--variants", "ours", "--jobs", "1", "--steps", "2", "--warmup", "1",
         "--cache-dir", str(tmp_path / "models"), "--out-dir", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["best_peer"] is None and last["headline"] == "ours"  # the defaults
    assert last["ours_step_s"] > 0
    text = (tmp_path / "results").glob("peer_w1_*.md").__next__().read_text()
    assert "| ours | defaults |" in text
    rows = json.loads(text.split("```json\n")[1].split("\n```")[0])
    assert [r["variant"] for r in rows] == ["ours"]
    assert all(r["steps_timed"] == 2 and r["completion_tokens_per_step"] > 0 for r in rows)
    assert all(r["phases_s"]["train"] > 0 for r in rows)
