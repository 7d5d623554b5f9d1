"""benchmarks/bench_learning.py: its figures on hand-written metrics rows, and one short
real run (two configs and a failing one, one seed, two ranks) with --resume. Its
demo runs are also the test of `hybrid-engine demo`'s outputs: the task's parquet
files, the math and format rewards, metrics, TensorBoard, the plot, the final
policy and the last JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_train_cli import NOISE

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import bench_learning as bl
finally:
    sys.path.pop(0)


def _rows(step_s: list[float], accs: dict[int, float], **extra: float) -> list[dict]:
    """Metrics rows of a run: step i ends at sum(step_s[:i]); evals at the given steps."""
    rows, t = [], 0.0
    for step in range(len(step_s) + 1):
        if step:
            t += step_s[step - 1]
            rows.append({"step": step, "elapsed_s": t, "generate_s": float(step), "train_s": 1.0,
                         **extra})
        if step in accs:
            rows.append({"step": step, "eval/accuracy": accs[step]})
    return rows


def test_run_summary_mean_step_threshold_windows_and_late_phases() -> None:
    walls = [1.0, 3.0] * 5  # alternating steps, mean 2, median 2
    r = bl.run_summary(_rows(walls, {0: 0.3, 4: 0.7, 8: 0.5, 10: 0.8}, staleness_mean=0.5),
                       threshold=0.63, window=4)
    assert r["steps"] == 10 and r["wall_s"] == 20.0 and r["step_s_mean"] == 2.0
    assert r["acc_end"] == 0.8 and r["acc_max"] == 0.8 and r["acc_start"] == 0.3
    assert r["s_to_threshold"] == 8.0  # the first eval >= 0.63, at step 4's end
    assert r["windows"] == [2.0, 2.0]  # whole windows only: steps 1-4, 5-8
    assert r["generate_s"] == 8.0  # the mean of steps 6..10, not of all steps
    assert r["staleness_mean"] == 0.5
    assert bl.run_summary(_rows(walls, {0: 0.3}), 0.9, 1)["s_to_threshold"] is None


def test_a_tool_tasks_runs_report_the_tool_call_rate_and_the_gain() -> None:
    rows = _rows([1.0] * 4, {0: 0.2, 4: 0.9})
    rows[0]["eval/tool/calls"], rows[-1]["eval/tool/calls"] = 0.3, 1.0
    r = bl.run_summary(rows, threshold=0.5, window=2)
    assert (r["calls_start"], r["calls_end"]) == (0.3, 1.0)
    assert r["calls_curve"] == [(0, 0.3), (4, 1.0)] and r["gain_points"] == pytest.approx(70)
    c = bl.config_summary({0: r, 1: bl.run_summary(_rows([1.0] * 4, {0: 0.5, 4: 0.6}), 0.5, 2)},
                          None)
    assert c["gain_points_mean"] == pytest.approx(40) and c["gain_points_min"] == pytest.approx(10)
    args = bl.argparse.Namespace(task="tools", nproc=2, cache_dir="c", steps=3, minutes=1.0,
                                 warm_start_steps=None, overrides=[])
    assert "--task=tools" in bl.demo_command(args, bl.Config("t"), 0, Path("o"))


def test_config_summary_compares_seed_by_seed_with_the_baseline() -> None:
    def run(step: float, acc: float) -> dict:
        return bl.run_summary(_rows([step] * 20, {0: 0.3, 20: acc}), 0.63, 10)

    base = {0: run(1.0, 0.60), 1: run(2.0, 0.70)}
    fast = {0: run(0.5, 0.62), 1: run(1.0, 0.66), 2: run(9.0, 0.9)}  # seed 2: no baseline
    c = bl.config_summary(fast, base)
    assert c["step_over_baseline"] == pytest.approx(0.5)  # (0.5 + 1) / (1 + 2)
    assert c["step_over_baseline_per_seed"] == [0.5, 0.5]
    lo, hi = c["step_over_baseline_ci"]
    assert lo <= 0.5 <= hi and hi < 1
    assert c["acc_end_minus_baseline_per_seed"] == pytest.approx([0.02, -0.04])
    assert c["reached_threshold"] == 2 and c["acc_end_sd"] > 0
    assert "step_over_baseline" not in bl.config_summary(base, None)


def test_parse_config_and_bad_configs_fail_in_one_line() -> None:
    c = bl.parse_config("k1:async_rollout.max_staleness=1+algorithm.behaviour_logp=rollout")
    assert c.name == "k1" and c.overrides == ["async_rollout.max_staleness=1",
                                              "algorithm.behaviour_logp=rollout"]
    assert bl.parse_config("k0").overrides == []
    for bad in ("k1:async_rollout.max_staleness", ":a=1", "a=1"):
        with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
            bl.parse_config(bad)
    out = subprocess.run([sys.executable, "benchmarks/bench_learning.py", "--configs", "a", "a"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "config names must differ" in out.stderr


def _check_demo_outputs(out: Path, summary: dict, cache: Path) -> None:
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert 0 < summary["step_s_median"] < summary["wall_s"]
    assert summary["acc_start"] is not None and summary["acc_end"] is not None
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]
    assert {"reward/math", "reward/format"} <= rows[1].keys()  # the math + format rewards
    assert len(list(cache.glob("task-*/t*.parquet"))) == 2  # the train and test files
    assert "eval/accuracy" in rows[-1] and rows[-1]["step"] == 2  # the final policy is evaluated
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "metrics.png").stat().st_size > 0
    assert (out / "final" / "COMPLETE").is_file()
    # A samples table every 2 steps: the chat-templated prompt, each reward component.
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in samples}) == [2] and len(samples) == 8
    assert samples[0]["prompt"].startswith("<|im_start|>user\n")
    assert {"reward/math", "reward/format", "advantage"} <= samples[0].keys()


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_learning_runs_the_demo_per_seed_and_config_and_resumes(tmp_path) -> None:
    runs = tmp_path / "runs"
    cmd = [sys.executable, "benchmarks/bench_learning.py", "--seeds", "3", "--steps", "2",
           "--warm-start-steps", "2", "--nproc", "2", "--window", "1", "--minutes", "3",
           "--threshold", "0", "--tag", "_t", "--note", "a note",
           f"--runs-dir={runs}", f"--cache-dir={tmp_path / 'cache'}",
           f"--out-dir={tmp_path / 'out'}", "--set", "eval.every=2",
           "--set", "eval.num_prompts=16", "--set", "log.samples_every=2", "--configs", "base",
           "k1:async_rollout.max_staleness=1+algorithm.behaviour_logp=rollout",
           "bad:async_rollout.max_staleness=-1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # 'bad' failed
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == ["bad-s3"] and "max_staleness" in (runs / "bad-s3.log").read_text()
    base, k1 = result["configs"]["base"], result["configs"]["k1"]
    assert base["staleness_mean"] == 0 and k1["staleness_mean"] > 0  # its overrides applied
    assert base["seeds"] == k1["seeds"] == [3]
    assert "step_over_baseline_ci" in k1  # --window 1: two whole windows of 2 steps (10: none)
    assert k1["reached_threshold"] == 1  # --threshold 0: reached at the first eval
    assert "warm start: 2 steps" in (runs / "base-s3.log").read_text()  # --warm-start-steps
    assert "warm start: cache hit" in (runs / "k1-s3.log").read_text()  # the demo's cache
    assert k1["step_over_baseline_per_seed"][0] == pytest.approx(
        k1["step_s_mean"] / base["step_s_mean"])
    for name in ("base", "k1"):
        cfg = yaml.safe_load((runs / f"{name}-s3" / "config.yaml").read_text())
        assert cfg["seed"] == 3 and cfg["rollout"]["seed"] == 3  # the seed, for every run
        assert cfg["eval"]["every"] == 2 and cfg["train"]["num_steps"] == 2  # --set, --steps
        assert cfg["rollout"]["tensor_parallel_size"] == 2  # --nproc
        assert cfg["max_wall_s"] == 180  # --minutes
    _check_demo_outputs(runs / "base-s3", json.loads((runs / "base-s3.json").read_text()),
                        tmp_path / "cache")
    log = (runs / "base-s3.log").read_text()  # the demo's console, warm start included
    assert not NOISE.findall(log), log[-3000:]
    report = Path(result["report"])
    assert report.name.startswith("learning_cpu_t_") and report.with_suffix(".png").is_file()
    assert "| k1 | 3 | 2 |" in report.read_text() and "a note" in report.read_text()
    # --resume reads the finished runs (no new log) and reruns only what failed.
    stamp = (runs / "k1-s3.log").stat().st_mtime_ns
    again = subprocess.run([*cmd[:-1], "--resume"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (runs / "k1-s3.log").stat().st_mtime_ns == stamp
    rerun = json.loads(again.stdout.strip().splitlines()[-1])["configs"]["k1"]
    assert rerun["step_s_mean"] == k1["step_s_mean"]
