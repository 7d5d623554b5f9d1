"""One prepared GPU run: our colocated step per phase against floors measured on
the same card, generation variants, a profiled train step, and TRL's
GRPOTrainer (vLLM colocate) on the same job, in the same run.

The job: a random-init Qwen2.5-shaped model (--size 0.5b or 1.5b: vocabulary
151,936, tied embeddings), 32 random 16-token prompts x K = 8 x 256 new tokens
(a random model never stops early: 65,536 sampled tokens per step), one
optimizer step per generation, GRPO without KL, fp32 master weights with bf16
compute, vLLM in bf16 with CUDA graphs, the engine's memory released for
training (sleep level 2).

Parts, each in its own process (one vLLM engine per process), each with its
own deadline (the whole run fits about 9 minutes of GPU time):
- ours: copy and GEMM ceilings (the faster of bf16 and fp32) measured here; a
  warm-up step, then --steps timed steps, each phase timed (to_rollout
  includes the weight sync), with the device memory in use at each phase's end
  and the allocator's peak, and the engine's weights and KV cache as
  memory.release=auto counts them beside what the release freed;
  generation variants on the same engine (what ours asks now: log-probs for
  one completion per group, flat; every completion's log-probs as dicts; as
  flat lists; none; none with the garbage collector off; twice the
  sequences); one profiled train step (kernel busy fraction and top ops);
  the resolved vLLM settings.
- trl: benchmarks/peer/trl_grpo.py on the same job (--workload gpu), when
  trl is importable; skipped otherwise.

Floors, from the measured ceilings (not the spec sheet):
- generate: per decode step max(bytes read / copy bandwidth, FLOPs / GEMM
  peak), bytes = the bf16 weights once + the KV cache of the mean context of
  every sequence; times the new tokens;
- train: 6 x non-embedding params x trained tokens + the vocabulary
  projection (6 x V x H per loss token), at the GEMM peak.

The last stdout line is JSON with generate_over_floor, train_over_floor,
step_over_floor and, when TRL ran, ours_over_trl (median step / TRL's median
step). Results: benchmarks/results/gpu_<size>_<card>_<yyyymm>.json and .md.

    python benchmarks/bench_gpu.py --size 1.5b         # on one GPU (docs/benchmarks.md#gpu)
    python benchmarks/bench_gpu.py --cpu --quick       # tiny shapes on CPU, the same code
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VOCAB = 151_936
SIZES = {  # Qwen2.5's shapes (config.json of Qwen/Qwen2.5-0.5B and -1.5B); quick: CPU mode
    "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                 intermediate_size=8960),
    "quick": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=256),
}
# prompts, K, new tokens, prompt tokens
JOBS = {"gpu": (32, 8, 256, 16), "quick": (4, 2, 8, 8)}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1.5b")
    p.add_argument("--cpu", action="store_true", help="run on CPU (with --quick: the tested mode)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and job, 1 timed step")
    p.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up")
    p.add_argument("--deadline", type=float, default=480, help="seconds for all parts")
    p.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True,
                   help="run TRL's part when trl is importable")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--work", default="/tmp/bench_gpu", help="model and part outputs")
    p.add_argument("--_part", dest="part", choices=["ours"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.steps = "quick", 1
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device: pass --cpu (with --quick for the tiny job)")
    return args


def _job(args: argparse.Namespace) -> tuple[int, int, int, int]:
    return JOBS["quick" if args.quick else "gpu"]


def _device(args: argparse.Namespace) -> str:
    return "cpu" if args.cpu else "cuda"


def _sync(args: argparse.Namespace) -> None:
    if not args.cpu:
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------
# Ceilings and floors
# --------------------------------------------------------------------------


def _timed_median(fn, args: argparse.Namespace, repeats: int = 10) -> float:
    """Median wall seconds of fn() after one warm-up, the device synchronised."""
    fn()
    _sync(args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ceilings(args: argparse.Namespace) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and GEMM FLOP/s, measured
    on this device with torch's own kernels. The GEMM ceiling is bf16's on a GPU
    and the faster of bf16 and fp32 on a CPU; fp32's alone on a CPU without bf16
    instructions (AVX2), where torch's bf16 GEMM runs ~90x below fp32 and
    vLLM-CPU's own GEMMs run above it."""
    import torch

    from hybrid_engine.parallel.precision import native_bf16

    dev = _device(args)
    n, m = (64 << 20, 1024) if args.cpu else (2 << 30, 8192)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy_s = _timed_median(lambda: b.copy_(a), args)
    dtypes = [torch.bfloat16] if native_bf16(dev) else []
    dtypes += [torch.float32] if args.cpu or not dtypes else []
    gemm_s = {}
    for dtype in dtypes:
        g = torch.randn(m, m, device=dev, dtype=dtype)
        h = torch.randn_like(g)
        gemm_s[str(dtype)[6:]] = _timed_median(lambda: g @ h, args)  # noqa: B023
    return {"copy_bytes_s": 2 * n / copy_s, "gemm_flops": 2 * m ** 3 / min(gemm_s.values()),
            **{f"gemm_flops_{k}": 2 * m ** 3 / v for k, v in gemm_s.items()}}


def _spec(args: argparse.Namespace):  # noqa: ANN202
    from hybrid_engine.models.tiny import TinyModelSpec

    return TinyModelSpec(arch="qwen2", vocab_size=VOCAB, tie_word_embeddings=True,
                         max_position_embeddings=4096, dtype="bfloat16", **SIZES[args.size])


def floors(args: argparse.Namespace, ceil: dict[str, float]) -> dict[str, float]:
    """Seconds the step's generation and training need at the measured ceilings."""
    spec = _spec(args)
    prompts, k, new, prompt_len = _job(args)
    seqs, params = prompts * k, spec.num_params
    embed = VOCAB * spec.hidden_size
    kv_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.resolved_head_dim * 2
    mean_context = prompt_len + new / 2
    step_bytes = 2 * params + kv_per_token * mean_context * seqs
    step_flops = 2 * params * seqs  # one token per sequence per decode step
    # copy_bytes_s counts bytes read and written: a read-only stream moves about as fast.
    decode = max(step_bytes / ceil["copy_bytes_s"], step_flops / ceil["gemm_flops"])
    tokens, loss_tokens = seqs * (prompt_len + new), seqs * new
    train_flops = 6 * (params - embed) * tokens + 6 * embed * loss_tokens
    return {"generate_s": new * decode, "train_s": train_flops / ceil["gemm_flops"],
            "decode_step_bytes": step_bytes, "train_flops": train_flops}


# --------------------------------------------------------------------------
# Ours: the colocated step, phase by phase
# --------------------------------------------------------------------------


def _overrides(args: argparse.Namespace, model: Path) -> dict:
    prompts, k, new, prompt_len = _job(args)
    out = {
        "model.path": str(model), "model.compute_dtype": "bfloat16",
        "model.rollout_dtype": "bfloat16", "rollout.tensor_parallel_size": 1,
        "rollout.num_samples_per_prompt": k, "rollout.max_tokens": new,
        "rollout.max_model_len": prompt_len + new + 64, "rollout.enforce_eager": args.cpu,
        "train.prompts_per_step": prompts, "train.lr": 1e-6, "train.sharding": "auto",
        "train.max_tokens_per_micro_batch": 8192 if args.size == "1.5b" else 16384,
        "memory.release": "true", "sync.method": "reshard", "sync.verify": False,
        "output_dir": str(Path(args.work) / "run"),
    }
    out.update({"memory.kv_cache_gib": 0.25} if args.cpu else {"memory.gpu_memory_fraction": 0.5})
    return out


def _prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    import random

    prompts, _, _, prompt_len = _job(args)
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(prompt_len)] for _ in range(prompts)]


def _memory(args: argparse.Namespace) -> dict[str, float]:
    """Device memory now: in use on the device (CUDA: total - free, every
    allocator; CPU: this process's RSS) and torch's allocated peak since the last
    reset (CUDA only; reset here)."""
    import torch

    if args.cpu:
        import psutil

        return {"in_use_gib": psutil.Process().memory_info().rss / 2 ** 30}
    free, total = torch.cuda.mem_get_info()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    torch.cuda.reset_peak_memory_stats()
    return {"in_use_gib": (total - free) / 2 ** 30, "allocated_peak_gib": peak}


def _phase(row: dict, name: str, fn, args: argparse.Namespace):  # noqa: ANN202
    """fn()'s result; its seconds and the memory after it go into row."""
    t = time.perf_counter()
    out = fn()
    _sync(args)
    row[f"{name}_s"] = time.perf_counter() - t
    row[f"mem_{name}"] = _memory(args)
    return out


def _rewarded(actor, alg, out, step: int) -> list:  # noqa: ANN001
    """The completions as trajectories with hashed rewards (1024 levels) and advantages."""
    from hybrid_engine.policy.colocated import completions_to_trajectories

    trajs = completions_to_trajectories(out)
    for i, t in enumerate(trajs):
        t.reward = (zlib.crc32(f"{step}|{i}|{t.response_ids[:8]}".encode()) % 1024) / 1023
    alg.compute_advantages(trajs)
    return trajs


def _steps(args: argparse.Namespace, actor, alg) -> list[dict]:  # noqa: ANN001
    """One warm-up step (step 0), then args.steps timed ones, phase by phase."""
    _, k, _, _ = _job(args)
    rows, trajs = [], None
    for step in range(args.steps + 1):
        row: dict = {"step": step}
        _phase(row, "to_rollout", actor.phases.to_rollout, args)
        out = _phase(row, "generate", lambda: actor.generate(
            _prompts(args, step), num_samples=k, seed=step), args)
        row["tokens"] = out.num_tokens
        trajs = _rewarded(actor, alg, out, step)
        row["engine_weights_bytes"] = actor.rollout.weight_bytes()
        row["engine_kv_bytes"] = actor.rollout.kv_cache_bytes()
        _phase(row, "to_train", actor.phases.to_train, args)
        row["released_bytes"] = actor.phases.released_bytes  # CUDA: mem_get_info's change
        m = _phase(row, "train", lambda: actor.train_step(trajs), args)
        row["trainer_kept_bytes"] = actor.trainer.kept_bytes()
        row["mismatch_abs_mean"] = m.get("mismatch_abs_mean")
        row["step_s"] = sum(row[f"{p}_s"] for p in ("to_rollout", "generate", "to_train", "train"))
        rows.append(row)
        print(f"step {step}: " + ", ".join(f"{p} {row[p + '_s']:.3f} s" for p in
                                           ("to_rollout", "generate", "to_train", "train")),
              flush=True)
    return rows


# Generation variants: keyword arguments of every request's SamplingParams (the
# first completion of each group may differ: "sample"), and the request count.
VARIANTS = {
    "ours": {"sample": {"logprobs": 0, "flat_logprobs": True}, "rest": {}},
    "logprobs_dict": {"sample": {"logprobs": 0}, "rest": {"logprobs": 0}},
    "logprobs_flat": {"sample": {"logprobs": 0, "flat_logprobs": True},
                      "rest": {"logprobs": 0, "flat_logprobs": True}},
    "no_logprobs": {"sample": {}, "rest": {}},
}


def _generate(args: argparse.Namespace, llm, variant: dict, *, groups: int = 1,  # noqa: ANN001
              seed: int = 99) -> tuple[float, int]:
    """(seconds, sampled tokens) of one llm.generate of the job's requests (groups
    times the prompts), seeded per request as the engine seeds them."""
    from vllm import SamplingParams, TokensPrompt

    _, k, new, _ = _job(args)
    prompts = [p for g in range(groups) for p in _prompts(args, seed + g)]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(k)]
    params = [SamplingParams(n=1, temperature=1.0, max_tokens=new, detokenize=False, seed=i,
                             **variant["sample" if i % k == 0 else "rest"])
              for i in range(len(requests))]
    _sync(args)
    t = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    _sync(args)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def generation_variants(args: argparse.Namespace, actor, rounds: int = 2) -> dict:  # noqa: ANN001
    """Tokens/s of each variant on the step's engine, interleaved over rounds;
    then ours with the garbage collector off, and ours with twice the sequences."""
    actor.phases.to_rollout()
    llm, out = actor.rollout.llm, {}
    _generate(args, llm, VARIANTS["ours"])  # warm: the first call after a sync
    for _ in range(rounds):
        for name, variant in VARIANTS.items():
            s, tokens = _generate(args, llm, variant)
            out.setdefault(name, []).append(tokens / s)
    gc.disable()
    try:
        s, tokens = _generate(args, llm, VARIANTS["ours"])
    finally:
        gc.enable()
    out["ours_gc_off"] = [tokens / s]
    s, tokens = _generate(args, llm, VARIANTS["ours"], groups=2)
    out["ours_2x_sequences"] = [tokens / s]
    return {name: {"tok_s": v, "median_tok_s": statistics.median(v)} for name, v in out.items()}


def profiled_train_step(args: argparse.Namespace, actor, trajs) -> dict:  # noqa: ANN001
    """One train step under torch.profiler: wall seconds, the device's busy share
    (CUDA: summed kernel time / wall) and the top ops by self time."""
    from torch.profiler import ProfilerActivity, profile

    actor.phases.to_train()
    acts = [ProfilerActivity.CPU] + ([] if args.cpu else [ProfilerActivity.CUDA])
    _sync(args)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        actor.train_step(trajs)
        _sync(args)
        wall = time.perf_counter() - t
    attr = "self_cpu_time_total" if args.cpu else "self_device_time_total"
    events = prof.key_averages()
    busy = None if args.cpu else sum(e.self_device_time_total for e in events) / 1e6 / wall
    top = sorted(events, key=lambda e: -getattr(e, attr))[:12]
    return {"wall_s": wall, "device_busy": busy,
            "top_ops_ms": {e.key[:80]: getattr(e, attr) / 1e3 for e in top}}


def part_ours(args: argparse.Namespace) -> dict:
    """The ours part: ceilings, steps, variants, the profiled step, floors."""
    import torch

    from hybrid_engine.algorithms.algorithm import Algorithm
    from hybrid_engine.config import RunConfig, apply_overrides
    from hybrid_engine.models.tiny import write_tiny_model
    from hybrid_engine.policy.colocated import HybridActor

    res: dict = {"size": args.size, "job": dict(zip(("prompts", "k", "new_tokens", "prompt_tokens"),
                                                    _job(args)))}
    res["device"] = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    res["ceilings"] = ceilings(args)
    model = Path(args.work) / f"model_{args.size}"
    if not (model / "model.safetensors").is_file():
        write_tiny_model(model, _spec(args))
    cfg = apply_overrides(RunConfig(), _overrides(args, model))
    t = time.perf_counter()
    actor = HybridActor(cfg)
    res["startup_s"], res["engine"] = time.perf_counter() - t, actor.engine_facts
    alg = Algorithm(cfg.algorithm, num_samples=cfg.rollout.num_samples_per_prompt,
                    max_tokens=cfg.rollout.max_tokens, prompts_per_step=cfg.train.prompts_per_step)
    try:
        res["steps"] = _steps(args, actor, alg)
        res["generation"] = generation_variants(args, actor)
        out = actor.generate(_prompts(args, 7), num_samples=cfg.rollout.num_samples_per_prompt)
        res["train_profile"] = profiled_train_step(args, actor, _rewarded(actor, alg, out, 7))
    finally:
        actor.shutdown()
    res["floors"] = floors(args, res["ceilings"])
    return res


# --------------------------------------------------------------------------
# TRL on the same job, and the driver
# --------------------------------------------------------------------------


def _run_part(cmd: list[str], timeout: float, log: Path) -> str | None:
    """Runs cmd with its output in log; None when it succeeded, else why not."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=max(timeout, 1), cwd=REPO)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s (log: {log})"
    if proc.returncode != 0:
        return f"exit code {proc.returncode}:\n" + log.read_text()[-3000:]
    return None


def part_trl(args: argparse.Namespace, model: Path, timeout: float) -> dict:
    """TRL's GRPOTrainer (benchmarks/peer/trl_grpo.py) on the same job: bf16
    autocast, no importance-sampling forward, gradient checkpointing off."""
    import importlib.util

    if not args.trl or importlib.util.find_spec("trl") is None:
        return {"skipped": "trl is not importable" if args.trl else "--no-trl"}
    out = Path(args.work) / "trl"
    _, k, _, _ = _job(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(REPO / "benchmarks" / "peer" / "trl_grpo.py"), "--model", str(model),
           "--workload", "quick" if args.quick else "gpu", "--device", _device(args), "--bf16",
           "--micro-batch", str(k), "--steps", str(args.steps), "--out", str(out)]
    error = _run_part(cmd, timeout, Path(args.work) / "trl.log")
    if error:
        return {"error": error}
    rows = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    return rows[-1]


def summarize(ours: dict, trl: dict) -> dict:
    """The headline ratios from the parts' results."""
    timed = ours["steps"][1:]
    med = {k: statistics.median(r[k] for r in timed)
           for k in ("to_rollout_s", "generate_s", "to_train_s", "train_s", "step_s")}
    fl = ours["floors"]
    out = {"size": ours["size"], "device": ours["device"], "median": med,
           "generate_over_floor": med["generate_s"] / fl["generate_s"],
           "train_over_floor": med["train_s"] / fl["train_s"],
           "step_over_floor": med["step_s"] / (fl["generate_s"] + fl["train_s"]),
           "generated_tok_s": statistics.median(r["tokens"] / r["generate_s"] for r in timed),
           "in_use_after_gib": {p: max(r[f"mem_{p}"]["in_use_gib"] for r in timed)
                               for p in ("to_rollout", "generate", "to_train", "train")}}
    # The figures memory.release=auto logs against independent measurements: the
    # engine's weights + KV cache against what its release freed (CUDA: the whole
    # engine sleeps; CPU: the KV cache only).
    out["engine_over_released"] = statistics.median(
        (r["engine_weights_bytes"] + r["engine_kv_bytes"]) / r["released_bytes"] for r in timed
        if r["released_bytes"]) if any(r["released_bytes"] for r in timed) else None
    if trl.get("median_step_s"):
        out["trl_step_s"] = trl["median_step_s"]
        out["ours_over_trl"] = med["step_s"] / trl["median_step_s"]
    return out


def _table(s: dict, ours: dict) -> str:
    fl, med = ours["floors"], s["median"]
    rows = [("generate", med["generate_s"], fl["generate_s"], s["generate_over_floor"]),
            ("train", med["train_s"], fl["train_s"], s["train_over_floor"]),
            ("to_rollout (sync)", med["to_rollout_s"], None, None),
            ("to_train (release)", med["to_train_s"], None, None),
            ("step", med["step_s"], fl["generate_s"] + fl["train_s"], s["step_over_floor"])]
    lines = ["| phase | median s | floor s | x floor |", "|---|---|---|---|"]
    for name, v, f, x in rows:
        lines.append(f"| {name} | {v:.3f} | {'' if f is None else f'{f:.4f}'} | "
                     f"{'' if x is None else f'{x:.1f}'} |")
    gen = ours["generation"]
    lines += ["", "| generation variant | tok/s (median) |", "|---|---|"]
    lines += [f"| {k} | {v['median_tok_s']:.0f} |" for k, v in gen.items()]
    if s["engine_over_released"] is not None:
        lines += ["", f"The engine's weights and KV cache as counted, over what its release "
                  f"freed (mem_get_info on CUDA): {s['engine_over_released']:.3f}."]
    if "ours_over_trl" in s:
        lines += ["", f"TRL's median step: {s['trl_step_s']:.3f} s; ours / TRL = "
                      f"{s['ours_over_trl']:.2f}."]
    return "\n".join(lines) + "\n"


def _write(args: argparse.Namespace, ours: dict, trl: dict, s: dict) -> Path:
    """The result files (.json with every measurement, .md with the tables)."""
    from _common import result_header, result_path

    md = result_path(args.out_dir, f"gpu_{args.size}", quick=args.quick)
    md.with_suffix(".json").write_text(json.dumps({"summary": s, "ours": ours, "trl": trl},
                                                  indent=1, default=str) + "\n")
    facts = ", ".join(f"{k} {v}" for k, v in ours["engine"].items())
    ceil = ours["ceilings"]
    md.write_text(
        result_header(__file__, None,
                      device_detail="" if ours["device"] == "cpu" else f" ({ours['device']})")
        + f"Job: {json.dumps(ours['job'])}; model: Qwen2.5-{args.size} shape, vocabulary "
        f"{VOCAB}, tied, random init.\n\nMeasured ceilings: copy "
        f"{ceil['copy_bytes_s'] / 1e12:.3f} TB/s (read + written), GEMM (the faster of bf16 "
        f"and fp32) {ceil['gemm_flops'] / 1e12:.1f} TFLOP/s.\n\nvLLM: {facts}.\n\n" + _table(s, ours)
        + f"\nTRL: {json.dumps(trl)[:600]}\n")
    return md


def main(argv=None) -> None:
    args = _args(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.part == "ours":
        res = part_ours(args)
        (Path(args.work) / "ours.json").write_text(json.dumps(res, default=str))
        return
    t0 = time.perf_counter()
    argv_part = [a for a in (argv if argv is not None else sys.argv[1:])]
    error = _run_part([sys.executable, __file__, *argv_part, "--_part", "ours"],
                      args.deadline, Path(args.work) / "ours.log")
    if error:
        raise SystemExit(f"the ours part failed: {error}")
    ours = json.loads((Path(args.work) / "ours.json").read_text())
    trl = part_trl(args, Path(args.work) / f"model_{args.size}",
                   args.deadline - (time.perf_counter() - t0))
    s = summarize(ours, trl)
    md = _write(args, ours, trl, s)
    print(md.read_text())
    print(json.dumps({**s, "result": str(md), "when": datetime.date.today().isoformat()}))


if __name__ == "__main__":
    main()
