"""How fast does a weight sync FSDP2 -> vLLM TP run, against two naive paths and the floor?

For each model size, --jobs fresh torchrun jobs of N ranks: FSDP2 (fp32
master) holds the policy, a colocated vLLM engine (bf16, TP = T) serves it.
Three sync methods run in one job (`SyncConfig.method`):

- reshard (ours): the reshard plan (pack -> all_to_all in buckets -> unpack;
  local blocks copied directly), then vLLM-CPU's re-pack of its GEMM weights;
- naive: `full_tensor()` of every parameter (fp32 on the wire), cast to bf16,
  vLLM reload (what TRL / verl do);
- naive_bucketed: each rank casts its shard to bf16, one
  `all_gather_into_tensor` per bucket into persistent buffers, vLLM reload
  per bucket (the naive path written with ordinary care).

Each method is warmed up once; then --repeats rounds run every method once in
a rotating order (ABC, BCA, CAB, ...). Every field of every repeat is kept:
the record of that repeat's slowest rank (largest total; all its fields, so
they add up; bytes: the most any rank received). Medians per field are over
all repeats of all jobs. transfer + re-pack <= total is asserted on every
rank before, and on every kept record after.

Floor (of the reshard design, per rank, slowest rank): all_to_all is timed at
the plan's real bucket splits (no self chunk) at a few scaled sizes and fit
as time = latency + bytes / bandwidth (least squares); then
floor = buckets x latency + bytes received / bandwidth + bytes packed (cast
from fp32) and written locally / measured cast rate + bytes unpacked /
measured copy rate. The headline is the whole sync over the floor, with the
transfer alone and the re-pack beside it, and the faster naive over ours;
95% CIs by a hierarchical bootstrap over jobs x repeats (`_stats.ratio_ci`).

Prints a table; the last stdout line is JSON. Results go to
benchmarks/results/sync_<device>_n<N>_<yyyymm>.md.

    python benchmarks/bench_sync.py                 # qwen2-180m, N=2, T=2, 3 jobs x 10
    python benchmarks/bench_sync.py --quick         # 'small', 2 jobs x 3 repeats
    python benchmarks/bench_sync.py --sizes tiny small qwen2-180m --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("reshard", "naive", "naive_bucketed")
FIELDS = ("total", "transfer", "repack", "local", "pack", "exchange", "unpack", "bytes")
WIRE_DTYPE = "bfloat16"
SCALES = (0.25, 0.5, 1.0)  # all_to_all fit points: the real bucket splits, scaled


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=None,
                   help="tiny-model presets to sweep (hybrid_engine.models.tiny.PRESETS); "
                        "default qwen2-180m ('small' with --quick)")
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--tp", type=int, default=None, help="rollout TP size T (default N)")
    p.add_argument("--bucket-mb", type=float, default=64.0,
                   help="bucket size of reshard (all_to_all) and naive_bucketed (gathered)")
    p.add_argument("--jobs", type=int, default=None, help="fresh torchrun jobs per size "
                   "(default 3; 2 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per job "
                   "(default 10; 3 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="the 'small' preset, 2 jobs x 3 repeats (explicit flags still win)")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    p.add_argument("--_rank-job", dest="rank_job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = ["small"] if args.quick else ["qwen2-180m"]
    if args.jobs is None:
        args.jobs = 2 if args.quick else 3
    if args.repeats is None:
        args.repeats = 3 if args.quick else 10
    if args.jobs < 1 or args.repeats < 1 or args.nproc < 1 or args.bucket_mb <= 0:
        p.error("--jobs, --repeats, --nproc must be >= 1 and --bucket-mb > 0")
    return args


# --- one job, on every rank (under torchrun) -----------------------------------

def _fields(m: dict, wall_s: float) -> dict[str, float]:
    """One repeat's fields on this rank from WeightSync.sync's metrics; total is
    the wall time around the call. Raises if transfer + re-pack exceed it."""
    out = {"total": wall_s, "bytes": m.get("sync_bytes_received", 0.0)}
    for f in FIELDS[1:-1]:
        out[f] = m.get(f"sync_{f}_s", 0.0)
    if out["transfer"] + out["repack"] > out["total"]:
        raise AssertionError(f"transfer {out['transfer']:.6f} s + re-pack {out['repack']:.6f} s "
                             f"> total {out['total']:.6f} s: the parts are mis-timed")
    return out


def _timed_sync(sync, model, rollout) -> dict[str, float]:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    m = sync.sync(model, rollout)
    return _fields(m, time.perf_counter() - t0)


def _rounds(syncs: dict, model, rollout, repeats: int) -> dict[str, list[dict]]:
    """Warm-up of each method, then `repeats` rounds in rotating order; returns
    method -> per-repeat fields of this rank."""
    for s in syncs.values():
        s.sync(model, rollout)
    out: dict[str, list[dict]] = {k: [] for k in syncs}
    names = list(syncs)
    for i in range(repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(_timed_sync(syncs[name], model, rollout))
    return out


def _lstsq(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my / mx if mx else 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _a2a_fit(executor, reps: int = 3) -> dict[str, float]:
    """all_to_all_single timed at the plan's real per-bucket splits of this rank
    (remote blocks only: no self chunk), scaled by SCALES; fit per rank as
    time = latency + bytes_received / bandwidth (least squares)."""
    import torch
    import torch.distributed as dist

    buckets = [b for g in executor.groups for b in g.buckets]
    xs, ys = [], []
    for scale in SCALES:
        for b in buckets:
            send = [int(x * scale) for x in b.send_splits]
            recv = [int(x * scale) for x in b.recv_splits]
            sbuf = torch.zeros(max(1, sum(send)), dtype=torch.uint8)
            rbuf = torch.empty(max(1, sum(recv)), dtype=torch.uint8)
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_to_all_single(rbuf[: sum(recv)], sbuf[: sum(send)], recv, send)
                times.append(time.perf_counter() - t0)
            xs.append(float(sum(recv)))
            ys.append(statistics.median(times))
    latency, slope = _lstsq(xs, ys)
    if latency < 0 or slope <= 0:
        # Noise at small sizes: no latency, the line through the origin.
        sxx = sum(x * x for x in xs)
        latency, slope = 0.0, (sum(x * y for x, y in zip(xs, ys)) / sxx) if sxx else 0.0
    return {"latency_s": latency, "a2a_gb_s": (1 / slope / 1e9) if slope > 0 else float("inf"),
            "fit_points": len(xs)}


def _copy_rate(nbytes: int, src_dtype, dst_dtype, reps: int = 3) -> float:
    """Bytes written per second by `dst.copy_(src)` (a cast when the dtypes
    differ) at the sync's own volume, both ranks at once as in the sync."""
    import torch
    import torch.distributed as dist

    itemsize = torch.empty((), dtype=dst_dtype).element_size()
    n = max(1 << 16, nbytes // itemsize)
    src = torch.randn(n).to(src_dtype)
    dst = torch.empty(n, dtype=dst_dtype)
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return n * itemsize / best


def _floor(plan, executor, rank: int) -> dict[str, float]:
    """This rank's floor of the reshard design, and the fit behind it."""
    import torch

    itemsize = torch.empty((), dtype=getattr(torch, WIRE_DTYPE)).element_size()
    recv = plan.elements_received(rank) * itemsize
    packed = plan.elements_sent(rank) * itemsize
    local = sum(b.numel for b in plan.local[rank]) * itemsize
    buckets = sum(len(g.buckets) for g in executor.groups)
    fit = _a2a_fit(executor)
    cast = _copy_rate(packed + local, torch.float32, getattr(torch, WIRE_DTYPE))
    copy = _copy_rate(recv, getattr(torch, WIRE_DTYPE), getattr(torch, WIRE_DTYPE))
    a2a = fit["a2a_gb_s"] * 1e9
    floor = (buckets * fit["latency_s"] + recv / a2a + (packed + local) / cast + recv / copy)
    return {"floor_s": floor, "latency_s": fit["latency_s"], "a2a_gb_s": fit["a2a_gb_s"],
            "cast_gb_s": cast / 1e9, "copy_gb_s": copy / 1e9, "fit_points": fit["fit_points"],
            "floor_buckets": buckets, "floor_bytes_received": recv, "floor_bytes_packed": packed,
            "floor_bytes_local": local}


def _slowest_rank(records: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per repeat, the record of the rank whose total was the largest (all of
    its fields, so its parts still add up to at most its total); bytes are the
    largest any rank received."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.zeros(world, len(records), len(FIELDS), dtype=torch.float64)
    t[rank] = torch.tensor([[r[f] for f in FIELDS] for r in records], dtype=torch.float64)
    dist.all_reduce(t)  # every rank's rows, everywhere
    out = []
    for i in range(len(records)):
        slowest = int(t[:, i, FIELDS.index("total")].argmax())
        rec = dict(zip(FIELDS, t[slowest, i].tolist()))
        rec["bytes"] = t[:, i, FIELDS.index("bytes")].max().item()
        rec["slowest_rank"] = slowest
        out.append(rec)
    return out


def _max_over_ranks(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _rank_job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_engine.config import MemoryConfig, RolloutConfig, SyncConfig
    from hybrid_engine.parallel.fsdp import build_fsdp_model
    from hybrid_engine.roles.sync import WeightSync
    from hybrid_engine.rollout.engine import VLLMRollout

    t_start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp or world
    wire = getattr(torch, WIRE_DTYPE)
    # The trainer's own FSDP2 layout, built shard by shard from the file.
    model, _ = build_fsdp_model(args.rank_job, init_device_mesh("cpu", (world,)))
    rollout = VLLMRollout(args.rank_job, RolloutConfig(
        tensor_parallel_size=tp, max_model_len=256, max_tokens=16, enforce_eager=True),
        memory=MemoryConfig(kv_cache_gib=1.0), dtype=WIRE_DTYPE)
    syncs = {m: WeightSync(model.config, SyncConfig(method=m, bucket_mb=args.bucket_mb),
                           tp=tp, wire_dtype=wire) for m in METHODS}
    WeightSync(model.config, SyncConfig(method="reshard", verify=True, bucket_mb=args.bucket_mb),
               tp=tp, wire_dtype=wire).sync(model, rollout)  # bit-exact check of ours
    t_rounds = time.perf_counter()
    per_rank = _rounds(syncs, model, rollout, args.repeats)
    t_floor = time.perf_counter()
    ours = syncs["reshard"]
    floor = _floor(ours.plan, ours.executor, rank)
    t_end = time.perf_counter()
    # A repeat's fields = its slowest rank's; the floor is the slowest rank's too.
    repeats = {m: _slowest_rank(rs) for m, rs in per_rank.items()}
    floor = dict(zip(floor, _max_over_ranks(list(floor.values()))))
    itemsize = torch.empty((), dtype=wire).element_size()
    bytes_min, staging = _max_over_ranks([ours.plan.elements_received(rank) * itemsize,
                                          rollout.staging_bytes])
    if rank == 0:
        print(json.dumps({
            "model_params": sum(r * c for r, c in ours.plan.hf_shapes.values()),
            "world_size": world, "tp": tp, "repeats": repeats, "floor": floor,
            "bytes_min_per_rank": int(bytes_min),
            "reshard_buffer_bytes": ours.executor.buffer_bytes, "staging_bytes": int(staging),
            "naive_bucketed_buffer_bytes": syncs["naive_bucketed"].gather.buffer_bytes,
            "naive_bucketed_buckets": len(syncs["naive_bucketed"].gather.buckets),
            "reshard_buckets": int(floor["floor_buckets"]),
            "job_phases_s": {"start_and_verify": t_rounds - t_start, "rounds": t_floor - t_rounds,
                             "floor": t_end - t_floor},
        }), flush=True)
    rollout.shutdown()


# --- driver --------------------------------------------------------------------

def _run_job(args: argparse.Namespace, folder: Path, preset: str, job: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", __file__, "--_rank-job", str(folder),
           f"--bucket-mb={args.bucket_mb}", f"--repeats={args.repeats}", "--jobs=1"]
    if args.tp:
        cmd.append(f"--tp={args.tp}")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-5000:])
        raise SystemExit(f"bench job {job} for {preset} failed (exit {out.returncode})")
    return json.loads(lines[-1])


def _summarize(preset: str, jobs: list[dict]) -> dict:
    """One size's row: medians per method and field, ratios with their CIs."""
    import _stats

    first = jobs[0]
    samples = {m: {f: [[r[f] for r in j["repeats"][m]] for j in jobs] for f in FIELDS}
               for m in METHODS}
    med = {m: {f: _stats.describe(samples[m][f])["median"] for f in FIELDS} for m in METHODS}
    total = {m: samples[m]["total"] for m in METHODS}
    floors = [j["floor"]["floor_s"] for j in jobs]
    floor_jobs = [[fl] * len(t) for fl, t in zip(floors, total["reshard"])]
    floor_s = statistics.median(floors)
    ours = med["reshard"]
    best = min(("naive", "naive_bucketed"), key=lambda m: med[m]["total"])
    row = {
        "preset": preset, "model_params": first["model_params"],
        "world_size": first["world_size"], "tp": first["tp"],
        "jobs": len(jobs), "repeats": len(total["reshard"][0]),
        "ours_s": ours["total"], "transfer_s": ours["transfer"], "repack_s": ours["repack"],
        "overhead_s": ours["total"] - ours["transfer"] - ours["repack"],
        "naive_s": med["naive"]["total"], "naive_bucketed_s": med["naive_bucketed"]["total"],
        "floor_s": floor_s,
        "ours_over_floor": ours["total"] / floor_s,
        "ours_over_floor_ci": _stats.ratio_ci(total["reshard"], floor_jobs, paired=True),
        "transfer_over_floor": ours["transfer"] / floor_s,
        "best_naive": best, "best_naive_s": med[best]["total"],
        "best_naive_over_ours": med[best]["total"] / ours["total"],
        "best_naive_over_ours_ci": _stats.ratio_ci(total[best], total["reshard"], paired=True),
        "naive_over_ours": med["naive"]["total"] / ours["total"],
        "naive_over_ours_ci": _stats.ratio_ci(total["naive"], total["reshard"], paired=True),
        "naive_bucketed_over_ours": med["naive_bucketed"]["total"] / ours["total"],
        "naive_bucketed_over_ours_ci": _stats.ratio_ci(total["naive_bucketed"], total["reshard"],
                                                       paired=True),
        "floor_fit": [{k: j["floor"][k] for k in ("floor_s", "latency_s", "a2a_gb_s",
                                                     "copy_gb_s", "cast_gb_s", "fit_points")}
                      for j in jobs],
        "wire_dtype": WIRE_DTYPE, "naive_wire_dtype": "float32",
        "naive_bucketed_wire_dtype": WIRE_DTYPE,
        "bytes_received_per_rank": int(med["reshard"]["bytes"]),
        "bytes_min_per_rank": first["bytes_min_per_rank"],
        "naive_bytes_received_per_rank": int(med["naive"]["bytes"]),
        "naive_bucketed_bytes_received_per_rank": int(med["naive_bucketed"]["bytes"]),
        # Extra memory of ours: the exchange buffers (persistent) + the staging
        # tensors vLLM-CPU's packed weights need (freed after each sync).
        "peak_extra_bytes": first["reshard_buffer_bytes"] + first["staging_bytes"],
        "buffer_bytes": first["reshard_buffer_bytes"], "staging_bytes": first["staging_bytes"],
        "naive_bucketed_buffer_bytes": first["naive_bucketed_buffer_bytes"],
        "buckets": first["reshard_buckets"],
        "naive_bucketed_buckets": first["naive_bucketed_buckets"],
    }
    for m in METHODS:
        d = _stats.describe(total[m])
        key = "ours" if m == "reshard" else m
        row[f"{key}_s_iqr"] = d["iqr"]
        row[f"{key}_s_q1_q3"] = [d["q1"], d["q3"]]
        row[f"{m}_medians"] = med[m]
    row["per_repeat"] = {m: [j["repeats"][m] for j in jobs] for m in METHODS}
    return row


def _check_parts(row: dict) -> None:
    """transfer + re-pack <= total in every repeat of every method (each rank
    asserted it on its own numbers; a repeat keeps the slowest rank's record)."""
    for m in METHODS:
        for job in row["per_repeat"][m]:
            for r in job:
                if r["transfer"] + r["repack"] > r["total"]:
                    raise SystemExit(f"{row['preset']} {m}: transfer + re-pack > total in {r}")


def _run_size(args: argparse.Namespace, preset: str) -> dict:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    if preset not in PRESETS:
        raise SystemExit(f"unknown size {preset!r}; choose from {sorted(PRESETS)}")
    folder = Path(args.cache_dir) / preset
    if not (folder / "model.safetensors").exists():
        write_tiny_model(folder, PRESETS[preset])
    jobs = [_run_job(args, folder, preset, j) for j in range(args.jobs)]
    row = _summarize(preset, jobs)
    _check_parts(row)
    row["job_phases_s"] = [j["job_phases_s"] for j in jobs]
    return row


def _ci(pair: list[float]) -> str:
    return f"[{pair[0]:.2f}, {pair[1]:.2f}]"


def _table(rows: list[dict]) -> str:
    head = ("| model | params | N | T | jobs x repeats | ours s (IQR) | transfer s | re-pack s "
            "| naive s (IQR) | naive_bucketed s (IQR) | floor s | ours/floor [95% CI] "
            "| transfer/floor | best naive/ours [95% CI] | naive/ours [CI] "
            "| naive_bucketed/ours [CI] | recv MB/rank (bf16) | min MB | naive recv MB (fp32) "
            "| bucketed recv MB (bf16) | peak extra MB | bucketed buffers MB |")
    lines = [head, "|" + "---|" * 22]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['model_params'] / 1e6:.1f}M | {r['world_size']} | {r['tp']} "
            f"| {r['jobs']} x {r['repeats']} | {r['ours_s']:.4f} ({r['ours_s_iqr']:.4f}) "
            f"| {r['transfer_s']:.4f} | {r['repack_s']:.4f} "
            f"| {r['naive_s']:.4f} ({r['naive_s_iqr']:.4f}) "
            f"| {r['naive_bucketed_s']:.4f} ({r['naive_bucketed_s_iqr']:.4f}) "
            f"| {r['floor_s']:.4f} | {r['ours_over_floor']:.2f} {_ci(r['ours_over_floor_ci'])} "
            f"| {r['transfer_over_floor']:.2f} "
            f"| {r['best_naive_over_ours']:.2f} {_ci(r['best_naive_over_ours_ci'])} ({r['best_naive']}) "
            f"| {r['naive_over_ours']:.2f} {_ci(r['naive_over_ours_ci'])} "
            f"| {r['naive_bucketed_over_ours']:.2f} {_ci(r['naive_bucketed_over_ours_ci'])} "
            f"| {r['bytes_received_per_rank'] / 1e6:.2f} | {r['bytes_min_per_rank'] / 1e6:.2f} "
            f"| {r['naive_bytes_received_per_rank'] / 1e6:.2f} "
            f"| {r['naive_bucketed_bytes_received_per_rank'] / 1e6:.2f} "
            f"| {r['peak_extra_bytes'] / 1e6:.1f} | {r['naive_bucketed_buffer_bytes'] / 1e6:.1f} |")
    return "\n".join(lines)


NOTE = (
    "ours = the whole `WeightSync.sync` with method reshard (transfer + vLLM-CPU re-pack + "
    "overhead); naive = full_tensor() per parameter in fp32, cast, vLLM reload; "
    "naive_bucketed = bf16 shards, one all_gather_into_tensor per bucket into persistent "
    "buffers, vLLM reload per bucket. Each method warmed up once, then rounds in rotating "
    "order (ABC, BCA, CAB, ...). A repeat keeps its slowest rank's record (largest total); times are "
    "medians over all repeats of all jobs (IQR beside); CIs: 95% hierarchical bootstrap over "
    "jobs x repeats, paired by round (`_stats.ratio_ci`); ours/floor divides by each job's "
    "floor. Floor = buckets x fitted all_to_all latency + bytes received / fitted bandwidth "
    "(all_to_all timed at the plan's real bucket splits, scaled) + bytes packed and written "
    "locally / measured fp32->bf16 cast rate + bytes unpacked / measured copy rate. Bytes are "
    "each method's own wire dtype, per rank.")


def main(argv=None) -> None:
    args = _args(argv)
    if args.rank_job:
        _rank_job(args)
        return
    t0 = time.monotonic()
    rows = [_run_size(args, s) for s in args.sizes]
    table = _table(rows)
    print(table)
    from _common import result_header, result_path

    path = result_path(args.out_dir, "sync", tag=f"_n{args.nproc}", quick=args.quick)
    path.write_text(result_header(__file__, argv) + NOTE + "\n\n" + f"{table}\n\n"
                    f"Wall time of the whole run: {time.monotonic() - t0:.0f} s.\n\n"
                    f"```json\n{json.dumps(rows, indent=1)}\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    last = {k: v for k, v in rows[-1].items() if k != "per_repeat"}
    print(json.dumps({**last, "result_file": str(path), "rows": rows}))


if __name__ == "__main__":
    main()
