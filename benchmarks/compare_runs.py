"""Learning curves of finished runs side by side (e.g. `hybrid-engine demo` with and
without PPO updates): held-out accuracy over steps and wall time, step cost, and the
PPO and critic metrics that show the knobs acted.

    python benchmarks/compare_runs.py --run default=runs/demo --run ppo=runs/demo_ppo

Reads each run's metrics.jsonl (it runs nothing), prints a markdown table, writes
<out-dir>/learning_<device>_<yyyymm>.md and a PNG of the curves, and prints one JSON
object as its last line. Per run: held-out greedy accuracy at the first and last
evaluation (gain in points), RL steps and wall seconds, median step / train seconds,
optimizer steps per RL step, mean clip fraction and PPO KL over trained steps, and,
when the run has a critic, its value loss over the first and the last tenth of steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import _common


def load(folder: str | Path) -> list[dict]:
    """The rows of folder/metrics.jsonl (a torn last line is skipped)."""
    rows = []
    for line in (Path(folder) / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not rows:
        raise ValueError(f"{folder}/metrics.jsonl has no rows")
    return rows


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(rows: list[dict]) -> dict:
    """One run's figures (see the module docstring); None where a run has no such metric."""
    evals, wall = [], 0.0
    for r in rows:  # a final eval row after the last step has no elapsed_s: the step's
        wall = r.get("elapsed_s", wall)
        if "eval/accuracy" in r:
            evals.append((r["step"], r["eval/accuracy"], wall))
    steps = [r for r in rows if r["step"] > 0 and "elapsed_s" in r]
    trained = [r for r in steps if not r.get("skipped_degenerate")]
    tenth = max(len(trained) // 10, 1)
    vf = [r["critic/vf_loss"] for r in trained if "critic/vf_loss" in r]
    walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])]
    out = {
        "steps": len(steps), "wall_s": steps[-1]["elapsed_s"] if steps else 0.0,
        "acc_start": evals[0][1] if evals else None, "acc_end": evals[-1][1] if evals else None,
        "median_step_s": statistics.median(walls) if walls else None,
        "median_train_s": statistics.median([r["train_s"] for r in trained]) if trained else None,
        "optimizer_steps": _mean([r.get("optimizer_steps", 1.0) for r in trained]),
        "clip_frac": _mean([r["clip_frac"] for r in trained if "clip_frac" in r]),
        "ppo_kl": _mean([r["ppo_kl"] for r in trained if "ppo_kl" in r]),
        "vf_loss_first": _mean(vf[:tenth]) if vf else None,
        "vf_loss_last": _mean(vf[-tenth:]) if vf else None,
        "vf_clip_frac": _mean([r["critic/vf_clip_frac"] for r in trained
                               if "critic/vf_clip_frac" in r]),
        "curve": evals,
    }
    if out["acc_start"] is not None:
        out["gain_points"] = 100 * (out["acc_end"] - out["acc_start"])
    return out


def _fmt(v: object, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def table(runs: dict[str, dict]) -> str:
    head = ("| run | RL steps | wall s | acc start | acc end | gain (points) | median step s | "
            "median train s | updates/step | clip_frac | ppo_kl | critic vf_loss first -> last "
            "(vf_clip_frac) |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for name, s in runs.items():
        critic = "-" if s["vf_loss_first"] is None else (
            f"{s['vf_loss_first']:.4f} -> {s['vf_loss_last']:.4f} ({_fmt(s['vf_clip_frac'])})")
        lines.append(
            f"| {name} | {s['steps']} | {s['wall_s']:.0f} | {_fmt(s['acc_start'])} | "
            f"{_fmt(s['acc_end'])} | {_fmt(s.get('gain_points'), '+.1f')} | "
            f"{_fmt(s['median_step_s'], '.2f')} | {_fmt(s['median_train_s'], '.2f')} | "
            f"{_fmt(s['optimizer_steps'], '.0f')} | {_fmt(s['clip_frac'], '.4f')} | "
            f"{_fmt(s['ppo_kl'], '.1e')} | {critic} |")
    return head + "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in runs.items():
        steps, acc, wall = zip(*s["curve"]) if s["curve"] else ((), (), ())
        axes[0].plot(steps, acc, marker=".", label=name)
        axes[1].plot(wall, acc, marker=".", label=name)
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("RL wall seconds")
    save_accuracy_plot(fig, axes, path)


def save_accuracy_plot(fig, axes, path: Path) -> None:  # noqa: ANN001 - matplotlib objects
    """Labels the accuracy axes (y), grids and legends them, writes path, closes fig."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="NAME=DIR",
                   help="a finished run folder (holding metrics.jsonl), repeatable")
    p.add_argument("--out-dir", default="benchmarks/results", help="where the report goes")
    p.add_argument("--note", default="", help="a paragraph written under the table")
    args = p.parse_args(argv)
    runs = {}
    for item in args.run:
        name, sep, folder = item.rpartition("=")  # names may hold "="
        if not sep or not name or not folder:
            p.error(f"--run {item!r} is not NAME=DIR")
        runs[name] = summarize(load(folder))
    text = table(runs)
    print(text)
    path = _common.result_path(args.out_dir, "learning")
    png = path.with_suffix(".png")
    plot(runs, png)
    curves = "\n".join(f"- {name}: " + " ".join(f"{st}:{a:.3f}" for st, a, _ in s["curve"])
                       for name, s in runs.items())
    path.write_text(_common.result_header(__file__, argv) + text + "\n\n"
                    + (args.note + "\n\n" if args.note else "")
                    + f"Held-out accuracy over steps (step:accuracy):\n\n{curves}\n\n"
                    + f"![curves]({png.name})\n")
    result = {name: {k: v for k, v in s.items() if k != "curve"} for name, s in runs.items()}
    print(json.dumps({"report": str(path), "runs": result}))
    return result


if __name__ == "__main__":
    main()
