"""How fast is copy_blocks at a sync's pack and unpack, against a plain copy of the same bytes?

`hybrid_engine.reshard.ops.copy_blocks` copies many 2-D strided blocks in one
call with the dtype cast fused (C++/OpenMP on CPU, one CUDA kernel on GPU).
The sync uses it to pack parameter slices into one flat send buffer and to
unpack a flat receive buffer into slices of the targets. Workloads, built
from Qwen2-like decoder layers (hidden H, kv_dim H/4, intermediate 11H/2;
q/k/v/o, gate/up/down, biases, two norms) and the share TP rank 1 of T=2
holds of each parameter -- column-parallel (q/k/v and their biases,
gate/up): the second half of the rows; row-parallel (o/down): the second
half of the columns, each row a segment; norms: whole:

- pack: the shares of fp32 parameters -> one flat bf16 buffer (cast fused);
- unpack_rows: a flat bf16 buffer -> the column-parallel shares and norms of
  bf16 targets (row slices, no cast);
- unpack_cols: a flat bf16 buffer -> the row-parallel shares of bf16 targets
  (column slices: one segment per row, no cast);
- copy_fp32: one big contiguous fp32 buffer -> another (kernel and copy_
  directly comparable).

Each workload has enough layers to move >= 512 MB read + written (24 MB with
--quick): twice the last-level cache of the 2-core dev machine (260 MiB).
On every device there is (cpu; cuda too when available), in --jobs fresh
processes, each with interleaved rounds (one call of each per round, after a
warm-up round), the median, IQR and fastest seconds over all rounds of all
jobs of: the kernel; the floor, `dst.copy_(src)` on flat contiguous tensors
of the same element count and dtypes, hence the same bytes (a fp32->bf16
copy_ is the best torch does for a cast copy); and `copy_blocks_ref`, the
pure-torch loop of one copy_ per block. kernel/copy_ comes with a bootstrap
95% CI over jobs x rounds (paired by round). Every kernel output is first
checked against copy_blocks_ref's, bit for bit.

Prints a table; the last stdout line is JSON. Results go to
benchmarks/results/kernels_<device>_<yyyymm>.md.

    python benchmarks/bench_kernels.py              # >= 512 MB per workload, 3 jobs x 10 rounds
    python benchmarks/bench_kernels.py --quick      # 24 MB per workload, 1 job x 5 rounds, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_engine import _native
from hybrid_engine.reshard.ops import block_between, blocks_tensor, copy_blocks, copy_blocks_ref

REPO = Path(__file__).resolve().parents[1]

# name -> (TP kinds of the parameter shares it moves, source dtype, destination
# dtype, whether it packs shares into a buffer (else unpacks a buffer into them))
SYNC_WORKLOADS = {
    "pack": (("col", "row", "rep"), torch.float32, torch.bfloat16, True),
    "unpack_rows": (("col", "rep"), torch.bfloat16, torch.bfloat16, False),
    "unpack_cols": (("row",), torch.bfloat16, torch.bfloat16, False),
}
COPY_WORKLOAD = "copy_fp32"


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per job (10; quick 5)")
    p.add_argument("--jobs", type=int, default=None,
                   help="fresh processes, each --repeats rounds (3; quick 1)")
    p.add_argument("--quick", action="store_true", help="24 MB per workload, 1 job x 5 rounds")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--_job", dest="job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.repeats = args.repeats or (5 if args.quick else 10)
    args.jobs = args.jobs or (1 if args.quick else 3)
    if args.repeats < 1 or args.jobs < 1:
        p.error("--repeats and --jobs must be >= 1")
    return args


# --- geometry ------------------------------------------------------------------

def layer_params(hidden: int, kv_dim: int, intermediate: int) -> list[tuple[tuple[int, ...], str]]:
    """(shape, TP kind) of each parameter of one Qwen2 decoder layer, HF order.

    Kinds: "col" column-parallel (TP splits rows), "row" row-parallel (TP
    splits columns), "rep" replicated."""
    h, kv, i = hidden, kv_dim, intermediate
    return [((h, h), "col"), ((h,), "col"),    # q_proj weight, bias
            ((kv, h), "col"), ((kv,), "col"),  # k_proj
            ((kv, h), "col"), ((kv,), "col"),  # v_proj
            ((h, h), "row"),                   # o_proj
            ((i, h), "col"), ((i, h), "col"),  # gate_proj, up_proj
            ((h, i), "row"),                   # down_proj
            ((h,), "rep"), ((h,), "rep")]      # input / post-attention layernorm


def _share(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The view of parameter t that TP rank 1 of T=2 holds (see layer_params)."""
    if kind == "col":
        return t[t.shape[0] // 2:]
    if kind == "row":
        return t[:, t.shape[1] // 2:]
    return t


def _share_elems(params: list[tuple[tuple[int, ...], str]], kinds: tuple[str, ...]) -> int:
    """Elements of the shares of the params whose kind is in kinds."""
    return sum(_share(torch.empty(s, device="meta"), k).numel() for s, k in params if k in kinds)


def geometry(quick: bool) -> dict:
    """Every workload's size: the layer dims, the layers of each sync workload
    (the fewest that move >= min_bytes read + written) and the elements of
    the fp32 copy (min_bytes / 8)."""
    hidden = 256 if quick else 1024
    dims = {"hidden": hidden, "kv_dim": hidden // 4, "intermediate": 11 * hidden // 2}
    min_bytes = 24_000_000 if quick else 512_000_000
    layer = layer_params(**dims)
    layers = {}
    for name, (kinds, src, dst, _) in SYNC_WORKLOADS.items():
        per_layer = _share_elems(layer, kinds) * (src.itemsize + dst.itemsize)
        layers[name] = math.ceil(min_bytes / per_layer)
    return {**dims, "min_bytes": min_bytes, "layers": layers, "copy_elems": min_bytes // 8}


# --- workloads -----------------------------------------------------------------

@dataclass
class Workload:
    """One copy_blocks call: its tensors, block table and element count."""

    name: str
    srcs: list[torch.Tensor]
    dsts: list[torch.Tensor]
    blocks: torch.Tensor
    elems: int

    @property
    def nbytes(self) -> int:
        """Bytes read + written by the call."""
        return self.elems * (self.srcs[0].element_size() + self.dsts[0].element_size())


def _buffer_workload(name: str, params: list[tuple[tuple[int, ...], str]], kinds: tuple[str, ...],
                     src_dtype: torch.dtype, dst_dtype: torch.dtype, pack: bool,
                     device: torch.device) -> Workload:
    """Shares of the params of the given kinds -> one flat buffer (pack), or the
    buffer -> the shares; the source side random, the destination side zero."""
    params = [(s, k) for s, k in params if k in kinds]
    param_dtype, buf_dtype = (src_dtype, dst_dtype) if pack else (dst_dtype, src_dtype)
    make_params, make_buf = (torch.randn, torch.zeros) if pack else (torch.zeros, torch.randn)
    tensors = [make_params(s, dtype=param_dtype, device=device) for s, _ in params]
    shares = [_share(t, k) for t, (_, k) in zip(tensors, params)]
    elems = sum(s.numel() for s in shares)
    buf = make_buf(elems, dtype=buf_dtype, device=device)
    blocks, offset = [], 0
    for i, (t, share) in enumerate(zip(tensors, shares)):
        piece = buf[offset:offset + share.numel()].view(share.shape)
        offset += share.numel()
        blocks.append(block_between(i, t, share, 0, buf, piece) if pack
                      else block_between(0, buf, piece, i, t, share))
    srcs, dsts = (tensors, [buf]) if pack else ([buf], tensors)
    return Workload(name, srcs, dsts, blocks_tensor(blocks), elems)


def _workloads(geo: dict, device: torch.device) -> Iterator[Workload]:
    """The workloads on device, built one at a time (memory holds one if the
    caller drops each before asking for the next)."""
    layer = layer_params(geo["hidden"], geo["kv_dim"], geo["intermediate"])
    for name, spec in SYNC_WORKLOADS.items():
        yield _buffer_workload(name, layer * geo["layers"][name], *spec, device)
    yield _buffer_workload(COPY_WORKLOAD, [((geo["copy_elems"],), "rep")], ("rep",),
                           torch.float32, torch.float32, True, device)


# --- measurement ---------------------------------------------------------------

def _check(w: Workload) -> None:
    """Runs the kernel once; fails unless its output equals copy_blocks_ref's bit for bit."""
    expected = [d.clone() for d in w.dsts]
    copy_blocks_ref(w.srcs, expected, w.blocks)
    copy_blocks(w.srcs, w.dsts, w.blocks)
    for i, (got, want) in enumerate(zip(w.dsts, expected)):
        if not torch.equal(got, want):
            raise SystemExit(f"{w.name} on {got.device}: copy_blocks output {i} differs "
                             "from copy_blocks_ref")


def _seconds(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of one call of fn (CUDA: events around it, the device idle before)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _times(fns: dict[str, Callable[[], None]], device: torch.device,
           repeats: int) -> dict[str, list[float]]:
    """Seconds of each fn per round: a warm-up round, then `repeats` rounds of one
    call each, so load from others on the machine hits every fn alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats + 1):
        for k, fn in fns.items():
            t = _seconds(fn, device)
            if r > 0:
                times[k].append(t)
    return times


def _measure(w: Workload, device: torch.device, repeats: int) -> dict:
    """One job's rounds of the kernel, a plain copy_ of the same bytes and
    copy_blocks_ref: the workload's facts and the raw seconds per round."""
    _check(w)
    flat_src = torch.randn(w.elems, device=device).to(w.srcs[0].dtype)
    flat_dst = torch.empty(w.elems, dtype=w.dsts[0].dtype, device=device)
    times = _times({
        "kernel": lambda: copy_blocks(w.srcs, w.dsts, w.blocks),
        "copy": lambda: flat_dst.copy_(flat_src),
        "ref": lambda: copy_blocks_ref(w.srcs, w.dsts, w.blocks),
    }, device, repeats)
    return {"device": device.type, "workload": w.name,
            "src_dtype": str(w.srcs[0].dtype).removeprefix("torch."),
            "dst_dtype": str(w.dsts[0].dtype).removeprefix("torch."),
            "blocks": w.blocks.shape[0], "elements": w.elems, "bytes": w.nbytes, "times": times}


def summarize(jobs: list[list[dict]]) -> list[dict]:
    """One row per (device, workload) from every job's raw rows: median, IQR and
    fastest seconds over all rounds of all jobs, GB/s, kernel/copy_ (= copy_ s /
    kernel s of the medians) with its bootstrap CI (rounds paired), ref/kernel."""
    import _stats

    rows = []
    for i, first in enumerate(jobs[0]):
        times = {k: [job[i]["times"][k] for job in jobs] for k in ("kernel", "copy", "ref")}
        d = {k: _stats.describe(v) for k, v in times.items()}
        s = {k: v["median"] for k, v in d.items()}
        nbytes = first["bytes"]
        rows.append({
            **{k: v for k, v in first.items() if k != "times"},
            "jobs": len(jobs), "rounds": d["kernel"]["n"],
            "kernel_s": s["kernel"], "copy_s": s["copy"], "ref_s": s["ref"],
            "kernel_iqr_s": d["kernel"]["iqr"], "copy_iqr_s": d["copy"]["iqr"],
            "kernel_gbps": nbytes / s["kernel"] / 1e9, "copy_gbps": nbytes / s["copy"] / 1e9,
            "ref_gbps": nbytes / s["ref"] / 1e9,
            "kernel_over_copy": s["copy"] / s["kernel"],
            "kernel_over_copy_ci": _stats.ratio_ci(times["copy"], times["kernel"]),
            "ref_over_kernel_s": s["ref"] / s["kernel"],
            "kernel_best_s": d["kernel"]["min"], "copy_best_s": d["copy"]["min"],
            "ref_best_s": d["ref"]["min"],
            "best_kernel_over_copy": d["copy"]["min"] / d["kernel"]["min"]})
    return rows


def _run_device(device: torch.device, geo: dict, repeats: int) -> list[dict]:
    """Every workload on one device; fails if the native kernel is missing there."""
    if not _native.has_kernel("copy_blocks", device.type.upper()):
        raise SystemExit(f"no native copy_blocks kernel for {device.type} "
                         f"(load error: {_native.load_error()}): nothing to benchmark")
    rows = []
    for w in _workloads(geo, device):
        print(f"{device.type} {w.name}: {w.blocks.shape[0]} blocks, {w.nbytes / 1e6:.0f} MB ...",
              file=sys.stderr, flush=True)
        rows.append(_measure(w, device, repeats))
        del w
    return rows


# --- report --------------------------------------------------------------------

def _table(rows: list[dict]) -> str:
    """Markdown table, one line per (device, workload)."""
    head = ("| device | workload | dtypes | blocks | MB r+w | kernel ms (IQR) | copy_ ms | ref ms "
            "| kernel GB/s | copy_ GB/s | ref GB/s | kernel/copy_ [95% CI] | best-of kernel/copy_ "
            "| ref/kernel time |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        lines.append(
            f"| {r['device']} | {r['workload']} | {r['src_dtype']}->{r['dst_dtype']} "
            f"| {r['blocks']} | {r['bytes'] / 1e6:.1f} | {r['kernel_s'] * 1e3:.2f} "
            f"({r['kernel_iqr_s'] * 1e3:.2f}) "
            f"| {r['copy_s'] * 1e3:.2f} | {r['ref_s'] * 1e3:.2f} | {r['kernel_gbps']:.1f} "
            f"| {r['copy_gbps']:.1f} | {r['ref_gbps']:.1f} | {r['kernel_over_copy']:.2f} "
            f"[{r['kernel_over_copy_ci'][0]:.2f}, {r['kernel_over_copy_ci'][1]:.2f}] "
            f"| {r['best_kernel_over_copy']:.2f} | {r['ref_over_kernel_s']:.2f} |")
    return "\n".join(lines)


def _floor(rows: list[dict]) -> str:
    """The 'Floor' paragraph: the kernel's fraction of the plain copy, per device."""
    parts = []
    for dev in dict.fromkeys(r["device"] for r in rows):
        mine = [r for r in rows if r["device"] == dev]
        fracs = ", ".join(f"{r['workload']} {r['kernel_over_copy']:.2f} "
                          f"[{r['kernel_over_copy_ci'][0]:.2f}, {r['kernel_over_copy_ci'][1]:.2f}]"
                          for r in mine)
        lo = min(r["kernel_over_copy"] for r in mine)
        hi = max(r["kernel_over_copy"] for r in mine)
        parts.append(f"on {dev} the kernel reaches {lo:.2f}-{hi:.2f} of it ({fracs})")
    return ("Floor: a plain `dst.copy_(src)` of flat contiguous tensors with the same element "
            "count and dtypes moves the same bytes read + written in one torch op, so it is the "
            "floor for a copy_blocks call (a fp32->bf16 copy_ is the best torch does for a cast "
            "copy); kernel/copy_ = kernel GB/s / copy_ GB/s is the kernel's fraction of it: "
            + "; ".join(parts) + ".")


def _description(geo: dict, repeats: int, jobs: int) -> str:
    """The result file's paragraph on what was measured and how."""
    layers = ", ".join(f"{k} {v}" for k, v in geo["layers"].items())
    return (
        "copy_blocks (one call per workload) against `dst.copy_(src)` on flat contiguous tensors "
        "of the same element count and dtypes, and against copy_blocks_ref (one torch copy_ per "
        f"block). Qwen2-like layers: hidden {geo['hidden']}, kv_dim {geo['kv_dim']}, "
        f"intermediate {geo['intermediate']}; layers {layers}; copy_fp32 {geo['copy_elems']} "
        f"elements: each workload moves >= {geo['min_bytes'] / 1e6:.0f} MB read + written. "
        "pack: TP-rank shares of fp32 parameters -> one bf16 buffer; unpack_rows: bf16 buffer "
        "-> row slices of column-parallel bf16 targets and norms; unpack_cols: bf16 buffer -> "
        "column slices (one segment per row) of row-parallel bf16 targets. Times: median (IQR) "
        f"over {jobs} fresh process(es) x {repeats} interleaved rounds, each process after a "
        "warm-up round; kernel/copy_ with a bootstrap 95% CI over jobs x rounds (paired by "
        "round); every kernel output equals "
        "copy_blocks_ref's bit for bit. best-of kernel/copy_ = fastest copy_ round / fastest "
        "kernel round (load from others only slows a round down); ref/kernel time = "
        "copy_blocks_ref s / kernel s.")


def _job(args: argparse.Namespace) -> list[dict]:
    """One process's raw rows: every workload on every device."""
    geo = geometry(args.quick)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    torch.manual_seed(0)
    return [r for d in devices for r in _run_device(d, geo, args.repeats)]


def _spawn_job(args: argparse.Namespace) -> list[dict]:
    """Runs _job in a fresh process (its own allocator, caches and thread pool)."""
    cmd = [sys.executable, __file__, "--_job", f"--repeats={args.repeats}",
           *(["--quick"] if args.quick else [])]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_kernels job failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = _args(argv)
    if args.job:
        print(json.dumps(_job(args)), flush=True)
        return
    geo = geometry(args.quick)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    load_before = os.getloadavg()[0]
    jobs = []
    for j in range(args.jobs):
        print(f"job {j + 1}/{args.jobs}", file=sys.stderr, flush=True)
        jobs.append(_spawn_job(args))
    rows = summarize(jobs)
    load_after = os.getloadavg()[0]
    table = _table(rows)
    print(table)
    from _common import cpu_name, result_header, result_path

    path = result_path(args.out_dir, "kernels", quick=args.quick)
    cpu = cpu_name()
    path.write_text(
        result_header(__file__, argv,
                      device_detail=f", CPU {cpu}" if len(devices) > 1 else f" ({cpu})",
                      after_cores=f", torch.get_num_threads() {torch.get_num_threads()} "
                      f"(the CPU kernel's OpenMP threads); 1-min load average {load_before:.2f} "
                      f"before, {load_after:.2f} after (shared machine)")
        + f"{_description(geo, args.repeats, args.jobs)}\n\n{table}\n\n{_floor(rows)}\n\n"
        f"```json\n{json.dumps(rows, indent=1)}\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    results: dict[str, dict[str, dict]] = {}
    for r in rows:
        results.setdefault(r["device"], {})[r["workload"]] = r
    print(json.dumps({"devices": [d.type for d in devices], "torch_threads": torch.get_num_threads(),
                      "quick": args.quick, "jobs": args.jobs, "repeats": args.repeats,
                      "geometry": geo, "results": results}))


if __name__ == "__main__":
    main()
