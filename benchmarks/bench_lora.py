"""LoRA: what each way of serving the adapters costs -- sync, generation, memory.

Fresh torchrun jobs of N ranks, one mode each, modes in rotating order job
after job (--jobs of each), the same model, prompts, sampling and seeds:

- full: no LoRA, every weight trains; the reshard sync moves the whole model;
- merge: model.lora_rank=R, sync.lora=merge: W0 + (alpha / r) B A resharded
  into vLLM's base weights (the same bytes as full) and plain vLLM kernels;
- adapter: sync.lora=adapter: only the adapter elements each rank lacks move,
  and vLLM's LoRA kernels add them in every forward.

Each job is the colocated hybrid actor as shipped (`make_policy`), training
with FSDP2 full sharding (so the sync moves what each rank lacks): WARMUP
unmeasured steps (the first releases the KV cache, the second regrows it),
then --repeats measured steps of generate (P prompts x K samples) -> train ->
sync. Per step: generation tokens/s (the replicas' sampled tokens
over the generate call's seconds, the slowest rank's), the sync's seconds and
bytes received (the rank that received most); per job: each rank's peak RSS
(`ru_maxrss`, the whole process: trainer, engine and the sync's buffers).
Medians over all steps of all jobs with IQRs; the ratios' 95% CIs are
bootstraps over jobs x steps (`_stats.ratio_ci`, unpaired: the modes ran in
different jobs). The bytes' floor is the planner's minimum per rank, printed
beside them; the sync's time floor at these bytes is bench_sync.py's.

Prints a table; the last stdout line is JSON. Writes
benchmarks/results/lora_<device>_<yyyymm>.md.

    python benchmarks/bench_lora.py                 # qwen2-180m, N=2, T=2, rank 16, 3 jobs x 3 steps
    python benchmarks/bench_lora.py --quick         # tiny preset, adapter only, 1 job x 2 steps
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("full", "merge", "adapter")
WARMUP = 2  # unmeasured steps of every job


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-180m", help="model size (models/tiny.py PRESETS)")
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--tp", type=int, default=None, help="rollout TP size T (default N)")
    p.add_argument("--lora-rank", type=int, default=16, help="model.lora_rank of merge, adapter")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="K completions per prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="max new tokens per completion")
    p.add_argument("--jobs", type=int, default=3, help="fresh jobs per mode")
    p.add_argument("--repeats", type=int, default=3, help="measured steps per job")
    p.add_argument("--quick", action="store_true",
                   help="tiny preset, adapter mode, 1 job x 2 steps (the test's run)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    p.add_argument("--_rank-job", dest="rank_job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.modes, args.jobs, args.repeats = "tiny", ["adapter"], 1, 2
        args.prompts, args.max_tokens = 4, 16
    return args


# --- on every rank, under torchrun ------------------------------------------------

def _config(args: argparse.Namespace, mode: str, model: str):  # noqa: ANN202
    from hybrid_engine.config import RunConfig, apply_overrides

    lora = {} if mode == "full" else {"model.lora_rank": args.lora_rank, "sync.lora": mode}
    return apply_overrides(RunConfig(), {
        "model.path": model, "rollout.tensor_parallel_size": args.tp or args.nproc,
        "rollout.max_tokens": args.max_tokens, "rollout.max_model_len": args.max_tokens + 64,
        "rollout.enforce_eager": True, "memory.kv_cache_gib": 0.5,
        "train.micro_batch_size": 8, "train.lr": 1e-5,
        # sharded training, the sync's general case (replicated, nothing would move)
        "train.sharding": "full", **lora})


def _rank_job(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from hybrid_engine.job import make_policy
    from hybrid_engine.policy.training import completions_to_trajectories

    mode, model = args.rank_job.split("|")
    actor = make_policy(_config(args, mode, model))
    prompts = [f"{i}+{i + 7}=" for i in range(args.prompts)]
    steps = []
    try:
        for i in range(WARMUP + args.repeats):
            t0 = time.perf_counter()
            out = actor.generate(prompts, num_samples=args.samples, seed=i)
            gen_s = time.perf_counter() - t0
            trajs = completions_to_trajectories(out)
            for j, t in enumerate(trajs):
                t.advantages = [1.0 if j % 2 else -1.0] * len(t.response_ids)
            actor.train_step(trajs)
            sync = actor.sync_weights()
            steps.append({"tokens": sum(len(t) for t in out.token_ids), "generate_s": gen_s,
                          "sync_s": sync["sync_s"], "sync_bytes": sync["sync_bytes_received"]})
        gathered = [None] * dist.get_world_size()
        mine = {"steps": steps[WARMUP:], "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                * 1024, "bytes_min": _bytes_min(actor)}
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() == 0:
            print(json.dumps({"mode": mode, "ranks": gathered}), flush=True)
    finally:
        actor.shutdown()


def _bytes_min(actor) -> int:  # noqa: ANN001
    """The planner's minimum bytes this rank receives per sync, in the wire dtype."""
    import torch

    sync = actor.syncer
    itemsize = torch.empty((), dtype=sync.wire_dtype).element_size()
    return sync.plan.elements_received(sync.rank) * itemsize


# --- the parent ------------------------------------------------------------------

def _run_job(args: argparse.Namespace, mode: str, model: Path, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", str(Path(__file__).resolve()), *argv,
           f"--_rank-job={mode}|{model}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"mode"')]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{mode} job failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    print(f"  {mode}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(lines[-1])


def _per_step(job: dict) -> list[dict]:
    """A job's measured steps, each over its ranks: tokens/s of all replicas over
    the slowest rank's generate seconds (TP ranks of a replica return the same
    tokens, counted once), the slowest rank's sync, the most bytes any received."""
    ranks, tp_ranks = job["ranks"], job["tp"]
    out = []
    for i in range(len(ranks[0]["steps"])):
        s = [r["steps"][i] for r in ranks]
        tokens = sum(x["tokens"] for x in s[::tp_ranks])
        out.append({"tok_s": tokens / max(x["generate_s"] for x in s),
                    "sync_s": max(x["sync_s"] for x in s),
                    "sync_bytes": max(x["sync_bytes"] for x in s)})
    return out


def _summarize(jobs: dict[str, list[dict]]) -> dict:
    import _stats

    rows, series = {}, {}
    for mode, js in jobs.items():
        steps = [_per_step(j) for j in js]
        series[mode] = {k: [[s[k] for s in job] for job in steps] for k in ("tok_s", "sync_s")}
        peaks = [max(r["peak_rss"] for r in j["ranks"]) for j in js]
        rows[mode] = {
            "tok_s": _stats.describe(series[mode]["tok_s"]),
            "sync_s": _stats.describe(series[mode]["sync_s"]),
            "sync_bytes": max(s["sync_bytes"] for job in steps for s in job),
            "bytes_min": max(r["bytes_min"] for r in js[0]["ranks"]),
            "peak_rss": _stats.describe(peaks), "peak_rss_jobs": peaks}
    ratios = {}
    for a, b, key in (("merge", "adapter", "sync_s"), ("full", "adapter", "sync_s"),
                      ("merge", "adapter", "tok_s"), ("full", "merge", "tok_s")):
        if a in series and b in series:
            ratios[f"{a}/{b} {key}"] = {
                "ratio": _stats.ratio(series[a][key], series[b][key]),
                "ci": _stats.ratio_ci(series[a][key], series[b][key], paired=False)}
    return {"rows": rows, "ratios": ratios}


def _table(summary: dict) -> str:
    lines = ["| mode | sync s (IQR) | sync MB/rank | min MB/rank | gen tok/s (IQR) "
             "| peak RSS MB/rank (range) |", "|---|---|---|---|---|---|"]
    for mode, r in summary["rows"].items():
        lines.append(
            f"| {mode} | {r['sync_s']['median']:.4f} ({r['sync_s']['iqr']:.4f}) "
            f"| {r['sync_bytes'] / 1e6:.3f} | {r['bytes_min'] / 1e6:.3f} "
            f"| {r['tok_s']['median']:.0f} ({r['tok_s']['iqr']:.0f}) "
            f"| {r['peak_rss']['median'] / 2**20:.0f} ({r['peak_rss']['min'] / 2**20:.0f}"
            f"-{r['peak_rss']['max'] / 2**20:.0f}) |")
    lines += ["", "| ratio | median | 95% CI |", "|---|---|---|"]
    for name, r in summary["ratios"].items():
        lines.append(f"| {name} | {r['ratio']:.2f} | [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _args(argv)
    if args.rank_job:
        _rank_job(args)
        return
    argv = list(argv if argv is not None else sys.argv[1:])
    sys.path.insert(0, str(REPO))
    from _common import preset_model, result_header, result_path

    from hybrid_engine.models.tiny import PRESETS

    model = preset_model(args.cache_dir, args.preset)
    t0, jobs = time.perf_counter(), {m: [] for m in args.modes}
    for j in range(args.jobs):
        for mode in args.modes[j % len(args.modes):] + args.modes[:j % len(args.modes)]:
            print(f"job {j + 1}/{args.jobs}: {mode} ...", file=sys.stderr, flush=True)
            jobs[mode].append({**_run_job(args, mode, model, argv), "tp": args.tp or args.nproc})
    summary = _summarize(jobs)
    table = _table(summary)
    print(table)
    path = result_path(args.out_dir, "lora", quick=args.quick)
    result = {"preset": args.preset, "model_params": PRESETS[args.preset].num_params,
              "nproc": args.nproc, "tp": args.tp or args.nproc, "lora_rank": args.lora_rank,
              "jobs": args.jobs, "repeats": args.repeats, "prompts": args.prompts,
              "samples": args.samples, "max_tokens": args.max_tokens,
              "wall_s": time.perf_counter() - t0, **summary}
    path.write_text(result_header(__file__, argv) + __doc__.split("\n\n")[1] + "\n\n"
                    + table + f"\n\nWall time: {result['wall_s']:.0f} s.\n\n```json\n"
                    + json.dumps(result, indent=1) + "\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps({**result, "result_file": str(path)}))


if __name__ == "__main__":
    main()
