"""Sample tables and the experiment trackers (W&B, MLflow).

Job: `samples_table` turns a step's first samples into a table (prompt,
completion, reward and each of its components, advantage, length, policy
version); `Trackers` starts the trackers `log.trackers` names beyond the run
folder's own files, gives them the run name and the resolved config, then each
step's metrics and each samples table, and finishes them.

The trackers are accelerate's tracking classes (`WandBTracker`,
`MLflowTracker`), used directly rather than through an `Accelerator`. Where that
API falls short, the libraries are called directly: accelerate has no MLflow
table (`mlflow.log_table` appends each table to the run's `samples.json`), and
MLflow refuses '@' in metric names (`eval/pass@4` goes there as
`eval/pass_at_4`). Their run ids are kept in the run folder (`trackers.json`),
so a resumed run logs into the same W&B and MLflow runs.

No network is needed: W&B follows WANDB_MODE (`offline` writes under
<output_dir>/wandb, for `wandb sync` later), and MLflow writes a file store
under <output_dir>/mlruns unless MLFLOW_TRACKING_URI names another.

Invariant: only rank 0 builds a `Trackers`; nothing here is collective.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXTERNAL", "Trackers", "samples_table"]

log = logging.getLogger(__name__)

EXTERNAL = ("wandb", "mlflow")  # the trackers that are libraries (the `trackers` extra)
_MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE")


def samples_table(step: int, trajs: Sequence[Any], decode: Callable[[list[int]], str],
                  rows: int) -> tuple[list[str], list[list]]:
    """(columns, rows) of the step's first `rows` samples, in the order sampled
    (a prompt group's samples are adjacent). Columns: step, group, prompt,
    completion (decoded with special tokens: what the model saw and wrote),
    reward, reward/<component> for every component, advantage (the mean over the
    sampled tokens; None before the algorithm sets it), length (sampled tokens)
    and policy_version."""
    chosen = list(trajs[:rows])
    components = sorted({k for t in chosen for k in t.reward_components})
    columns = ["step", "group", "prompt", "completion", "reward",
               *(f"reward/{k}" for k in components), "advantage", "length", "policy_version"]
    table = []
    for t in chosen:
        mask = t.loss_mask if t.loss_mask is not None else [True] * len(t.response_ids)
        sampled = [float(a) for a, m in zip(t.advantages, mask) if m] \
            if t.advantages is not None else []
        table.append([step, t.group_id, decode(list(t.prompt_ids)), decode(list(t.response_ids)),
                      float(t.reward), *(t.reward_components.get(k) for k in components),
                      sum(sampled) / len(sampled) if sampled else None, int(sum(mask)),
                      t.policy_version])
    return columns, table


def _mlflow_key(key: str) -> str:
    """A metric name MLflow accepts: '@' -> '_at_', other refused characters -> '_'."""
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"))


class Trackers:
    """The external trackers of `names` (those in EXTERNAL; others are ignored).

    Args:
        names: log.trackers.
        out: the run folder (W&B files, the MLflow file store, trackers.json).
        run_name: the run's name in each tracker.
        config: the resolved config, flat ({dotted key: value}).
        resume: continue the runs recorded in out/trackers.json, if any.

    Raises:
        ValueError: a tracker did not start (its library's reason in the message).
    """

    def __init__(self, names: Sequence[str], out: Path, run_name: str,
                 config: Mapping[str, Any], *, resume: bool) -> None:
        self.out, self.active = out, {}
        wanted = [n for n in names if n in EXTERNAL]
        if not wanted:
            return
        ids_path = out / "trackers.json"
        ids = json.loads(ids_path.read_text()) if resume and ids_path.is_file() else {}
        from accelerate.state import PartialState

        PartialState()  # accelerate's trackers log through its logger, which needs it
        # MLflow's store is set for this run only (set_tracking_uri also exports
        # MLFLOW_TRACKING_URI): `finish` puts the environment back as it was.
        self._env = ({k: os.environ.get(k) for k in _MLFLOW_ENV}
                     if "mlflow" in wanted and not os.environ.get("MLFLOW_TRACKING_URI") else None)
        for name in wanted:
            try:
                self.active[name], ids[name] = _START[name](out, run_name, ids.get(name))
            except Exception as e:  # the library's own error types
                self.finish()
                hint = " (no network: set WANDB_MODE=offline)" if name == "wandb" else ""
                raise ValueError(f"log.trackers: {name} did not start{hint}: "
                                 f"{type(e).__name__}: {e}") from e
        ids_path.write_text(json.dumps(ids))
        values = {k: v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
                  for k, v in config.items()}
        for name, tracker in self.active.items():
            tracker.store_init_configuration(_unlogged(tracker, values) if name == "mlflow"
                                             else values)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, tracker in self.active.items():
            if name == "mlflow":
                tracker.log({_mlflow_key(k): v for k, v in metrics.items()}, step=step)
            else:
                tracker.log(dict(metrics), step=step)

    def table(self, step: int, columns: list[str], rows: list[list]) -> None:
        """A samples table: W&B's `samples_table` at the step, and the rows appended
        to MLflow's samples.json artifact."""
        if "wandb" in self.active:
            self.active["wandb"].log_table("samples_table", columns=columns, data=rows, step=step)
        if "mlflow" in self.active:
            import mlflow

            mlflow.log_table({c: [r[i] for r in rows] for i, c in enumerate(columns)},
                             artifact_file="samples.json",
                             run_id=self.active["mlflow"].active_run.info.run_id)

    def finish(self) -> None:
        for tracker in self.active.values():
            tracker.finish()
        self.active = {}
        if getattr(self, "_env", None) is not None:
            import mlflow

            mlflow.set_tracking_uri(None)  # the module's store, and its variable
            for key, value in self._env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._env = None


def _unlogged(tracker: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """The params an MLflow run lacks: it refuses to change one, so a resumed run's
    changed values are named in a warning and its first ones stay."""
    logged = tracker.active_run.data.params
    changed = [f"{k} ({logged[k]} -> {v})" for k, v in values.items()
               if k in logged and logged[k] != str(v)]
    if changed:
        log.warning("MLflow keeps a run's first params; changed on resume: %s", ", ".join(changed))
    return {k: v for k, v in values.items() if k not in logged}


def _start_wandb(out: Path, run_name: str, run_id: str | None) -> tuple[Any, str]:
    """A W&B run in project WANDB_PROJECT (default hybrid-engine), files under out."""
    from accelerate.tracking import WandBTracker

    resume = {"id": run_id, "resume": "allow"} if run_id else {}
    tracker = WandBTracker(os.environ.get("WANDB_PROJECT", "hybrid-engine"), name=run_name,
                           dir=str(out), **resume)
    tracker.start()
    return tracker, tracker.run.id


def _start_mlflow(out: Path, run_name: str, run_id: str | None) -> tuple[Any, str]:
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default hybrid-engine), in
    MLFLOW_TRACKING_URI or else a file store under out/mlruns."""
    import mlflow
    from accelerate.tracking import MLflowTracker

    if not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 asks to opt in
        mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
    tracker = MLflowTracker(experiment_name="hybrid-engine", run_id=run_id, run_name=run_name)
    tracker.start()
    return tracker, tracker.active_run.info.run_id


_START = {"wandb": _start_wandb, "mlflow": _start_mlflow}
