"""What building the resharding plan costs a rank: seconds and memory, per cluster shape.

Every rank of a job builds the sync's plan when it starts (`reshard.plan.build_plan`,
the planner `hybrid-engine plan` runs too). For each model and cluster shape of
`plan_scale.py` (config.json files only, no weights) this times that build in
a fresh process per job: its wall seconds and its peak resident memory above
the process's own after the imports (ru_maxrss), with the plan's size
(buckets, remote and local blocks). train.sharding=full, bf16 wire dtype,
sync.bucket_mb=256, as `plan_scale.py`'s full rows.

Prints a table (median, min-max over the jobs); the last stdout line is JSON.
Writes benchmarks/results/plan_build_<device>_<yyyymm>.md.

    python benchmarks/bench_plan.py                 # every shape, 3 jobs each
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
from hybrid_engine.reshard.layouts import check_model
from hybrid_engine.reshard.plan import build_plan
config, world, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dims = check_model(_load_config(config), tp)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
plan = build_plan(dims, world, tp, bucket_elems=(256 << 20) // 2)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"seconds": seconds, "peak_mib": peak / 1024, "buckets": len(plan.buckets),
                  "remote_blocks": sum(len(b) for b in plan.buckets),
                  "local_blocks": sum(len(b) for b in plan.local)}))
"""


def job(config: str, world: int, tp: int) -> dict:
    """One fresh process building one plan."""
    cmd = [sys.executable, "-c", _JOB, str(ROOT / "configs" / f"{config}.json"), str(world),
           str(tp)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| model | ranks | TP | build s, median (min-max) | peak MiB above imports, median "
             "(min-max) | buckets | remote blocks | local blocks |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, m = r["seconds"], r["peak_mib"]
        lines.append(f"| {r['model']} | {r['world']} | {r['tp']} | {statistics.median(s):.2f} "
                     f"({min(s):.2f}-{max(s):.2f}) | {statistics.median(m):.0f} ({min(m):.0f}-"
                     f"{max(m):.0f}) | {r['buckets']} | {r['remote_blocks']} | "
                     f"{r['local_blocks']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3, help="fresh processes per shape")
    ap.add_argument("--quick", action="store_true", help="the 7B shape on one node, 1 job")
    ap.add_argument("--out-dir", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    shapes = SHAPES[:1] if args.quick else SHAPES
    jobs = 1 if args.quick else args.jobs
    rows = []
    for config, nodes, dpn, tp in shapes:
        runs = [job(config, nodes * dpn, tp) for _ in range(jobs)]
        rows.append({"model": config, "world": nodes * dpn, "tp": tp,
                     "seconds": [r["seconds"] for r in runs],
                     "peak_mib": [r["peak_mib"] for r in runs],
                     **{k: runs[0][k] for k in ("buckets", "remote_blocks", "local_blocks")}})
        print(f"{config} {nodes * dpn} ranks TP {tp}: {statistics.median(rows[-1]['seconds']):.2f} s",
              file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    from _common import result_header, result_path

    out = result_path(args.out_dir, "plan_build", quick=args.quick)
    out.write_text(result_header(__file__, argv) + "Every rank builds the whole plan (all "
                   "ranks' blocks) today; train.sharding=full, bucket 256 MiB of bf16.\n\n"
                   + text)
    print(json.dumps({"rows": rows, "result": str(out)}))


if __name__ == "__main__":
    main()
