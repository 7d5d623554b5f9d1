"""How much memory does each phase of an RL step hold, and what does colocation release?

One torchrun job of N ranks per mode, the same model, prompts, sampling and
seeds:

- colocated: the hybrid engine as shipped: before training the engine
  releases its memory (GPU: vLLM sleep level 2; CPU: the KV cache, the only
  thing vLLM-CPU can drop) and regrows it before generation;
- resident: the naive colocation: trainer and engine both stay resident
  (`rollout.release_memory=false`);
- separate: `placement=separate` on the same N ranks: the first N/2 only
  train (FSDP2 over N/2), the last N/2 only roll out (vLLM, T = N/2 unless
  --tp); reported for the trainer ranks and the rollout ranks apart.

Each rank runs warmup steps, then one measured step of generate -> score (the
trainer's log-probs of the samples, what a reference forward costs) -> train
-> sync, while a thread samples its RSS every 5 ms (CPU) or the CUDA
allocator's peak per phase (GPU). Reported per phase, slowest/biggest rank:
peak RSS, RSS at the phase's end, and tracked tensor bytes (trainer
parameters + gradients + optimizer state, engine weights, KV cache).

Prints a table; the last stdout line is JSON. Writes
benchmarks/results/memory_<device>_<yyyymm>.md and a timeline chart (.png).

    python benchmarks/bench_memory.py                  # small preset, N=2, T=2
    python benchmarks/bench_memory.py --quick          # tiny preset
    python benchmarks/bench_memory.py --preset qwen2-180m
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "train", "sync")
MODES = ("colocated", "resident", "separate")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="tiny-model preset (hybrid_engine.models.tiny)")
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--tp", type=int, default=None,
                   help="rollout TP size T (default N colocated, N/2 separate)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache per rank")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (x K)")
    p.add_argument("--samples", type=int, default=4, help="K completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="max new tokens per completion")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    p.add_argument("--quick", action="store_true", help="the tiny preset")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    p.add_argument("--_rank-job", dest="rank_job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.preset = "tiny"
    return args


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

    def phase(self, name: str):  # noqa: ANN201
        import contextlib

        @contextlib.contextmanager
        def span():  # noqa: ANN202
            import torch

            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            a = time.perf_counter() - self.t0
            yield
            self.spans.append((name, a, time.perf_counter() - self.t0))

        return span()


def _tracked_bytes(actor) -> dict[str, int]:  # noqa: ANN001
    """Bytes of the tensors each layout holds right now (this rank's shards;
    0 for a layout this rank does not hold, under separate placement)."""
    tr, engine = actor.trainer, actor.rollout
    out = {"trainer_params": 0, "trainer_grads": 0, "trainer_optim": 0,
           "engine_weights": engine._weight_bytes() if engine is not None else 0,
           "kv_cache": sum(st.nbytes() for st in engine._kv_storages()) if engine is not None else 0}
    if tr is None:
        return out
    params = sum(p.to_local().untyped_storage().nbytes() if hasattr(p, "to_local")
                 else p.untyped_storage().nbytes() for p in tr.module.parameters())
    grads = sum((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).untyped_storage().nbytes()
                for p in tr.module.parameters() if p.grad is not None)
    optim = 0
    for state in tr.optimizer.state.values():
        for v in state.values():
            if hasattr(v, "untyped_storage"):
                t = v.to_local() if hasattr(v, "to_local") else v
                optim += t.untyped_storage().nbytes()
    return {**out, "trainer_params": params, "trainer_grads": grads, "trainer_optim": optim}


def _tp(args: argparse.Namespace, mode: str) -> int:
    return args.tp or (max(1, args.nproc // 2) if mode == "separate" else args.nproc)


def _rank_job(args: argparse.Namespace) -> None:
    import torch

    from hybrid_engine.actor import completions_to_trajectories
    from hybrid_engine.config import RunConfig, apply_overrides
    from hybrid_engine.job import make_policy

    mode, model = args.rank_job.split("|")
    cfg = apply_overrides(RunConfig(), {
        "model.path": model, "rollout.tensor_parallel_size": _tp(args, mode),
        "rollout.max_tokens": args.max_tokens,
        "rollout.max_model_len": 256, "rollout.kv_cache_gib": args.kv_cache_gib,
        "rollout.enforce_eager": True, "rollout.release_memory": mode == "colocated",
        "train.micro_batch_size": 8, "train.lr": 1e-5,
        "placement": "separate" if mode == "separate" else "colocated"})
    actor = make_policy(cfg)
    prompts = [f"{i}+{i + 7}=" for i in range(args.prompts)]
    sampler = _Sampler()
    rows: dict[str, dict] = {}

    def step(measure: bool, seed: int) -> None:
        def phase(name):  # noqa: ANN001, ANN202
            return sampler.phase(name) if measure else _null()

        with phase("generate"):
            trajs = completions_to_trajectories(actor.generate(prompts, num_samples=args.samples,
                                                               seed=seed))
        if measure:
            rows["generate"] = _tracked_bytes(actor)
        with phase("score"):
            actor.compute_logprobs(trajs)
        if measure:
            rows["score"] = _tracked_bytes(actor)
        for i, t in enumerate(trajs):
            t.advantages = [1.0 if i % 2 else -1.0] * len(t.response_ids)
        with phase("train"):
            actor.train_step(trajs)
        if measure:
            rows["train"] = _tracked_bytes(actor)
        with phase("sync"):
            actor.sync_weights()
        if measure:
            rows["sync"] = _tracked_bytes(actor)

    try:
        for i in range(args.warmup):
            step(False, seed=i)
        sampler.start()
        step(True, seed=100)
        sampler.stop()
        role = "" if mode != "separate" else (" (train ranks)" if actor.is_trainer
                                               else " (rollout ranks)")
        out = {"mode": mode + role, "rank": actor.rank, "spans": sampler.spans,
               "samples": sampler.samples, "tracked": rows,
               "released_bytes": getattr(actor, "released_bytes", 0),
               "cuda_peak": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}
        Path(os.environ["BENCH_OUT"]).joinpath(f"{mode}-rank{actor.rank}.json").write_text(json.dumps(out))
    finally:
        actor.shutdown()


def _null():  # noqa: ANN202
    import contextlib

    return contextlib.nullcontext()


# --- the parent ----------------------------------------------------------------


def _phase_rows(mode: str, results: list[dict]) -> list[dict]:
    rows = []
    for ph in PHASES:
        peak, end, tracked = 0, 0, {}
        for r in results:
            (_, a, b), = [s for s in r["spans"] if s[0] == ph]
            inside = [rss for t, rss in r["samples"] if a <= t <= b] or [0]
            after = [rss for t, rss in r["samples"] if t >= b][:1] or inside[-1:]
            peak, end = max(peak, max(inside)), max(end, after[0])
            tracked = max(tracked, r["tracked"][ph], key=lambda d: sum(d.values()) if d else -1)
        rows.append({"mode": mode, "phase": ph, "peak_rss_bytes": peak, "end_rss_bytes": end,
                     **{f"{k}_bytes": v for k, v in tracked.items()},
                     "tracked_bytes": sum(tracked.values())})
    return rows


def _table(rows: list[dict]) -> str:
    head = ("| mode | phase | peak RSS MB | RSS after MB | tracked MB | trainer (p+g+opt) MB | "
            "engine weights MB | KV cache MB |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    mb = 2**20
    for r in rows:
        trainer = r["trainer_params_bytes"] + r["trainer_grads_bytes"] + r["trainer_optim_bytes"]
        out.append(f"| {r['mode']} | {r['phase']} | {r['peak_rss_bytes'] / mb:.0f} | "
                   f"{r['end_rss_bytes'] / mb:.0f} | {r['tracked_bytes'] / mb:.0f} | {trainer / mb:.0f} | "
                   f"{r['engine_weights_bytes'] / mb:.0f} | {r['kv_cache_bytes'] / mb:.0f} |")
    return "\n".join(out)


def _chart(results: dict[str, dict], path: Path) -> None:
    """RSS of the first rank of each mode (and role) through the measured step,
    phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), sharey=True)
    colors = dict(zip(PHASES, ("#cfe2f3", "#d9ead3", "#fce5cd", "#ead1dc"), strict=True))
    for ax, (mode, r) in zip(axes, results.items(), strict=True):
        t0 = r["spans"][0][1]
        for name, a, b in r["spans"]:
            ax.axvspan(a - t0, b - t0, color=colors[name], label=name)
        ax.plot([t - t0 for t, _ in r["samples"]], [rss / 2**20 for _, rss in r["samples"]],
                color="black", lw=1)
        ax.set_title(f"{mode}: rank {r['rank']} RSS through one step")
        ax.set_ylabel("MB")
        ax.legend(loc="lower right", fontsize=7, ncol=4)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = _args(argv)
    if args.rank_job:
        _rank_job(args)
        return
    sys.path.insert(0, str(REPO))
    from hybrid_engine.cli import env_info
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    model = Path(args.cache_dir) / args.preset
    if not (model / "config.json").is_file():
        write_tiny_model(model, PRESETS[args.preset])
    rows, rank0 = [], {}
    released = {}
    with tempfile.TemporaryDirectory(prefix="bench_memory-") as tmp:
        for mode in MODES:
            print(f"running {mode} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={args.nproc}", str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
                   f"--_rank-job={mode}|{model}"]
            env = {**os.environ, "BENCH_OUT": tmp,
                   "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
            if proc.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
            results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob(f"{mode}-rank*.json"))]
            for label in sorted({r["mode"] for r in results}, reverse=True):  # train ranks first
                mine = [r for r in results if r["mode"] == label]
                rows += _phase_rows(label, mine)
                rank0[label] = min(mine, key=lambda r: r["rank"])
                released[label] = max(r["released_bytes"] for r in mine)
    table = _table(rows)
    print(table)
    info = env_info()
    device = "cpu" if info["device"] == "cpu" else "gpu"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"memory_{device}_{datetime.date.today():%Y%m}"
    _chart(rank0, out_dir / f"{stem}.png")
    labels = list(rank0)
    peak = {m: max(r["peak_rss_bytes"] for r in rows if r["mode"] == m) for m in labels}
    train_rss = {m: next(r["peak_rss_bytes"] for r in rows if r["mode"] == m and r["phase"] == "train")
                 for m in labels}
    summary = {"preset": args.preset, "model_params": PRESETS[args.preset].num_params,
               "world_size": args.nproc, "tp": _tp(args, "colocated"),
               "separate_tp": _tp(args, "separate"),
               "peak_rss_bytes": peak, "train_peak_rss_bytes": train_rss,
               "released_bytes_per_rank": released["colocated"], "phases": rows}
    from _common import result_header

    mb = 2**20
    (out_dir / f"{stem}.md").write_text(
        result_header(__file__, argv) +
        f"Model {args.preset} ({PRESETS[args.preset].num_params / 1e6:.1f}M params), N={args.nproc} "
        f"(colocated T={_tp(args, 'colocated')}; separate: {args.nproc - args.nproc // 2} train "
        f"rank(s), {args.nproc // 2} rollout rank(s), T={_tp(args, 'separate')}), "
        f"{args.prompts} prompts x K={args.samples}, "
        f"max_tokens={args.max_tokens}, KV cache {args.kv_cache_gib:g} GiB/rank; the same "
        "model, prompts, sampling and seeds in every mode. Per phase, the biggest rank (of "
        "each role under separate placement).\n\n"
        f"{table}\n\n"
        f"Colocated releases {released['colocated'] / mb:.0f} MB per rank before training "
        f"(peak RSS while training: {train_rss['colocated'] / mb:.0f} MB colocated vs "
        f"{train_rss['resident'] / mb:.0f} MB resident). On CPU vLLM has no sleep mode: only "
        "the KV cache can be released; the engine's weights stay resident in every phase. "
        "On GPU, sleep level 2 also drops the weights (not measured here: no GPU run). "
        "Separate placement releases nothing: each layout owns its ranks, so a train rank "
        f"peaks at {peak['separate (train ranks)'] / mb:.0f} MB and a rollout rank at "
        f"{peak['separate (rollout ranks)'] / mb:.0f} MB, with half the ranks for each layout.\n\n"
        f"![memory timeline]({stem}.png)\n\n```json\n{json.dumps(summary, indent=1)}\n```\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
