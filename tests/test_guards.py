"""The controller's stop checks on metrics (pure: no engine, no ranks)."""

from __future__ import annotations

import json

from hybrid_engine.config import RunConfig, apply_overrides
from hybrid_engine.guards import Guards


def _cfg(**overrides: object) -> RunConfig:
    """A RunConfig with these keys of the guards section."""
    return apply_overrides(RunConfig(), {f"guards.{k}": v for k, v in overrides.items()})


def test_mismatch_alarm_flags_always_and_aborts_only_when_asked() -> None:
    m = {"mismatch_abs_mean": 0.5, "mismatch_abs_max": 2.0}
    warn = Guards(_cfg(mismatch_alarm=0.1))
    assert warn.check(3, m) is None and m["mismatch_alarm"] == 1.0
    stop = Guards(_cfg(mismatch_alarm=0.1, mismatch_abort=True))
    msg = stop.check(3, dict(m))
    assert msg is not None and msg.startswith("step 3: rollout/trainer log-prob mismatch 0.5")
    quiet = {"mismatch_abs_mean": 0.05}
    assert stop.check(4, quiet) is None and "mismatch_alarm" not in quiet


def test_with_stale_samples_the_alarm_watches_the_numerics_not_the_drift() -> None:
    stop = Guards(_cfg(mismatch_alarm=0.1, mismatch_abort=True))
    drifted = {"mismatch_abs_mean": 0.5, "mismatch_numerics_abs_mean": 1e-6,
               "mismatch_numerics_abs_max": 1e-5, "mismatch_split_tokens": 40.0}
    assert stop.check(3, drifted) is None and "mismatch_alarm" not in drifted
    broken = {"mismatch_abs_mean": 0.5, "mismatch_numerics_abs_mean": 0.4,
              "mismatch_numerics_abs_max": 3.0, "mismatch_split_tokens": 40.0}
    assert "mismatch 0.4 (mean |diff| on sampled tokens, max 3)" in stop.check(4, broken)
    # A split that measured no tokens (its sample had none) says nothing: the total counts.
    empty = {"mismatch_abs_mean": 0.5, "mismatch_abs_max": 2.0,
             "mismatch_numerics_abs_mean": 0.0, "mismatch_split_tokens": 0.0}
    assert "mismatch 0.5 (mean |diff| on sampled tokens, max 2)" in stop.check(5, empty)


def test_nonfinite_streak_counts_resets_and_aborts_at_the_limit() -> None:
    g = Guards(_cfg(max_nonfinite_in_a_row=2), lambda: "ckpt/step_00000003")
    rows = [{"skipped": 1.0}, {"skipped": 0.0}, {"skipped": 1.0}, {"eval/accuracy": 0.5},
            {"skipped": 1.0}]
    answers = [g.check(i, r) for i, r in enumerate(rows, 1)]
    assert [r.get("nonfinite_in_a_row") for r in rows] == [1.0, 0.0, 1.0, None, 2.0]
    assert answers[:4] == [None] * 4
    assert "step 5: 2 steps in a row" in answers[4] and "ckpt/step_00000003" in answers[4]
    unlimited = Guards(_cfg(max_nonfinite_in_a_row=0))
    assert all(unlimited.check(i, {"skipped": 1.0}) is None for i in range(10))


def test_a_step_counts_toward_the_streak_only_when_no_update_was_taken() -> None:
    """Four updates, one skipped: the weights moved, so the streak breaks."""
    g = Guards(_cfg(max_nonfinite_in_a_row=2))
    rows = [{"skipped": 4.0, "optimizer_steps": 0.0}, {"skipped": 1.0, "optimizer_steps": 3.0},
            {"skipped": 4.0, "optimizer_steps": 0.0}]
    assert [g.check(i, r) for i, r in enumerate(rows, 1)] == [None] * 3
    assert [r["nonfinite_in_a_row"] for r in rows] == [1.0, 0.0, 1.0]


def test_the_streak_survives_a_resume() -> None:
    """A run resumed after 2 skipped steps aborts at the same step as the straight run."""
    cfg = _cfg(max_nonfinite_in_a_row=3)
    straight = Guards(cfg)
    assert [straight.check(i, {"skipped": 1.0}) is None for i in (1, 2, 3)] == [True, True, False]
    first = Guards(cfg)
    first.check(1, {"skipped": 1.0})
    first.check(2, {"skipped": 1.0})
    resumed = Guards(cfg)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert "step 3: 3 steps in a row" in resumed.check(3, {"skipped": 1.0})
    fresh = Guards(cfg)
    fresh.load_state_dict({})  # a checkpoint from before the streak was saved
    assert fresh.nonfinite_in_a_row == 0


def test_a_nan_mismatch_on_a_skipped_step_is_left_to_the_nonfinite_streak() -> None:
    """A NaN trainer forward makes the mismatch NaN too; the step is skipped, and the
    non-finite streak (not the weight-sync alarm) decides whether to stop."""
    g = Guards(_cfg(mismatch_abort=True, max_nonfinite_in_a_row=3))
    row = {"skipped": 1.0, "mismatch_abs_mean": float("nan")}
    assert g.check(1, row) is None and "mismatch_alarm" not in row
    assert "exceeds" in g.check(2, {"skipped": 0.0, "mismatch_abs_mean": float("nan")})
