"""Does colocation slow generation down? Colocated rollout vs a standalone engine.

Two kinds of torchrun job of N ranks each, on the same model, prompts,
sampling parameters, seeds and max_tokens (vLLM bf16, TP = T):

- colocated: a `HybridActor` (FSDP2 fp32 master + AdamW + vLLM) that has
  generated once, taken one `train_step` (so gradients and optimizer state
  exist; the learning rate is negligible so the weights stay those of the
  file), and gone through the release/regrow cycle: KV cache freed for
  training, regrown, weights re-packed by the sync. Then `actor.generate` is
  timed;
- standalone: a `VLLMRollout` and nothing else; `rollout.generate` is timed.

The cost of colocation is memory: the trainer's state stays resident beside
the engine, so the engine gets a smaller KV cache and fits fewer sequences at
once. Each rank is given the same memory budget B (--device-gib; on CPU RAM
stands in for device memory, so B is a model of a device, not a limit the OS
enforces) and each engine's KV cache is what B leaves:

    colocated KV  = B - trainer state resident while generating (fp32 params +
                    AdamW m, v: 12 bytes/param / N, FSDP shards; the gradients
                    are freed after each optimizer step) - engine weights
                    (bf16: 2 bytes/param / T)
    standalone KV = B - engine weights

passed to vLLM as `kv_cache_memory_bytes` (memory.kv_cache_gib, exact to the
byte on CPU). By default B is chosen so the colocated KV holds --kv-share of
the blocks the workload needs at once (all prompts x K sequences of prompt +
max_tokens tokens, in vLLM-CPU blocks of 128 tokens): the colocated KV binds,
the standalone one fits every sequence at once. The result file states B,
each KV size, the tokens and sequences it holds, and what the workload needs.

Replication: --jobs fresh pairs of jobs (one of each kind, started together).
In each pair, once both are warm (one warm-up generate each) they take turns,
one generate at a time (the idle job waits on a file, using no CPU),
alternating which goes first; --repeats timed generates per job (barrier,
wall time of the slowest rank). Tokens/s = generated token ids (all replicas:
the returned `Completions` is the same on every rank, checked) / seconds.

Headline: colocated/standalone = median tok/s of all colocated repeats /
median of all standalone repeats, with a paired hierarchical bootstrap 95%
CI over jobs x repeats (`_stats.ratio_ci`, repeat i of both kinds of one
pair resampled together); medians and IQR of each kind beside it.
Diagnostics: the median of the per-pair ratios, the quiet ratio (medians over
the repeats in which every rank had >= 90% of its core: CPU s / wall s of the
generate, 1 thread per rank) and the per-CPU-s ratio (tok/s / that share).

Prints a table; the last stdout line is JSON. Results go to
benchmarks/results/rollout_<device>_<yyyymm>.md.

    python benchmarks/bench_rollout.py                  # qwen2-180m, 3 x 10, N=2, T=2 (~5 min)
    python benchmarks/bench_rollout.py --quick          # tiny model, 1 pair x 3, ~1 min
    python benchmarks/bench_rollout.py --device-gib 2   # an explicit budget per rank
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
# vLLM-CPU's KV block, in tokens (its platform default; checked against the engine's).
VLLM_CPU_BLOCK = 128
# What the trainer keeps beside the engine while it generates: fp32 master
# param + AdamW exp_avg + exp_avg_sq. Gradients (4 more) exist only inside
# train_step (zero_grad(set_to_none=True) after the optimizer step), while the
# colocated engine's KV cache is released.
TRAINER_BYTES_PER_PARAM = 12
ENGINE_BYTES_PER_PARAM = 2  # bf16 engine weights


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="qwen2-180m",
                   help="tiny-model preset (hybrid_engine.models.tiny.PRESETS)")
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--tp", type=int, default=None, help="rollout TP size T (default N)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per generate")
    p.add_argument("--num-samples", type=int, default=2, help="completions per prompt K")
    p.add_argument("--max-tokens", type=int, default=32, help="max new tokens per completion")
    p.add_argument("--jobs", type=int, default=3, help="fresh pairs of jobs (one of each kind)")
    p.add_argument("--repeats", type=int, default=10, help="timed generates per job")
    p.add_argument("--device-gib", type=float, default=None,
                   help="memory budget per rank in GiB (default: chosen from --kv-share)")
    p.add_argument("--kv-share", type=float, default=0.5,
                   help="default budget: the colocated KV cache holds this share of the "
                        "blocks the workload needs at once")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM enforce_eager (no torch.compile)")
    p.add_argument("--quick", action="store_true",
                   help="'tiny' preset, 8 prompts x 4 x 32 tokens, 1 pair x 3 repeats")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    p.add_argument("--_rank-job", dest="rank_job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_mode", dest="mode", choices=MODES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_kv-bytes", dest="kv_bytes", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_turns", dest="turns", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.num_prompts, args.num_samples, args.max_tokens = "tiny", 8, 4, 32
        args.jobs, args.repeats = 1, 3
    for name in ("nproc", "num_prompts", "num_samples", "max_tokens", "jobs", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.kv_share <= 1:
        p.error("--kv-share must be in (0, 1]")
    if args.device_gib is not None and args.device_gib <= 0:
        p.error("--device-gib must be > 0")
    return args


# --- one job, on every rank (under torchrun) -----------------------------------

def _overrides(args: argparse.Namespace, world: int) -> dict:
    """The run config both kinds of job share (the standalone one uses .rollout);
    only the KV cache size differs."""
    return {
        "rollout.tensor_parallel_size": args.tp or world,
        "rollout.num_samples_per_prompt": args.num_samples,
        "rollout.max_tokens": args.max_tokens,
        "rollout.max_model_len": _max_model_len(args),
        "memory.kv_cache_gib": args.kv_bytes / 2**30,
        "memory.release": "true",  # colocated: through a KV release and regrow, as measured
        "rollout.enforce_eager": args.eager,
        # One real optimizer step (grads + AdamW state allocated, sync re-packs),
        # but a step too small to move the fp32 weights: both kinds of job then
        # sample from the same weights.
        "train.lr": 1e-20,
        "train.micro_batch_size": 4,
    }


def _max_model_len(args: argparse.Namespace) -> int:
    return args.max_tokens + 64  # arithmetic prompts are a few tokens


def _digest(token_ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def _engine_kv(rollout) -> dict:  # noqa: ANN001
    """What vLLM made of the KV size it was given (this rank)."""
    block_size, blocks = rollout.kv_blocks()
    return {"block_size": block_size, "kv_blocks": blocks,
            "kv_storage_bytes": rollout.kv_cache_bytes()}


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
        from hybrid_engine.policy.colocated import HybridActor, completions_to_trajectories

        actor = HybridActor.from_pretrained(model_dir, overrides=overrides)
        rollout, generate, shutdown = actor.rollout, actor.generate, actor.shutdown
        # The real colocated state: generate, train (the KV cache is released,
        # gradients and optimizer state are allocated), then back to inference
        # (the KV cache is regrown and committed, the stale weights are synced
        # and re-packed).
        # A short step on a few prompts: the state, not the step, matters here.
        trajs = completions_to_trajectories(actor.generate(
            _prompts(actor.tokenizer, args)[:world], num_samples=2, seed=10_000))
        for i, t in enumerate(trajs):
            t.advantages = [1.0 if i % 2 else -1.0] * len(t.response_ids)
        with actor.training():
            m = actor.train_step(trajs)
        with actor.inference():
            pass
        setup["released_bytes"] = m["mem_released_bytes"]
        setup["phase_inference"] = float(actor.phase == "inference")
    else:
        from hybrid_engine.rollout.engine import VLLMRollout

        cfg = apply_overrides(RunConfig(), {**overrides, "model.path": model_dir})
        from hybrid_engine.parallel.precision import resolve_rollout_dtype

        rollout = VLLMRollout(model_dir, cfg.rollout, memory=cfg.memory,
                              dtype=resolve_rollout_dtype(cfg.model.rollout_dtype, "cpu"))
        shutdown = rollout.shutdown
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
            "num_prompts": len(prompts), "prompt_lens": sorted(map(len, prompts)),
            "times_s": times, "cpu_share": shares, "tokens": tokens, "digests": digests,
            "tok_s": [n / t for n, t in zip(tokens, times, strict=True)],
            "same_on_all_ranks": all(e == mine for e in everyone),
            "rss_max_bytes": int(rss.item()), "torch_threads": torch.get_num_threads(),
            "kv_bytes_given": args.kv_bytes, **_engine_kv(rollout), **setup,
        }), flush=True)
    # The whole actor (watchdog, engine), then the group: a process that exits with
    # them alive can abort in teardown ("terminate called without an active
    # exception", seen once in CI after the result line was printed).
    shutdown()
    if dist.is_initialized():  # vLLM's teardown may have destroyed it already
        dist.destroy_process_group()


def _signal(args: argparse.Namespace, rank: int, what: str) -> None:
    """Rank 0 tells the driver this job reached `what`."""
    if args.turns and rank == 0:
        (Path(args.turns) / f"{args.mode}.{what}").touch()


def _wait_turn(args: argparse.Namespace, rank: int, i: int) -> None:
    """Blocks until the driver gives this job turn i (rank 0 polls a file; the
    other ranks wait in a barrier)."""
    if not args.turns:
        return
    import torch.distributed as dist

    if rank == 0:
        go = Path(args.turns) / f"{args.mode}.go{i}"
        while not go.exists():
            time.sleep(0.005)
    dist.barrier()


def _prompts(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """Fixed arithmetic-environment prompts (token ids, raw text): the same in every job."""
    from hybrid_engine.envs.arithmetic import ArithmeticEnv
    from hybrid_engine.envs.chat import PromptFormat

    return ArithmeticEnv(tokenizer, seed=1234, prompt_format=PromptFormat("none")).sample_prompts(
        args.num_prompts)


# --- driver: the memory plan ----------------------------------------------------

def _model(args: argparse.Namespace):  # noqa: ANN202 - (folder, n_params, spec)
    from hybrid_engine.models.tiny import PRESETS, hf_param_shapes, write_tiny_model

    if args.size not in PRESETS:
        raise SystemExit(f"--size {args.size!r}: not a preset ({', '.join(PRESETS)})")
    spec = PRESETS[args.size]
    folder = Path(args.cache_dir) / args.size
    if not (folder / "model.safetensors").exists():
        write_tiny_model(folder, spec)
    n_params = sum(math.prod(s) for s in hf_param_shapes(spec).values())
    return folder, n_params, spec


def _kv_bytes_per_token(spec, tp: int) -> int:  # noqa: ANN001
    """K and V of every layer for one token on one TP rank, bf16: 2 x layers x
    (kv heads / T, at least 1: vLLM replicates a head when T exceeds them) x head_dim x 2."""
    heads = max(1, spec.num_kv_heads // tp)
    return 2 * spec.num_layers * heads * spec.resolved_head_dim * ENGINE_BYTES_PER_PARAM


def _plan(args: argparse.Namespace, spec, n_params: int, prompt_lens: list[int]) -> dict:  # noqa: ANN001
    """The per-rank memory budget and each kind of job's KV size (bytes).

    Workload need: one engine replica serves ceil(prompts / replicas) prompts
    x K sequences, each of at most prompt + max_tokens tokens, in whole blocks
    (the longest prompts are assumed, so the need is not understated)."""
    world, tp = args.nproc, args.tp or args.nproc
    if world % tp:
        raise SystemExit(f"--tp {tp} must divide --nproc {world}")
    per_token = _kv_bytes_per_token(spec, tp)
    block_bytes = per_token * VLLM_CPU_BLOCK
    replicas = world // tp
    prompts_per_engine = math.ceil(len(prompt_lens) / replicas)
    longest = sorted(prompt_lens, reverse=True)[:prompts_per_engine]
    seq_blocks = [math.ceil((n + args.max_tokens) / VLLM_CPU_BLOCK) for n in longest]
    need_blocks = args.num_samples * sum(seq_blocks)
    trainer = TRAINER_BYTES_PER_PARAM * n_params // world
    engine = ENGINE_BYTES_PER_PARAM * n_params // tp
    if args.device_gib is not None:
        budget = int(args.device_gib * 2**30)
    else:  # the colocated KV holds kv_share of the need (+ half a block: floor-safe)
        blocks = max(1, math.floor(args.kv_share * need_blocks))
        budget = trainer + engine + blocks * block_bytes + block_bytes // 2
    kv = {"colocated": budget - trainer - engine, "standalone": budget - engine}
    min_blocks = math.ceil(_max_model_len(args) / VLLM_CPU_BLOCK)  # vLLM: one longest request
    if kv["colocated"] < min_blocks * block_bytes:
        raise SystemExit(
            f"device budget {budget / 2**30:.3f} GiB leaves the colocated engine "
            f"{kv['colocated'] / 2**20:.1f} MiB of KV cache, less than vLLM's minimum "
            f"({min_blocks} block(s) of {block_bytes / 2**20:.2f} MiB for max_model_len "
            f"{_max_model_len(args)}): raise --device-gib (trainer state "
            f"{trainer / 2**30:.3f} GiB + engine weights {engine / 2**30:.3f} GiB per rank)")
    return {
        "device_budget_bytes": budget, "trainer_state_bytes": trainer,
        "engine_weight_bytes": engine, "kv_bytes_per_token": per_token,
        "block_size": VLLM_CPU_BLOCK, "kv_cache_bytes": kv,
        "workload_seqs_per_engine": prompts_per_engine * args.num_samples,
        "workload_tokens_at_once": args.num_samples * sum(n + args.max_tokens for n in longest),
        "workload_blocks_at_once": need_blocks,
        "workload_block_tokens_at_once": need_blocks * VLLM_CPU_BLOCK,
        "min_blocks": min_blocks,
    }


def _capacity(plan: dict, jobs: list[dict], args: argparse.Namespace) -> dict:
    """What each engine actually got (vLLM's block count, from the jobs):
    tokens and whole sequences it holds at once."""
    out: dict[str, dict] = {"kv_blocks": {}, "kv_tokens": {}, "kv_seqs": {}, "kv_storage_bytes": {}}
    for m in MODES:
        mine = [j for j in jobs if j["mode"] == m]
        if any(j["block_size"] != plan["block_size"] for j in mine):
            raise SystemExit(f"vLLM's KV block is {mine[0]['block_size']} tokens, the plan "
                             f"assumed {plan['block_size']}: update VLLM_CPU_BLOCK")
        blocks = min(j["kv_blocks"] for j in mine)
        per_seq = math.ceil((max(mine[0]["prompt_lens"]) + args.max_tokens) / plan["block_size"])
        out["kv_blocks"][m] = blocks
        out["kv_tokens"][m] = blocks * plan["block_size"]
        out["kv_seqs"][m] = min(blocks // per_seq, plan["workload_seqs_per_engine"])
        out["kv_storage_bytes"][m] = max(j["kv_storage_bytes"] for j in mine)
    return out


# --- driver: the jobs -----------------------------------------------------------

def _job_cmd(args: argparse.Namespace, folder: Path, mode: str, kv_bytes: int,
             turns: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", __file__, "--_rank-job", str(folder),
           f"--_mode={mode}", f"--_kv-bytes={kv_bytes}", f"--_turns={turns}",
           f"--num-prompts={args.num_prompts}", f"--num-samples={args.num_samples}",
           f"--max-tokens={args.max_tokens}", f"--repeats={args.repeats}",
           "--eager" if args.eager else "--no-eager"]
    if args.tp:
        cmd.append(f"--tp={args.tp}")
    return cmd


class _Job:
    """One torchrun job, its output to a file (vLLM logs a lot)."""

    def __init__(self, args: argparse.Namespace, folder: Path, mode: str, kv_bytes: int,
                 logs: Path, turns: str) -> None:
        self.mode = mode
        self.log = logs / f"{mode}-{time.monotonic_ns()}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
        self.t0 = time.perf_counter()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(_job_cmd(args, folder, mode, kv_bytes, turns), stdout=f,
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


def _run_pair(args: argparse.Namespace, folder: Path, kv: dict[str, int], logs: Path,
              index: int) -> list[dict]:
    """One fresh pair of jobs, started together; once both are warm they take
    turns, one generate at a time, alternating which goes first (and which
    starts the alternation from one pair to the next)."""
    turns = logs / f"turns{index}"
    turns.mkdir()
    jobs = {m: _Job(args, folder, m, kv[m], logs, str(turns)) for m in MODES}
    try:
        for m in MODES:
            _wait_file(turns / f"{m}.ready", list(jobs.values()))
        for i in range(args.repeats):
            for m in (MODES if (i + index) % 2 == 0 else MODES[::-1]):
                (turns / f"{m}.go{i}").touch()
                _wait_file(turns / f"{m}.done{i}", list(jobs.values()))
        return [{**jobs[m].result(), "pair": index} for m in MODES]
    finally:
        for j in jobs.values():
            j.kill()


# --- driver: statistics and output -----------------------------------------------

def _summary(args: argparse.Namespace, n_params: int, plan: dict, jobs: list[dict]) -> dict:
    from _stats import describe, ratio, ratio_ci

    pairs = sorted({j["pair"] for j in jobs})
    per_job = {m: [next(j for j in jobs if j["mode"] == m and j["pair"] == p)["tok_s"]
                   for p in pairs] for m in MODES}
    flat = {m: [x for job in per_job[m] for x in job] for m in MODES}
    share = {m: [x for j in jobs if j["mode"] == m for x in j["cpu_share"]] for m in MODES}
    # Generates during which every rank had its core (nothing else ran on the machine).
    quiet = {m: [x for x, c in zip(flat[m], share[m], strict=True) if c >= QUIET_SHARE]
             for m in MODES}
    quiet_med = {m: statistics.median(quiet[m]) if quiet[m] else None for m in MODES}
    # Tokens per CPU-second of the most starved rank: roughly load-independent.
    per_cpu = {m: statistics.median(x / c for x, c in zip(flat[m], share[m], strict=True))
               for m in MODES}
    pair_ratios = [c / s for c, s in zip(flat["colocated"], flat["standalone"], strict=True)]
    desc = {m: describe(per_job[m]) for m in MODES}
    digests = {m: [d for j in jobs if j["mode"] == m for d in j["digests"]] for m in MODES}
    head = ratio(per_job["colocated"], per_job["standalone"])
    first = jobs[0]
    return {
        "model": args.size, "model_params": n_params,
        "world_size": first["world_size"], "nproc": first["world_size"], "tp": first["tp"],
        "num_prompts": first["num_prompts"], "num_samples": args.num_samples,
        "max_tokens": args.max_tokens, "schedule": "interleaved",
        "jobs": len(pairs), "repeats": args.repeats,
        # Headline: median colocated / median standalone, paired bootstrap CI.
        "ratio": head, "paired_ratio": head,
        "ratio_ci": ratio_ci(per_job["colocated"], per_job["standalone"], paired=True),
        "colocated_tok_s": desc["colocated"]["median"],
        "standalone_tok_s": desc["standalone"]["median"],
        "colocated_tok_s_iqr": desc["colocated"]["iqr"],
        "standalone_tok_s_iqr": desc["standalone"]["iqr"],
        "tok_s_stats": desc,
        "ratio_pairs_median": statistics.median(pair_ratios), "ratios": pair_ratios,
        "colocated_tok_s_quiet": quiet_med["colocated"],
        "standalone_tok_s_quiet": quiet_med["standalone"],
        "ratio_quiet": (quiet_med["colocated"] / quiet_med["standalone"]
                        if None not in quiet_med.values() else None),
        "quiet_repeats": {m: len(quiet[m]) for m in MODES},
        "ratio_per_cpu_s": per_cpu["colocated"] / per_cpu["standalone"],
        **plan, **_capacity(plan, jobs, args),
        "tok_s_jobs": per_job, "cpu_share": share,
        "tokens_per_generate": {m: sorted({n for j in jobs if j["mode"] == m for n in j["tokens"]})
                                for m in MODES},
        # Same seeds and weights; different batch compositions may round bf16 differently.
        "same_tokens": digests["colocated"] == digests["standalone"],
        "same_on_all_ranks": all(j["same_on_all_ranks"] for j in jobs),
        "rss_max_bytes": {m: max(j["rss_max_bytes"] for j in jobs if j["mode"] == m) for m in MODES},
        "kv_released_bytes": max(j.get("released_bytes", 0) for j in jobs if j["mode"] == "colocated"),
        "torch_threads": first["torch_threads"],
        "setup_s": {m: statistics.median(j["setup_s"] for j in jobs if j["mode"] == m) for m in MODES},
    }


def _table(s: dict) -> str:
    mb = 2**20
    head = ("| model | params | N | T | prompts x K x max_tokens | budget/rank | KV colocated "
            "| KV standalone | workload needs at once | colocated tok/s (IQR) "
            "| standalone tok/s (IQR) | colocated/standalone [95% CI] | jobs x repeats "
            "| pair-ratio median | quiet ratio (repeats) |")
    kv = {m: (f"{s['kv_cache_bytes'][m] / mb:.1f} MiB: {s['kv_tokens'][m]} tokens, "
              f"{s['kv_seqs'][m]} seqs") for m in MODES}
    return "\n".join([head, "|" + "---|" * 15, (
        f"| {s['model']} | {s['model_params'] / 1e6:.1f}M | {s['world_size']} | {s['tp']} "
        f"| {s['num_prompts']} x {s['num_samples']} x {s['max_tokens']} "
        f"| {s['device_budget_bytes'] / 2**30:.3f} GiB | {kv['colocated']} | {kv['standalone']} "
        f"| {s['workload_seqs_per_engine']} seqs, {s['workload_tokens_at_once']} tokens "
        f"({s['workload_block_tokens_at_once']} in blocks) "
        f"| {s['colocated_tok_s']:.1f} ({s['colocated_tok_s_iqr']:.1f}) "
        f"| {s['standalone_tok_s']:.1f} ({s['standalone_tok_s_iqr']:.1f}) "
        f"| **{s['ratio']:.3f}** [{s['ratio_ci'][0]:.3f}, {s['ratio_ci'][1]:.3f}] "
        f"| {s['jobs']} x {s['repeats']} | {s['ratio_pairs_median']:.3f} "
        f"| {'-' if s['ratio_quiet'] is None else format(s['ratio_quiet'], '.3f')} "
        f"({s['quiet_repeats']['colocated']}+{s['quiet_repeats']['standalone']}) |")])


def _prose(s: dict, args: argparse.Namespace) -> str:
    mb, gib = 2**20, 2**30
    return (
        "Colocated: HybridActor after generate -> train_step (lr 1e-20: gradients and AdamW "
        "state allocated, weights unchanged) -> KV cache released and regrown, weights synced "
        "and re-packed; standalone: VLLMRollout only. Same prompts (arithmetic env), sampling, "
        f"seeds, max_tokens; vLLM bf16, enforce_eager={args.eager}.\n\n"
        f"Memory plan per rank: budget {s['device_budget_bytes'] / gib:.3f} GiB "
        f"({'--device-gib' if args.device_gib is not None else f'chosen so the colocated KV holds {args.kv_share:g} of the need'}); "
        f"trainer state resident while generating {s['trainer_state_bytes'] / gib:.3f} GiB "
        f"(12 bytes/param / N={s['world_size']}: fp32 params, AdamW m and v; the gradients are "
        "freed after each optimizer step, while the colocated KV cache is released); engine weights {s['engine_weight_bytes'] / gib:.3f} GiB "
        f"(bf16, / T={s['tp']}). KV per token per rank {s['kv_bytes_per_token']} bytes "
        f"(2 x layers x KV heads/T x head_dim x 2 bytes), blocks of {s['block_size']} tokens "
        f"({s['kv_bytes_per_token'] * s['block_size'] / mb:.2f} MiB). "
        f"Colocated KV = budget - trainer - weights = {s['kv_cache_bytes']['colocated'] / mb:.1f} MiB: "
        f"{s['kv_blocks']['colocated']} blocks, {s['kv_tokens']['colocated']} tokens, "
        f"{s['kv_seqs']['colocated']} sequences at once; standalone KV = budget - weights = "
        f"{s['kv_cache_bytes']['standalone'] / mb:.1f} MiB: {s['kv_blocks']['standalone']} blocks, "
        f"{s['kv_tokens']['standalone']} tokens, {s['kv_seqs']['standalone']} sequences at once. "
        f"The workload needs {s['workload_seqs_per_engine']} sequences per engine at once, "
        f"{s['workload_tokens_at_once']} tokens ({s['workload_blocks_at_once']} blocks = "
        f"{s['workload_block_tokens_at_once']} tokens). On CPU the budget is a model of a "
        "device: RAM is not actually that small.\n\n"
        "tok/s = generated token ids over all replicas / wall s of generate (slowest rank). "
        "colocated/standalone = median over all timed repeats of each kind (jobs x repeats), "
        "95% CI: paired hierarchical bootstrap (jobs, then repeat pairs). Each pair of jobs: "
        "both alive, taking turns one generate at a time, alternating which goes first; one "
        "warm-up generate each. pair-ratio median = median of the ratios of back-to-back "
        f"generates; quiet ratio = medians over the repeats in which every rank had >= "
        f"{QUIET_SHARE} of its core (CPU s / wall s; counts in brackets). "
        f"Same tokens in both kinds: {s['same_tokens']} (bf16 sums may round differently "
        "with other batch compositions).\n\n")


def main(argv=None) -> None:
    args = _args(argv)
    if args.rank_job:
        _rank_job(args)
        return
    # SIGTERM unwinds (the jobs are killed in `finally`) instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    folder, n_params, spec = _model(args)
    from transformers import AutoTokenizer

    prompt_lens = [len(p) for p in _prompts(AutoTokenizer.from_pretrained(str(folder)), args)]
    plan = _plan(args, spec, n_params, prompt_lens)
    print(f"budget {plan['device_budget_bytes'] / 2**30:.3f} GiB/rank, KV "
          + ", ".join(f"{m} {b / 2**20:.1f} MiB" for m, b in plan["kv_cache_bytes"].items()),
          file=sys.stderr, flush=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    jobs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as logs:
        for index in range(args.jobs):
            jobs += _run_pair(args, folder, plan["kv_cache_bytes"], Path(logs), index)
    s = _summary(args, n_params, plan, jobs)
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
            f"(shared machine); {s['wall_s']:.0f} s")
        + _prose(s, args)
        + f"{table}\n\n```json\n{json.dumps({**s, 'job_results': jobs}, indent=1)}\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(s))


if __name__ == "__main__":
    main()
