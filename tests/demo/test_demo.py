"""`hybrid-engine demo --set`: overrides on top of the demo's recipe, bad ones
refused before any rank starts. The demo's run and outputs are checked by
tests/benchmarks/test_learning.py (its runs are demos); the full demo's learning
claim is measured by `make demo` itself (README), not here."""

from __future__ import annotations

import subprocess
import sys


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
    # `train`'s form of an override reaches the demo's config as --set does.
    out = subprocess.run([sys.executable, "-m", "hybrid_engine.cli", "demo",
                          "--model.lora_rank", "-1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error: model.lora_rank must be >= 0" in out.stderr, out.stderr
