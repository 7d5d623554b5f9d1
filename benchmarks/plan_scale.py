"""What one weight sync moves at cluster scale, on paper: `hybrid-engine plan` over model shapes.

For each model shape in benchmarks/configs/ (config.json files of Qwen2.5-7B,
Qwen2.5-32B, Llama-3.1-70B and the Mixture-of-Experts Qwen3-30B-A3B and
Qwen3-235B-A22B; no weights) and cluster shape, runs
`hybrid-engine plan --json` (the planner the ranks themselves run) under
full and hybrid sharding (hybrid: one shard group per node) and under full
sharding with training TP equal to the rollout's (`--train-tp`: TP groups
inside a node, FSDP2 across them), and tabulates
the busiest rank's bytes received within and between nodes, its messages, the
sync's time floor at H100 link speeds (NVLink 450 GB/s and one 400 Gb/s NIC
per GPU, each direction) and what an all-gather of every tensor would move
instead.

Prints the table; the last stdout line is JSON. Writes
benchmarks/results/plan_scale.md and the table in docs/scale.md (between its
`plan-table` markers). Takes about a minute on 2 CPU cores.

    python benchmarks/plan_scale.py            # every shape
    python benchmarks/plan_scale.py --quick    # the 7B shape on one node, seconds; writes no docs
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# (config, nodes, devices per node, rollout TP)
SHAPES = [("qwen2.5-7b", 1, 8, 4), ("qwen2.5-7b", 4, 8, 4), ("qwen2.5-32b", 4, 8, 8),
          ("llama3.1-70b", 1, 8, 8), ("llama3.1-70b", 8, 8, 8), ("qwen3-30b-a3b", 2, 8, 4),
          ("qwen3-235b-a22b", 8, 8, 8)]
LAYOUTS = ("full", "hybrid", "tp")  # tp: full with --train-tp = the rollout's TP
MARKERS = ("<!-- plan-table: begin -->", "<!-- plan-table: end -->")


def plan(config: str, nodes: int, dpn: int, tp: int, layout: str) -> dict:
    """One `hybrid-engine plan --json` run, as a user would type it."""
    sharding = ["--sharding", "full", "--train-tp", str(tp)] if layout == "tp" else [
        "--sharding", layout]
    cmd = [sys.executable, "-m", "hybrid_engine.cli", "plan", "--config",
           str(ROOT / "configs" / f"{config}.json"), "--nodes", str(nodes),
           "--devices-per-node", str(dpn), "--tp", str(tp), *sharding, "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {"model": config, "cmd": " ".join(["hybrid-engine", *cmd[3:-1]]),
            **json.loads(out.strip().splitlines()[-1])}


def table(reports: list[dict]) -> str:
    head = ("| model | ranks (nodes x GPUs) | TP | sharding | received per rank, GB (in node + off node) "
            "| messages | floor, s | all-gather instead, GB |\n|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in reports:
        b = r["per_rank"][r["busiest_rank"]]
        rows.append(
            f"| {r['model']} ({r['params'] / 1e9:.1f}B) | {r['world']} ({r['nodes']} x "
            f"{r['devices_per_node']}) | {r['tp']} | {r['sharding']}"
            f"{f' + training TP {t}' if (t := r.get('train_tp', 1)) > 1 else ''} | "
            f"{(b['recv_intra'] + b['recv_inter']) / 1e9:.2f} ({b['recv_intra'] / 1e9:.2f} + "
            f"{b['recv_inter'] / 1e9:.2f}) | {b['messages']} | {r['floor_s']:.3f} | "
            f"{r['naive_received_max'] / 1e9:.1f} |")
    return head + "\n".join(rows) + "\n"


def write_docs(path: Path, text: str) -> None:
    """Replaces the table between the plan-table markers of path."""
    doc = path.read_text()
    pattern = re.compile(re.escape(MARKERS[0]) + ".*?" + re.escape(MARKERS[1]), re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{path}: no {MARKERS[0]} ... {MARKERS[1]} markers")
    path.write_text(pattern.sub(lambda _: f"{MARKERS[0]}\n{text}{MARKERS[1]}", doc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 7B shape on one node only")
    ap.add_argument("--out-dir", default=str(ROOT / "results"), help="where plan_scale.md goes")
    ap.add_argument("--docs", default=str(ROOT.parent / "docs" / "scale.md"),
                    help="the doc whose table is replaced ('' = none; --quick writes none)")
    args = ap.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    reports = [plan(c, n, d, tp, s) for c, n, d, tp in shapes
               for s in LAYOUTS if s != "hybrid" or n > 1]
    text = table(reports)
    print(text)
    out = Path(args.out_dir) / f"plan_scale{'_quick' if args.quick else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from _common import result_header

    out.write_text(result_header(__file__, None) + text + "\nCommands:\n\n"
                   + "".join(f"- `{r['cmd']}`\n" for r in reports))
    if args.docs and not args.quick:
        write_docs(Path(args.docs), text)
    print(json.dumps({"rows": [{k: r[k] for k in ("model", "world", "tp", "sharding", "train_tp",
                                                  "floor_s")}
                               for r in reports], "result": str(out)}))


if __name__ == "__main__":
    main()
