"""Does a config learn the demo task as well as the baseline, in less wall time? Seeds x configs.

What runs: `hybrid-engine demo` (the warm-started 4M model learning GSM8K-shaped
word problems, held-out greedy accuracy every 10 steps; with --task tools the
tool demo, where it learns to call a calculator) once per (seed, config),
interleaved seed by seed (seed 0: every config in order, then seed 1, ...), one
run at a time, each with `--set seed=S --set rollout.seed=S`, the config's
overrides and the common `--set`s. The first config is the baseline. A config is
`NAME` or `NAME:KEY=VALUE+KEY=VALUE...`, e.g. (the default)
`k0 k1:async_rollout.max_staleness=1+algorithm.behaviour_logp=rollout`. The demos
share one warm start (--cache-dir) and run under --runs-dir/<name>-s<seed>
(their metrics.jsonl, TensorBoard, log <name>-s<seed>.log beside it); a run
that finished before (its <name>-s<seed>.json summary is there) is read, not
rerun, with --resume, so an interrupted benchmark goes on where it stopped.
A failed run is reported and the others go on (exit status 1 at the end).

Reported, per run: RL steps, mean step s (the RL phase's wall clock at its
last step / steps: evaluations, checkpoints and every phase included, which is
what "less wall time" means), median step s, start, final and best held-out
accuracy, the held-out tool calls per episode at the start and the end (a
tool task's), RL seconds until the accuracy first reaches --threshold, mean
staleness, and phase means over steps > 5 (generate, score, train, sync).
Per config: the means over seeds (accuracy with its sd over seeds, its gain
over the run's start in points, and its
paired difference to the baseline per seed), and its wall time over the
baseline's: the ratio of mean step seconds with a 95% bootstrap CI that
resamples seeds, then --window-step windows inside each run (window means:
a window of 10 steps holds one evaluation, and any schedule repeating every
1, 2, 5 or 10 steps, e.g. a colocated burst, the same number of times).
No floor: this compares whole runs of one task, not an operation.

Writes <out-dir>/learning_<device><tag>_<yyyymm>.md (tables, per-run curves)
and a PNG of accuracy (and a tool task's tool-call rate) over RL wall seconds;
prints the tables, then one JSON
object as the last line (per config: step_s_mean, step_over_baseline and its
CI, acc_end_mean and sd, seconds to the threshold, runs failed).

    python benchmarks/bench_learning.py                    # 3 seeds x (k0, k1), ~50 min on 2 cores
    python benchmarks/bench_learning.py --nproc 1 --steps 200 --runs-dir $OUT/runs  # one GPU
    python benchmarks/bench_learning.py --task tools --configs tools --steps 100  # the tool demo
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import _common
import _stats
import compare_runs

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = ("k0", "k1:async_rollout.max_staleness=1+algorithm.behaviour_logp=rollout")
PHASES = ("generate", "score", "train", "sync")
TOOL_CALLS = "eval/tool/calls"


@dataclass
class Config:
    name: str
    overrides: list[str] = field(default_factory=list)


def parse_config(spec: str) -> Config:
    """`NAME` or `NAME:KEY=VALUE+KEY=VALUE` (ValueError on a malformed one)."""
    name, _, rest = spec.partition(":")
    items = [s for s in rest.split("+") if s] if rest else []
    if not name or "=" in name or any("=" not in s for s in items):
        raise ValueError(f"config {spec!r} is not NAME or NAME:KEY=VALUE+KEY=VALUE")
    return Config(name, items)


def run_summary(rows: list[dict], threshold: float, window: int) -> dict:
    """One run's figures from its metrics rows (see the module docstring)."""
    s = compare_runs.summarize(rows)
    steps = [r for r in rows if r["step"] > 0 and "elapsed_s" in r]
    ends = [0.0] + [r["elapsed_s"] for r in steps]
    walls = [b - a for a, b in zip(ends, ends[1:])]
    reached = [w for _, acc, w in s["curve"] if acc >= threshold]
    late = [r for r in steps if r["step"] > 5]
    calls = [(r["step"], r[TOOL_CALLS]) for r in rows if TOOL_CALLS in r]
    return {
        "steps": s["steps"], "wall_s": s["wall_s"],
        "step_s_mean": s["wall_s"] / s["steps"] if s["steps"] else None,
        "step_s_median": statistics.median(walls) if walls else None,
        "acc_start": s["acc_start"], "acc_end": s["acc_end"],
        "acc_max": max((acc for _, acc, _ in s["curve"]), default=None),
        "gain_points": s.get("gain_points"),
        "calls_start": calls[0][1] if calls else None,
        "calls_end": calls[-1][1] if calls else None, "calls_curve": calls,
        "s_to_threshold": reached[0] if reached else None,
        "staleness_mean": _mean(r["staleness_mean"] for r in steps if "staleness_mean" in r),
        **{f"{p}_s": _mean(r[f"{p}_s"] for r in late if f"{p}_s" in r) for p in PHASES},
        # Whole windows of `window` steps (their mean step seconds): what the CI resamples.
        "windows": [statistics.fmean(walls[i:i + window])
                    for i in range(0, len(walls) - window + 1, window)],
        "curve": s["curve"],
    }


def _mean(values) -> float | None:  # noqa: ANN001 - any iterable of floats
    values = list(values)
    return statistics.fmean(values) if values else None


def config_summary(runs: dict[int, dict], base: dict[int, dict] | None) -> dict:
    """Means over seeds and the comparison with the baseline's runs of the same seeds
    (base None: this is the baseline)."""
    seeds = sorted(runs)
    acc = [runs[s]["acc_end"] for s in seeds if runs[s]["acc_end"] is not None]
    reached = [runs[s]["s_to_threshold"] for s in seeds if runs[s]["s_to_threshold"] is not None]
    out = {
        "seeds": seeds,
        "step_s_mean": _mean(runs[s]["step_s_mean"] for s in seeds),
        "acc_end_mean": _mean(acc), "acc_end_sd": statistics.stdev(acc) if len(acc) > 1 else None,
        "gain_points_mean": _mean(runs[s]["gain_points"] for s in seeds
                                  if runs[s]["gain_points"] is not None),
        "gain_points_min": min((runs[s]["gain_points"] for s in seeds
                                if runs[s]["gain_points"] is not None), default=None),
        "s_to_threshold_mean": _mean(reached), "reached_threshold": len(reached),
        "staleness_mean": _mean(runs[s]["staleness_mean"] for s in seeds
                                if runs[s]["staleness_mean"] is not None),
    }
    paired = [s for s in seeds if s in base] if base is not None else []
    if paired:
        out["step_over_baseline"] = (_mean(runs[s]["step_s_mean"] for s in paired)
                                     / _mean(base[s]["step_s_mean"] for s in paired))
        out["step_over_baseline_per_seed"] = [runs[s]["step_s_mean"] / base[s]["step_s_mean"]
                                              for s in paired]
        num, den = [runs[s]["windows"] for s in paired], [base[s]["windows"] for s in paired]
        if all(num) and all(den):
            # Seeds resampled (the same draw for both: a seed's pair), then windows in each run.
            out["step_over_baseline_ci"] = _stats.ratio_ci(num, den, paired=False,
                                                           stat=statistics.fmean)
        out["acc_end_minus_baseline_per_seed"] = [
            runs[s]["acc_end"] - base[s]["acc_end"] for s in paired
            if runs[s]["acc_end"] is not None and base[s]["acc_end"] is not None]
    return out


def _f(v: object, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def tables(results: dict[str, dict[int, dict]], summaries: dict[str, dict], threshold: float,
           baseline: str) -> str:
    head = (f"| config | seed | steps | mean step s | median step s | RL wall s | start acc | "
            f"final acc | max acc | tool calls start -> end | RL s to >= {threshold} | "
            "staleness mean |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {name} | {seed} | {r['steps']} | {_f(r['step_s_mean'])} | "
            f"{_f(r['step_s_median'])} | {r['wall_s']:.1f} | {_f(r['acc_start'], '.4f')} | "
            f"{_f(r['acc_end'], '.4f')} | {_f(r['acc_max'], '.4f')} | "
            f"{_f(r['calls_start'], '.3f')} -> {_f(r['calls_end'], '.3f')} | "
            f"{_f(r['s_to_threshold'], '.1f')} | {_f(r['staleness_mean'], '.2f')} |"
            for seed in sorted({s for runs in results.values() for s in runs})
            for name, runs in results.items() if seed in runs
            for r in [runs[seed]]]
    per_run = head + "\n".join(rows)
    head = (f"| config | seeds | mean step s | over {baseline} [95% CI] | per seed | "
            f"final acc mean (sd) | gain points mean (min) | minus {baseline} per seed | "
            f"RL s to >= {threshold} (runs reaching it) |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for name, c in summaries.items():
        ci = c.get("step_over_baseline_ci")
        ratio = "baseline" if name == baseline else "-" if "step_over_baseline" not in c else (
            f"{c['step_over_baseline']:.3f}x" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""))
        rows.append(
            f"| {name} | {len(c['seeds'])} | {_f(c['step_s_mean'])} | {ratio} | "
            + ", ".join(f"{x:.3f}" for x in c.get("step_over_baseline_per_seed", [])) + " | "
            f"{_f(c['acc_end_mean'], '.4f')} ({_f(c['acc_end_sd'], '.4f')}) | "
            f"{_f(c['gain_points_mean'], '+.1f')} ({_f(c['gain_points_min'], '+.1f')}) | "
            + ", ".join(f"{x:+.4f}" for x in c.get("acc_end_minus_baseline_per_seed", []))
            + f" | {_f(c['s_to_threshold_mean'], '.1f')} ({c['reached_threshold']}"
            f"/{len(c['seeds'])}) |")
    per_config = head + "\n".join(rows)
    head = ("| config | seed | " + " | ".join(PHASES) + " |\n|---|---|"
            + "---|" * len(PHASES) + "\n")
    rows = [f"| {name} | {seed} | " + " | ".join(_f(r[f"{p}_s"]) for p in PHASES) + " |"
            for name, runs in results.items() for seed, r in sorted(runs.items())]
    phases = head + "\n".join(rows)
    return (f"{per_config}\n\nPer run:\n\n{per_run}\n\nPhase means over steps > 5 (s):\n\n"
            f"{phases}")


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tools = any(r["calls_curve"] for runs in results.values() for r in runs.values())
    fig, axes = plt.subplots(1, 2 if tools else 1, figsize=(12 if tools else 7, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, runs) in enumerate(results.items()):
        for j, (seed, r) in enumerate(sorted(runs.items())):
            label = name if j == 0 else None
            if r["curve"]:
                _, acc, wall = zip(*r["curve"])
                ax.plot(wall, acc, color=colors[i % len(colors)], alpha=0.8, label=label)
            if tools and r["calls_curve"]:
                step, calls = zip(*r["calls_curve"])
                axes[0][1].plot(step, calls, color=colors[i % len(colors)], alpha=0.8, label=label)
    ax.set_xlabel("RL wall seconds")
    if tools:
        axes[0][1].set(xlabel="RL step", ylabel="held-out tool calls per episode")
        axes[0][1].grid(alpha=0.3)
    compare_runs.save_accuracy_plot(fig, [ax], path)


def demo_command(args: argparse.Namespace, config: Config, seed: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "hybrid_engine.cli", "demo", f"--task={args.task}",
            f"--nproc={args.nproc}",
            f"--output-dir={out}", f"--cache-dir={args.cache_dir}", f"--steps={args.steps}",
            f"--minutes={args.minutes}",
            *([f"--warm-start-steps={args.warm_start_steps}"] if args.warm_start_steps else []),
            f"--set=seed={seed}", f"--set=rollout.seed={seed}",
            *(f"--set={item}" for item in [*config.overrides, *args.overrides])]


def run_demo(args: argparse.Namespace, config: Config, seed: int) -> dict | None:
    """The demo's final JSON (after running it unless --resume finds it); None if it failed."""
    runs = Path(args.runs_dir)
    out, done = runs / f"{config.name}-s{seed}", runs / f"{config.name}-s{seed}.json"
    if args.resume and done.is_file() and (out / "metrics.jsonl").is_file():
        return json.loads(done.read_text())
    runs.mkdir(parents=True, exist_ok=True)
    log = runs / f"{config.name}-s{seed}.log"
    done.unlink(missing_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(demo_command(args, config, seed, out), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=f, text=True)
        f.write(proc.stdout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(f"  failed (exit {proc.returncode}); log: {log}", flush=True)
        return None
    done.write_text(lines[-1] + "\n")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                   help="NAME or NAME:KEY=VALUE+KEY=VALUE, the first is the baseline "
                        f"(default: {' '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--task", choices=("word_problems", "tools"), default="word_problems",
                   help="the demo's task (default word_problems; tools: the calculator demo)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                   help="seed and rollout.seed of each run (default 0 1 2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, repeatable")
    p.add_argument("--nproc", type=int, default=2, help="ranks per demo (default 2)")
    p.add_argument("--steps", type=int, default=200, help="RL steps per run (default 200, the demo's)")
    p.add_argument("--minutes", type=float, default=9.0,
                   help="wall-time limit of each run's RL phase (default 9)")
    p.add_argument("--warm-start-steps", type=int, default=None,
                   help="the demo's warm-start steps (default: the demo's)")
    p.add_argument("--threshold", type=float, default=0.55,
                   help="report the RL seconds to this held-out accuracy (default 0.55)")
    p.add_argument("--window", type=int, default=10,
                   help="steps per window in the wall-time CI (default 10: one eval each)")
    p.add_argument("--runs-dir", default=str(REPO / "runs" / "bench_learning"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "demo"))
    p.add_argument("--resume", action="store_true",
                   help="read the runs that finished before instead of rerunning them")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--tag", default="", help="added to the result file's name")
    p.add_argument("--note", default="", help="a paragraph written under the tables")
    args = p.parse_args(argv)
    try:
        configs = [parse_config(c) for c in args.configs]
    except ValueError as e:
        p.error(str(e))
    if len({c.name for c in configs}) != len(configs):
        p.error("config names must differ")
    if args.window < 1 or args.steps < 1 or args.nproc < 1:
        p.error("--window, --steps and --nproc must be >= 1")

    results: dict[str, dict[int, dict]] = {c.name: {} for c in configs}
    failed, todo, t0 = [], [(s, c) for s in args.seeds for c in configs], time.perf_counter()
    for i, (seed, config) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {config.name} seed {seed} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        if run_demo(args, config, seed) is None:
            failed.append(f"{config.name}-s{seed}")
            continue
        r = run_summary(compare_runs.load(Path(args.runs_dir) / f"{config.name}-s{seed}"),
                        args.threshold, args.window)
        results[config.name][seed] = r
        print(f"  {r['steps']} steps, {_f(r['step_s_mean'])} s per step, "
              f"accuracy {_f(r['acc_start'], '.4f')} -> {_f(r['acc_end'], '.4f')}"
              + (f", tool calls {r['calls_start']:.3f} -> {r['calls_end']:.3f}"
                 if r["calls_curve"] else ""), flush=True)
    base = configs[0].name
    summaries = {c.name: config_summary(results[c.name], results[base] if c.name != base else None)
                 for c in configs if results[c.name]}
    text = tables(results, summaries, args.threshold, base)
    print(text)
    path = _common.result_path(args.out_dir, "learning", tag=args.tag)
    png = path.with_suffix(".png")
    plot(results, png)
    curves = "\n".join(f"- {name} seed {seed}: " + " ".join(
        f"{st}:{acc:.4f}@{w:.1f}s" for st, acc, w in r["curve"])
        + ("; tool calls per episode " + " ".join(f"{st}:{c:.3f}" for st, c in r["calls_curve"])
           if r["calls_curve"] else "")
        for name, runs in results.items() for seed, r in sorted(runs.items()))
    configs_text = "\n".join(f"- {c.name}: " + (" ".join(f"--set {o}" for o in c.overrides)
                                                 or "the demo's recipe") for c in configs)
    path.write_text(_common.result_header(__file__, argv)
                    + f"Configs (baseline first; every run adds --set seed=S --set "
                    f"rollout.seed=S):\n\n{configs_text}\n\n{text}\n\n"
                    + (f"Failed runs: {', '.join(failed)}\n\n" if failed else "")
                    + (args.note + "\n\n" if args.note else "")
                    + f"Held-out accuracy (step:accuracy@RL seconds):\n\n{curves}\n\n"
                    + f"![curves]({png.name})\n")
    result = {"report": str(path), "baseline": base, "failed": failed,
              "configs": {name: {k: v for k, v in c.items()} for name, c in summaries.items()}}
    print(json.dumps(result))
    if failed:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
