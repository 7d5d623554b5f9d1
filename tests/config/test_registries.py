"""Open registries: a config field that names an estimator, loss or environment
is a str checked against its registry at build time, so a new entry needs no
config edit."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.algorithms.advantages import ADVANTAGES, register_advantage
from hybrid_engine.algorithms.algorithm import Algorithm
from hybrid_engine.config import RunConfig, apply_overrides, check_registered, help_text
from hybrid_engine.trajectory import Trajectory

_NAME = "test_plus_seven"  # registered once per process (a registry refuses repeats)


def _register() -> None:
    if _NAME not in ADVANTAGES:
        register_advantage(_NAME)(lambda rewards_GK: torch.full_like(rewards_GK.float(), 7.0))


def test_a_registered_estimator_needs_no_config_edit() -> None:
    _register()
    cfg = apply_overrides(RunConfig(), {"algorithm.advantage": _NAME,
                                        "rollout.num_samples_per_prompt": 2})
    check_registered(cfg)
    assert _NAME in help_text(cfg)  # --help lists what is registered now
    algo = Algorithm(cfg.algorithm, num_samples=2, max_tokens=4)
    trajs = [Trajectory(prompt_ids=[1], response_ids=[2, 3], loss_mask=[True, True],
                        rollout_logp=[0.0, 0.0], reward=float(i)) for i in range(2)]
    algo.compute_advantages(trajs)
    assert all(t.advantages.tolist() == [7.0, 7.0] for t in trajs)  # the new estimator ran


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("algorithm.advantage", "grop", "algorithm.advantage: unknown advantage estimator 'grop'; "
                                    "did you mean 'grpo'?"),
    ("algorithm.policy_loss", "gpso", "did you mean 'gspo'?"),
    ("algorithm.kl_estimator", "k9", "algorithm.kl_estimator: unknown KL estimator 'k9'"),
    ("env.name", "arithmatic", "env.name: unknown environment 'arithmatic'"),
])
def test_an_unknown_name_is_refused_at_build_time_with_the_closest(key, value, expected) -> None:
    cfg = apply_overrides(RunConfig(), {key: value})  # the config itself stays open
    with pytest.raises(ValueError, match="available: ") as e:
        check_registered(cfg)
    assert str(e.value).startswith(expected) or expected in str(e.value)


def test_help_lists_every_registry() -> None:
    text = help_text(RunConfig())
    line = {row.split("=")[0]: row for row in text.splitlines()}
    assert "Registered: drgrpo, gae, grpo" in line["--algorithm.advantage"]
    assert "gspo, ppo" in line["--algorithm.policy_loss"]
    assert "k1, k2, k3" in line["--algorithm.kl_estimator"]
    assert "arithmetic" in line["--env.name"]
