"""`hybrid-engine plan`: what one weight sync moves at cluster scale, from a config.json alone.

The resharding planner (`reshard/plan.py`) runs for the given world (nodes x
devices per node, colocated: every rank trains and rolls out), rollout TP
size and training layout: the buckets are cut exactly as the ranks of such a
job cut them, and `reshard/costs.cluster_traffic` reads every rank's traffic
within and between nodes from them in closed form, without listing a block.
No weights, no devices and no process group are needed.

Printed: per rank (the busiest, the mean, the least loaded) the bytes it
receives from its own node and from other nodes, the bytes it sends, its
messages (one per bucket and source rank), and the sync's time floor at the
given link speeds. `--json` prints the same as one JSON object, every rank
included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_arguments", "format_report", "plan_report", "run"]

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="a model's config.json, under any name (or the folder holding it); "
                        "no weights are read")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--devices-per-node", type=int, default=8, help="ranks per node (default 8)")
    p.add_argument("--tp", type=int, default=1, help="rollout tensor-parallel size (default 1)")
    p.add_argument("--sharding", choices=["full", "hybrid", "replicate"], default="full",
                   help="train.sharding: full (FSDP2 over every rank, the default), hybrid "
                        "(sharded within groups of --shard-group-size ranks, replicated across), "
                        "replicate")
    p.add_argument("--shard-group-size", type=int, default=None,
                   help="ranks per shard group under hybrid (default: --devices-per-node)")
    p.add_argument("--train-tp", type=int, default=1,
                   help="train.tensor_parallel_size (sharding full): TP groups of this many "
                        "consecutive ranks split attention and dense MLPs, FSDP2 across them "
                        "(default 1)")
    p.add_argument("--dtype", choices=sorted(_ITEMSIZE), default="bfloat16",
                   help="the rollout's weight dtype, the sync's wire dtype (default bfloat16)")
    p.add_argument("--bucket-mb", type=float, default=256.0,
                   help="sync.bucket_mb: most MiB a rank sends or receives per exchange (default 256)")
    p.add_argument("--intra-gbps", type=float, default=3600.0,
                   help="each device's link within a node, Gb/s per direction (default 3600: "
                        "H100 NVLink, 450 GB/s)")
    p.add_argument("--link-gbps", type=float, default=400.0,
                   help="each device's link out of its node, Gb/s per direction (default 400: "
                        "one NDR InfiniBand NIC per GPU)")
    p.add_argument("--json", action="store_true", help="one JSON object, every rank included")


def _load_config(path: str):  # noqa: ANN202 - a transformers config
    """The transformers config of a config.json-style file, or of a model folder's."""
    from transformers import AutoConfig

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--config {path}: not a readable JSON config ({e})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ValueError(f"--config {path}: no model_type (not a HF config.json?)")
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not d.get("architectures") and d["model_type"] in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        d["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[d["model_type"]]]  # as HF's would
    try:
        return AutoConfig.for_model(d.pop("model_type"), **d)
    except (ValueError, TypeError, StrictDataclassError) as e:
        raise ValueError(f"--config {path}: {' '.join(str(e).split())}") from None


def plan_report(args: argparse.Namespace) -> dict:
    """The plan's numbers for args (see add_arguments) as a dict.

    Raises:
        ValueError: a one-line reason (unsupported model, sizes that do not divide).
    """
    from hybrid_engine.parallel.tensor_parallel import check_run
    from hybrid_engine.reshard.costs import cluster_traffic, time_floor
    from hybrid_engine.reshard.layouts import check_model, hf_shapes
    from hybrid_engine.reshard.plan import cut_buckets

    if args.nodes < 1 or args.devices_per_node < 1:
        raise ValueError("--nodes and --devices-per-node must be positive")
    world = args.nodes * args.devices_per_node
    train_tp = args.train_tp
    if train_tp > 1 and args.sharding != "full":
        raise ValueError(f"--train-tp {train_tp} shards with FSDP2 across the TP groups: "
                         f"--sharding full, not {args.sharding}")
    group = {"full": world // max(train_tp, 1), "replicate": 1,
             "hybrid": args.shard_group_size or args.devices_per_node}[args.sharding]
    hf = _load_config(args.config)
    dims = check_model(hf, args.tp)
    check_run(hf, train_tp, world, lora=False, sync_method="reshard")
    itemsize = _ITEMSIZE[args.dtype]
    bucket_elems = max(1, int(args.bucket_mb * 2**20) // itemsize)
    cut = cut_buckets(dims, world, args.tp, bucket_elems=bucket_elems,
                      shard_group_size=None if train_tp > 1 else group, train_tp=train_tp)
    traffic = cluster_traffic(cut, args.devices_per_node, itemsize)
    params = sum(r * c for r, c in hf_shapes(dims).values())
    busiest = max(traffic, key=lambda t: t.seconds(args.intra_gbps, args.link_gbps))
    return {
        "arch": dims.arch, "params": params, "model_bytes": params * itemsize,
        "world": world, "nodes": args.nodes, "devices_per_node": args.devices_per_node,
        "tp": args.tp, "sharding": args.sharding, "shard_group_size": group,
        "train_tp": train_tp,
        "dtype": args.dtype, "bucket_mb": args.bucket_mb, "buckets": len(cut.buckets),
        "intra_gbps": args.intra_gbps, "link_gbps": args.link_gbps,
        "floor_s": time_floor(traffic, args.intra_gbps, args.link_gbps),
        "busiest_rank": busiest.rank,
        "naive_received_max": _naive_received(cut.geo) * itemsize,
        "per_rank": [{"rank": t.rank, "recv_intra": t.recv_intra, "recv_inter": t.recv_inter,
                      "sent_intra": t.sent_intra, "sent_inter": t.sent_inter,
                      "messages": t.messages, "local": t.local} for t in traffic],
    }


def _naive_received(geo) -> int:  # noqa: ANN001 - a reshard.buckets.Geometry
    """Most elements a rank receives when every HF tensor is all-gathered to it, less
    its own block (`ReshardPlan.naive_elements_received`)."""
    def received(g: int) -> int:
        return sum(rows * cols - (r1 - r0) * (c1 - c0) for name, (rows, cols) in geo.shapes.items()
                   for (r0, r1), (c0, c1) in [geo.source_block(name, g)])

    return max(received(g) for g in range(geo.num_sources))


def _row(label: str, r: dict, floor_s: float | None) -> str:
    gb = 1e9
    floor = "" if floor_s is None else f"{floor_s:9.3f}"
    return (f"{label:<16}{(r['recv_intra'] + r['recv_inter']) / gb:>10.3f}"
            f"{r['recv_intra'] / gb:>10.3f}{r['recv_inter'] / gb:>10.3f}"
            f"{(r['sent_intra'] + r['sent_inter']) / gb:>10.3f}{r['messages']:>10.0f}{floor}")


def format_report(rep: dict) -> str:
    """The human-readable table of a plan_report."""
    from hybrid_engine.reshard.costs import RankTraffic

    ranks = rep["per_rank"]
    floors = [RankTraffic(**r).seconds(rep["intra_gbps"] * 1e9 / 8, rep["link_gbps"] * 1e9 / 8)
              for r in ranks]
    mean = {k: sum(r[k] for r in ranks) / len(ranks) for k in ranks[0]}
    least = min(range(len(ranks)), key=lambda g: floors[g])
    b = rep["busiest_rank"]
    return "\n".join([
        f"{rep['arch']}: {rep['params'] / 1e9:.2f}B parameters, {rep['model_bytes'] / 1e9:.1f} GB "
        f"in {rep['dtype']}",
        f"{rep['world']} ranks = {rep['nodes']} node(s) x {rep['devices_per_node']}, colocated; "
        f"rollout TP {rep['tp']} ({rep['world'] // rep['tp']} replicas); train.sharding="
        f"{rep['sharding']} ({rep['shard_group_size']} ranks per shard group"
        f"{f', training TP {t}' if (t := rep['train_tp']) > 1 else ''}); "
        f"{rep['buckets']} buckets of <= {rep['bucket_mb']:g} MiB",
        f"links per device, each direction: {rep['intra_gbps']:g} Gb/s within a node, "
        f"{rep['link_gbps']:g} Gb/s between nodes",
        "",
        f"{'GB per sync':<16}{'received':>10}{'in node':>10}{'off node':>10}{'sent':>10}"
        f"{'messages':>10}{'floor s':>9}",
        _row(f"busiest (r{b})", ranks[b], floors[b]),
        _row("mean", mean, sum(floors) / len(floors)),
        _row(f"least (r{least})", ranks[least], floors[least]),
        "",
        f"time floor of one sync: {rep['floor_s']:.3f} s (bytes / link speed on the busiest "
        "rank; leaves out latency, buffer copies and the engine's re-pack)",
        f"all-gathering every tensor instead (sync.method=naive): up to "
        f"{rep['naive_received_max'] / 1e9:.3f} GB received per rank",
    ])


def run(args: argparse.Namespace) -> int:
    try:
        rep = plan_report(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep) if args.json else format_report(rep))
    return 0
