"""Our RL step against a widely used colocated peer, on the same machine, interleaved.

The peer: TRL's GRPOTrainer with vLLM in colocate mode and DDP training
(benchmarks/peer/trl_grpo.py; setup and shims in benchmarks/peer/README.md),
the peer users pick for colocated GRPO. Ours: `hybrid-engine train` exactly as
bench_step.py runs it. Same model (a random-init 180M Qwen2, by default the
preset qwen2-180m-v512), same workload
(bench_step's W1 or W2: prompts x K completions x new tokens per optimizer
step, one optimizer step per rollout, GRPO without KL, AdamW lr 1e-4, bf16
rollout, fp32 master weights), same reward (bench_step's hashed one), 2 ranks
with one OMP thread each.

Variants (`--variants`, any subset, run in this order within each round):
- trl: the peer as a user runs it for this job: fp32 training, micro-batches of
  4 sequences, TRL's default importance-sampling correction (an extra no-grad
  forward per step), one vLLM engine per rank (TP 1, TRL's default);
- trl_fast: the peer with what we use ourselves: bf16 autocast, no extra
  forward, each rank's sequences in one micro-batch;
- ours: the project's defaults, as bench_step runs them (bf16 compute over fp32
  master weights, train.sharding=auto, packed micro-batches of up to 32 sequences);
- ours_fast: train.sharding=replicate (DDP), model.compute_dtype=bfloat16, one
  micro-batch (train.max_tokens_per_micro_batch=4096).

`--jobs` rounds; each round runs one fresh job of every variant, so slow drifts
of the machine hit every variant alike. Per job: `--warmup` steps left out, then
`--steps` timed steps; a step's time is the wall clock between consecutive
steps' ends (the peer's from a TrainerCallback, ours from metrics.jsonl), so
both include everything between two steps. Reported: median (IQR) over all
timed steps of all jobs, and each variant's ratio to the fastest peer variant
with a 95% hierarchical-bootstrap interval (jobs, then steps: benchmarks/_stats).
The peer needs a Python with trl (`--peer-python`, or $HE_PEER_PYTHON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _stats
import bench_step
from _common import result_header, result_path

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "peer" / "trl_grpo.py"
VARIANTS = {
    "trl": ("peer", ["--micro-batch", "4", "--is-correction"]),
    "trl_fast": ("peer", ["--micro-batch", "{per_rank}", "--bf16"]),
    "ours": ("ours", []),
    "ours_fast": ("ours", ["train.sharding=replicate", "model.compute_dtype=bfloat16",
                           "train.max_tokens_per_micro_batch=4096"]),
}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(bench_step.WORKLOADS), default="w1")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--jobs", type=int, default=3, help="rounds: fresh jobs per variant")
    p.add_argument("--steps", type=int, default=8, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=2, help="steps per job before the timed ones")
    p.add_argument("--preset", default="qwen2-180m-v512",
                   help="model preset (bench_step's; default: the peer-sized job, vocab 512)")
    p.add_argument("--peer-python", default=os.environ.get("HE_PEER_PYTHON"),
                   help="a Python with trl and datasets (default $HE_PEER_PYTHON)")
    p.add_argument("--cache-dir", default=str(HERE.parent / ".cache" / "bench_models"))
    p.add_argument("--out-dir", default=str(HERE / "results"))
    args = p.parse_args(argv)
    if any(VARIANTS[v][0] == "peer" for v in args.variants) and not args.peer_python:
        p.error("the peer variants need --peer-python (a Python with trl; "
                "benchmarks/peer/README.md)")
    if args.jobs < 1 or args.steps < 1 or args.warmup < 1:
        p.error("--jobs, --steps and --warmup must be >= 1")
    return args


def _peer_job(args: argparse.Namespace, flags: list[str], model: Path, out: Path) -> dict:
    prompts, k, _ = bench_step.WORKLOADS[args.workload]
    per_rank = str(prompts * k // 2)
    cmd = [args.peer_python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(PEER_SCRIPT), "--model", str(model), "--workload", args.workload,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
           *(f.format(per_rank=per_rank) for f in flags)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONWARNINGS": "ignore::UserWarning"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    results = out / "results.jsonl"
    if proc.returncode != 0 or not results.is_file():
        raise SystemExit(f"peer job failed: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(ln) for ln in results.read_text().splitlines()]
    summary = rows[-1]
    steps = [r for r in rows[:-1] if not r["warmup"]]
    _, k_, tokens = bench_step.WORKLOADS[args.workload]
    assert all(r["completions"] == prompts * k_ for r in steps), steps
    return {"step_s": [r["step_s"] for r in steps],
            "tokens": [r["completion_tokens"] for r in steps],
            "peak_rss_mib": max(summary["peak_rss_mib_per_rank"]), "summary": summary}


def _ours_job(args: argparse.Namespace, sets: list[str], out: Path, work: Path) -> dict:
    ns = argparse.Namespace(workload=args.workload, warmup=args.warmup, steps=args.steps,
                            cache_dir=args.cache_dir, set=[])
    job = bench_step._run_job(ns, args.preset, 2, "colocated", tuple(sets), out, work)
    timed = bench_step._timed(job, args.warmup, args.steps)
    prompts, k, _ = bench_step.WORKLOADS[args.workload]
    return {"step_s": [r["step_wall_s"] for r in timed],
            "tokens": [round(r["response_len_mean"] * prompts * k) for r in timed],
            # rank 0's RSS at each phase's end (metrics.py), the largest: not ru_maxrss
            "peak_rss_mib": max(r.get(f"mem_{p}_bytes", 0.0) for r in job["rows"]
                                for p in ("generate", "score", "train", "sync")) / 2**20,
            "phases": {p: _stats.describe([r[f"{p}_s"] for r in timed])["median"]
                       for p in ("generate", "train", "sync")}}


def main(argv=None) -> None:
    args = _args(argv)
    model = bench_step._model(args.preset, Path(args.cache_dir))
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="bench_peer-") as tmp:
        work = Path(tmp)
        (work / "reward.py").write_text(bench_step.REWARD)
        for j in range(args.jobs):
            for v in args.variants:
                kind, flags = VARIANTS[v]
                print(f"round {j + 1}/{args.jobs}: {v} ...", file=sys.stderr, flush=True)
                out = work / f"{v}-{j}"
                job = (_peer_job(args, flags, model, out) if kind == "peer"
                       else _ours_job(args, flags, out, work))
                print(f"  {v}: median {_stats.describe(job['step_s'])['median']:.3f} s/step",
                      file=sys.stderr, flush=True)
                results[v].append(job)
    peers = [v for v in args.variants if VARIANTS[v][0] == "peer"]
    best_peer = min(peers, key=lambda v: _stats.describe([j["step_s"] for j in results[v]])[
        "median"]) if peers else None
    rows = []
    for v in args.variants:
        jobs = [j["step_s"] for j in results[v]]
        d = _stats.describe(jobs)
        per_rank = str(bench_step.WORKLOADS[args.workload][0] * bench_step.WORKLOADS[args.workload][1] // 2)
        row = {"variant": v, "kind": VARIANTS[v][0],
               "settings": [f.format(per_rank=per_rank) for f in VARIANTS[v][1]],
               "step_s": d["median"], "step_iqr_s": d["iqr"], "jobs": len(jobs),
               "steps_timed": d["n"], "step_s_per_job": jobs,
               "completion_tokens_per_step": _stats.describe([j["tokens"] for j in results[v]])[
                   "median"],
               "peak_rss_mib": max(j["peak_rss_mib"] for j in results[v])}
        if VARIANTS[v][0] == "ours":
            row["phases_s"] = {p: _stats.describe([j["phases"][p] for j in results[v]])["median"]
                               for p in ("generate", "train", "sync")}
        if best_peer:
            ref = [j["step_s"] for j in results[best_peer]]
            row["vs_best_peer"] = _stats.ratio(jobs, ref)
            row["vs_best_peer_ci95"] = _stats.ratio_ci(jobs, ref, paired=False)
        rows.append(row)
    table = _table(rows, best_peer)
    print(table)
    prompts, k, max_tokens = bench_step.WORKLOADS[args.workload]
    path = result_path(args.out_dir, f"peer_{args.workload}")
    peer = _peer_versions(args.peer_python) if peers else ""
    path.write_text(
        result_header(__file__, argv) + (f"Peer: {peer}.\n\n" if peer else "") +
        f"Workload {args.workload}: {prompts} prompts x K={k} completions x {max_tokens} new "
        f"tokens per optimizer step, model {args.preset}, 2 ranks x 1 OMP thread; {args.jobs} "
        f"rounds, each a fresh job of every variant in the order of the table; {args.warmup} "
        f"warm-up + {args.steps} timed steps per job. Variants: see bench_peer.py's docstring. "
        "RSS: the peer's peak per rank (ru_maxrss, the larger rank); ours: rank 0's RSS at "
        "the end of each phase, the largest (metrics.jsonl), not a peak.\n\n"
        + table + "\n\n```json\n" + json.dumps(rows, indent=1) + "\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    head = next((r for r in rows if r["variant"] == "ours"), rows[-1])  # the defaults
    print(json.dumps({"workload": args.workload, "best_peer": best_peer,
                      "best_peer_step_s": next((r["step_s"] for r in rows
                                                if r["variant"] == best_peer), None),
                      **{f"{r['variant']}_step_s": r["step_s"] for r in rows},
                      "headline": head["variant"], "headline_vs_best_peer": head.get("vs_best_peer"),
                      "headline_vs_best_peer_ci95": head.get("vs_best_peer_ci95")}))


def _peer_versions(python: str) -> str:
    code = ("import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' "
            "for p in ('trl', 'datasets', 'accelerate')))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or f"versions unknown ({proc.stderr.strip()[-200:]})"


def _table(rows: list[dict], best_peer: str | None) -> str:
    out = [f"| variant | settings | jobs x steps | step s (IQR) | vs {best_peer or 'peer'} (95% CI) | "
           "ours: generate / train / sync s | completion tokens per step | RSS MiB |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = r.get("vs_best_peer_ci95")
        vs = f"{r['vs_best_peer']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "-"
        ph = " / ".join(f"{r['phases_s'][p]:.2f}" for p in ("generate", "train", "sync")) \
            if "phases_s" in r else "-"
        out.append(f"| {r['variant']} | {' '.join(r['settings']) or 'defaults'} | "
                   f"{r['jobs']} x {r['steps_timed'] // r['jobs']} | {r['step_s']:.2f} "
                   f"({r['step_iqr_s']:.2f}) | {vs} | {ph} | {r['completion_tokens_per_step']:.0f} | "
                   f"{r['peak_rss_mib']:.0f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
