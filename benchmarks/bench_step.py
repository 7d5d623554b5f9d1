"""Where does an RL step's time go? generate / score / train / sync, per model size and rank count.

For each (model preset, N ranks, placement) one `hybrid-engine train` job
under torchrun -- colocated: every rank holds the FSDP2 trainer and a vLLM
engine, TP = min(2, N); separate: the first N/2 ranks only train, the last
N/2 only roll out, TP = min(2, N/2) -- with the same recipe, model, prompts,
sampling and seeds everywhere. The reward is a coin
flip hashed from the completion so every group carries signal and every step
trains (a random-init model never solves the task). Reported: the median over
the timed steps (the first `--warmup` steps excluded) of each phase's seconds
from the job's own metrics.jsonl, their sum (step_s) and tokens/s (prompt +
response tokens of the step / step_s).

Prints a table; the last stdout line is JSON. Writes
benchmarks/results/step_cpu_<yyyymm>.md and a phase-breakdown chart (.png).

    python benchmarks/bench_step.py             # tiny and qwen2-180m at N=1,2,4; both placements
    python benchmarks/bench_step.py --quick     # tiny at N=1,2 colocated and N=2 separate, 3 steps
    python benchmarks/bench_step.py --configs tiny:2 tiny:2:separate qwen2-180m:1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "train", "sync")
REWARD = ("import zlib\n\n"
          "def reward(prompt, completion, answer):\n"
          "    return float(zlib.crc32(completion.encode()) % 2)\n")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+",
                   default=["tiny:1", "tiny:2", "tiny:2:separate", "tiny:4", "tiny:4:separate",
                            "qwen2-180m:1", "qwen2-180m:2", "qwen2-180m:2:separate",
                            "qwen2-180m:4", "qwen2-180m:4:separate"],
                   help="PRESET:N[:separate] (presets: hybrid_engine.models.tiny.PRESETS)")
    p.add_argument("--steps", type=int, default=6, help="RL steps per job")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (x K samples)")
    p.add_argument("--samples", type=int, default=4, help="K completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="max new tokens per completion")
    p.add_argument("--quick", action="store_true",
                   help="tiny at N=1,2 and N=2 separate, 3 steps (1 warmup)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    args = p.parse_args(argv)
    if args.quick:
        args.configs, args.steps, args.warmup = ["tiny:1", "tiny:2", "tiny:2:separate"], 3, 1
    if args.warmup >= args.steps:
        p.error(f"--warmup={args.warmup} must be below --steps={args.steps}")
    return args


def _model(preset: str, cache: Path) -> Path:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    folder = cache / preset
    if not (folder / "config.json").is_file():
        write_tiny_model(folder, PRESETS[preset])
    return folder


def _num_params(preset: str) -> int:
    from hybrid_engine.models.tiny import PRESETS

    return PRESETS[preset].num_params


def _tp(nproc: int, placement: str) -> int:
    return min(2, nproc // 2 if placement == "separate" else nproc)


def _run(args: argparse.Namespace, preset: str, nproc: int, placement: str, work: Path) -> dict:
    model = _model(preset, Path(args.cache_dir))
    out = work / f"{preset}-n{nproc}-{placement}"
    overrides = [
        f"--model.path={model}", f"--output_dir={out}", "--overwrite", "--no-progress",
        f"--placement={placement}", f"--rollout.tensor_parallel_size={_tp(nproc, placement)}",
        f"--rollout.num_samples_per_prompt={args.samples}", f"--rollout.max_tokens={args.max_tokens}",
        f"--train.prompts_per_step={args.prompts}", f"--train.num_steps={args.steps}",
        "--train.micro_batch_size=8", "--checkpoint_every=0", "--eval_every=0",
        "--sync.verify=false", "--max_wall_s=1200", f"--env.reward_fn={work / 'reward.py'}:reward",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "hybrid_engine.cli", "train",
           "--recipe=tiny_grpo_debug", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{preset} N={nproc} {placement} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > args.warmup]
    row = {"preset": preset, "world_size": nproc, "placement": placement,
           "tp": _tp(nproc, placement),
           "model_params": _num_params(preset), "steps_timed": len(timed),
           "steps_trained": sum(r.get("skipped_degenerate", 1.0) == 0.0 for r in timed)}
    for ph in PHASES:
        row[f"{ph}_s"] = statistics.median(r.get(f"{ph}_s", 0.0) for r in timed)
    row["step_s"] = statistics.median(sum(r.get(f"{ph}_s", 0.0) for ph in PHASES) for r in timed)
    row["tok_s"] = statistics.median(r["tok_s"] for r in timed)
    return row


def _table(rows: list[dict]) -> str:
    head = ("| model | params | N | placement | T | generate s | score s | train s | sync s | "
            "step s | tok/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['model_params'] / 1e6:.1f}M | {r['world_size']} | "
            f"{r['placement']} | {r['tp']} | "
            f"{r['generate_s']:.3f} | {r['score_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.3f} | "
            f"{r['step_s']:.3f} | {r['tok_s']:.0f} |")
    return "\n".join(lines)


def _chart(rows: list[dict], path: Path) -> None:
    """Stacked horizontal bars: seconds per phase for each configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['preset']} N={r['world_size']}" + (" sep" if r["placement"] == "separate" else "")
              for r in rows]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.2))
    left = [0.0] * len(rows)
    for ph in PHASES:
        vals = [r[f"{ph}_s"] for r in rows]
        ax.barh(labels, vals, left=left, label=ph)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_xlabel("seconds per RL step (median)")
    ax.set_title("Step time by phase (CPU; sep = separate placement)")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(PHASES), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = _args(argv)
    sys.path.insert(0, str(REPO))

    configs = []
    for c in args.configs:
        parts = c.split(":")
        preset, n = parts[0], parts[1] if len(parts) > 1 else "2"
        placement = parts[2] if len(parts) > 2 else "colocated"
        if placement not in ("colocated", "separate") or not n.isdigit():
            raise SystemExit(f"--configs: {c!r} is not PRESET:N[:separate]")
        if placement == "separate" and int(n) < 2:
            raise SystemExit(f"--configs: {c!r}: separate placement needs N >= 2")
        configs.append((preset, int(n), placement))
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp:
        work = Path(tmp)
        (work / "reward.py").write_text(REWARD)
        rows = []
        for preset, n, placement in configs:
            print(f"running {preset} on {n} rank(s), {placement} ...", file=sys.stderr, flush=True)
            rows.append(_run(args, preset, n, placement, work))
    table = _table(rows)
    print(table)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"step_cpu_{datetime.date.today():%Y%m}"
    _chart(rows, out_dir / f"{stem}.png")
    from _common import result_header

    (out_dir / f"{stem}.md").write_text(
        result_header(__file__, argv) +
        "Colocated: every rank trains and rolls out; separate: the first N/2 ranks train, the "
        f"last N/2 roll out. Recipe tiny_grpo_debug, {args.prompts} prompts x K={args.samples}, "
        f"max_tokens={args.max_tokens}, {args.steps} steps ({args.warmup} warmup left out), "
        "identical model, prompts, sampling parameters and seeds in every configuration; "
        "medians per step. T is min(2, N) colocated and min(2, N/2) separate, so the two rows "
        "of one N may differ in T. Ranks share the machine's cores (OMP threads = cores / N): "
        "on CPU a rank stands for a device, and with more ranks than cores the engines' "
        "busy-waiting TP collectives compete with the other ranks for them.\n\n"
        f"{table}\n\n![phases]({stem}.png)\n\n```json\n{json.dumps(rows, indent=1)}\n```\n")
    print(json.dumps({"configs": rows, "chart": str(out_dir / f"{stem}.png")}))


if __name__ == "__main__":
    main()
