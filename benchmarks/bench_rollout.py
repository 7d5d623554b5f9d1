"""Does colocation slow generation down? Colocated rollout vs a standalone engine.

Two kinds of torchrun job of N ranks each, on the same model, prompts,
sampling parameters, seeds and max_tokens (vLLM bf16, TP = T):

- colocated: a `HybridActor` (FSDP2 fp32 master + AdamW + vLLM) that has
  generated once, taken one `train_step` (so gradients and optimizer state
  exist; the learning rate is negligible so the weights, hence the samples,
  stay those of the file), and gone through the release/regrow cycle: KV
  cache freed for training, regrown, weights re-packed by the sync. Then
  `actor.generate` is timed;
- standalone: a `VLLMRollout` and nothing else; `rollout.generate` is timed.

Each job: one warm-up generate, then --repeats timed ones (barrier, wall
time of the slowest rank). Tokens/s = generated token ids (all replicas:
the returned `Completions` is the same on every rank, checked) / seconds.

The machine is shared and noisy, so the two kinds are measured in the same
time window. --schedule interleaved (default): one job of each kind, both
started at once; once both are warm they take turns, one generate at a time
(the idle job waits on a file, using no CPU), alternating which goes first in
each pair; paired ratio = median over pairs. --schedule sequential: the jobs
run one after the other, --rounds times each, alternating which goes first
(ABBA); paired ratio = median over rounds. Reported: the median tok/s over
all timed repeats of each kind, ratio = colocated / standalone of those
medians (target >= 0.95), the paired ratio, the best-of ratio (fastest repeat
of each kind), and the quiet ratio: medians over the repeats during which
every rank had >= 90% of its core (CPU s / wall s of the generate, 1 thread
per rank), the least load-biased of these on a shared machine; and, as a
rough load correction, the ratio of tok/s divided by that CPU share.

Prints a table; the last stdout line is JSON. Results go to
benchmarks/results/rollout_<device>_<yyyymm>.md.

    python benchmarks/bench_rollout.py                  # small, N=2, T=2
    python benchmarks/bench_rollout.py --quick          # tiny model, < 1 min
    python benchmarks/bench_rollout.py --size qwen2-180m    # ~3 min alone, 5 under load
    python benchmarks/bench_rollout.py --schedule sequential --rounds 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("colocated", "standalone")
QUIET_SHARE = 0.9  # a generate counts as unloaded if each rank got this share of its core


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small",
                   help="tiny-model preset (hybrid_engine.models.tiny.PRESETS)")
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--tp", type=int, default=None, help="rollout TP size T (default N)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per generate")
    p.add_argument("--num-samples", type=int, default=4, help="completions per prompt K")
    p.add_argument("--max-tokens", type=int, default=64, help="max new tokens per completion")
    p.add_argument("--repeats", type=int, default=20,
                   help="timed generates per job (short ones, many: more land in quiet moments)")
    p.add_argument("--schedule", choices=("interleaved", "sequential"), default="interleaved",
                   help="both jobs alive, taking turns per generate; or one job after the other")
    p.add_argument("--rounds", type=int, default=1,
                   help="jobs of each kind, alternating which runs first (ABBA)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache per rank")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM enforce_eager (no torch.compile)")
    p.add_argument("--quick", action="store_true",
                   help="'tiny' preset, 8 prompts x 4 x 32 tokens, 3 repeats")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    p.add_argument("--_rank-job", dest="rank_job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_mode", dest="mode", choices=MODES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_turns", dest="turns", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one job, on every rank (under torchrun) -----------------------------------

def _overrides(args: argparse.Namespace, world: int) -> dict:
    """The run config both kinds of job share (the standalone one uses .rollout)."""
    return {
        "rollout.tensor_parallel_size": args.tp or world,
        "rollout.num_samples_per_prompt": args.num_samples,
        "rollout.max_tokens": args.max_tokens,
        "rollout.max_model_len": args.max_tokens + 64,
        "rollout.kv_cache_gib": args.kv_cache_gib,
        "rollout.enforce_eager": args.eager,
        # One real optimizer step (grads + AdamW state allocated, sync re-packs),
        # but a step too small to move the fp32 weights: both kinds of job then
        # sample the same tokens, and the comparison is exactly like for like.
        "train.lr": 1e-20,
        "train.micro_batch_size": 4,
    }


def _digest(token_ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def _rank_job(args: argparse.Namespace) -> None:
    import psutil
    import torch
    import torch.distributed as dist

    from hybrid_engine.config import RunConfig, apply_overrides

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_dir = args.rank_job
    overrides = _overrides(args, world)
    t_setup = time.perf_counter()
    setup: dict[str, float] = {}
    if args.mode == "colocated":
        from hybrid_engine.actor import HybridActor, completions_to_trajectories

        actor = HybridActor.from_pretrained(model_dir, overrides=overrides)
        rollout, generate = actor.rollout, actor.generate
        # The real colocated state: generate, train (the KV cache is released,
        # gradients and optimizer state are allocated), then back to inference
        # (the KV cache is regrown and committed, the stale weights are synced
        # and re-packed).
        trajs = completions_to_trajectories(
            actor.generate(_prompts(actor.tokenizer, args), seed=10_000))
        trajs = trajs[: 2 * world]  # a short step: the state, not the step, matters here
        for i, t in enumerate(trajs):
            t.advantages = [1.0 if i % 2 else -1.0] * len(t.response_ids)
        with actor.training():
            m = actor.train_step(trajs)
        with actor.inference():
            pass
        setup["released_bytes"] = m["mem_released_bytes"]
        setup["phase_inference"] = float(actor.phase == "inference")
    else:
        from hybrid_engine.roles.vllm_rollout import VLLMRollout

        cfg = apply_overrides(RunConfig(), {**overrides, "model.path": model_dir})
        rollout = VLLMRollout(model_dir, cfg.rollout, dtype=cfg.model.rollout_dtype)
        generate = rollout.generate
    setup["setup_s"] = time.perf_counter() - t_setup
    prompts = _prompts(rollout.tokenizer, args)

    def once(seed: int):
        """(wall s of the slowest rank, lowest CPU share of a rank, Completions)."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        out = generate(prompts, num_samples=args.num_samples, seed=seed)
        wall = time.perf_counter() - t0
        # CPU seconds / wall seconds: ~1 when this rank had its core to itself
        # (1 thread per rank), lower when another process took it from it.
        t = torch.tensor([wall, -(time.process_time() - c0) / wall])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t[0].item(), -t[1].item(), out

    once(seed=999)  # warm-up
    _signal(args, rank, "ready")
    times, shares, tokens, digests = [], [], [], []
    for i in range(args.repeats):
        _wait_turn(args, rank, i)
        t, share, out = once(seed=i)
        _signal(args, rank, f"done{i}")
        times.append(t)
        shares.append(share)
        tokens.append(out.num_tokens)
        digests.append(_digest(out.token_ids))
    # The Completions must be the same on every rank (TP ranks sample alike;
    # replicas are gathered): then rank 0's count is the total over replicas.
    mine = (tokens, digests)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    rss = torch.tensor([float(psutil.Process().memory_info().rss)])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({
            "mode": args.mode, "world_size": world, "tp": args.tp or world,
            "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "times_s": times, "cpu_share": shares, "tokens": tokens, "digests": digests,
            "tok_s": [n / t for n, t in zip(tokens, times, strict=True)],
            "same_on_all_ranks": all(e == mine for e in everyone),
            "rss_max_bytes": int(rss.item()), "torch_threads": torch.get_num_threads(),
            **setup,
        }), flush=True)
    rollout.shutdown()


def _signal(args: argparse.Namespace, rank: int, what: str) -> None:
    """Interleaved schedule: rank 0 tells the driver this job reached `what`."""
    if args.turns and rank == 0:
        (Path(args.turns) / f"{args.mode}.{what}").touch()


def _wait_turn(args: argparse.Namespace, rank: int, i: int) -> None:
    """Interleaved schedule: blocks until the driver gives this job turn i
    (rank 0 polls a file; the other ranks wait in a barrier)."""
    if not args.turns:
        return
    import torch.distributed as dist

    if rank == 0:
        go = Path(args.turns) / f"{args.mode}.go{i}"
        while not go.exists():
            time.sleep(0.005)
    dist.barrier()


def _prompts(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """Fixed arithmetic-environment prompts (token ids): the same in every job."""
    from hybrid_engine.envs.arithmetic import ArithmeticEnv

    return ArithmeticEnv(tokenizer, seed=1234).sample_prompts(args.num_prompts)


# --- driver --------------------------------------------------------------------

def _model(args: argparse.Namespace) -> tuple[Path, int]:
    from hybrid_engine.models.tiny import PRESETS, hf_param_shapes, write_tiny_model

    folder = Path(args.cache_dir) / args.size
    if not (folder / "model.safetensors").exists():
        write_tiny_model(folder, PRESETS[args.size])
    n_params = sum(math.prod(s) for s in hf_param_shapes(PRESETS[args.size]).values())
    return folder, n_params


def _job_cmd(args: argparse.Namespace, folder: Path, mode: str, turns: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", __file__, "--_rank-job", str(folder),
           f"--_mode={mode}", f"--num-prompts={args.num_prompts}",
           f"--num-samples={args.num_samples}", f"--max-tokens={args.max_tokens}",
           f"--repeats={args.repeats}", f"--kv-cache-gib={args.kv_cache_gib}",
           "--eager" if args.eager else "--no-eager"]
    if args.tp:
        cmd.append(f"--tp={args.tp}")
    if turns:
        cmd.append(f"--_turns={turns}")
    return cmd


class _Job:
    """One torchrun job, its output to a file (vLLM logs a lot)."""

    def __init__(self, args: argparse.Namespace, folder: Path, mode: str, logs: Path,
                 turns: str | None = None) -> None:
        self.mode = mode
        self.log = logs / f"{mode}-{time.monotonic_ns()}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
        self.t0 = time.perf_counter()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(_job_cmd(args, folder, mode, turns), stdout=f,
                                         stderr=subprocess.STDOUT, text=True, env=env)

    def check(self) -> None:
        """Raises SystemExit (after killing this job) if it died early."""
        if self.proc.poll() not in (None, 0):
            self.fail()

    def fail(self) -> None:
        self.kill()
        text = self.log.read_text()
        first_tb = text.find("Traceback")  # the root cause, not torchrun's summary
        sys.stderr.write((text[first_tb:first_tb + 6000] + "\n...\n" if first_tb >= 0 else "")
                         + text[-3000:])
        raise SystemExit(f"bench job {self.mode} failed (exit {self.proc.returncode})")

    def kill(self) -> None:
        """Kills torchrun and its workers (which torchrun starts in sessions of their own)."""
        from hybrid_engine.testing import kill_tree

        kill_tree(self.proc.pid)
        self.proc.poll()

    def result(self, timeout: float = 600.0) -> dict:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.fail()
        lines = [ln for ln in self.log.read_text().splitlines() if ln.startswith("{")]
        if self.proc.returncode != 0 or not lines:
            self.fail()
        res = json.loads(lines[-1])
        res["job_s"] = time.perf_counter() - self.t0
        print(f"  {self.mode:<10} tok/s {' '.join(f'{x:8.1f}' for x in res['tok_s'])}  "
              f"(job {res['job_s']:.0f} s)", file=sys.stderr, flush=True)
        return res


def _wait_file(path: Path, jobs: list[_Job], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for j in jobs:
            j.check()
        if time.monotonic() > deadline:
            for j in jobs:
                j.kill()
            raise SystemExit(f"timed out waiting for {path.name}")
        time.sleep(0.01)


def _run_sequential(args: argparse.Namespace, folder: Path, logs: Path) -> list[dict]:
    results = []
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            job = _Job(args, folder, mode, logs)
            try:
                results.append(job.result())
            finally:
                job.kill()
    return results


def _run_interleaved(args: argparse.Namespace, folder: Path, logs: Path) -> list[dict]:
    turns = logs / "turns"
    turns.mkdir()
    jobs = {m: _Job(args, folder, m, logs, str(turns)) for m in MODES}
    try:
        for m in MODES:
            _wait_file(turns / f"{m}.ready", list(jobs.values()))
        for i in range(args.repeats):
            for m in (MODES if i % 2 == 0 else MODES[::-1]):
                (turns / f"{m}.go{i}").touch()
                _wait_file(turns / f"{m}.done{i}", list(jobs.values()))
        return [jobs[m].result() for m in MODES]
    finally:
        for j in jobs.values():
            j.kill()


def _summary(args: argparse.Namespace, n_params: int, jobs: list[dict]) -> dict:
    by = {m: [j for j in jobs if j["mode"] == m] for m in MODES}
    tok_s = {m: [x for j in by[m] for x in j["tok_s"]] for m in MODES}
    med = {m: statistics.median(tok_s[m]) for m in MODES}
    share = {m: [x for j in by[m] for x in j["cpu_share"]] for m in MODES}
    # Generates during which every rank had its core (nothing else ran on the machine).
    quiet = {m: [x for x, c in zip(tok_s[m], share[m], strict=True) if c >= QUIET_SHARE]
             for m in MODES}
    quiet_med = {m: statistics.median(quiet[m]) if quiet[m] else None for m in MODES}
    # Tokens per CPU-second of the most starved rank: roughly load-independent
    # (assumes the speed scales with the CPU share; TP ranks also wait on each other).
    per_cpu = {m: statistics.median(x / c for x, c in zip(tok_s[m], share[m], strict=True))
               for m in MODES}
    if args.schedule == "interleaved":  # pairs of back-to-back generates
        pairs = [c / s for c, s in zip(tok_s["colocated"], tok_s["standalone"], strict=True)]
    else:  # rounds: ratio of the medians of the two jobs of a round
        pairs = [statistics.median(c["tok_s"]) / statistics.median(s["tok_s"])
                 for c, s in zip(by["colocated"], by["standalone"], strict=True)]
    digests = {m: [d for j in by[m] for d in j["digests"]] for m in MODES}
    first = jobs[0]
    return {
        "model": args.size, "model_params": n_params,
        "world_size": first["world_size"], "tp": first["tp"],
        "num_prompts": first["num_prompts"], "num_samples": args.num_samples,
        "max_tokens": args.max_tokens, "schedule": args.schedule, "repeats": args.repeats,
        "rounds": args.rounds if args.schedule == "sequential" else 1,
        "colocated_tok_s": med["colocated"], "standalone_tok_s": med["standalone"],
        "ratio": med["colocated"] / med["standalone"],
        "ratio_paired": statistics.median(pairs),
        "ratios": pairs,
        # Noise on a shared machine only ever slows a generate down: the best
        # repeat of each kind is the other estimate of its unloaded speed.
        "colocated_tok_s_best": max(tok_s["colocated"]),
        "standalone_tok_s_best": max(tok_s["standalone"]),
        "ratio_best": max(tok_s["colocated"]) / max(tok_s["standalone"]),
        "colocated_tok_s_quiet": quiet_med["colocated"],
        "standalone_tok_s_quiet": quiet_med["standalone"],
        "ratio_quiet": (quiet_med["colocated"] / quiet_med["standalone"]
                        if None not in quiet_med.values() else None),
        "quiet_repeats": {m: len(quiet[m]) for m in MODES},
        "ratio_per_cpu_s": per_cpu["colocated"] / per_cpu["standalone"],
        "cpu_share": share,
        "colocated_tok_s_all": tok_s["colocated"], "standalone_tok_s_all": tok_s["standalone"],
        "tokens_per_generate": {m: sorted({n for j in by[m] for n in j["tokens"]}) for m in MODES},
        # Same seeds, same weights (the train step's lr is negligible): the same tokens.
        "same_tokens": digests["colocated"] == digests["standalone"],
        "same_on_all_ranks": all(j["same_on_all_ranks"] for j in jobs),
        "rss_max_bytes": {m: max(j["rss_max_bytes"] for j in by[m]) for m in MODES},
        "kv_released_bytes": max(j.get("released_bytes", 0) for j in by["colocated"]),
        "torch_threads": first["torch_threads"],
        "setup_s": {m: statistics.median(j["setup_s"] for j in by[m]) for m in MODES},
    }


def _table(s: dict) -> str:
    head = ("| model | params | N | T | prompts x K x max_tokens | colocated tok/s | standalone tok/s "
            "| ratio | paired ratio (min-max) | best-of ratio | quiet ratio (repeats) "
            "| per-CPU-s ratio | same tokens | RSS/rank colocated | RSS/rank standalone |")
    return "\n".join([head, "|" + "---|" * 15, (
        f"| {s['model']} | {s['model_params'] / 1e6:.1f}M | {s['world_size']} | {s['tp']} "
        f"| {s['num_prompts']} x {s['num_samples']} x {s['max_tokens']} "
        f"| {s['colocated_tok_s']:.1f} | {s['standalone_tok_s']:.1f} | {s['ratio']:.3f} "
        f"| {s['ratio_paired']:.3f} ({min(s['ratios']):.2f}-{max(s['ratios']):.2f}) "
        f"| {s['ratio_best']:.3f} "
        f"| {'-' if s['ratio_quiet'] is None else format(s['ratio_quiet'], '.3f')} "
        f"({s['quiet_repeats']['colocated']}+{s['quiet_repeats']['standalone']}) "
        f"| {s['ratio_per_cpu_s']:.3f} "
        f"| {s['same_tokens']} "
        f"| {s['rss_max_bytes']['colocated'] / 2**30:.2f} GiB "
        f"| {s['rss_max_bytes']['standalone'] / 2**30:.2f} GiB |")])


def main(argv=None) -> None:
    args = _args(argv)
    if args.rank_job:
        _rank_job(args)
        return
    # SIGTERM unwinds (the jobs are killed in `finally`) instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.size, args.num_prompts, args.max_tokens, args.repeats = "tiny", 8, 32, 3
    folder, n_params = _model(args)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as logs:
        run = _run_interleaved if args.schedule == "interleaved" else _run_sequential
        jobs = run(args, folder, Path(logs))
    s = _summary(args, n_params, jobs)
    s["wall_s"] = time.perf_counter() - t0
    s["loadavg_1m"] = [load_before, os.getloadavg()[0]]
    table = _table(s)
    print(table)
    from _common import cpu_name, result_header, result_path

    path = result_path(args.out_dir, "rollout", quick=args.quick)

    path.write_text(
        result_header(
            __file__, argv, device_detail=f" ({cpu_name()})",
            after_cores=f", OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // args.nproc)} per rank; "
            f"1-min load average {s['loadavg_1m'][0]:.2f} before, {s['loadavg_1m'][1]:.2f} after "
            "(shared machine)")
        + "Colocated: HybridActor after generate -> train_step (lr 1e-20: gradients and AdamW "
        "state allocated, weights unchanged) -> KV cache released and regrown, weights synced "
        "and re-packed; standalone: VLLMRollout only. Same prompts (arithmetic env), sampling, "
        "seeds, max_tokens; vLLM bf16, enforce_eager="
        f"{args.eager}. tok/s = generated token ids over all replicas / wall s of generate "
        "(slowest rank). ratio = ratio of the medians over all timed repeats of each kind; "
        "best-of ratio = ratio of the fastest repeats (load only slows a repeat down); "
        "quiet ratio = ratio of the medians over the repeats in which every rank had "
        f">= {QUIET_SHARE} of its core (CPU s / wall s of the generate; counts in brackets); "
        "per-CPU-s ratio = ratio of the medians of tok/s divided by that CPU share "
        "(a rough load correction); "
        + ("paired ratio = median over pairs of back-to-back generates (both jobs alive, "
           "taking turns, alternating which goes first)."
           if args.schedule == "interleaved" else
           "paired ratio = median over rounds (jobs one after the other, ABBA).") + "\n\n"
        f"{table}\n\n```json\n{json.dumps({**s, 'jobs': jobs}, indent=1)}\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(s))


if __name__ == "__main__":
    main()
