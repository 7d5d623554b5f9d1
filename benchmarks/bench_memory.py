"""How much memory does a whole RL step hold per rank: colocated, resident, separate?

Fresh torchrun jobs of N ranks per mode (--jobs of each, modes in rotating
order), the same model, prompts, sampling and seeds:

- colocated: the hybrid engine as shipped: before training the engine
  releases its memory (GPU: vLLM sleep level 2; CPU: the KV cache, the only
  thing vLLM-CPU can drop) and regrows it before generation;
- resident: the naive colocation: trainer and engine both stay resident
  (`memory.release=false`);
- separate: `placement=separate` on the same N ranks: the first N/2 only
  train (in the layout train.sharding=auto picks), the last N/2 only roll out (vLLM, T = N/2 unless
  --tp); reported for the trainer ranks and the rollout ranks apart.

Each rank runs warmup steps, then one measured step of generate -> score (the
trainer's log-probs of the samples, what a reference forward costs) -> train
-> sync, while a thread samples its RSS every 5 ms. The headline is the
WHOLE-STEP peak RSS of a rank (the biggest rank of each mode and role; median
and range over the jobs): what a device must hold, whichever phase needs it.
Per phase: peak RSS, RSS at the phase's end, and tracked bytes (trainer
parameters + gradients + optimizer state, engine weights, engine packed
weights, KV cache).

vLLM-CPU packs the linear weights (and a copy of the embedding and lm_head)
into oneDNN handles after loading; those are not tensors, so they are counted
apart: bytes computed from each packed layer's shape and dtype
(out x in / T x itemsize; oneDNN's packed buffer measured within 1% of that
for 768..16000-wide bf16 matrices). The engine's plain tensors (embedding,
the stale lm_head, norms, biases) are counted as engine weights.

The KV cache is sized to the workload by default: the sequences one engine
holds at once (prompts per replica x K) x (longest prompt + max_tokens)
tokens, in whole vLLM-CPU blocks of 128 tokens, x KV bytes per token per
rank. --kv-cache-gib sweeps explicit sizes instead (every mode at each size).
The KV cache is a setting, not a saving: what colocation saves is the part
of it that is released while training and that training would otherwise
stack on top of.

Prints a table; the last stdout line is JSON. Writes
benchmarks/results/memory_<device>_<yyyymm>.md and a timeline chart (.png).

    python benchmarks/bench_memory.py                  # qwen2-180m, N=2, 3 jobs per mode (~5-6 min)
    python benchmarks/bench_memory.py --quick          # tiny preset, 1 job per mode
    python benchmarks/bench_memory.py --kv-cache-gib 0.25 1   # sweep the KV size
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "train", "sync")
MODES = ("colocated", "resident", "separate")
# vLLM-CPU's KV block, in tokens (its platform default; checked against the engine's).
VLLM_CPU_BLOCK = 128


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-180m",
                   help="tiny-model preset (hybrid_engine.models.tiny)")
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--tp", type=int, default=None,
                   help="rollout TP size T (default N colocated, N/2 separate)")
    p.add_argument("--kv-cache-gib", type=float, nargs="+", default=None,
                   help="KV cache sizes per rank to sweep (default: sized to the workload)")
    p.add_argument("--prompts", type=int, default=4,
                   help="prompts per step (x K); with K=4 and N=2 one micro-batch of 8 per "
                        "rank, the train step's activation peak (train.micro_batch_size=8)")
    p.add_argument("--samples", type=int, default=4, help="K completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="max new tokens per completion")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--jobs", type=int, default=3, help="fresh jobs per mode (and KV size)")
    p.add_argument("--quick", action="store_true", help="the tiny preset, 1 job per mode")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    p.add_argument("--_rank-job", dest="rank_job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.jobs = "tiny", 1
    for name in ("nproc", "prompts", "samples", "max_tokens", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.kv_cache_gib and min(args.kv_cache_gib) <= 0:
        p.error("--kv-cache-gib sizes must be > 0")
    return args


def _prompts(n: int) -> list[str]:
    return [f"{i}+{i + 7}=" for i in range(n)]


def _max_model_len(args: argparse.Namespace) -> int:
    return args.max_tokens + 64  # the prompts are a few tokens


# --- on every rank, under torchrun --------------------------------------------


class _Sampler:
    """RSS of this process every 5 ms, with the phase it falls in."""

    def __init__(self) -> None:
        import psutil

        self.proc, self.t0 = psutil.Process(), time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self.spans: list[tuple[str, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, self.proc.memory_info().rss))
            time.sleep(0.005)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @contextlib.contextmanager
    def phase(self, name: str):  # noqa: ANN201
        a = time.perf_counter() - self.t0
        yield
        self.spans.append((name, a, time.perf_counter() - self.t0))


def _tracked_bytes(actor, packed: int) -> dict[str, int]:  # noqa: ANN001
    """Bytes of what each layout holds right now (this rank's shards; 0 for a
    layout this rank does not hold, under separate placement)."""
    tr, engine = actor.trainer, actor.rollout
    out = {"trainer_params": 0, "trainer_grads": 0, "trainer_optim": 0,
           # the plain tensors: weight_bytes() counts the packed copies too
           "engine_weights": engine.weight_bytes() - packed if engine is not None else 0,
           "engine_packed": packed,
           "kv_cache": engine.kv_cache_bytes() if engine is not None else 0}
    if tr is None:
        return out

    def local(t):  # noqa: ANN001, ANN202
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()

    params = [p for p in tr.module.parameters()]
    optim = sum(local(v) for state in tr.optimizer.state.values() for v in state.values()
                if hasattr(v, "untyped_storage"))
    return {**out, "trainer_params": sum(local(p) for p in params),
            "trainer_grads": sum(local(p.grad) for p in params if p.grad is not None),
            "trainer_optim": optim}


def _tp(args: argparse.Namespace, mode: str) -> int:
    return args.tp or (max(1, args.nproc // 2) if mode == "separate" else args.nproc)


def _rank_job(args: argparse.Namespace) -> None:
    from hybrid_engine.policy.training import completions_to_trajectories
    from hybrid_engine.config import RunConfig, apply_overrides
    from hybrid_engine.job import make_policy
    from hybrid_engine.rollout import vllm_compat

    mode, model, kv_bytes = args.rank_job.split("|")
    cfg = apply_overrides(RunConfig(), {
        "model.path": model, "rollout.tensor_parallel_size": _tp(args, mode),
        "rollout.max_tokens": args.max_tokens,
        "rollout.max_model_len": _max_model_len(args),
        "memory.kv_cache_gib": int(kv_bytes) / 2**30,
        "rollout.enforce_eager": True, "memory.release": mode == "colocated",
        "train.micro_batch_size": 8, "train.lr": 1e-5,
        "placement": "separate" if mode == "separate" else "colocated"})
    actor = make_policy(cfg)
    engine = actor.rollout
    packed = vllm_compat.cpu_packed_bytes(engine._model()) if engine is not None else 0
    prompts = _prompts(args.prompts)
    sampler = _Sampler()
    rows: dict[str, dict] = {}

    def step(measure: bool, seed: int) -> None:
        def phase(name):  # noqa: ANN001, ANN202
            return sampler.phase(name) if measure else contextlib.nullcontext()

        with phase("generate"):
            trajs = completions_to_trajectories(actor.generate(prompts, num_samples=args.samples,
                                                               seed=seed))
        if measure:
            rows["generate"] = _tracked_bytes(actor, packed)
        with phase("score"):
            actor.compute_logprobs(trajs)
        if measure:
            rows["score"] = _tracked_bytes(actor, packed)
        for i, t in enumerate(trajs):
            t.advantages = [1.0 if i % 2 else -1.0] * len(t.response_ids)
        with phase("train"):
            actor.train_step(trajs)
        if measure:
            rows["train"] = _tracked_bytes(actor, packed)
        with phase("sync"):
            actor.sync_weights()
        if measure:
            rows["sync"] = _tracked_bytes(actor, packed)

    try:
        for i in range(args.warmup):
            step(False, seed=i)
        sampler.start()
        step(True, seed=100)
        sampler.stop()
        role = "" if mode != "separate" else (" (train ranks)" if actor.is_trainer
                                               else " (rollout ranks)")
        block = engine.kv_blocks()[0] if engine is not None else None
        out = {"mode": mode + role, "rank": actor.rank, "spans": sampler.spans,
               "samples": sampler.samples, "tracked": rows, "block_size": block,
               "released_bytes": getattr(actor, "released_bytes", 0)}
        Path(os.environ["BENCH_OUT"]).joinpath(f"{mode}-rank{actor.rank}.json").write_text(json.dumps(out))
    finally:
        actor.shutdown()


# --- the parent: KV sizes ---------------------------------------------------------


def _kv_need(args: argparse.Namespace, spec, mode: str, prompt_lens: list[int]) -> dict:  # noqa: ANN001
    """The KV cache one rank's engine needs for this workload in this mode:
    its replica's sequences at once, each in whole blocks, at the mode's T."""
    tp = _tp(args, mode)
    rollout_ranks = args.nproc // 2 if mode == "separate" else args.nproc
    replicas = max(1, rollout_ranks // tp)
    seqs = math.ceil(len(prompt_lens) / replicas) * args.samples
    blocks_per_seq = math.ceil((max(prompt_lens) + args.max_tokens) / VLLM_CPU_BLOCK)
    min_blocks = math.ceil(_max_model_len(args) / VLLM_CPU_BLOCK)  # vLLM: one longest request
    blocks = max(seqs * blocks_per_seq, min_blocks)
    per_token = 2 * spec.num_layers * max(1, spec.num_kv_heads // tp) * spec.resolved_head_dim * 2
    block_bytes = per_token * VLLM_CPU_BLOCK
    return {"seqs": seqs, "blocks": blocks, "kv_bytes_per_token": per_token,
            "tokens": seqs * (max(prompt_lens) + args.max_tokens),
            # + half a block: vLLM floors bytes to blocks; the half keeps the count exact.
            "bytes": blocks * block_bytes + block_bytes // 2}


# --- the parent: one job, and what it measured -------------------------------------


def _run_job(args: argparse.Namespace, mode: str, model: Path, kv_bytes: int, tmp: Path,
             argv: list[str]) -> list[dict]:
    """One torchrun job of one mode; returns each rank's result."""
    out = tmp / f"{mode}-{time.monotonic_ns()}"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", str(Path(__file__).resolve()), *argv,
           f"--_rank-job={mode}|{model}|{kv_bytes}"]
    env = {**os.environ, "BENCH_OUT": str(out),
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        tb = text.find("Traceback")
        raise SystemExit(f"{mode} failed:\n{text[tb:tb + 4000] if tb >= 0 else ''}\n{text[-3000:]}")
    print(f"  {mode}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def _phase_rows(results: list[dict]) -> list[dict]:
    """Per phase, the biggest rank among `results` (one role of one job)."""
    rows = []
    for ph in PHASES:
        peak, end, tracked = 0, 0, {}
        for r in results:
            (_, a, b), = [s for s in r["spans"] if s[0] == ph]
            inside = [rss for t, rss in r["samples"] if a <= t <= b] or [0]
            after = [rss for t, rss in r["samples"] if t >= b][:1] or inside[-1:]
            peak, end = max(peak, max(inside)), max(end, after[0])
            tracked = max(tracked, r["tracked"][ph], key=lambda d: sum(d.values()) if d else -1)
        rows.append({"phase": ph, "peak_rss_bytes": peak, "end_rss_bytes": end,
                     **{f"{k}_bytes": v for k, v in tracked.items()},
                     "tracked_bytes": sum(tracked.values())})
    return rows


def _whole_step_peak(results: list[dict]) -> int:
    """The biggest rank's peak RSS over the whole measured step."""
    peaks = []
    for r in results:
        a, b = r["spans"][0][1], r["spans"][-1][2]
        peaks.append(max(rss for t, rss in r["samples"] if a <= t <= b))
    return max(peaks)


def _label(mode: str, kv_gib: float | None) -> str:
    return mode if kv_gib is None else f"{mode}, KV {kv_gib:g} GiB"


# --- the parent: output --------------------------------------------------------------


def _peak_table(peaks: dict[str, dict], kv: dict[str, int], packed: dict[str, int],
                ref: dict[str, str]) -> str:
    mb = 2**20
    out = ["| mode | KV cache/rank MB | packed engine weights MB | whole-step peak RSS/rank MB, "
           "median (min-max) | vs resident |", "|---|---|---|---|---|"]
    for label, p in peaks.items():
        base = ref.get(label)
        vs = (f"{(p['median'] - peaks[base]['median']) / peaks[base]['median']:+.1%}"
              if base and base != label else "")
        out.append(f"| {label} | {kv[label] / mb:.1f} | {packed[label] / mb:.1f} | "
                   f"{p['median'] / mb:.0f} ({p['min'] / mb:.0f}-{p['max'] / mb:.0f}) | {vs} |")
    return "\n".join(out)


def _phase_table(rows: list[dict]) -> str:
    head = ("| mode | phase | peak RSS MB | RSS after MB | tracked MB | trainer (p+g+opt) MB | "
            "engine weights MB | packed weights MB | KV cache MB |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    mb = 2**20
    for r in rows:
        trainer = r["trainer_params_bytes"] + r["trainer_grads_bytes"] + r["trainer_optim_bytes"]
        out.append(f"| {r['mode']} | {r['phase']} | {r['peak_rss_bytes'] / mb:.0f} | "
                   f"{r['end_rss_bytes'] / mb:.0f} | {r['tracked_bytes'] / mb:.0f} | {trainer / mb:.0f} | "
                   f"{r['engine_weights_bytes'] / mb:.0f} | {r['engine_packed_bytes'] / mb:.0f} | "
                   f"{r['kv_cache_bytes'] / mb:.1f} |")
    return "\n".join(out)


def _chart(results: dict[str, dict], path: Path) -> None:
    """RSS of the first rank of each mode (and role) through the measured step,
    phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), sharey=True,
                             squeeze=False)
    colors = dict(zip(PHASES, ("#cfe2f3", "#d9ead3", "#fce5cd", "#ead1dc"), strict=True))
    for ax, (mode, r) in zip(axes[:, 0], results.items(), strict=True):
        t0 = r["spans"][0][1]
        for name, a, b in r["spans"]:
            ax.axvspan(a - t0, b - t0, color=colors[name], label=name)
        ax.plot([t - t0 for t, _ in r["samples"]], [rss / 2**20 for _, rss in r["samples"]],
                color="black", lw=1)
        ax.set_title(f"{mode}: rank {r['rank']} RSS through one step")
        ax.set_ylabel("MB")
        ax.legend(loc="lower right", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = _args(argv)
    if args.rank_job:
        _rank_job(args)
        return
    argv = list(argv if argv is not None else sys.argv[1:])
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from _common import preset_model
    from _stats import describe
    from hybrid_engine.models.tiny import PRESETS

    model = preset_model(args.cache_dir, args.preset)
    spec = PRESETS[args.preset]
    tok = AutoTokenizer.from_pretrained(str(model))
    prompt_lens = [len(tok.encode(p, add_special_tokens=False)) for p in _prompts(args.prompts)]
    need = {m: _kv_need(args, spec, m, prompt_lens) for m in MODES}
    sizes = args.kv_cache_gib or [None]
    t_start = time.perf_counter()
    per_job: dict[str, list[dict]] = {}  # label -> one entry per job
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
        for kv_gib in sizes:
            for j in range(args.jobs):
                for mode in MODES[j % 3:] + MODES[:j % 3]:  # rotate which mode runs first
                    kv_bytes = need[mode]["bytes"] if kv_gib is None else int(kv_gib * 2**30)
                    print(f"job {j + 1}/{args.jobs}: {mode}, KV {kv_bytes / 2**20:.1f} MiB ...",
                          file=sys.stderr, flush=True)
                    results = _run_job(args, mode, model, kv_bytes, Path(tmp), argv)
                    for role in sorted({r["mode"] for r in results}, reverse=True):  # train first
                        mine = [r for r in results if r["mode"] == role]
                        blocks = {r["block_size"] for r in mine} - {None}
                        if blocks - {VLLM_CPU_BLOCK}:
                            raise SystemExit(f"vLLM's KV block is {blocks} tokens; the sizing "
                                             f"assumed {VLLM_CPU_BLOCK}: update VLLM_CPU_BLOCK")
                        per_job.setdefault(_label(role, kv_gib), []).append({
                            "peak": _whole_step_peak(mine), "phases": _phase_rows(mine),
                            "released": max(r["released_bytes"] for r in mine),
                            "first_rank": min(mine, key=lambda r: r["rank"])})
    wall = time.perf_counter() - t_start
    labels = list(per_job)
    peaks = {lb: {**describe([float(j["peak"]) for j in per_job[lb]]),
                  "jobs": [j["peak"] for j in per_job[lb]]} for lb in labels}
    # Per-phase rows: peak RSS as the median over jobs; tracked bytes (identical) from job 1.
    rows = []
    for lb in labels:
        for i, ph in enumerate(PHASES):
            r = dict(per_job[lb][0]["phases"][i])
            for key in ("peak_rss_bytes", "end_rss_bytes"):
                r[key] = int(statistics.median(j["phases"][i][key] for j in per_job[lb]))
            rows.append({"mode": lb, **r})
    phase = {(r["mode"], r["phase"]): r for r in rows}
    kv = {lb: max(phase[(lb, ph)]["kv_cache_bytes"] for ph in PHASES) for lb in labels}
    packed = {lb: phase[(lb, "generate")]["engine_packed_bytes"] for lb in labels}
    ref = {lb: lb.replace("colocated", "resident") for lb in labels if lb.startswith("colocated")}
    peak_table = _peak_table(peaks, kv, packed, ref)
    phase_table = _phase_table(rows)
    print(peak_table)
    print()
    print(phase_table)

    from _common import result_header, result_path

    mb = 2**20
    path = result_path(args.out_dir, "memory", quick=args.quick)
    charted = [lb for lb in labels if sizes == [None] or lb.endswith(_label("", sizes[-1]))]
    _chart({lb: per_job[lb][0]["first_rank"] for lb in charted}, path.with_suffix(".png"))
    col, res = labels[0], ref.get(labels[0], labels[0])
    summary = {
        "preset": args.preset, "model_params": spec.num_params,
        "world_size": args.nproc, "nproc": args.nproc, "tp": _tp(args, "colocated"),
        "separate_tp": _tp(args, "separate"), "jobs": args.jobs,
        "prompts": args.prompts, "samples": args.samples, "max_tokens": args.max_tokens,
        "prompt_tokens_max": max(prompt_lens), "kv_sizing": "workload" if sizes == [None] else "sweep",
        "kv_need": need,
        "whole_step_peak_bytes": peaks,
        "whole_step_peak_mb": {lb: p["median"] / mb for lb, p in peaks.items()},
        "colocated_vs_resident": (peaks[col]["median"] - peaks[res]["median"]) / peaks[res]["median"],
        "kv_cache_bytes": kv, "kv_cache_mb": kv[col] / mb,
        "packed_weight_bytes": packed,
        "peak_rss_bytes": {lb: p["median"] for lb, p in peaks.items()},
        "train_peak_rss_bytes": {lb: phase[(lb, "train")]["peak_rss_bytes"] for lb in labels},
        "released_bytes_per_rank": max(j["released"] for j in per_job[col]),
        "wall_s": wall, "phases": rows,
    }
    sep = {lb: peaks[lb]["median"] for lb in labels if lb.startswith("separate")}
    path.write_text(
        result_header(__file__, argv, after_cores=f"; {wall:.0f} s") +
        f"Model {args.preset} ({spec.num_params / 1e6:.1f}M params), N={args.nproc} "
        f"(colocated T={_tp(args, 'colocated')}; separate: {args.nproc - args.nproc // 2} train "
        f"rank(s), {args.nproc // 2} rollout rank(s), T={_tp(args, 'separate')}), "
        f"{args.prompts} prompts x K={args.samples}, max_tokens={args.max_tokens} (prompts up to "
        f"{max(prompt_lens)} tokens), {args.jobs} fresh job(s) per mode; the same model, prompts, "
        "sampling and seeds in every mode. "
        + ("KV cache sized to the workload: "
           + "; ".join(f"{m}: {need[m]['seqs']} sequences at once x {need[m]['blocks']} "
                       f"block(s) of {VLLM_CPU_BLOCK} tokens x {need[m]['kv_bytes_per_token']} "
                       f"bytes/token/rank = {need[m]['bytes'] / mb:.1f} MiB/rank" for m in MODES)
           if sizes == [None] else f"KV cache swept: {', '.join(f'{g:g}' for g in sizes)} GiB/rank")
        + ".\n\nHeadline: the whole-step peak RSS of the biggest rank (of each role under "
        "separate placement), median and range over the jobs.\n\n"
        f"{peak_table}\n\n"
        f"Colocated vs resident, whole step: {peaks[col]['median'] / mb:.0f} vs "
        f"{peaks[res]['median'] / mb:.0f} MB ({summary['colocated_vs_resident']:+.1%}). "
        f"Colocation releases the KV cache ({summary['released_bytes_per_rank'] / mb:.1f} MB per "
        "rank) while training; that lowers the whole-step peak only where training would "
        "otherwise stack on top of it. On CPU vLLM has no sleep mode: the engine's weights "
        f"(plain tensors plus {packed[col] / mb:.0f} MB of oneDNN-packed copies, computed from "
        "the layer shapes) stay resident in every phase; on GPU, sleep level 2 also drops the "
        "weights (not measured here). Separate placement releases nothing: "
        + "; ".join(f"{lb} peak at {v / mb:.0f} MB" for lb, v in sep.items())
        + ", with half the ranks for each layout.\n\n"
        "Per phase (median over jobs of the biggest rank's peak; tracked bytes of job 1):\n\n"
        f"{phase_table}\n\n"
        f"![memory timeline]({path.with_suffix('.png').name})\n\n"
        f"```json\n{json.dumps(summary, indent=1)}\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
