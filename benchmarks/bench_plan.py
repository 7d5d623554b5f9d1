"""What building the resharding plan costs a rank: seconds and memory, per cluster shape.

Every rank of a job builds its own plan of the sync when it starts
(`reshard.plan.build_plan(rank=r)`: only the blocks it sends, receives or
copies). For each model and cluster shape of `plan_scale.py` (config.json
files only, no weights) this times that build in a fresh process per job,
for the first rank and the last: its wall seconds and its peak resident
memory above the process's own after the imports (ru_maxrss), with the
plan's size (buckets, the rank's remote and local blocks); the cluster view
`hybrid-engine plan` computes (the buckets, then every rank's traffic in
closed form, no block listed; 8 devices per node); and, once per shape, the
whole plan (every rank's blocks, the tests' reference). train.sharding=full, bf16 wire dtype, sync.bucket_mb=256, as
`plan_scale.py`'s full rows. --check also builds every rank's plan beside
the whole one and asserts each is the whole plan restricted to that rank,
on each of `plan_scale.py`'s rows (full, hybrid with a shard group per node,
and full with training TP equal to the rollout's); --check-only does only
that (writes benchmarks/results/plan_check_<device>_<yyyymm>.md).

Prints a table (median, min-max over the jobs); the last stdout line is JSON.
Writes benchmarks/results/plan_build_<device>_<yyyymm>.md.

    python benchmarks/bench_plan.py                 # every shape, 3 jobs each
    python benchmarks/bench_plan.py --check         # ... and every rank's plan checked
    python benchmarks/bench_plan.py --check-only    # only the check, every row
    python benchmarks/bench_plan.py --quick         # the 7B shape on one node, 1 job
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from plan_scale import SHAPES  # noqa: E402

_JOB = """
import json, resource, sys, time
from hybrid_engine.scale import _load_config
from hybrid_engine.reshard.costs import cluster_traffic
from hybrid_engine.reshard.layouts import check_model
from hybrid_engine.reshard.plan import build_plan, cut_buckets
config, world, tp, which = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dims = check_model(_load_config(config), tp)
kw = dict(bucket_elems=(256 << 20) // 2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if which == "cluster":  # hybrid-engine plan's view: every rank's traffic, no block listed
    cut = cut_buckets(dims, world, tp, **kw)
    cluster_traffic(cut, 8, 2)
    sizes = {"buckets": len(cut.buckets), "remote_blocks": None, "local_blocks": None}
else:
    plan = build_plan(dims, world, tp, rank=None if which == "whole" else int(which), **kw)
    sizes = {"buckets": len(plan.buckets), "remote_blocks": sum(len(b) for b in plan.buckets),
             "local_blocks": sum(len(b) for b in plan.local)}
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"seconds": seconds, "peak_mib": peak / 1024, **sizes}))
"""

_CHECK = """
import sys
from hybrid_engine.scale import _load_config
from hybrid_engine.reshard.layouts import check_model
from hybrid_engine.reshard.plan import build_plan, rank_plans
config, world, tp, group = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
train_tp = int(sys.argv[5])
dims = check_model(_load_config(config), tp)
kw = dict(bucket_elems=(256 << 20) // 2, shard_group_size=None if train_tp > 1 else group,
          train_tp=train_tp)
whole = build_plan(dims, world, tp, **kw)
for r, mine in enumerate(rank_plans(dims, world, tp, range(world), **kw)):
    assert len(mine.buckets) == len(whole.buckets), r
    for i in range(len(whole.buckets)):
        assert mine.sends(i, r) == whole.sends(i, r) and mine.recvs(i, r) == whole.recvs(i, r), r
    assert mine.local[r] == whole.local[r], r
print("equal")
"""


def job(config: str, world: int, tp: int, which: str) -> dict:
    """One fresh process building one plan (which: a rank's, "whole", or "cluster":
    the cut and every rank's traffic, as `hybrid-engine plan` computes them)."""
    cmd = [sys.executable, "-c", _JOB, str(ROOT / "configs" / f"{config}.json"), str(world),
           str(tp), which]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def check(config: str, world: int, tp: int, group: int, train_tp: int = 1) -> bool:
    """Every rank's plan equals the whole plan restricted to it (one process), with
    shard groups of `group` ranks (training TP train_tp > 1: its own groups)."""
    cmd = [sys.executable, "-c", _CHECK, str(ROOT / "configs" / f"{config}.json"), str(world),
           str(tp), str(group), str(train_tp)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip() == "equal"


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def table(rows: list[dict]) -> str:
    lines = ["| model | ranks | TP | plan | build s, median (min-max) | peak MiB above imports, "
             "median (min-max) | buckets | remote blocks | local blocks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, m = r["seconds"], r["peak_mib"]
        lines.append(f"| {r['model']} | {r['world']} | {r['tp']} | {r['plan']} | "
                     f"{statistics.median(s):.2f} ({min(s):.2f}-{max(s):.2f}) | "
                     f"{statistics.median(m):.0f} ({min(m):.0f}-{max(m):.0f}) | {r['buckets']} | "
                     f"{_count(r['remote_blocks'])} | {_count(r['local_blocks'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3, help="fresh processes per shape and plan")
    ap.add_argument("--check", action="store_true",
                    help="also check every rank's plan against the whole plan")
    ap.add_argument("--check-only", action="store_true", help="only the check, no timings")
    ap.add_argument("--quick", action="store_true", help="the 7B shape on one node, 1 job")
    ap.add_argument("--out-dir", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    shapes = SHAPES[:1] if args.quick else SHAPES
    jobs = 1 if args.quick else args.jobs
    rows, checked = [], {}
    for config, nodes, dpn, tp in shapes:
        world = nodes * dpn
        timed = () if args.check_only else (("whole", 1), ("rank 0", jobs),
                                             (f"rank {world - 1}", jobs), ("cluster view", jobs))
        for plan, runs in timed:
            done = [job(config, world, tp, plan.split()[-1].replace("view", "cluster"))
                    for _ in range(runs)]
            rows.append({"model": config, "world": world, "tp": tp, "plan": plan,
                         "seconds": [r["seconds"] for r in done],
                         "peak_mib": [r["peak_mib"] for r in done],
                         **{k: done[0][k] for k in ("buckets", "remote_blocks", "local_blocks")}})
            print(f"{config} {world} ranks TP {tp} {plan}: "
                  f"{statistics.median(rows[-1]['seconds']):.2f} s", file=sys.stderr, flush=True)
        if args.check or args.check_only:  # plan_scale's rows: full, hybrid past one node, TP
            for sharding, group, ttp in (("full", world, 1), ("hybrid", dpn, 1),
                                         ("full + training TP", 0, tp)):
                if sharding != "hybrid" or nodes > 1:
                    checked[f"{config}/{world}/{tp}/{sharding}"] = check(config, world, tp,
                                                                         group, ttp)
                    print(f"checked {config} {world} {tp} {sharding}", file=sys.stderr,
                          flush=True)
    text = "" if args.check_only else table(rows)
    if args.check or args.check_only:
        text += ("\nEvery rank's plan equals the whole plan restricted to it: "
                 + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in checked.items()) + ".\n")
    print(text)
    from _common import result_header, result_path

    out = result_path(args.out_dir, "plan_check" if args.check_only else "plan_build",
                      quick=args.quick)
    out.write_text(result_header(__file__, argv) + "Buckets of 256 MiB of bf16.\n\n" + text)
    print(json.dumps({"rows": rows, "checked": checked, "result": str(out)}))


if __name__ == "__main__":
    main()
