"""`hybrid-engine demo` plumbing on a fresh folder, shortened: the task's parquet
files, the warm start, GRPO on 2 ranks with the math and format
rewards, every output and the final JSON line. The full demo's
learning claim is measured by `make demo` itself (README), not here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _demo(tmp_path, out: str) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "hybrid_engine.cli", "demo", f"--output-dir={tmp_path / out}",
           f"--cache-dir={tmp_path / 'cache'}", "--warm-start-steps=5", "--steps=2",
           "--minutes=3", "--set=env.num_eval_prompts=32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), text


def test_demo_outputs(tmp_path) -> None:
    first, log1 = _demo(tmp_path, "a")
    assert {"acc_start", "acc_end", "steps", "wall_s", "output_dir"} <= first.keys()
    assert first["steps"] == 2 and first["world_size"] == 2
    assert 0 < first["step_s_median"] < first["wall_s"]
    out = tmp_path / "a"
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]
    assert {"reward/math", "reward/format"} <= rows[1].keys()  # the math + format rewards
    assert len(list((tmp_path / "cache").glob("task-*/t*.parquet"))) == 2  # train and test files
    assert "eval/accuracy" in rows[-1] and rows[-1]["step"] == 2  # the final policy is evaluated
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "metrics.png").stat().st_size > 0
    assert (out / "final" / "COMPLETE").is_file()
    assert "warm start: 5 steps" in log1  # a cache hit: tests/demo/test_warmstart.py


def test_demo_set_overrides_apply_on_top_of_the_recipe_and_bad_ones_fail_early() -> None:
    from hybrid_engine.demo import demo_config

    data = ("t/train.parquet", "t/test.parquet")
    cfg = demo_config("m", "out", world=2, minutes=1.0, steps=5, data=data,
                      overrides=["train.ppo_epochs=2", "train.mini_batches_per_rollout=2"])
    assert (cfg.train.ppo_epochs, cfg.train.mini_batches_per_rollout) == (2, 2)
    assert cfg.train.num_steps == 5 and cfg.model.path == "m"  # the demo's own values stay
    assert (cfg.env.dataset_path, cfg.env.eval_dataset_path) == data
    assert demo_config("m", "out", world=2, minutes=1.0, steps=5, data=data).train.ppo_epochs == 1
    out = subprocess.run([sys.executable, "-m", "hybrid_engine.cli", "demo",
                          "--set", "train.ppo_epoch=2"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "error:" in out.stderr and "ppo_epochs" in out.stderr
    assert "Traceback" not in out.stderr
