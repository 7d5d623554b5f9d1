"""metrics.jsonl survives crashes and full disks: a torn last line is dropped on
resume (else every later --resume would fail with a bare JSON error), a
failed append is undone, and the resume rewrite replaces the file whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_engine.metrics import MetricsSink


def _steps(path: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in path.read_text().splitlines()]


def _run_with_rows(out: Path, steps: range) -> None:
    sink = MetricsSink(out)
    for s in steps:
        sink.write(s, {"reward_mean": float(s)})
    sink.close()


def test_resume_drops_a_torn_last_line(tmp_path) -> None:
    _run_with_rows(tmp_path, range(1, 5))
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 5, "reward_me')  # the crash came mid-append
    sink = MetricsSink(tmp_path, resume=3)  # resuming after step 2's checkpoint
    sink.write(3, {"reward_mean": 3.5})
    sink.close()
    assert _steps(path) == [1, 2, 3]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_bad_line_inside_the_file_is_named(tmp_path) -> None:
    _run_with_rows(tmp_path, range(1, 3))
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\nnot json\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a metrics row: 'not json'"):
        MetricsSink(tmp_path, resume=2)
    assert path.read_text().splitlines()[1] == "not json"  # nothing rewritten


def test_an_append_that_fails_midway_is_undone(tmp_path) -> None:
    """A real short write: the file-size limit (RLIMIT_FSIZE) lets the kernel write
    part of the row, then fails (EFBIG, as ENOSPC does on a full disk)."""
    _run_with_rows(tmp_path, range(1, 3))
    path = tmp_path / "metrics.jsonl"
    before = path.read_bytes()
    code = f"""
import resource, signal
from hybrid_engine.metrics import MetricsSink
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
sink = MetricsSink({str(tmp_path)!r}, resume=3)
resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 10}, resource.RLIM_INFINITY))
try:
    sink.write(3, {{"reward_mean": 3.0, "loss": 1.0}})
except OSError as e:
    print("failed", e.errno)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "failed" in proc.stdout, proc.stdout + proc.stderr
    assert path.read_bytes() == before  # no torn half-row left behind
