"""Stop checks on a step's metrics: the rollout/trainer mismatch alarm and the
non-finite streak.

The controller asks `Guards.check(step, metrics)` after every step and eval;
the answer (None, or the message to abort with) depends only on the metrics,
which are identical on every rank, so every rank stops together. Flags go into
the metrics (mismatch_alarm, nonfinite_in_a_row) so the metrics writer records
them; the writer itself decides nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from hybrid_engine.config import RunConfig

__all__ = ["Guards", "RunAborted"]

log = logging.getLogger("hybrid_engine.train")


class RunAborted(RuntimeError):
    """The run stopped itself (mismatch alarm with mismatch_abort, too many
    non-finite steps in a row). Raised on every rank alike, before the step's
    checkpoint, so the newest checkpoint is a good one."""


class Guards:
    """Args:
        cfg: the run config; its guards section sets the checks.
        newest_checkpoint: names the newest complete checkpoint for the abort
            message (None: the run keeps none).
    """

    def __init__(self, cfg: RunConfig,
                 newest_checkpoint: Callable[[], object] | None = None) -> None:
        self.cfg, self.newest_checkpoint = cfg, newest_checkpoint
        self.nonfinite_in_a_row = 0

    def state_dict(self) -> dict:
        """What a resume needs to go on as the straight run would (the streak)."""
        return {"nonfinite_in_a_row": self.nonfinite_in_a_row}

    def load_state_dict(self, d: dict) -> None:
        self.nonfinite_in_a_row = int(d.get("nonfinite_in_a_row", 0))

    def check(self, step: int, m: dict[str, float]) -> str | None:
        """Flags m; returns why the run must stop now, or None."""
        alarm = self._mismatch_alarm(step, m)
        streak = self._nonfinite_streak(step, m)
        if alarm and self.cfg.guards.mismatch_abort:
            return alarm
        return streak

    def _nonfinite_streak(self, step: int, m: dict[str, float]) -> str | None:
        """Counts steps whose every update the trainer skipped for a NaN/inf loss
        or gradient norm (m["skipped"] > 0 and no optimizer step); the abort
        message once guards.max_nonfinite_in_a_row are in a row. A step with
        some updates skipped and some taken warns and breaks the streak."""
        if "skipped" not in m:
            return None  # an eval row, or a step with nothing to train on
        stalled = m["skipped"] > 0 and m.get("optimizer_steps", 0.0) == 0
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if stalled else 0
        m["nonfinite_in_a_row"] = float(self.nonfinite_in_a_row)
        limit = self.cfg.guards.max_nonfinite_in_a_row
        if not limit or self.nonfinite_in_a_row < limit:
            if stalled:
                log.warning("step %d: non-finite loss or gradient norm (%s): step skipped, "
                            "weights unchanged", step, m.get("grad_norm"))
            elif m["skipped"]:
                log.warning("step %d: %d of its updates had a non-finite loss or gradient "
                            "norm and were skipped", step, int(m["skipped"]))
            return None
        newest = self.newest_checkpoint() if self.newest_checkpoint else None
        return (f"step {step}: {limit} steps in a row had a non-finite loss or gradient norm "
                f"(skipped, weights unchanged); aborting. Newest checkpoint: "
                f"{newest or 'none'}; lower train.lr, check the reward scale, or raise "
                "guards.max_nonfinite_in_a_row")

    def _mismatch_alarm(self, step: int, m: dict[str, float]) -> str | None:
        """The alarm message when the step's rollout/trainer mismatch is over the
        threshold (also flagged as mismatch_alarm = 1; logged even without abort)."""
        # Stale samples: the split's numerics (when it measured tokens), since drift
        # is the policy's own change.
        key = "mismatch_numerics_abs_mean" if m.get("mismatch_split_tokens", 0.0) > 0 else \
            "mismatch_abs_mean"
        limit, value = self.cfg.guards.mismatch_alarm, m.get(key)
        if limit is None or value is None or value <= limit:
            return None
        if m.get("skipped") and not math.isfinite(value):
            return None  # a non-finite trainer forward: the non-finite streak's to judge
        m["mismatch_alarm"] = 1.0
        worst = m.get(key.replace("mean", "max"), float("nan"))
        msg = (f"step {step}: rollout/trainer log-prob mismatch {value:.3g} (mean |diff| on "
               f"sampled tokens, max {worst:.3g}) exceeds "
               f"guards.mismatch_alarm={limit}: the weight sync or the dtypes are likely broken")
        log.warning("%s", msg)
        return msg
