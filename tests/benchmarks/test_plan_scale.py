"""benchmarks/plan_scale.py: its quick run end to end, and docs/scale.md holds the table of
the committed result file (both written by one run of the script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import plan_scale  # noqa: E402


def test_plan_scale_quick_runs_the_command(tmp_path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{plan_scale.MARKERS[0]}\nold\n{plan_scale.MARKERS[1]}\nafter\n")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plan_scale.py"), "--quick",
                           f"--out-dir={tmp_path}", f"--docs={doc}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("| model | ranks (nodes x GPUs) |")
    rows = json.loads(lines[-1])["rows"]
    assert [(r["model"], r["train_tp"]) for r in rows] == [("qwen2.5-7b", 1), ("qwen2.5-7b", 4)]
    result = (tmp_path / "plan_scale_quick.md").read_text()
    assert "| qwen2.5-7b (7.6B) | 8 (1 x 8) | 4 | full |" in result
    assert "| qwen2.5-7b (7.6B) | 8 (1 x 8) | 4 | full + training TP 4 |" in result
    assert "old" in doc.read_text()  # --quick writes no docs
    plan_scale.write_docs(doc, "new\n")
    assert doc.read_text() == f"before\n{plan_scale.MARKERS[0]}\nnew\n{plan_scale.MARKERS[1]}\nafter\n"


def test_scale_doc_holds_the_committed_table() -> None:
    doc = (REPO / "docs" / "scale.md").read_text()
    table = doc.split(plan_scale.MARKERS[0] + "\n")[1].split(plan_scale.MARKERS[1])[0]
    # per shape: full and training TP, and hybrid past one node
    assert table.count("\n") == 2 + sum(2 if nodes == 1 else 3
                                        for _, nodes, _, _ in plan_scale.SHAPES)
    assert table in (REPO / "benchmarks" / "results" / "plan_scale.md").read_text()
