"""benchmarks/bench_kernels.py --quick end to end: every workload on every device,
byte counts that match the workload geometry, positive times, the result file."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"
WORKLOADS = ("pack", "unpack_rows", "unpack_cols", "copy_fp32")


def _quick_geometry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The script's own geometry(quick=True): its sizes, not its byte counts."""
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module.geometry(quick=True)


def _per_layer(geo: dict) -> dict[str, tuple[int, int]]:
    """(blocks, bytes read + written) per layer of each sync workload, from the
    layer shapes: TP rank 1 of 2 gets half the rows of q/k/v (weights and
    biases), gate and up; half the columns of o and down; both norms whole."""
    h, kv, i = geo["hidden"], geo["kv_dim"], geo["intermediate"]
    col = h * h // 2 + h // 2 + 2 * (kv * h // 2 + kv // 2) + 2 * (i * h // 2)
    row = h * h // 2 + h * i // 2
    rep = 2 * h
    return {"pack": (12, (col + row + rep) * (4 + 2)),   # fp32 -> bf16
            "unpack_rows": (10, (col + rep) * (2 + 2)),  # bf16 -> bf16
            "unpack_cols": (2, row * (2 + 2))}


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs the benchmark; on the deadline it is killed (it starts no children)."""
    try:
        return subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench_kernels --quick did not finish within {timeout:.0f} s")


def test_bench_kernels_quick(tmp_path, monkeypatch) -> None:
    out = _run(["--quick", "--jobs=2", "--repeats=3", f"--out-dir={tmp_path}"], timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])  # the last stdout line
    assert {"devices", "torch_threads", "geometry", "results"} <= summary.keys()
    assert (summary["jobs"], summary["repeats"]) == (2, 3)
    assert summary["devices"] == ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    assert summary["torch_threads"] >= 1
    geo = _quick_geometry(monkeypatch)
    assert summary["geometry"] == geo
    expected = {"copy_fp32": (1, geo["copy_elems"] * (4 + 4))}
    for name, (blocks, nbytes) in _per_layer(geo).items():
        layers = geo["layers"][name]  # the fewest that move min_bytes
        assert nbytes * layers >= geo["min_bytes"] > nbytes * (layers - 1), name
        expected[name] = (blocks * layers, nbytes * layers)
    assert all(16e6 <= b <= 40e6 for _, b in expected.values())  # quick: 16-40 MB each
    for device in summary["devices"]:
        rows = summary["results"][device]
        assert set(rows) == set(WORKLOADS)
        for name, (blocks, nbytes) in expected.items():
            r = rows[name]
            assert (r["blocks"], r["bytes"]) == (blocks, nbytes), name
            for k in ("kernel_s", "copy_s", "ref_s", "kernel_best_s", "copy_best_s", "ref_best_s"):
                assert r[k] > 0, (name, k)
            assert r["kernel_gbps"] == pytest.approx(nbytes / r["kernel_s"] / 1e9)
            assert r["copy_gbps"] == pytest.approx(nbytes / r["copy_s"] / 1e9)
            assert r["kernel_over_copy"] == pytest.approx(r["copy_s"] / r["kernel_s"])
            assert (r["jobs"], r["rounds"]) == (2, 6)  # every round of both fresh jobs
            lo, hi = r["kernel_over_copy_ci"]
            assert 0 < lo <= hi
            assert r["kernel_iqr_s"] >= 0 and r["kernel_best_s"] <= r["kernel_s"]
    files = list(tmp_path.glob("kernels_*_quick.md"))
    assert len(files) == 1
    text = files[0].read_text()
    assert "Command: `python benchmarks/bench_kernels.py --quick" in text
    assert "torch.get_num_threads()" in text and "Floor:" in text
    assert "| device | workload | dtypes | blocks |" in text
    blocks, _ = expected["pack"]
    assert f"| cpu | pack | float32->bfloat16 | {blocks} |" in text
