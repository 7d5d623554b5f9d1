"""benchmarks/compare_runs.py on hand-written metrics.jsonl files: the figures it
reports (accuracy gain, step cost, updates, clip fraction, critic value loss)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _write(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True)
    lines = [json.dumps(r) for r in rows] + ['{"step": 9, "torn']  # a torn last line
    (folder / "metrics.jsonl").write_text("\n".join(lines))


def test_compare_runs_reports_gain_cost_updates_and_critic(tmp_path) -> None:
    plain = [{"step": 0, "eval/accuracy": 0.25}]
    plain += [{"step": s, "elapsed_s": 2.0 * s, "train_s": 1.5, "skipped_degenerate": 0.0,
               "clip_frac": 0.0, "ppo_kl": 0.0} for s in range(1, 11)]
    plain.append({"step": 10, "eval/accuracy": 0.5})  # the final eval: no elapsed_s
    critic = [{**r, "optimizer_steps": 2.0, "clip_frac": 0.1, "critic/vf_clip_frac": 0.5,
               "critic/vf_loss": 1.0 if r["step"] == 1 else 0.2} for r in plain if r["step"]]
    critic = [plain[0], *critic]
    _write(tmp_path / "a", plain)
    _write(tmp_path / "b", critic)
    out = subprocess.run(
        [sys.executable, "benchmarks/compare_runs.py", f"--run=plain=x={tmp_path / 'a'}",
         f"--run=critic={tmp_path / 'b'}", f"--out-dir={tmp_path / 'out'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    a, b = result["runs"]["plain=x"], result["runs"]["critic"]
    assert a["gain_points"] == 25.0 and a["steps"] == 10 and a["median_step_s"] == 2.0
    assert a["optimizer_steps"] == 1.0 and a["vf_loss_first"] is None
    assert b["optimizer_steps"] == 2.0 and b["clip_frac"] == 0.1
    assert b["vf_loss_first"] == 1.0 and b["vf_loss_last"] == 0.2  # first / last tenth
    assert "| plain=x | 10 |" in out.stdout
    report = Path(result["report"])
    assert report.is_file() and report.with_suffix(".png").is_file()
    assert "0:0.250 10:0.500" in report.read_text()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compare_runs
    finally:
        sys.path.pop(0)
    curve = compare_runs.summarize(compare_runs.load(tmp_path / "a"))["curve"]
    assert curve == [(0, 0.25, 0.0), (10, 0.5, 20.0)]  # the final eval at its step's time
