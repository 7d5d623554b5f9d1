"""How much memory does `hybrid-engine eval` hold, against a training run of the same model?

Fresh jobs, as a user starts them (`hybrid-engine ... --nproc N`), the two
kinds interleaved (--jobs of each, the order alternating), on the same model,
evaluation file and rollout settings:

- eval: `hybrid-engine eval --model.path=M --env.eval_dataset_path=F
  --eval.num_samples=4`: the vLLM engine alone (`EnginePolicy`), the file
  evaluated whole, greedy and sampled;
- train: `hybrid-engine train` of the same model for one RL step (generate,
  score, train, sync; no evaluation): trainer, optimizer and engine.

A thread samples the RSS of every process of the job's tree every 20 ms (the
launcher, the ranks, the reward workers). Reported per kind: the peak of the
tree's total (what the machine must hold) and the biggest process's peak (what
one rank holds), median and range over the jobs, and eval's over train's.
No floor: this compares two whole commands, not an operation.

Prints a table; the last stdout line is JSON. Writes
benchmarks/results/eval_memory_<device>_<yyyymm>.md.

    python benchmarks/bench_eval_memory.py                 # qwen2-180m, N=2, 3 jobs each (~2 min)
    python benchmarks/bench_eval_memory.py --quick         # tiny preset, 1 job each
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("eval", "train")


def _args(argv=None) -> argparse.Namespace:  # noqa: ANN001
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-180m", help="tiny-model preset (random weights)")
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--rows", type=int, default=8, help="rows of the evaluation file")
    p.add_argument("--max-tokens", type=int, default=32, help="max new tokens per completion")
    p.add_argument("--jobs", type=int, default=3, help="fresh jobs of each kind")
    p.add_argument("--quick", action="store_true", help="the tiny preset, 1 job each")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.jobs = "tiny", 1
    return args


def _tree_rss(root: int) -> tuple[int, int]:
    """(total RSS, biggest process's RSS) of root and its descendants now."""
    import psutil

    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    rss = []
    for proc in procs:
        try:
            rss.append(proc.memory_info().rss)
        except psutil.NoSuchProcess:
            pass
    return sum(rss), max(rss, default=0)


def _run(cmd: list[str], cwd: Path) -> dict:
    """Runs cmd, sampling its tree's RSS; {"total", "biggest", "wall_s"} (peaks, bytes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = {"total": 0, "biggest": 0}

    def sample() -> None:
        while proc.poll() is None:
            total, biggest = _tree_rss(proc.pid)
            peak["total"], peak["biggest"] = max(peak["total"], total), max(peak["biggest"], biggest)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate(timeout=1800)
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{out[-4000:]}")
    return {**peak, "wall_s": time.perf_counter() - t0}


def _commands(args: argparse.Namespace, model: Path, data: Path, tmp: Path) -> dict[str, list]:
    cli = [sys.executable, "-m", "hybrid_engine.cli"]
    common = [f"--nproc={args.nproc}", f"--model.path={model}",
              f"--rollout.max_tokens={args.max_tokens}", "--rollout.max_model_len=256"]
    return {
        "eval": [*cli, "eval", *common, f"--env.eval_dataset_path={data}",
                 "--eval.num_samples=4"],
        "train": [*cli, "train", *common, f"--env.dataset_path={data}", "--no-progress",
                  "--train.num_steps=1", "--eval.at_start=false", "--eval.at_end=false",
                  "--overwrite", f"--output_dir={tmp / 'run'}"],
    }


def _table(peaks: dict[str, dict], mb: float = 2**20) -> str:
    lines = ["| command | jobs | tree total peak MB (median [min, max]) | biggest process MB "
             "| wall s |", "|---|---|---|---|---|"]
    for kind, jobs in peaks.items():
        def col(key: str) -> str:
            xs = sorted(j[key] / mb for j in jobs)
            return f"{xs[len(xs) // 2]:.0f} [{xs[0]:.0f}, {xs[-1]:.0f}]"
        walls = sorted(j["wall_s"] for j in jobs)
        lines.append(f"| {kind} | {len(jobs)} | {col('total')} | {col('biggest')} "
                     f"| {walls[len(walls) // 2]:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:  # noqa: ANN001
    args = _args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    from _common import preset_model, result_header, result_path
    from hybrid_engine.models.tiny import PRESETS

    model = preset_model(args.cache_dir, args.preset)
    peaks: dict[str, list[dict]] = {k: [] for k in KINDS}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_eval_memory-") as tmp:
        data = Path(tmp) / "problems.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{i}+{i + 7}=", "answer": str(2 * i + 7)})
                                + "\n" for i in range(args.rows)))
        cmds = _commands(args, model, data, Path(tmp))
        for j in range(args.jobs):
            for kind in KINDS if j % 2 == 0 else KINDS[::-1]:
                print(f"job {j + 1}/{args.jobs}: {kind} ...", file=sys.stderr, flush=True)
                peaks[kind].append(_run(cmds[kind], Path(tmp)))
    wall = time.perf_counter() - t_start
    table = _table(peaks)
    med = {k: sorted(j["total"] for j in v)[len(v) // 2] for k, v in peaks.items()}
    big = {k: sorted(j["biggest"] for j in v)[len(v) // 2] for k, v in peaks.items()}
    print(table)
    spec = PRESETS[args.preset]
    summary = {"preset": args.preset, "model_params": spec.num_params, "nproc": args.nproc,
               "rows": args.rows, "jobs": args.jobs, "peaks": peaks,
               "total_peak_mb": {k: v / 2**20 for k, v in med.items()},
               "biggest_peak_mb": {k: v / 2**20 for k, v in big.items()},
               "eval_over_train_total": med["eval"] / med["train"],
               "eval_over_train_biggest": big["eval"] / big["train"], "wall_s": wall}
    path = result_path(args.out_dir, "eval_memory", quick=args.quick)
    path.write_text(
        result_header(__file__, argv, after_cores=f"; {wall:.0f} s")
        + f"Model {args.preset} ({spec.num_params / 1e6:.1f}M params), N={args.nproc} ranks, "
        f"an evaluation file of {args.rows} rows, max_tokens={args.max_tokens}, {args.jobs} "
        "fresh job(s) of each command, interleaved. eval: the engine alone, greedy and 4 "
        "samples per row; train: one RL step, no evaluation.\n\n"
        + table + "\n\n"
        f"eval / train: tree total {summary['eval_over_train_total']:.2f}, biggest process "
        f"{summary['eval_over_train_biggest']:.2f} (medians).\n")
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
