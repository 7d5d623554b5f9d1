"""Where does an RL step's wall time go, as a user would run it? N = 1, 2, 4 ranks.

What runs: for each config (model preset, N ranks, placement) `--jobs` (or @JOBS) fresh
`hybrid-engine train` jobs under torchrun, recipe tiny_grpo_debug with what
a user changes for a real run: bf16 rollout (`model.rollout_dtype=bfloat16`),
the weight sync bench_sync times (`sync.method=reshard`, `sync.bucket_mb=64`),
`sync.verify=false`, no checkpoints, no evals. Training stays as the recipe
sets it, the project's defaults: bf16 compute over fp32 master weights,
`train.sharding=auto`, micro-batches of up to 32 sequences, packed, AdamW lr
1e-4, enforce_eager, 0.25 GiB KV cache, max_model_len 128. Colocated: every rank
trains (in the layout sharding=auto chose) and rolls out (vLLM, TP = min(2, N)); separate (`--configs PRESET:N:separate`): the first
N/2 ranks train, the last N/2 roll out. The reward is one of 1024 levels in
[0, 1] hashed from a call counter and the completion, so every group carries
signal and every step trains (a random-init model never solves the task, and
at the recipe's lr it soon collapses to identical completions).

Workloads: `w1` (default) 4 prompts x K=4 = 16 completions x
16 new tokens per step, a user's small GRPO batch; `w2` 16 x 4 = 64
completions x 64 tokens. The environment's prompts are 1-3 digit
arithmetic (short: the trained tokens are mostly completions). `mixed`
(for partial rollouts): 16 x 4 completions of up to 112 tokens, every 24th
vocabulary id a stop token, so a random-init model's completion lengths are
geometric (mean ~24) with a long tail; a config with
`async_rollout.partial` gets a table against the same config without it
(generate seconds, tokens the engine sampled and its tok/s in the generate
phase, trained samples per step, parked groups, staleness, ratios with
bootstrap CIs). `long` (generation-heavy, for generation ahead under separate
placement): 1 x 4 completions x 256 tokens, max_model_len raised to 320;
decoding 4 sequences is bound by reading the weights once per token, so
generation's seconds come near training's, as in GPU RL jobs, where decoding
usually takes the larger share (on W1/W2 training is 3-4x generation on these CPUs, which bounds
what overlap can save: step >= max(train, generate)). Colocated, nothing overlaps: what
generation ahead saves there is a burst's (one pass samples k + 1 steps' batches, which
costs little more than one when decoding is bound by reading the weights), so its step
is reported as the mean over k + 1 consecutive steps, against the synchronous config's.
`gpu` (one GPU's job, too big for these CPUs): 32 x 8 completions x 256 tokens with
level-2 sleep every train phase, CUDA graphs, half the device for vLLM and micro-batches
of 16384 tokens, as in `results/gpu_loop_qwen2_180m_h100_202611.md`; with a GPU the jobs
run on it and the floors' GEMM peak and copy bandwidth are measured on it, e.g.
`--workload gpu --jobs 2 --steps 6 --configs
qwen2-180m:1 qwen2-180m:1+async_rollout.max_staleness=1+algorithm.behaviour_logp=rollout`.

Measured, per job: `--warmup` steps (left out), `--steps` timed steps, then
ONE profiled step (left out of every timing).
- step_s: wall clock per step = the difference of consecutive steps'
  `elapsed_s` (the controller's wall clock at each step's end), so it
  includes everything between two steps (metrics writing, the stop check),
  not only the phases. Phases (switch_s: the layout switches; generate_s,
  score_s, train_s, sync_s)
  come from the same rows (rank 0's timers; every phase is collective);
  overhead_s = step wall - sum of the phases, per step.
- Every statistic is `_stats.describe` over all timed steps of all jobs
  (median, IQR); per-step values are kept in the result file.
- Against the first config (before/after): each config's median step over the
  first's with a 95% bootstrap CI (jobs, then steps); and, with >= 2 warm-up
  steps, steps 1 and 2 against the steady state (their sum minus two of the
  job's median timed steps) next to the job's start-up (its wall clock outside
  the training loop: imports, model load, engine start, exit).
- Train split: the profiled step's trainer `train_step` runs under
  torch.profiler (`HYBRID_ENGINE_PROFILE_TRAIN`, see roles/profile.py):
  optimizer = gradient clipping + AdamW; comm = wall time while a gloo
  collective or the shared-memory gradient all-reduce (train.cpu_shm_allreduce)
  runs outside the optimizer (overlap with compute is counted as comm); compute = the rest of train_step. The fractions (medians over jobs x
  ranks, renormalised to sum to 1) times the timed steps' median
  train_step_s (the trainer's own timer, every step) give train_compute_s,
  train_comm_s, train_optimizer_s: the profiler slows the profiled step, so
  its seconds are not used directly. train_other_s = train_s - train_step_s
  per step: what the train phase does besides the trainer (collating the
  batch; releasing the KV cache counts in switch_s).
- train_mfu: model FLOPs of the train phase / train_s per rank, over the
  per-rank matmul peak. FLOPs per step = 6 x (parameters except the two
  vocabulary matrices) x trained tokens (prompt + completion, padding not
  counted) + 6 x lm_head parameters x loss tokens (the vocabulary projection
  only runs on completion positions); the trainer runs nothing else in the
  train phase (on-policy GRPO: no old/reference log-prob forward; the
  fused vocabulary step's recompute is not a model FLOP). Attention score FLOPs
  are left out: at these lengths (< 64 positions) they are < 1% (s / 12H).
  matmul_peak_flops: best of 5 GEMMs 2048^3 in the training compute dtype,
  measured per config in a separate process after its jobs (nothing else of
  ours running) with the threads one rank gets (OMP threads = cores // N, at
  least 1). With more ranks than cores (N=4 on 2 cores) a rank gets only
  cores / (N x threads) of that, so the per-rank peak is scaled by it
  (matmul_peak_per_rank_flops).
- train_floor_s: the same model FLOPs per rank at the per-rank matmul peak
  (= train_s x train_mfu): the train phase's distance to its floor is
  train_s / train_floor_s. train_top_ops: the profiled step's 10 ops with the
  most self time, as shares of that step (medians over jobs x ranks).
- generate_floor_s: the larger of two lower bounds. Bytes
  (generate_floor_bytes_s): decoding reads every weight of the replica's TP
  shard once per decode step: max new tokens x parameters x rollout bytes / T,
  at one rank's copy bandwidth (mem_bandwidth_per_rank: best of 5 copies of a
  512 MiB tensor, read + written bytes, the rank's threads, measured after the
  jobs like the GEMM peak). FLOPs (generate_floor_flops_s): 2 x (body +
  lm_head) FLOPs per sampled token, over the rollout ranks, at one
  rank's GEMM peak in the rollout dtype (rollout_peak_per_rank_flops; fp32's on
  a CPU without bf16 instructions, where vLLM beats torch's bf16 GEMM). On the
  180M presets on 1 thread per rank the FLOPs term is the larger: narrowly on W1
  (0.22 s against 0.13), 7x on W2. sync_floor_s: every byte the sync installs (received
  or local) read once from the master weights and written once, at the same
  bandwidth; the network is left out. Both are lower bounds.
- CPU time: step_user_s / step_sys_s = rank 0's user / system CPU seconds in
  the four phases (getrusage of the process, all threads: vLLM's and gloo's
  too), and <phase>_user_s / <phase>_sys_s per phase (medians). System time is
  the kernel's: mostly page faults (memory mapped or first touched: a KV cache
  regrown, buffers allocated afresh) and the shared-memory / socket traffic of
  the collectives. With one thread per rank, user + sys near the wall time
  means the rank computed or spun the whole phase; far below it, it waited.
- generated_tok_s = sampled completion tokens per step (all replicas, each
  sample once) / generate_s (medians); gen_tok_s_median: the same per step
  from the controller's gen_tok_s metric.
- tokens_per_step: generated (completion tokens), trained (prompt +
  completion tokens the train phase runs, each sequence with its prompt),
  prompt (= trained - generated: the prompt counted once per completion).

Budget (the default run must fit `make bench`: report.py gives a script 60
min). Per job: start-up (~40 s, ~60 s at N=4) + (warm-up + timed + 1) steps.
Estimated w1 step times alone on 2 cores: N=2 ~8.5 s (measured), N=1 ~5.5 s
and N=4 ~15 s (scaled by the last full run's N=1/N=2
and N=4/N=2 ratios; N=4 puts 4 ranks on 2 cores). 3 jobs x 23 steps at every N
would take ~40 min, so the default runs 3 jobs at N=2 (the headline), 2 at
N=1 and 1 at N=4 (`--configs qwen2-180m:1@2 qwen2-180m:2@3 qwen2-180m:4@1`),
all with 20 timed steps: ~24 min alone (estimated; the timings taken while
this was written had 5-10 other processes on the 2 cores and were 10x off).
The N=4 row's IQR is within one job.

Prints a table; the last stdout line is JSON (the headline config's keys at
the top level, every config under "configs"). Writes
<out-dir>/step_cpu_<yyyymm>[_quick].md and a stacked-phase chart (.png).

    python benchmarks/bench_step.py               # qwen2-180m at N=1,2,4 colocated (2/3/1 jobs)
    python benchmarks/bench_step.py --quick       # tiny at N=1,2, 1 job, 4 timed steps
    python benchmarks/bench_step.py --workload w2 --configs qwen2-180m:2 qwen2-180m:2:separate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

import _stats  # noqa: E402
from _common import result_header, result_path  # noqa: E402

PHASES = ("switch", "generate", "score", "train", "sync")
# 3 jobs for the headline N=2; fewer at N=1 and N=4 to fit the budget (docstring).
DEFAULT_CONFIGS = ("qwen2-180m:1@2", "qwen2-180m:2@3", "qwen2-180m:4@1")
# prompts per step, K, max new tokens
WORKLOADS = {"w1": (4, 4, 16), "w2": (16, 4, 64), "mixed": (16, 4, 112), "long": (1, 4, 256),
             "gpu": (32, 8, 256)}
# long: few sequences, long completions: decoding 4 sequences reads every weight per
# token, so generation's seconds come near training's (as in GPU RL jobs, where decoding
# usually takes the larger share); the recipe's max_model_len (128) is raised to fit the completions.
WORKLOAD_SETS = {"long": ("rollout.max_model_len=320",),
                 # gpu: the settings of gpu_loop_qwen2_180m_h100_202611.md (a user's GPU job:
                 # level-2 sleep every train phase, CUDA graphs, half the device for vLLM)
                 "gpu": ("rollout.max_model_len=320", "memory.release=true",
                         "rollout.enforce_eager=false", "memory.gpu_memory_fraction=0.5",
                         "train.max_tokens_per_micro_batch=16384")}
# mixed: every MIXED_STOP_EVERY-th id of the vocabulary ends a completion, so a random-init
# model's lengths are geometric (mean ~24, a few near the cap of 112): a long tail.
MIXED_STOP_EVERY = 24
PROFILE_ENV = "HYBRID_ENGINE_PROFILE_TRAIN"  # = hybrid_engine.roles.profile.PROFILE_ENV
# A reward per scored sample hashed from a call counter and the completion, one of 1024
# levels in [0, 1]: every rank scores the same list in the same order, so ranks agree; a
# counter keeps the rewards varied even when the policy collapses to identical completions
# (lr 1e-4 on a random-init model does so within a few steps), and with 1024 levels a
# group of K = 4 is all-equal (a skipped step) with odds ~1e-9, not 1/8 as with a coin flip.
REWARD = ("import itertools, zlib\n\n"
          "_calls = itertools.count()\n\n"
          "def reward(prompt, completion, answer):\n"
          "    return (zlib.crc32(f'{next(_calls)}|{completion}'.encode()) % 1024) / 1023\n")
GEMM_N = 2048


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                   help="PRESET:N[:separate][@JOBS][+KEY=VALUE...] (presets: "
                        "hybrid_engine.models.tiny.PRESETS; @JOBS overrides --jobs for that "
                        "config; each +KEY=VALUE is a train override for it alone, e.g. "
                        "qwen2-180m:2+train.sharding=grad_op)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a train override for every config (repeatable), e.g. "
                        "--set model.compute_dtype=bfloat16")
    p.add_argument("--headline", default="qwen2-180m:2",
                   help="config whose values are the JSON's top-level keys (else the last)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w1",
                   help="w1: 4 prompts x K=4 x 16 tokens; w2: 16 x 4 x 64; mixed: 16 x 4 x "
                        "up to 112, lengths ~ geometric (mean ~24): a long tail; long: 1 x 4 "
                        "x 256 (max_model_len 320): generation-heavy; gpu: 32 x 8 x 256 "
                        "with level-2 sleep and CUDA graphs (one GPU's job)")
    p.add_argument("--jobs", type=int, default=3, help="fresh jobs per config without @JOBS")
    p.add_argument("--steps", type=int, default=20, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=2, help="steps per job before the timed ones")
    p.add_argument("--quick", action="store_true",
                   help="tiny at N=1 and N=2 (sharding=grad_op) colocated, 1 job, 4 timed "
                        "steps (1 warm-up)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    args = p.parse_args(argv)
    if args.quick:
        args.configs, args.jobs, args.steps, args.warmup = \
            ["tiny:1", "tiny:2+train.sharding=grad_op"], 1, 4, 1
    if args.jobs < 1 or args.steps < 1 or args.warmup < 1:
        p.error("--jobs, --steps and --warmup must be >= 1 (step 1's wall has no previous step)")
    for kv in args.set:
        _check_set(kv, p)
    args.parsed = [_parse_config(c, args.jobs, p) for c in args.configs]
    return args


def _check_set(kv: str, p: argparse.ArgumentParser) -> None:
    key, eq, value = kv.partition("=")
    if not eq or not key or not value or key.startswith("-"):
        p.error(f"{kv!r} is not KEY=VALUE (a dotted config key, e.g. train.sharding=grad_op)")


def _parse_config(c: str, default_jobs: int,
                  p: argparse.ArgumentParser) -> tuple[str, int, str, int, tuple[str, ...]]:
    """'PRESET:N[:separate][@JOBS][+KEY=VALUE...]' -> (preset, N, placement, jobs, sets)."""
    from hybrid_engine.models.tiny import PRESETS

    c, *sets = c.split("+")
    for kv in sets:
        _check_set(kv, p)
    c, _, jobs = c.partition("@")
    if jobs and (not jobs.isdigit() or int(jobs) < 1):
        p.error(f"--configs: @{jobs} in {c!r} is not a job count >= 1")
    parts = c.split(":")
    preset, n = parts[0], parts[1] if len(parts) > 1 else "2"
    placement = parts[2] if len(parts) > 2 else "colocated"
    if preset not in PRESETS or placement not in ("colocated", "separate") or not n.isdigit() \
            or int(n) < 1 or len(parts) > 3:
        p.error(f"--configs: {c!r} is not PRESET:N[:separate] with PRESET in {sorted(PRESETS)}")
    if placement == "separate" and int(n) < 2:
        p.error(f"--configs: {c!r}: separate placement needs N >= 2")
    return preset, int(n), placement, int(jobs) if jobs else default_jobs, tuple(sets)


# --------------------------------------------------------------------------
# Model, FLOPs and the matmul peak
# --------------------------------------------------------------------------


def _model(preset: str, cache: Path) -> Path:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    folder = cache / preset
    if not (folder / "config.json").is_file():
        write_tiny_model(folder, PRESETS[preset])
    return folder


def _param_counts(preset: str) -> dict[str, int]:
    """{total, body: all but the vocabulary matrices, lm_head: the output projection}."""
    import math

    from hybrid_engine.models.tiny import PRESETS, hf_param_shapes

    spec = PRESETS[preset]
    shapes = hf_param_shapes(spec)
    vocab_h = spec.vocab_size * spec.hidden_size
    total = sum(math.prod(s) for s in shapes.values())
    embed_and_head = vocab_h * (1 if spec.tie_word_embeddings else 2)
    return {"total": total, "body": total - embed_and_head, "lm_head": vocab_h}


def _train_flops(params: dict[str, int], trained_tokens: float, loss_tokens: float) -> float:
    """Model FLOPs of one train phase (forward + backward), all ranks; see the docstring."""
    return 6.0 * params["body"] * trained_tokens + 6.0 * params["lm_head"] * loss_tokens


_GEMM = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
dt = getattr(torch, sys.argv[2]); n = int(sys.argv[3]); dev = sys.argv[4]
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
a, b = torch.randn(n, n, device=dev).to(dt), torch.randn(n, n, device=dev).to(dt)
c = torch.empty(n, n, dtype=dt, device=dev)
torch.mm(a, b, out=c)
best = float("inf")
for _ in range(5):
    sync(); t0 = time.perf_counter(); torch.mm(a, b, out=c); sync()
    best = min(best, time.perf_counter() - t0)
print(2 * n ** 3 / best)
"""


_STREAM = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
dev = sys.argv[3]
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
a = torch.ones(int(sys.argv[2]), dtype=torch.uint8, device=dev); b = torch.empty_like(a)
b.copy_(a)
best = float("inf")
for _ in range(5):
    sync(); t0 = time.perf_counter(); b.copy_(a); sync()
    best = min(best, time.perf_counter() - t0)
print(2 * a.numel() / best)
"""
STREAM_BYTES = 512 * 2**20


def _device() -> str:
    """Where the jobs run, so where the floors' peaks are measured: the GPU when
    there is one (the CLI then trains and rolls out on it), else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _mem_bandwidth(threads: int) -> float:
    """Best bytes/s (read + written) of a STREAM_BYTES tensor copy on `threads`
    threads, or on the GPU (own process)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", _STREAM, str(threads), str(STREAM_BYTES),
                           _device()],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"memory bandwidth measurement failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def _itemsize(dtype: str) -> int:
    """Bytes per element of a config dtype name ("float32", "bfloat16")."""
    from hybrid_engine.parallel.fsdp import DTYPES

    return DTYPES[dtype].itemsize


def _gen_floor_s(params_total: int, config: dict, decode_steps: int, bandwidth: float) -> float:
    """The bytes term of generate's floor. Decoding reads every weight of a replica's
    TP shard once per decode step: decode_steps x params x rollout bytes / T at one
    rank's copy bandwidth (prefill, attention and the KV cache are left out: < 5% of
    the bytes at these lengths)."""
    tp = config["rollout"]["tensor_parallel_size"]
    return decode_steps * params_total * _itemsize(_rollout_dtype(config)) / tp / bandwidth


def _gen_flops_floor_s(params: dict[str, int], tokens: float, rollout_ranks: int,
                       peak: float) -> float:
    """The compute term of generate's floor: every sampled token through the decoder
    and the vocabulary projection, 2 x (body + lm_head) FLOPs each (prompts, which
    the prefix cache may share, and attention's own FLOPs left out), spread over
    the rollout ranks, at one rank's GEMM peak in the rollout dtype."""
    return 2.0 * (params["body"] + params["lm_head"]) * tokens / rollout_ranks / peak


def _sync_floor_s(row: dict, config: dict, bandwidth: float) -> float:
    """Every byte the sync installs (received or local, in the rollout dtype) is read
    once from the master weights and written once: (master + rollout) bytes per
    element at one rank's copy bandwidth. The network is not in it (a lower bound)."""
    rollout = _itemsize(_rollout_dtype(config))
    ratio = (_itemsize(config["model"]["master_dtype"]) + rollout) / rollout
    return (row.get("sync_bytes_received", 0.0) + row.get("sync_bytes_local", 0.0)) * ratio \
        / bandwidth


def _compute_dtype(config: dict) -> str:
    """The job's training compute dtype as it ran ("auto" resolved on this device)."""
    from hybrid_engine.parallel.precision import resolve_compute_dtype

    return resolve_compute_dtype(config["model"]["compute_dtype"], _device())


def _rollout_dtype(config: dict) -> str:
    """The job's rollout dtype as it ran ("auto" resolved on this device)."""
    from hybrid_engine.parallel.precision import resolve_rollout_dtype

    return resolve_rollout_dtype(config["model"]["rollout_dtype"], _device())


def _rollout_peak_dtype(config: dict) -> str:
    """The dtype whose GEMM peak bounds generation: the rollout dtype, except bf16 on
    a CPU without bf16 instructions (AVX2), where fp32's: torch's bf16 GEMM there
    runs ~90x below fp32 and vLLM-CPU's own GEMMs run above it."""
    from hybrid_engine.parallel.precision import native_bf16

    dtype = _rollout_dtype(config)
    return "float32" if _device() == "cpu" and not native_bf16("cpu") else dtype


def _matmul_peak(threads: int, dtype: str) -> float:
    """Best FLOP/s of a GEMM_N^3 matmul in dtype on `threads` threads, or on the
    GPU (own process)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", _GEMM, str(threads), dtype, str(GEMM_N),
                           _device()],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"matmul peak measurement failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# One job
# --------------------------------------------------------------------------


def _tp(nproc: int, placement: str) -> int:
    return min(2, nproc // 2 if placement == "separate" else nproc)


def _threads(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def _run_job(args: argparse.Namespace, preset: str, nproc: int, placement: str,
             sets: tuple[str, ...], out: Path, work: Path) -> dict:
    """Runs one training job; returns its metrics rows, resolved config and profiles."""
    prompts, k, max_tokens = WORKLOADS[args.workload]
    num_steps = args.warmup + args.steps + 1  # + the profiled step
    overrides = [
        f"--model.path={_model(preset, Path(args.cache_dir))}", f"--output_dir={out}",
        "--overwrite", "--no-progress", f"--placement={placement}",
        "--model.rollout_dtype=bfloat16", "--sync.method=reshard", "--sync.bucket_mb=64",
        "--sync.verify=false", f"--rollout.tensor_parallel_size={_tp(nproc, placement)}",
        f"--rollout.num_samples_per_prompt={k}", f"--rollout.max_tokens={max_tokens}",
        f"--train.prompts_per_step={prompts}", f"--train.num_steps={num_steps}",
        "--checkpoint_every=0", "--eval.at_start=false", "--eval.at_end=false", "--max_wall_s=3000",
        f"--env.reward_fn={work / 'reward.py'}:reward",
        *(f"--{kv}" for kv in (*WORKLOAD_SETS.get(args.workload, ()), *args.set, *sets)),
    ]
    if args.workload == "mixed":
        from hybrid_engine.models.tiny import PRESETS

        overrides.append("--rollout.stop_token_ids=" + ",".join(
            str(i) for i in range(7, PRESETS[preset].vocab_size, MIXED_STOP_EVERY)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "hybrid_engine.cli", "train",
           "--recipe=tiny_grpo_debug", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(_threads(nproc)),
           PROFILE_ENV: f"{num_steps}:{out / 'profile'}"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{preset} N={nproc} {placement} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    import yaml

    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    if [r["step"] for r in rows] != list(range(1, num_steps + 1)):
        raise SystemExit(f"{out}: expected steps 1..{num_steps} in metrics.jsonl, "
                         f"got {[r['step'] for r in rows]}")
    profiles = [json.loads(f.read_text()) for f in sorted((out / "profile").glob("*.json"))]
    config = yaml.safe_load((out / "config.yaml").read_text())
    # the size vLLM ran (rollout.tensor_parallel_size=auto is chosen in the job)
    engine = json.loads((out / "engine.json").read_text())
    config["rollout"]["tensor_parallel_size"] = engine["tensor_parallel_size"]
    return {"rows": rows, "config": config, "profiles": profiles, "wall_s": wall_s}


def _first_steps(jobs: list[dict], timed: list[list[dict]]) -> dict:
    """Steps 1 and 2 against the steady state, per job: their wall clock (step 1's
    from the loop's start: the engine and the trainer are built before it), the
    seconds they take beyond two timed-median steps, and the job's start-up (its
    wall clock minus the loop's: imports, model load, engine start, exit)."""
    firsts, extras, starts = [], [], []
    for job, steps in zip(jobs, timed, strict=True):
        e = [r["elapsed_s"] for r in job["rows"]]
        first = [e[0], e[1] - e[0]]
        firsts.append(first)
        extras.append(sum(first) - 2 * _stats.describe([r["step_wall_s"] for r in steps])["median"])
        starts.append(job["wall_s"] - e[-1])
    return {"first_steps_s_jobs": firsts,
            "first_two_extra_s": _stats.describe(extras)["median"],
            "start_s": _stats.describe(starts)["median"]}


def _timed(job: dict, warmup: int, steps: int) -> list[dict]:
    """The timed rows (after the warm-up, before the profiled step), each with its
    wall clock `step_wall_s` (the difference to the previous step's elapsed_s)."""
    rows = job["rows"]
    out = []
    for prev, r in zip(rows[warmup - 1:warmup - 1 + steps], rows[warmup:warmup + steps], strict=True):
        out.append({**r, "step_wall_s": r["elapsed_s"] - prev["elapsed_s"]})
    return out


# --------------------------------------------------------------------------
# One config: jobs -> statistics
# --------------------------------------------------------------------------


def _jobs_of(jobs: list[list[dict]], fn) -> list[list[float]]:
    return [[fn(r) for r in job] for job in jobs]


def _med_iqr(row: dict, name: str, jobs: list[list[float]]) -> None:
    d = _stats.describe(jobs)
    row[name], row[f"{name}_iqr"] = d["median"], d["iqr"]
    if name == "step_s":
        row["step_s_q1"], row["step_s_q3"] = d["q1"], d["q3"]


def _config_row(args, preset: str, nproc: int, placement: str, jobs: list[dict],
                peak: float, dtype: str, bandwidth: float, rollout_peak: float) -> dict:
    timed = [_timed(j, args.warmup, args.steps) for j in jobs]
    params = _param_counts(preset)
    threads = _threads(nproc)
    share = min(1.0, (os.cpu_count() or 1) / (nproc * threads))
    row = {"preset": preset, "world_size": nproc, "placement": placement,
           "tp": jobs[0]["config"]["rollout"]["tensor_parallel_size"],
           "model_params": params["total"], "jobs": len(jobs),
           "steps_timed": sum(map(len, timed)), "steps_timed_per_job": args.steps,
           "steps_trained": sum(r.get("skipped_degenerate", 0.0) == 0.0 for j in timed for r in j),
           "threads_per_rank": threads, "compute_dtype": dtype}
    step_jobs = _jobs_of(timed, lambda r: r["step_wall_s"])
    _med_iqr(row, "step_s", step_jobs)
    for ph in PHASES:
        _med_iqr(row, f"{ph}_s", _jobs_of(timed, lambda r, ph=ph: r.get(f"{ph}_s", 0.0)))
    for kind in ("user", "sys"):  # rank 0's CPU seconds in the phases (metrics.PhaseTimer)
        for ph in PHASES:
            _med_iqr(row, f"{ph}_{kind}_s", _jobs_of(
                timed, lambda r, key=f"{ph}_{kind}_s": r.get(key, 0.0)))
        _med_iqr(row, f"step_{kind}_s", _jobs_of(
            timed, lambda r, kind=kind: sum(r.get(f"{ph}_{kind}_s", 0.0) for ph in PHASES)))
    _med_iqr(row, "overhead_s", _jobs_of(
        timed, lambda r: r["step_wall_s"] - sum(r.get(f"{ph}_s", 0.0) for ph in PHASES)))
    row["overhead_frac"] = row["overhead_s"] / row["step_s"]
    gen = _stats.describe(_jobs_of(timed, lambda r: r["generated_tokens"]))["median"]
    trained = _stats.describe(_jobs_of(timed, lambda r: r.get("tokens", 0.0)))["median"]
    row["tokens_per_step"] = {"generated": gen, "trained": trained, "prompt": trained - gen}
    row["generated_tok_s"] = gen / row["generate_s"]
    row["gen_tok_s_median"] = _stats.describe(_jobs_of(timed, lambda r: r["gen_tok_s"]))["median"]
    # MFU per step: that step's trained and loss tokens over its train seconds.
    row["matmul_peak_flops"], row["matmul_peak_per_rank_flops"] = peak, peak * share
    row["train_ranks"] = train_ranks = _train_ranks(nproc, placement, jobs[0]["config"])
    _med_iqr(row, "train_mfu", _jobs_of(timed, lambda r: _train_flops(
        params, r.get("tokens", 0.0), r.get("num_tokens", 0.0)) / train_ranks
        / max(r.get("train_s", 0.0), 1e-9) / (peak * share)))
    # the train phase's floor: its model FLOPs per rank at the per-rank GEMM peak
    _med_iqr(row, "train_floor_s", _jobs_of(timed, lambda r: _train_flops(
        params, r.get("tokens", 0.0), r.get("num_tokens", 0.0)) / train_ranks / (peak * share)))
    # generate and sync floors: bytes at one rank's measured copy bandwidth
    config, max_tokens = jobs[0]["config"], WORKLOADS[args.workload][2]
    row["mem_bandwidth_per_rank"] = bandwidth
    row["generate_floor_bytes_s"] = _gen_floor_s(params["total"], config, max_tokens, bandwidth)
    row["rollout_peak_per_rank_flops"] = rollout_peak * share
    rollout_ranks = nproc - train_ranks if placement == "separate" else nproc
    row["generate_floor_flops_s"] = _gen_flops_floor_s(params, gen, rollout_ranks,
                                                       rollout_peak * share)
    row["generate_floor_s"] = max(row["generate_floor_bytes_s"], row["generate_floor_flops_s"])
    _med_iqr(row, "sync_floor_s", _jobs_of(timed, lambda r: _sync_floor_s(r, config, bandwidth)))
    _med_iqr(row, "train_step_s", _jobs_of(timed, lambda r: r.get("train_step_s", 0.0)))
    _med_iqr(row, "train_other_s", _jobs_of(
        timed, lambda r: r.get("train_s", 0.0) - r.get("train_step_s", 0.0)))
    row.update(_train_split(jobs, row["train_step_s"]))
    ahead = jobs[0]["config"]["async_rollout"]
    row.update(_ahead_stats(timed, 0 if ahead["partial"] else ahead["max_staleness"]))
    row.update(_partial_stats(timed, ahead) if ahead["partial"] else {})
    _med_iqr(row, "train_samples", _jobs_of(timed, lambda r: r.get("train_samples", 0.0)))
    row["generate_s_jobs"] = _jobs_of(timed, lambda r: r.get("generate_s", 0.0))
    row["sampled_tok_s_jobs"] = _jobs_of(timed, lambda r: r.get(
        "partial/sampled_tokens", r["generated_tokens"]) / max(r.get("generate_s", 0.0), 1e-9))
    if row.get("generate_busy_s"):  # generation ahead: generate_s is the step's wait
        row["generated_tok_s"] = gen / row["generate_busy_s"]
    if ahead["partial"]:  # what the engine sampled in the step, not the trained samples' tokens
        row["generated_tok_s"] = row["partial_sampled_tokens"] / row["generate_s"]
    row["step_s_jobs"] = step_jobs
    row.update(_first_steps(jobs, timed) if args.warmup >= 2 else {})
    row["resolved_config"] = _same_config(jobs)
    return row


def _ahead_stats(timed: list[list[dict]], k: int) -> dict:
    """async_rollout.max_staleness = k > 0: generate_busy_s (the engine's seconds on the
    step's batch; generate_s is then the step's wait for it), the overlap bound
    max(train_s, generate_busy_s) per step and the step's wall over it, and the
    staleness distribution (fraction of the timed steps' samples at each d)."""
    if not k:
        return {"max_staleness": 0}
    out: dict = {"max_staleness": k}
    _med_iqr(out, "generate_busy_s", _jobs_of(timed, lambda r: r.get("generate_busy_s", 0.0)))
    _med_iqr(out, "overlap_bound_s", _jobs_of(
        timed, lambda r: max(r.get("train_s", 0.0), r.get("generate_busy_s", 0.0))))
    out["step_over_bound"] = _stats.describe(_jobs_of(
        timed, lambda r: r["step_wall_s"] / max(r.get("train_s", 0.0),
                                                r.get("generate_busy_s", 0.0), 1e-9)))
    return {**out, **_staleness_summary(timed, k)}


def _staleness_summary(timed: list[list[dict]], k: int) -> dict:
    """Staleness over all timed steps: the mean, the max, and the share of the
    samples at each staleness 0..k (per-step shares averaged over the steps)."""
    rows = [r for job in timed for r in job]
    out = {"staleness_mean": sum(r["staleness_mean"] for r in rows) / len(rows),
           "staleness_max": max(r["staleness_max"] for r in rows),
           "staleness_dist": {d: sum(r.get(f"staleness/{d}", 0.0) for r in rows) / len(rows)
                              for d in range(k + 1)}}
    if any("sync_inflight" in r for r in rows):  # async_rollout.inflight_updates
        out["staleness_token_mean"] = sum(r.get("staleness_token_mean", r["staleness_mean"])
                                          for r in rows) / len(rows)
        synced = [r["sync_inflight"] for r in rows if "sync_inflight" in r]
        out["installs_inflight"] = sum(synced) / len(synced)
    return out


def _partial_stats(timed: list[list[dict]], ahead: dict) -> dict:
    """async_rollout.partial: tokens the engine sampled per step (the trained
    samples' tokens include parked prefixes sampled earlier), parked groups after
    each step, continued samples, and the staleness distribution."""
    k = ahead["max_staleness"]
    out: dict = {"partial_rollout": True, "step_token_budget": ahead["step_token_budget"],
                 "max_staleness": 0}
    for key in ("sampled_tokens", "parked_groups", "continued_samples", "regenerated_groups",
                "dropped_groups"):
        _med_iqr(out, f"partial_{key}", _jobs_of(timed, lambda r, key=key: r.get(
            f"partial/{key}", 0.0)))
    return {**out, **_staleness_summary(timed, k)}


def _partial_table(rows: list[dict]) -> str:
    """Configs with partial rollouts against the same config without them: the
    generate phase (the long tail's idle time is in it) and the whole step."""
    skip = ("async_rollout.partial=", "async_rollout.step_token_budget=", "async_rollout.max_staleness=",
            "algorithm.behaviour_logp=", "async_rollout.stale_partial=")

    def key(r: dict) -> tuple:
        return (r["preset"], r["world_size"], r["placement"],
                tuple(o for o in r.get("overrides", []) if not o.startswith(skip)))

    base_of = {key(r): r for r in rows if not r.get("partial_rollout")}
    head = ("| config | budget | step s (IQR) | generate s | sampled tok / step | engine "
            "tok/s (generate) | trained samples / step | generate s per trained sample | "
            "parked groups | staleness mean (share at 0..k) | generate / without [95% CI] | "
            "tok/s / without [95% CI] | step / without [95% CI] |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in [*base_of.values(), *(r for r in rows if r.get("partial_rollout"))]:
        sampled = r.get("partial_sampled_tokens", r["tokens_per_step"]["generated"])
        tok_s = _stats.describe(r["sampled_tok_s_jobs"])["median"]
        cells = [f"{r['config_name']}", str(r.get("step_token_budget", "-")),
                 f"{r['step_s']:.3f} ({r['step_s_iqr']:.3f})", f"{r['generate_s']:.3f}",
                 f"{sampled:.0f}", f"{tok_s:.0f}", f"{r['train_samples']:.0f}",
                 f"{r['generate_s'] / max(r['train_samples'], 1e-9):.4f}"]
        base = base_of.get(key(r)) if r.get("partial_rollout") else None
        if not r.get("partial_rollout"):
            cells += ["-", "-", "-", "-", "-"]
        else:
            dist = " / ".join(f"{v:.2f}" for v in r["staleness_dist"].values())
            cells += [f"{r['partial_parked_groups']:.0f}", f"{r['staleness_mean']:.2f} ({dist})"]
            for name, jobs_key in (("generate", "generate_s_jobs"), ("tok_s", "sampled_tok_s_jobs"),
                                   ("step", "step_s_jobs")):
                if base is None:
                    cells.append("-")
                    continue
                a, b = _stats.describe(r[jobs_key])["median"], _stats.describe(base[jobs_key])["median"]
                ci = _stats.ratio_ci(r[jobs_key], base[jobs_key], paired=False)
                r[f"{name}_over_without_partial"], r[f"{name}_over_without_partial_ci"] = a / b, ci
                cells.append(f"{a / b:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if any(r.get("partial_rollout") for r in rows) else ""


def _ahead_table(rows: list[dict]) -> str:
    """Configs with generation ahead: the step against the overlap bound and against
    the same config without it (same preset, N, placement, other settings)."""
    def key(r: dict) -> tuple:
        return (r["preset"], r["world_size"], r["placement"],
                tuple(o for o in r.get("overrides", []) if not o.startswith(
                    ("async_rollout.max_staleness=", "algorithm.behaviour_logp=",
                     "async_rollout.inflight_updates=", "async_rollout.schedule="))))

    sync = {key(r): r for r in rows if not r.get("max_staleness")}
    head = ("| config | k | step s (IQR) | mean of k + 1 steps s (IQR) | train s | generate "
            "busy s (wait) | max(train, generate) s | step / max: median [q1, q3] | staleness "
            "mean (share at 0..k) | token staleness mean (installs in flight) | step / "
            "synchronous step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if not r.get("max_staleness"):
            continue
        base, n = sync.get(key(r)), r["max_staleness"] + 1
        # colocated, nothing overlaps: a burst generates once per k + 1 steps, so the
        # step that counts is the mean over k + 1 consecutive steps (any k + 1 hold one
        # burst); separate: the overlapped steps themselves
        colocated = r["placement"] == "colocated"
        cyc = _stats.describe(_cycles(r["step_s_jobs"], n))
        r["step_cycle_s"], r["step_cycle_s_iqr"] = cyc["median"], cyc["iqr"]
        ratio = "-"
        if base:
            num, den = ((_cycles(r["step_s_jobs"], n), _cycles(base["step_s_jobs"], n))
                        if colocated else (r["step_s_jobs"], base["step_s_jobs"]))
            r["step_over_synchronous"] = _stats.ratio(num, den)
            r["step_over_synchronous_ci"] = _stats.ratio_ci(num, den, paired=False)
            lo, hi = r["step_over_synchronous_ci"]
            ratio = (f"{r['step_over_synchronous']:.2f} "
                     f"({_stats.describe(den)['median']:.3f} s) [{lo:.2f}, {hi:.2f}]")
        b = r["step_over_bound"]
        bound = ("- | -" if colocated else
                 f"{r['overlap_bound_s']:.3f} | {b['median']:.3f} [{b['q1']:.3f}, {b['q3']:.3f}]")
        dist = " / ".join(f"{v:.2f}" for v in r["staleness_dist"].values())
        tok = (f"{r['staleness_token_mean']:.2f} ({r['installs_inflight']:.0%})"
               if "installs_inflight" in r else "-")
        lines.append(
            f"| {r['config_name']} | {r['max_staleness']} | {r['step_s']:.3f} "
            f"({r['step_s_iqr']:.3f}) | {r['step_cycle_s']:.3f} ({r['step_cycle_s_iqr']:.3f}) "
            f"| {r['train_s']:.3f} | {r['generate_busy_s']:.3f} ({r['generate_s']:.3f}) | "
            f"{bound} | {r['staleness_mean']:.2f} ({dist}) | {tok} | {ratio} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _cycles(jobs: list[list[float]], n: int) -> list[list[float]]:
    """Each job's steps as means of n consecutive steps (whole windows only)."""
    return [[statistics.fmean(job[i:i + n]) for i in range(0, len(job) - n + 1, n)]
            for job in jobs]


def _train_ranks(nproc: int, placement: str, config: dict) -> int:
    """Ranks that train: all colocated; separate: all but rollout.num_ranks (0 = half,
    rounded down to a multiple of the TP size, as the job resolves it)."""
    if placement == "colocated":
        return nproc
    tp, rollout = config["rollout"]["tensor_parallel_size"], config["rollout"]["num_ranks"]
    return nproc - (rollout or max(tp, nproc // 2 // tp * tp))


def _train_split(jobs: list[dict], train_step_s: float) -> dict:
    """The profiled step's train_step split, medians over jobs x ranks: as fractions of
    that step, and as seconds of the timed steps' median train_step_s (the profiler
    itself slows the profiled step)."""
    profs = [p for j in jobs for p in j["profiles"]]
    if not profs:  # a degenerate (skipped) step moved the profiled call past the run
        return {"train_profiled": 0}
    out = {"train_profiled": len(profs),
           "train_step_profiled_s": statistics.median(p["wall_s"] for p in profs)}
    for key in ("compute", "comm", "optimizer"):
        out[f"train_{key}_frac"] = statistics.median(p[f"{key}_s"] / p["wall_s"] for p in profs)
    total = sum(out[f"train_{key}_frac"] for key in ("compute", "comm", "optimizer"))
    for key in ("compute", "comm", "optimizer"):  # medians of fractions: renormalised
        out[f"train_{key}_frac"] /= total
        out[f"train_{key}_s"] = out[f"train_{key}_frac"] * train_step_s
    # the profiled step's top ops by self time, as shares of that step (medians)
    ops = {k for p in profs for k in p.get("top_self_s", {})}
    share = {k: statistics.median(p.get("top_self_s", {}).get(k, 0.0) / p["wall_s"]
                                  for p in profs) for k in ops}
    out["train_top_ops"] = dict(sorted(share.items(), key=lambda kv: -kv[1])[:10])
    return out


def _same_config(jobs: list[dict]) -> dict:
    """The resolved config of the config's jobs (they differ only in output_dir)."""
    strip = [{k: v for k, v in j["config"].items() if k != "output_dir"} for j in jobs]
    if any(s != strip[0] for s in strip):
        raise SystemExit("jobs of one config resolved to different configs")
    return strip[0]


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _table(rows: list[dict]) -> str:
    head = ("| model | params | N | placement | settings | T | jobs x steps | step s (IQR) | generate s | "
            "score s | switch s | train s | sync s | overhead | train: trainer (compute/comm/opt) + other | "
            "gen tok/s | "
            "train MFU (IQR) | rank-0 CPU s: user / sys (sys: gen / train / sync) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        split = ("n/a" if not r["train_profiled"] else
                 f"{r['train_compute_frac']:.0%}/{r['train_comm_frac']:.0%}/"
                 f"{r['train_optimizer_frac']:.0%}")
        split = f"{r['train_step_s']:.3f} ({split}) + {r['train_other_s']:.3f}"
        lines.append(
            f"| {r['preset']} | {r['model_params'] / 1e6:.1f}M | {r['world_size']} | "
            f"{r['placement']} | {', '.join(r.get('overrides', [])) or '-'} | {r['tp']} | {r['jobs']} x {r['steps_timed'] // r['jobs']} | "
            f"{r['step_s']:.3f} ({r['step_s_iqr']:.3f}) | {r['generate_s']:.3f} | "
            f"{r['score_s']:.3f} | {r['switch_s']:.3f} | {r['train_s']:.3f} | "
            f"{r['sync_s']:.3f} | {r['overhead_s']:.3f} ({r['overhead_frac']:.0%}) | {split} | "
            f"{r['generated_tok_s']:.0f} | {r['train_mfu']:.1%} ({r['train_mfu_iqr']:.1%}) | "
            f"{r['step_user_s']:.2f} / {r['step_sys_s']:.2f} ({r['generate_sys_s']:.2f} / "
            f"{r['train_sys_s']:.2f} / {r['sync_sys_s']:.2f}) |")
    return "\n".join(lines)


def _step_over_first(rows: list[dict]) -> None:
    """Sets each row's step_over_first (its median step over the first config's) and
    step_over_first_ci (95% hierarchical-bootstrap CI over jobs then steps; None
    when the job counts differ, since the bootstrap pairs jobs)."""
    base = rows[0]["step_s_jobs"]
    for r in rows:
        r["step_over_first"] = _stats.ratio(r["step_s_jobs"], base)
        r["step_over_first_ci"] = (_stats.ratio_ci(r["step_s_jobs"], base, paired=False)
                                   if len(r["step_s_jobs"]) == len(base) else None)


def _versus_first(rows: list[dict]) -> str:
    """The table of every config against the first (`_step_over_first`, and the
    train phases' ratio), with its steps 1-2 against the steady state."""
    head = ("| config | step s | step / first config [95% CI] | train s / first config | "
            "steps 1, 2 s (median job) | steps 1-2 beyond 2 steady steps s | start-up s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ci = r["step_over_first_ci"]
        ci = "[{:.3f}, {:.3f}]".format(*ci) if ci else "(unequal jobs)"
        firsts = sorted(r.get("first_steps_s_jobs", []), key=sum)
        first = "{:.2f}, {:.2f}".format(*firsts[len(firsts) // 2]) if firsts else "-"
        extra = f"{r['first_two_extra_s']:.2f} | {r['start_s']:.1f}" if firsts else "- | -"
        lines.append(
            f"| {r['config_name']} | {r['step_s']:.3f} | {r['step_over_first']:.3f} {ci} | "
            f"{r['train_s'] / rows[0]['train_s']:.3f} | {first} | {extra} |")
    return "\n".join(lines)


def _floors(rows: list[dict]) -> str:
    """Per config: each phase against its floor (the step's floor is their sum)."""
    head = ("| config | generate s (floor: bytes / FLOPs) | train s (floor) | sync s (floor) | "
            "step s (sum of floors) | copy GB/s per rank | GEMM TFLOP/s per rank (rollout) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        floor = r["generate_floor_s"] + r["train_floor_s"] + r["sync_floor_s"]
        lines.append(
            f"| {r['config_name']} | {r['generate_s']:.3f} ({r['generate_floor_bytes_s']:.3f} "
            f"/ {r['generate_floor_flops_s']:.3f}) | "
            f"{r['train_s']:.3f} ({r['train_floor_s']:.3f}) | {r['sync_s']:.3f} "
            f"({r['sync_floor_s']:.3f}) | {r['step_s']:.3f} ({floor:.3f}) | "
            f"{r['mem_bandwidth_per_rank'] / 1e9:.1f} | "
            f"{r['matmul_peak_per_rank_flops'] / 1e12:.2f} "
            f"({r['rollout_peak_per_rank_flops'] / 1e12:.2f}) |")
    return "\n".join(lines)


def _top_ops(rows: list[dict]) -> str:
    """Per config: the profiled train step's 10 ops with the most self time."""
    out = []
    for r in rows:
        ops = r.get("train_top_ops") or {}
        if ops:
            out.append(f"- {r['config_name']} (train floor {r['train_floor_s']:.3f} s = model "
                       f"FLOPs / per-rank GEMM peak, train {r['train_s']:.3f} s): " + ", ".join(
                           f"`{k}` {v:.0%}" for k, v in ops.items()))
    return "\n".join(out)


def _chart(rows: list[dict], path: Path) -> None:
    """Stacked horizontal bars: median seconds per phase (and overhead) per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['preset']} N={r['world_size']}" + (" sep" if r["placement"] == "separate" else "")
              for r in rows]
    fig, ax = plt.subplots(figsize=(8.5, 0.6 * len(rows) + 1.6))
    left = [0.0] * len(rows)
    for ph in (*PHASES, "overhead"):
        vals = [max(r[f"{ph}_s"], 0.0) for r in rows]
        ax.barh(labels, vals, left=left, label=ph)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.errorbar([r["step_s"] for r in rows], labels,
                xerr=[[r["step_s"] - r["step_s_q1"] for r in rows],
                      [r["step_s_q3"] - r["step_s"] for r in rows]],
                fmt="none", ecolor="black", capsize=3, label="step IQR")
    ax.set_xlabel("seconds per RL step (median wall clock; phases stacked)")
    ax.set_title("RL step by phase (CPU; sep = separate placement)")
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


AHEAD_HEADLINE_KEYS = ("max_staleness", "step_cycle_s", "step_cycle_s_iqr",
                       "step_over_synchronous", "step_over_synchronous_ci")
HEADLINE_KEYS = ("step_s", "step_s_iqr", "generate_s", "generate_floor_s",
                 "generate_floor_bytes_s", "generate_floor_flops_s", "score_s", "switch_s", "train_s",
                 "train_floor_s", "sync_s", "sync_floor_s", "step_user_s", "step_sys_s",
                 "mem_bandwidth_per_rank",
                 "overhead_s", "overhead_frac", "train_mfu", "train_mfu_iqr", "matmul_peak_flops",
                 "matmul_peak_per_rank_flops", "generated_tok_s", "tokens_per_step",
                 "preset", "model_params", "world_size", "placement", "tp", "jobs",
                 "steps_timed_per_job")


def main(argv=None) -> None:
    args = _args(argv)
    prompts, k, max_tokens = WORKLOADS[args.workload]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp:
        work = Path(tmp)
        (work / "reward.py").write_text(REWARD)
        for c, (preset, n, placement, num_jobs, sets) in enumerate(args.parsed):
            jobs = []
            for j in range(num_jobs):
                print(f"{preset} N={n} {placement} {' '.join(sets)}: job {j + 1}/{num_jobs} ...",
                      file=sys.stderr, flush=True)
                jobs.append(_run_job(args, preset, n, placement, sets,
                                     work / f"c{c}-{preset}-n{n}-{placement}-j{j}", work))
            dtype = _compute_dtype(jobs[0]["config"])
            peak = _matmul_peak(_threads(n), dtype)  # after the jobs: nothing else runs
            rollout_dtype = _rollout_peak_dtype(jobs[0]["config"])
            rollout_peak = peak if rollout_dtype == dtype else _matmul_peak(_threads(n),
                                                                            rollout_dtype)
            bandwidth = _mem_bandwidth(_threads(n))
            row = _config_row(args, preset, n, placement, jobs, peak, dtype, bandwidth,
                              rollout_peak)
            row["overrides"] = [*args.set, *sets]
            row["config_name"] = args.configs[c].partition("@")[0].split("+")[0] + \
                "".join(f"+{kv}" for kv in sets)
            rows.append(row)
    table = _table(rows)
    print(table)
    _step_over_first(rows)
    versus = _versus_first(rows)
    print(versus)
    ahead = _ahead_table(rows)
    if ahead:
        print(ahead)
        ahead = ("\n\nGeneration ahead of training (async_rollout.max_staleness = k): generate busy "
                 "= the engine's seconds on the step's batch (a burst's pass shared by its "
                 "batches' tokens; wait: what the step waited for it); the bound is the slower "
                 "side, per step (separate placement; colocated, nothing overlaps); mean of k "
                 "+ 1 steps: each job's steps in windows of k + 1 (a colocated burst generates "
                 "once in each), median (IQR) of the windows; step / synchronous step: ratio "
                 "of medians of steps (separate) or of k + 1 windows (colocated, the "
                 "synchronous config's steps in windows of the same size), bootstrap 95% CI; "
                 "staleness = step - the version "
                 "of the weights that sampled each sample; token staleness (in-flight "
                 "updates) = step - the version of the weights that sampled each token, and "
                 "installs in flight = the share of syncs installed between two engine steps "
                 f"of a running batch.\n\n{ahead}")
    partial = _partial_table(rows)
    if partial:
        print(partial)
        partial = ("\n\nPartial rollouts (async_rollout.partial): a step's generation stops "
                   "once it has its groups or has spent step_token_budget tokens; unfinished "
                   "sequences continue next step. sampled tok / step: what the engine sampled "
                   "in the step (the trained samples' tokens include parked prefixes); engine "
                   "tok/s = sampled / generate s per step (the long tail's idle time lowers "
                   "it); ratios: medians against the same config without partial rollouts, "
                   f"bootstrap 95% CI over steps.\n\n{partial}")
    path = result_path(args.out_dir, "step", quick=args.quick)
    chart = path.with_suffix(".png")
    _chart(rows, chart)
    names = [r["config_name"] for r in rows]
    head = rows[names.index(args.headline)] if args.headline in names else rows[-1]
    path.write_text(
        result_header(__file__, argv) +
        f"Workload {args.workload}: {prompts} prompts x K={k} completions x {max_tokens} new "
        f"tokens per step; recipe tiny_grpo_debug with bf16 rollout, reshard sync (64 MiB "
        f"buckets), the training defaults (bf16 compute, fp32 master weights, sharding=auto, "
        f"packing), memory.release=auto, unless a config's "
        f"settings say otherwise; fresh jobs per config as in the table, {args.warmup} warm-up "
        f"+ {args.steps} timed steps each, then one profiled step (train split). step s: wall "
        "clock between consecutive steps' ends, median (IQR) over all timed steps of all jobs; "
        "phases likewise; overhead = wall - phases. Train: the trainer's train_step seconds "
        "(compute/comm/opt: shares of the profiled trainer step, comm = gloo collectives "
        "and the shared-memory gradient all-reduce outside the optimizer) + the rest of the phase (KV cache release, batch). MFU: model "
        "FLOPs of the train phase per rank / train_s over the per-rank GEMM peak "
        f"({GEMM_N}^3, training dtype, the rank's threads, measured in this run). Ranks share "
        "the machine's cores (OMP threads = cores // N); with more ranks than cores they "
        f"time-share them. Headline: {names[rows.index(head)]}.\n\n"
        f"{table}\n\nEach config against the first (ratios of median steps, 95% bootstrap "
        "CI over jobs then steps; steps 1 and 2: wall clock, step 1's from the loop's start, "
        "after the engine and trainer are built; beyond: their sum minus two of the job's "
        "median timed steps; start-up: the job's wall clock outside the loop):\n\n"
        f"{versus}{ahead}{partial}\n\n![phases]({chart.name})\n\nEach phase against its floor (generate: the "
        "larger of every weight of the TP shard read once per decode step (max new tokens) "
        "and 2 x parameters FLOPs per sampled token at the rollout ranks' GEMM peak in the "
        "rollout dtype; sync: every installed byte read from the master weights and written "
        "once; bytes at one rank's measured copy bandwidth; train: model FLOPs at the "
        "per-rank GEMM peak):\n\n"
        f"{_floors(rows)}\n\nThe profiled train step's top 10 ops by "
        f"self time (share of that step, median over jobs x ranks):\n\n{_top_ops(rows)}\n\n"
        f"```json\n{json.dumps(rows, indent=1)}\n```\n")
    summary = {key: head[key] for key in HEADLINE_KEYS}
    # generation ahead: the step that counts (a colocated burst's steps alternate, so its
    # step_s alone, a median of single steps, would mislead) and its ratio to k = 0
    summary.update({key: head[key] for key in AHEAD_HEADLINE_KEYS if key in head})
    summary.update({key: head[key] for key in ("step_over_first", "step_over_first_ci",
                                                "first_two_extra_s", "start_s") if key in head})
    print(json.dumps({**summary, "workload": args.workload, "configs": rows,
                      "result": str(path), "chart": str(chart)}))


if __name__ == "__main__":
    main()
