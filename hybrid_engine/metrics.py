"""Per-step metrics: phase timing and memory, rollout statistics, and where they go.

Job: `PhaseTimer` measures seconds (wall, and the rank's user and system CPU
time) and memory of each phase of a step (generate, score, train, sync, eval); `trajectory_metrics` summarises a
step's samples (reward, accuracy, lengths); `MetricsSink` writes each step to
the log line and the trackers (`metrics.jsonl`, TensorBoard, W&B, MLflow; with
a samples table every log.samples_every steps), rank 0 only, and
`plot_metrics` draws reward, accuracy and the evaluation's curves over steps to a PNG.

Memory per phase: what the machine sees in use at the end of the phase. On
CPU the process RSS (vLLM's KV cache and weights included); on CUDA the
device's used memory (`mem_get_info`: total - free, every process on the
device), since torch's allocator statistics still count vLLM's sleeping pool
after level-2 sleep has unmapped it (measured on an H200: 41.6 GiB "allocated"
in the train phase right after sleep freed 41.5 GiB).

Invariant: only rank 0 writes files; every rank may call everything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_engine.config import LogConfig
from hybrid_engine.parallel import watchdog

__all__ = ["MetricsSink", "PhaseTimer", "SampleFile", "append_whole", "keep_rows_before",
           "plot_curves", "plot_metrics", "staleness_metrics", "trajectory_metrics"]

log = logging.getLogger("hybrid_engine.train")

# Keys of the one-line step log, in order, with their format.
_LINE_KEYS = (
    ("reward_mean", "reward {:.3f}"), ("accuracy", "acc {:.3f}"), ("eval/accuracy", "eval_acc {:.3f}"),
    ("kl", "kl {:.4f}"), ("entropy", "ent {:.3f}"), ("clip_frac", "clip {:.3f}"),
    ("grad_norm", "gnorm {:.3f}"), ("mismatch_abs_mean", "mis {:.1e}"),
    ("response_len_mean", "len {:.1f}"), ("gen_tok_s", "gen tok/s {:.0f}"),
)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _memory_bytes() -> float:
    """Bytes in use now: the device's used memory on CUDA, else this process's RSS."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return float(total - free)
    import psutil

    return float(psutil.Process().memory_info().rss)


def _cpu_times() -> tuple[float, float]:
    """(user, system) CPU seconds of this process, all its threads (vLLM's included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


class PhaseTimer:
    """Collects, for the phases of one step, `<phase>_s` (wall), `<phase>_user_s` and
    `<phase>_sys_s` (this rank's CPU time in user and kernel mode: system time is
    mostly page faults, i.e. memory being mapped or first touched) and
    `mem_<phase>_bytes`."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0, (u0, s0) = time.perf_counter(), _cpu_times()
        with watchdog.phase(name):  # names the phase if a peer goes silent here
            yield
        (u1, s1), m = _cpu_times(), self.metrics
        for key, dt in ((f"{name}_s", time.perf_counter() - t0), (f"{name}_user_s", u1 - u0),
                        (f"{name}_sys_s", s1 - s0)):
            m[key] = m.get(key, 0.0) + dt
        self.metrics[f"mem_{name}_bytes"] = _memory_bytes()


def trajectory_metrics(trajs: Sequence[Any]) -> dict[str, float]:
    """Reward mean/std, accuracy (mean of the "correct" component when the
    environment gives one), response length, each reward component's mean,
    reward/timeouts (reward calls killed at their timeout, a count),
    reward/unparsed (a judge's replies without a score, a count),
    prompts_truncated (prompts the rollout cut to fit max_model_len) and, for a
    chat environment's episodes, the tool metrics (`_tool_metrics`)."""
    n = max(len(trajs), 1)
    rewards = [t.reward for t in trajs]
    mean = sum(rewards) / n
    out = {
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "response_len_mean": sum(sum(t.loss_mask) for t in trajs) / n,
        "samples": float(len(trajs)),
        "prompts_truncated": float(len({t.group_id for t in trajs
                                        if "source_prompt_ids" in t.info})),
    }
    keys = sorted({k for t in trajs for k in t.reward_components})
    for k in keys:
        out[f"reward/{k}"] = sum(t.reward_components.get(k, 0.0) for t in trajs) / n
    if any("reward_timeouts" in t.info for t in trajs):
        out["reward/timeouts"] = float(sum(t.info.get("reward_timeouts", 0) for t in trajs))
    if any("reward_unparsed" in t.info for t in trajs):  # a judge's replies without a score
        out["reward/unparsed"] = float(sum(t.info.get("reward_unparsed", 0) for t in trajs))
    if any("num_tool_calls" in t.info for t in trajs):  # a chat environment's episodes
        out.update(_tool_metrics(trajs))
    # A reward-model environment keeps the task's correctness in info (not in the reward).
    correct = [t.info.get("correct", t.reward_components.get("correct")) for t in trajs]
    if trajs and all(c is not None for c in correct):
        out["accuracy"] = sum(float(c) for c in correct) / n
    return out


TOOL_METRICS = ("tool/calls", "tool/errors", "tool/timeouts", "turns_mean",
                "observation_tokens_mean", "over_budget")
"""What `trajectory_metrics` adds for a chat environment's episodes."""


def _tool_metrics(trajs: Sequence[Any]) -> dict[str, float]:
    """tool/calls, tool/errors, tool/timeouts (per episode), turns per episode,
    observation tokens per episode, and the share of episodes cut by their budget."""
    n = max(len(trajs), 1)

    def mean(key: str) -> float:
        return sum(float(t.info.get(key, 0)) for t in trajs) / n

    out = {"tool/calls": mean("num_tool_calls"), "tool/errors": mean("num_tool_errors"),
           "tool/timeouts": mean("num_tool_timeouts"), "turns_mean": mean("num_turns"),
           "observation_tokens_mean": mean("observation_tokens"),
           "over_budget": mean("over_budget")}
    return out


def staleness_metrics(trajs: Sequence[Any], step: int, k: int) -> dict[str, float]:
    """staleness_mean / _max over the step's samples (step - policy_version) and,
    with k > 0, the fraction at each staleness 0..k (staleness/<d>)."""
    st = [step - t.policy_version for t in trajs] or [0]
    out = {"staleness_mean": sum(st) / len(st), "staleness_max": float(max(st))}
    if k:
        out.update({f"staleness/{d}": st.count(d) / len(st) for d in range(k + 1)})
    versions = [t.token_versions for t in trajs if t.token_versions is not None]
    if versions:  # sequences sampled by more than one version: per token too
        tok = [step - v for vs in versions for v in vs]
        newer = sum(v > t.policy_version for t in trajs for v in t.token_versions or ())
        out["staleness_token_mean"] = sum(tok) / max(len(tok), 1)
        out["newer_weights_token_frac"] = newer / max(sum(len(t.response_ids) for t in trajs), 1)
    return out


class MetricsSink:
    """Where each step's metrics and samples go, on rank 0: the log line, and the
    trackers `log.trackers` names -- jsonl (metrics.jsonl, samples.jsonl),
    tensorboard (tb/: scalars, the staleness histogram, samples as text), wandb
    and mlflow (`tracking.Trackers`).

    Args:
        output_dir: the run folder.
        log: the log section (line cadence, samples cadence and rows, trackers).
        resume: keep the run folder's rows before this step (and continue the
            trackers' runs); None = start fresh.
        run_name, config: the trackers' run name (default: the folder's name) and
            the resolved config ({dotted key: value}) they record.
        eval_samples: the evaluations' JSON-lines file (eval.samples_file,
            relative to output_dir; its rows of steps before `resume` kept); None = none.
    """

    def __init__(self, output_dir: str | Path, log: LogConfig | None = None, *,
                 resume: int | None = None, run_name: str | None = None,
                 config: Mapping[str, Any] | None = None,
                 eval_samples: str | None = None) -> None:
        self.dir, self.log = Path(output_dir), log or LogConfig()
        self.writer, self.trackers, self.eval_samples = None, None, None
        self.path, self.samples_path = self.dir / "metrics.jsonl", self.dir / "samples.jsonl"
        if not _rank0():
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if eval_samples:
            (self.dir / eval_samples).parent.mkdir(parents=True, exist_ok=True)
            self.eval_samples = SampleFile(self.dir / eval_samples, resume=resume)
        from hybrid_engine.tracking import Trackers

        # The servers first: a tracker that does not start leaves the run folder's files as
        # they were.
        self.trackers = Trackers(self.log.trackers, self.dir, run_name or self.dir.resolve().name,
                                 config or {}, resume=resume is not None,
                                 timeout_s=self.log.tracker_timeout_s)
        if "jsonl" in self.log.trackers:
            keep_rows_before(self.path, resume)
            if self.log.samples_every or self.samples_path.exists():
                keep_rows_before(self.samples_path, resume)
        if "tensorboard" in self.log.trackers:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tb"), purge_step=resume)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not _rank0():
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if "jsonl" in self.log.trackers:
            append_whole(self.path, (json.dumps(row) + "\n").encode())
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, float(v), step)
            _staleness_histogram(self.writer, step, metrics)
            self.writer.flush()
        self.trackers.log(step, {k: float(v) for k, v in metrics.items()})
        if step % self.log.every == 0 or "eval/accuracy" in metrics:
            log.info("%s", format_line(step, metrics))

    def write_samples(self, step: int, trajs: Sequence[Any],
                      decode: Callable[[list[int]], str]) -> None:
        """The samples table of a step, every log.samples_every steps (else nothing)."""
        every = self.log.samples_every
        if not _rank0() or not every or step % every:
            return
        from hybrid_engine.tracking import samples_table

        columns, rows = samples_table(step, trajs, decode, self.log.samples_per_table)
        if "jsonl" in self.log.trackers:
            append_whole(self.samples_path, "".join(json.dumps(dict(zip(columns, r))) + "\n"
                                               for r in rows).encode())
        if self.writer is not None:
            self.writer.add_text("samples_table", _markdown(columns, rows), step)
            self.writer.flush()
        self.trackers.table(step, columns, rows)

    def write_eval_samples(self, rows: Sequence[dict]) -> None:
        """An evaluation's rows (`eval_samples.sample_rows`) into eval.samples_file."""
        if self.eval_samples is not None:
            self.eval_samples.write(rows)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.trackers is not None:
            self.trackers.finish()


class SampleFile:
    """A JSON-lines file of rows with a "step", written by rank 0 alone (every
    rank holds the same rows): evaluation samples (`eval_samples`).

    Args:
        path: the file; its folder must exist.
        resume: keep the rows of steps before this one (a resumed run's file);
            None = start the file empty.
    """

    def __init__(self, path: str | Path, *, resume: int | None = None) -> None:
        self.path, self.rank0 = Path(path), _rank0()
        if self.rank0:
            keep_rows_before(self.path, resume)

    def write(self, rows: Sequence[dict]) -> None:
        """Appends rows whole (a full disk leaves the file as it was)."""
        if self.rank0 and rows:
            append_whole(self.path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def keep_rows_before(path: Path, resume: int | None) -> None:
    """Rewrites a JSON-lines file (replaced whole, never torn) with its rows before
    step `resume`; None = empty."""
    kept = []
    if resume is not None and path.exists():
        kept = [ln for ln in _rows(path) if json.loads(ln)["step"] < resume]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    os.replace(tmp, path)


def _markdown(columns: list[str], rows: list[list]) -> str:
    """A markdown table (TensorBoard's text tab renders it)."""
    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


def _staleness_histogram(writer: Any, step: int, metrics: Mapping[str, float]) -> None:
    """The step's staleness distribution (the controller's staleness/<d> fractions)
    as a TensorBoard histogram, one bucket per staleness d."""
    frac = {int(k.split("/", 1)[1]): float(v) for k, v in metrics.items()
            if k.startswith("staleness/")}
    if not frac:
        return
    ds = sorted(frac)
    writer.add_histogram_raw(
        "staleness", min=float(min(d for d in ds if frac[d]) if any(frac.values()) else 0),
        max=float(max((d for d in ds if frac[d]), default=0)), num=1.0,
        sum=sum(d * frac[d] for d in ds), sum_squares=sum(d * d * frac[d] for d in ds),
        bucket_limits=[d + 0.5 for d in ds], bucket_counts=[frac[d] for d in ds],
        global_step=step)


def append_whole(path: Path, data: bytes) -> None:
    """Appends data whole or not at all: a short or failed write (a full disk)
    is cut back to the old size before the error goes on."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def _rows(path: Path) -> list[str]:
    """The JSON lines of a metrics.jsonl. A torn last line (a crash or a full
    disk mid-append) is dropped with a warning; a bad line before it is an
    error naming the file and line."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        try:
            json.loads(ln)["step"]
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:
                log.warning("%s: dropping a torn last line (%d chars)", path, len(ln))
                return lines[:-1]
            raise ValueError(f"{path}:{i + 1} is not a metrics row: {ln[:80]!r}") from None
    return lines


def format_line(step: int, m: Mapping[str, float]) -> str:
    """The one-line step summary (absent keys skipped)."""
    parts = [f"step {step}"] + [fmt.format(m[k]) for k, fmt in _LINE_KEYS if k in m]
    phases = [f"{p} {m[p + '_s']:.2f}s"
              for p in ("switch", "generate", "score", "train", "sync", "eval") if p + "_s" in m]
    mem = [f"{p} {m['mem_' + p + '_bytes'] / 2**30:.2f}" for p in ("generate", "train", "sync")
           if f"mem_{p}_bytes" in m]
    if m.get("skipped_degenerate"):
        parts.append("skipped: all groups degenerate")
    line = [f"{parts[0]}: " + ", ".join(parts[1:]), " ".join(phases)]
    return " | ".join(line + (["mem GiB " + " ".join(mem)] if mem else []))


def plot_curves(rows: list[dict]) -> list[tuple[str, str, list[tuple[int, float]]]]:
    """(label, line style, [(step, value)]) of each curve `plot_metrics` draws
    that has points."""
    sampled = sorted({k for r in rows for k in r
                      if k.startswith(("eval/mean@", "eval/pass@", "eval/maj@"))},
                     key=lambda k: (k.split("@")[0], int(k.split("@")[1])))
    curves = [("reward_mean", "train reward", "-"), ("accuracy", "train accuracy", "-"),
              ("eval/accuracy", "held-out accuracy (greedy)", "o-"),
              *((k, f"held-out {k.removeprefix('eval/')}", "s--") for k in sampled)]
    out = []
    for key, label, style in curves:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            out.append((label, style, pts))
    return out


def plot_metrics(metrics_path: str | Path, png_path: str | Path, title: str = "") -> None:
    """Training reward and accuracy, and the held-out evaluation's greedy accuracy,
    mean@n, pass@k and maj@k (every k logged), over steps, as a PNG titled `title`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(ln) for ln in _rows(Path(metrics_path))]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, style, pts in plot_curves(rows):
        ax.plot(*zip(*pts), style, label=label)
    if title:
        ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
