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
under <output_dir>/mlruns unless MLFLOW_TRACKING_URI names another. Where one
needs a server, `check_servers` (preflight, before any engine) asks for a login
(W&B) and an answer from the server, and the start waits at most
log.tracker_timeout_s for each answer (W&B's init_timeout; MLflow's HTTP timeout,
without its retries); a start that fails removes what it wrote in the run folder.

Invariant: only rank 0 builds a `Trackers`; nothing here is collective.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import netrc
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXTERNAL", "OFFLINE", "Trackers", "check_servers", "samples_table"]

log = logging.getLogger(__name__)

EXTERNAL = ("wandb", "mlflow")  # the trackers that are libraries (the `trackers` extra)
_MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE")
_MLFLOW_HTTP = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
# How to log without the tracker's server, for the errors that name it.
OFFLINE = {"wandb": "set WANDB_MODE=offline to log without a server (`wandb sync` uploads "
                    "the run later)",
           "mlflow": "unset MLFLOW_TRACKING_URI to log to the run's own file store "
                     "(<output_dir>/mlruns)"}


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
        timeout_s: the longest wait for each answer of a tracker's server as it
            starts (log.tracker_timeout_s).

    Raises:
        ValueError: a tracker did not start (its library's reason in the message);
            what the start wrote under out is removed first.
    """

    def __init__(self, names: Sequence[str], out: Path, run_name: str,
                 config: Mapping[str, Any], *, resume: bool, timeout_s: float = 30.0) -> None:
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
        before, name = _entries(out), wanted[0]
        values = {k: v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
                  for k, v in config.items()}
        try:
            with _bounded_mlflow_requests(timeout_s):
                for name in wanted:
                    self.active[name], ids[name] = _START[name](out, run_name, ids.get(name),
                                                                timeout_s)
                    self.active[name].store_init_configuration(
                        _unlogged(self.active[name], values) if name == "mlflow" else values)
        except Exception as e:  # the library's own error types
            self.finish()
            _put_back(out, before)
            raise ValueError(_start_error(name, e, timeout_s)) from e
        ids_path.write_text(json.dumps(ids))

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
            _restore_env(self._env)
            self._env = None


def check_servers(names: Sequence[str], timeout_s: float) -> None:
    """What the trackers of `names` need from a network, checked before the engine
    starts: W&B online (WANDB_MODE not offline, dryrun or disabled) needs a login
    (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or `wandb login`'s ~/.netrc entry
    for its host) and an answer from its server (WANDB_BASE_URL); MLflow with an
    http(s) MLFLOW_TRACKING_URI, an answer from that server. Any HTTP answer
    counts (what it says is the library's business at the start). One request
    per server, of at most timeout_s; no write.

    Raises:
        ValueError: naming the tracker's offline mode.
    """
    if "wandb" in names:
        base = _wandb_online_url()
        if base is not None:
            if not _wandb_login(base):
                raise ValueError(f"log.trackers has wandb, but no W&B login was found for {base} "
                                 "(WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc): log in, "
                                 f"or {OFFLINE['wandb']}")
            _check_answers("wandb", base, f"W&B's server {base}", timeout_s)
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in names and uri.split(":", 1)[0].lower() in ("http", "https"):
        shown = re.sub(r"//[^/@]*@", "//", uri)  # no user:password in the message
        _check_answers("mlflow", uri, f"MLFLOW_TRACKING_URI={shown}", timeout_s)


def _wandb_online_url() -> str | None:
    """W&B's server URL as wandb reads it from the environment; None when
    WANDB_MODE needs none."""
    import wandb

    settings = wandb.Settings()
    try:
        settings.update_from_env_vars(dict(os.environ))
    except ValueError as e:  # pydantic's ValidationError: WANDB_MODE, WANDB_BASE_URL, ...
        raise ValueError(f"log.trackers has wandb, which refuses its environment: "
                         f"{_one_line(e)}") from None
    return None if settings.mode in ("offline", "dryrun", "disabled") else str(settings.base_url)


def _wandb_login(base: str) -> bool:
    """Whether wandb will find credentials for the server at base: the environment,
    or the netrc file (NETRC, else ~/.netrc) holding its host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):
        return False
    host = urllib.parse.urlsplit(base)
    return any(entries.authenticators(h) for h in (host.netloc, host.hostname) if h)


def _check_answers(name: str, url: str, what: str, timeout_s: float) -> None:
    """One GET of url; an HTTP answer of any status within timeout_s passes."""
    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()  # noqa: S310 -- the user's URL
    except urllib.error.HTTPError:
        return  # an answer
    except (OSError, ValueError, http.client.HTTPException) as e:  # URLError is an OSError
        reason = getattr(e, "reason", None) or e
        raise ValueError(f"log.trackers has {name}, but {what} did not answer within "
                         f"log.tracker_timeout_s={timeout_s:g} s ({reason}): start it, or "
                         f"{OFFLINE[name]}") from None


def _start_error(name: str, e: Exception, timeout_s: float) -> str:
    """The one-sentence error of a tracker that did not start."""
    reason = _one_line(e).split(" Consider increasing the init_timeout")[0]  # W&B's advice
    server = name == "wandb" or os.environ.get("MLFLOW_TRACKING_URI")  # else a file store
    hint = f"; {OFFLINE[name]}" if server else ""
    bound = f"log.tracker_timeout_s={timeout_s:g} bounds each wait for its server"
    return f"log.trackers: {name} did not start ({bound}{hint}): {type(e).__name__}: {reason}"


def _one_line(e: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(e).split())


@contextlib.contextmanager
def _bounded_mlflow_requests(timeout_s: float) -> Iterator[None]:
    """MLflow's HTTP requests in this block: one try each, of at most timeout_s
    (its defaults, 7 retries of up to 120 s with backoff, cost minutes against a
    server that is down); the environment is put back after."""
    saved = {k: os.environ.get(k) for k in _MLFLOW_HTTP}
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, math.ceil(timeout_s)))  # an int
    try:
        yield
    finally:
        _restore_env(saved)


def _restore_env(saved: Mapping[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _entries(out: Path) -> dict[Path, str | None]:
    """What is in out and in its wandb/ and mlruns/ folders: {path: a link's target}."""
    found = {}
    for folder in (out, out / "wandb", out / "mlruns"):
        if folder.is_dir() and not folder.is_symlink():
            for p in folder.iterdir():
                found[p] = os.readlink(p) if p.is_symlink() else None
    return found


def _put_back(out: Path, before: Mapping[Path, str | None]) -> None:
    """Removes what a failed start added under out (see `_entries`) and points
    W&B's links (latest-run, debug logs) back where they pointed."""
    for p, target in sorted(_entries(out).items()):
        if p not in before:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        elif before[p] is not None and target != before[p]:
            p.unlink(missing_ok=True)
            os.symlink(before[p], p)


def _unlogged(tracker: Any, values: Mapping[str, Any]) -> dict[str, Any]:
    """The params an MLflow run lacks: it refuses to change one, so a resumed run's
    changed values are named in a warning and its first ones stay."""
    logged = tracker.active_run.data.params
    changed = [f"{k} ({logged[k]} -> {v})" for k, v in values.items()
               if k in logged and logged[k] != str(v)]
    if changed:
        log.warning("MLflow keeps a run's first params; changed on resume: %s", ", ".join(changed))
    return {k: v for k, v in values.items() if k not in logged}


def _start_wandb(out: Path, run_name: str, run_id: str | None,
                 timeout_s: float) -> tuple[Any, str]:
    """A W&B run in project WANDB_PROJECT (default hybrid-engine), files under out;
    wandb.init waits at most timeout_s for its server."""
    import wandb
    from accelerate.tracking import WandBTracker

    resume = {"id": run_id, "resume": "allow"} if run_id else {}
    tracker = WandBTracker(os.environ.get("WANDB_PROJECT", "hybrid-engine"), name=run_name,
                           dir=str(out), settings=wandb.Settings(init_timeout=timeout_s),
                           **resume)
    tracker.start()
    return tracker, tracker.run.id


def _start_mlflow(out: Path, run_name: str, run_id: str | None,
                  timeout_s: float) -> tuple[Any, str]:
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default hybrid-engine), in
    MLFLOW_TRACKING_URI or else a file store under out/mlruns (timeout_s: bounded
    by the caller, `_bounded_mlflow_requests`)."""
    import mlflow
    from accelerate.tracking import MLflowTracker

    if not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 asks to opt in
        mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
    tracker = MLflowTracker(experiment_name="hybrid-engine", run_id=run_id, run_name=run_name)
    tracker.start()
    return tracker, tracker.active_run.info.run_id


_START = {"wandb": _start_wandb, "mlflow": _start_mlflow}
