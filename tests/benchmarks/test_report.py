"""benchmarks/report.py's headline table, and the README quoting the newest report verbatim."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import report  # noqa: E402

SYNC = {"model_params": 181e6, "world_size": 2, "tp": 2, "ours_s": 0.2, "naive_s": 1.0,
        "naive_bucketed_s": 0.5, "floor_s": 0.1, "transfer_s": 0.12, "repack_s": 0.07,
        "ours_over_floor_ci": [1.9, 2.1], "best_naive_over_ours_ci": [2.4, 2.6],
        "bytes_received_per_rank": 22.4e6, "naive_bucketed_bytes_received_per_rank": 181e6,
        "jobs": 3, "repeats": 10}


def test_headline_quotes_ratios_with_cis_and_the_faster_naive() -> None:
    table = report.headline({"sync": SYNC})
    row = table.splitlines()[2]
    assert "**2.00x** the floor [1.90, 2.10]" in row
    # the faster naive is the headline baseline, not the weakest one
    assert "the faster naive (naive_bucketed, 0.500 s) is **2.50x** slower [2.40, 2.60]" in row
    assert row.endswith("| 3 x 10 |")


def test_headline_names_what_a_result_lacks() -> None:
    table = report.headline({"sync": {k: v for k, v in SYNC.items() if k != "floor_s"}})
    assert "(no headline: result lacks 'floor_s')" in table


def _dated_reports() -> list[Path]:
    return sorted(p for p in (REPO / "benchmarks" / "results").glob("*.md")
                  if re.fullmatch(r"\d{4}-\d{2}-\d{2}\.md", p.name))


def test_readme_quotes_the_newest_report_verbatim() -> None:
    """The README's benchmark headline is the newest report's headline table, line
    for line, and names that report: no number in it comes from anywhere else."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Benchmarks: the latest report", 1)[1].split("\n### ", 1)[0]
    newest = _dated_reports()[-1]
    assert f"benchmarks/results/{newest.name}" in section, f"README must cite {newest.name}"
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert len(rows) >= 4, "the README's headline table is missing"
    report_lines = set(newest.read_text().splitlines())
    stale = [r for r in rows if r not in report_lines]
    assert not stale, f"README rows not in {newest.name}: {stale}"
