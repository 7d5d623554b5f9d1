"""The vocabulary step's peak memory and time: the fused log-prob/entropy path against
per-chunk checkpointed autograd, at Qwen2.5's vocabulary (151,936).

The step is what the train step runs after the decoder: N hidden states
projected onto the vocabulary, each token's log-prob (and the entropy of the
metric's sample, every 16th token) in float32, and the backward to h and W.
Two implementations, each with chunks of C tokens:

- autograd: each chunk through `torch.utils.checkpoint`, the logits, softmax
  and entropy written as plain torch ops (the way most trainers chunk);
- fused: `hybrid_engine.roles.vocab_projection.vocab_logprobs`, which saves
  only h, W and two floats per token and recomputes each chunk in a
  hand-written backward.

In --jobs fresh processes, each with interleaved rounds (one forward +
backward of each variant per round, after a warm-up round), per variant and
dtype (fp32; bf16 h and W as FSDP2's bf16 compute holds them): the peak
memory above what the inputs and gradients hold (CPU: VmHWM reset through
/proc/self/clear_refs before each call; CUDA: max_memory_allocated) in units
of one fp32 [C, V] chunk (4 C V bytes, the floor of any path that
materialises a chunk's fp32 logits), and the seconds against the GEMM floor
(the three matmuls, h W^T, g W and g^T h, timed alone on the same shapes).
Each dtype's error against a float64 reference on the first rows (relative
norm of log-probs, entropy and both gradients) documents the bf16 gap.

Prints a table; the last stdout line is JSON. Results go to
benchmarks/results/vocab_<device>_<yyyymm>.md.

    python benchmarks/bench_vocab.py            # N 2048, H 128, C 1024: 3 jobs x 4 rounds
    python benchmarks/bench_vocab.py --quick    # N 256, H 64, C 128: 1 job x 2 rounds
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

import _common
import _stats
from hybrid_engine.roles.logprobs import ENTROPY_METRIC_EVERY
from hybrid_engine.roles.vocab_projection import vocab_logprobs

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151_936
VARIANTS = ("autograd", "fused")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="N, tokens per step (2048; quick 256)")
    p.add_argument("--hidden", type=int, default=None, help="H (128; quick 64)")
    p.add_argument("--chunk", type=int, default=None, help="C, tokens per chunk (1024; quick 128)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="V (Qwen2.5's 151936)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per job (4; quick 2)")
    p.add_argument("--jobs", type=int, default=None, help="fresh processes (3; quick 1)")
    p.add_argument("--quick", action="store_true", help="small shapes, 1 job x 2 rounds")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--_job", dest="job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    q = args.quick
    args.tokens = args.tokens or (256 if q else 2048)
    args.hidden = args.hidden or (64 if q else 128)
    args.chunk = args.chunk or (128 if q else 1024)
    args.repeats = args.repeats or (2 if q else 4)
    args.jobs = args.jobs or (1 if q else 3)
    return args


def _chunk_autograd(h_CH, w_VH, targets_C, every):  # noqa: ANN001, ANN202
    logits_CV = (h_CH @ w_VH.t()).float()
    lse_C = logits_CV.logsumexp(-1)
    logp_C = logits_CV.gather(-1, targets_C[:, None]).squeeze(-1) - lse_C
    rows_SV = logits_CV[::every].detach()
    entropy_S = lse_C[::every].detach() - (rows_SV.softmax(-1) * rows_SV).sum(-1)
    return logp_C, entropy_S


def autograd_logprobs(h_NH, w_VH, targets_N, chunk, every):  # noqa: ANN001, ANN201
    """The baseline: per-chunk checkpointed autograd (entropy on every `every`-th row)."""
    outs = [checkpoint(_chunk_autograd, h_NH[s : s + chunk], w_VH, targets_N[s : s + chunk],
                       every, use_reentrant=False) for s in range(0, h_NH.shape[0], chunk)]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def fused_logprobs(h_NH, w_VH, targets_N, chunk, every):  # noqa: ANN001, ANN201
    return vocab_logprobs(h_NH, w_VH, targets_N, chunk_tokens=chunk, entropy_every=every)


IMPLS = {"autograd": autograd_logprobs, "fused": fused_logprobs}


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _measured(fn, device: torch.device) -> tuple[float, float]:  # noqa: ANN001
    """(seconds, peak MiB above what was allocated before) of fn()."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = _status_mib("VmRSS")
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = _status_mib("VmHWM")
    # max: the kernel syncs RSS counters lazily, so a flat run can read a few pages below 0
    return time.perf_counter() - t0, max(peak - base, 0.0)


def _inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device,  # noqa: ANN202
            seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g).to(device)
    coef = torch.randn(n, generator=g).to(device)
    return h, w, targets, coef


def _step(impl, h, w, targets, coef, chunk):  # noqa: ANN001, ANN202
    logp, entropy = impl(h, w, targets, chunk, ENTROPY_METRIC_EVERY)
    (coef * logp).sum().backward()
    return logp.detach(), entropy.detach()


def _gemms(h, w, chunk):  # noqa: ANN001, ANN202
    """The step's three matmuls alone: h W^T, g W and g^T h, chunk by chunk."""
    with torch.no_grad():
        g_w = torch.empty_like(w)
        for s in range(0, h.shape[0], chunk):
            g_CV = h[s : s + chunk] @ w.t()
            _ = g_CV @ w
            g_w.addmm_(g_CV.t(), h[s : s + chunk])


def _errors(dtype: torch.dtype, hidden: int, vocab: int, chunk: int, device: torch.device) -> dict:
    """Relative-norm errors against float64 on 128 rows, per variant."""
    h, w, targets, coef = _inputs(128, hidden, vocab, dtype, device, seed=1)
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    logp_NV = (h64 @ w64.t()).log_softmax(-1)
    ref = [logp_NV.gather(-1, targets[:, None]).squeeze(-1),
           -(logp_NV.exp() * logp_NV).sum(-1)[::ENTROPY_METRIC_EVERY]]
    ref += torch.autograd.grad((coef.double() * ref[0]).sum(), (h64, w64))
    out = {}
    for name, impl in IMPLS.items():
        h.grad = w.grad = None
        logp, entropy = _step(impl, h, w, targets, coef, chunk)
        entropy = entropy[~entropy.isnan()]
        ours = [logp, entropy, h.grad, w.grad]
        out[name] = {k: float((a.double() - b.detach()).norm() / b.detach().norm())
                     for k, a, b in zip(("logp", "entropy", "grad_h", "grad_w"), ours, ref)}
    return out


def _rounds(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> dict:
    """Warm-up, then interleaved rounds of every variant and the GEMM floor."""
    h, w, targets, coef = _inputs(args.tokens, args.hidden, args.vocab, dtype, device)
    calls = {name: (lambda impl=impl: _step(impl, h, w, targets, coef, args.chunk))
             for name, impl in IMPLS.items()}
    calls["gemm"] = lambda: _gemms(h.detach(), w.detach(), args.chunk)
    for fn in calls.values():  # warm-up; the gradients stay allocated from here on
        fn()
    rows = {name: {"s": [], "peak_mib": []} for name in calls}
    for _ in range(args.repeats):
        for name, fn in calls.items():
            s, peak = _measured(fn, device)
            rows[name]["s"].append(s)
            rows[name]["peak_mib"].append(peak)
    return rows


def _job(args: argparse.Namespace) -> dict:
    """One process: per dtype, the rounds and the errors."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {dname: {**_rounds(args, dtype, device),
                    "errors": _errors(dtype, args.hidden, args.vocab, args.chunk, device)}
            for dname, dtype in DTYPES.items()}


def _spawn_job(args: argparse.Namespace) -> dict:
    """Runs _job in a fresh process (its own allocator and thread pool)."""
    cmd = [sys.executable, __file__, "--_job", f"--tokens={args.tokens}",
           f"--hidden={args.hidden}", f"--chunk={args.chunk}", f"--vocab={args.vocab}",
           f"--repeats={args.repeats}"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_vocab job failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(jobs: list[dict], args: argparse.Namespace) -> dict:
    """Per dtype: each variant's seconds and peak (medians, IQR), over the floors,
    fused/autograd ratios with bootstrap CIs, and job 1's errors."""
    chunk_mib = 4 * args.chunk * args.vocab / 2**20
    out = {}
    for dname in DTYPES:
        def series(name: str, key: str, d: str = dname) -> list[list[float]]:
            return [job[d][name][key] for job in jobs]
        floor_s = statistics.median(_stats.flat(series("gemm", "s")))
        res = {"floor_s": floor_s, "chunk_fp32_mib": chunk_mib,
               "errors": jobs[0][dname]["errors"]}
        for name in VARIANTS:
            s, peak = _stats.describe(series(name, "s")), _stats.describe(series(name, "peak_mib"))
            res[name] = {"s": s["median"], "s_iqr": s["iqr"], "over_floor": s["median"] / floor_s,
                         "peak_mib": peak["median"], "peak_iqr": peak["iqr"],
                         "peak_chunks": peak["median"] / chunk_mib}
        for key in ("s", "peak_mib"):
            num, den = series("fused", key), series("autograd", key)
            if min(_stats.flat(den)) <= 0:  # small chunks: the allocator reused freed memory
                res[f"fused_over_autograd_{key}"] = {"ratio": None, "ci95": None}
                continue
            res[f"fused_over_autograd_{key}"] = {"ratio": _stats.ratio(num, den),
                                                 "ci95": _stats.ratio_ci(num, den)}
        out[dname] = res
    return out


def _ratio_text(r: dict) -> str:
    if r["ratio"] is None:
        return "n/a (no peak measured above the inputs)"
    return f"**{r['ratio']:.2f}** [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"


def _table(res: dict) -> str:
    lines = ["| dtype | variant | peak above inputs, MiB (IQR) | in fp32 chunks | seconds (IQR) "
             "| over GEMM floor | err logp | err entropy | err grad h | err grad W |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for dname, r in res.items():
        for name in VARIANTS:
            v, e = r[name], r["errors"][name]
            lines.append(
                f"| {dname} | {name} | {v['peak_mib']:.0f} ({v['peak_iqr']:.0f}) "
                f"| {v['peak_chunks']:.2f} | {v['s']:.3f} ({v['s_iqr']:.3f}) "
                f"| {v['over_floor']:.2f}x | {e['logp']:.1e} | {e['entropy']:.1e} "
                f"| {e['grad_h']:.1e} | {e['grad_w']:.1e} |")
    lines.append("")
    for dname, r in res.items():
        m, s = (_ratio_text(r[f"fused_over_autograd_{k}"]) for k in ("peak_mib", "s"))
        lines.append(f"- {dname}: fused/autograd peak {m}, time {s}; GEMM floor "
                     f"{r['floor_s']:.3f} s; one fp32 chunk {r['chunk_fp32_mib']:.0f} MiB")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _args(argv)
    if args.job:
        print(json.dumps(_job(args)), flush=True)
        return
    jobs = []
    for j in range(args.jobs):
        print(f"job {j + 1}/{args.jobs}", file=sys.stderr, flush=True)
        jobs.append(_spawn_job(args))
    res = summarize(jobs, args)
    table = _table(res)
    print(table)
    path = _common.result_path(args.out_dir, "vocab", quick=args.quick)
    path.write_text(
        _common.result_header(__file__, argv)
        + f"N {args.tokens} tokens, H {args.hidden}, V {args.vocab}, chunks of {args.chunk}; "
        f"{args.jobs} jobs x {args.repeats} rounds. Errors: relative norm against float64 on "
        "128 rows of another draw.\n\n" + table + "\n\n"
        f"```json\n{json.dumps({'jobs': jobs}, indent=1)}\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    print(json.dumps({"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                      "chunk": args.chunk, "jobs": args.jobs, "repeats": args.repeats,
                      "quick": args.quick, "results": res}))


if __name__ == "__main__":
    main()
