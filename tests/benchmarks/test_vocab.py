"""benchmarks/bench_vocab.py end to end on a small vocabulary: every variant and dtype
timed and measured, the errors against float64, the ratios, the result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vocab.py"


def test_bench_vocab_quick(tmp_path) -> None:
    argv = ["--quick", "--vocab=4096", "--repeats=2", f"--out-dir={tmp_path}"]
    out = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])  # the last stdout line
    assert (summary["vocab"], summary["tokens"], summary["chunk"]) == (4096, 256, 128)
    for dtype, r in summary["results"].items():
        assert r["chunk_fp32_mib"] == pytest.approx(4 * 128 * 4096 / 2**20)
        assert r["floor_s"] > 0
        for name in ("autograd", "fused"):
            v = r[name]
            assert v["s"] > 0 and v["peak_mib"] >= 0 and v["over_floor"] == pytest.approx(v["s"] / r["floor_s"])
            assert v["peak_chunks"] == pytest.approx(v["peak_mib"] / r["chunk_fp32_mib"])
            # Both paths compute the same thing: fp32 to float64's ~1e-6, bf16 to its rounding.
            bound = 1e-5 if dtype == "fp32" else 3e-2
            assert all(0 <= e < bound for e in r["errors"][name].values()), (dtype, name)
        ratio = r["fused_over_autograd_s"]  # the peak's: None where the allocator reused memory
        assert ratio["ratio"] > 0 and 0 < ratio["ci95"][0] <= ratio["ci95"][1]
    text = next(tmp_path.glob("vocab_*_quick.md")).read_text()
    assert "Command: `python benchmarks/bench_vocab.py --quick --vocab=4096" in text
    assert "| fp32 | fused |" in text and "| bf16 | autograd |" in text
    sys.path.insert(0, str(BENCH.parent))
    import report

    row = report.headline({"vocab": summary}).splitlines()[2]
    assert "(`bench_vocab`)" in row and "no headline" not in row and row.endswith("| 1 x 2 |")
