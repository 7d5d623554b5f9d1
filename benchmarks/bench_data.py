"""How long does a rank take to open a large dataset file, and what memory does it keep?

Writes a GSM8K-shaped parquet of --rows rows (a question and a worked answer
of ~100 characters each: ~200 MB at 1M rows, snappy-compressed), then, for N
in --ranks, starts N processes at once, as torchrun starts N ranks. Each
builds the task's problem bank on the file (`envs.bank.ProblemBank`:
`env.dataset_path`, the held-out split by a hash of every prompt, so each row
is read once) and hands out 1024 training prompts. Per rank: the seconds
from the call to the prompts, the peak RSS (`ru_maxrss`, which counts the
memory-mapped file pages it touched: shared, in the page cache once for all
ranks), and its private (anonymous) memory at the end (`RssAnon`), both
above what the process held after its imports. The first launch builds
`datasets`' Arrow cache (cold); the later ones reuse it (warm), --jobs
times each, interleaved with the baseline: the median with the range.

Baseline, written with ordinary care: each rank reads the whole file with
`pyarrow.parquet.read_table` into memory and takes its prompt column as
Python strings (what a loader that keeps the rows does). Floor: the
file's bytes / this machine's memory-copy bandwidth (a 256 MiB numpy copy,
measured in the same run), the time to touch every byte once.

Prints a table; the last stdout line is JSON. Results go to
benchmarks/results/data_cpu_<yyyymm>[_quick].md.

    python benchmarks/bench_data.py                 # 1M rows, 1 and 2 ranks, 3 jobs
    python benchmarks/bench_data.py --quick         # 20k rows, 1 job: seconds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_RANK = r"""
import json, random, sys, time
path, mode = sys.argv[1], sys.argv[2]
def status_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
from hybrid_engine.envs.bank import ProblemBank, is_held_out
from hybrid_engine.envs.dataset import DatasetSpec
import pyarrow.parquet as pq
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS: the peak from here on
base_rss, base_anon = status_mib("VmRSS"), status_mib("RssAnon")
t0 = time.perf_counter()
if mode == "ours":
    bank = ProblemBank(None, dataset=DatasetSpec(path, prompt_key="question"), seed=0, name="bench")
    n = len(bank.next_train(1024))
else:  # the rows in memory, the same held-out split, 1024 prompts of a seeded order
    rows = pq.read_table(path).to_pylist()
    train = [r for r in rows if not is_held_out(r["question"])]
    n = len([train[i] for i in random.Random(0).sample(range(len(train)), 1024)])
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "prompts": n,
                  "peak_mib": status_mib("VmHWM") - base_rss,
                  "private_mib": status_mib("RssAnon") - base_anon}))
"""


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=None, help="rows of the file (default 1M; "
                   "20k with --quick)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--jobs", type=int, default=None, help="launches of each warm / baseline "
                   "configuration, interleaved (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="20k rows, 1 job: seconds")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    args.rows = args.rows or (20_000 if args.quick else 1_000_000)
    args.jobs = args.jobs or (1 if args.quick else 3)
    return args


def write_file(path: Path, rows: int) -> int:
    """A GSM8K-shaped parquet of rows rows, written in chunks; returns its bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chunk = 100_000
    writer = None
    for start in range(0, rows, chunk):
        ids = range(start, min(rows, start + chunk))
        words = [hashlib.sha512(str(i).encode()).hexdigest()  # incompressible
                 + hashlib.sha256(str(i).encode()).hexdigest() for i in ids]
        table = pa.table({
            "question": [f"Problem {i} ({w[:96]}): a shop sells {i % 97} apples a day for "
                         f"{i % 13} days; how many?" for i, w in zip(ids, words)],
            "answer": [f"{w[96:]}: it sells {i % 97} a day for {i % 13} days, so "
                       f"{(i % 97) * (i % 13)}.\n#### {(i % 97) * (i % 13)}"
                       for i, w in zip(ids, words)]})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return path.stat().st_size


def copy_bandwidth() -> float:
    """Bytes per second of a 256 MiB numpy copy (the fastest of 5)."""
    import numpy as np

    src = np.ones(2**28, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best


def launch(path: Path, ranks: int, mode: str, env: dict) -> list[dict]:
    """ranks processes at once; each one's JSON report."""
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(path), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(ranks)]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"a {mode} rank failed:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _summary(ranks: int, mode: str, cache: str, jobs: list[list[dict]]) -> dict:
    """One configuration over its jobs: per job the max over ranks, then the
    median (and the range of seconds) over the jobs."""
    import statistics

    seconds = [max(r["seconds"] for r in reports) for reports in jobs]
    return {"ranks": ranks, "mode": mode, "cache": cache, "jobs": len(jobs),
            "seconds_max": statistics.median(seconds), "seconds_min_job": min(seconds),
            "seconds_max_job": max(seconds),
            "peak_mib_max": statistics.median(max(r["peak_mib"] for r in j) for j in jobs),
            "private_mib_max": statistics.median(max(r["private_mib"] for r in j) for j in jobs)}


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _common import result_header, result_path

    args = _args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    path = work / "gsm8k_shaped.parquet"
    size = write_file(path, args.rows)
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1"}
    bandwidth = copy_bandwidth()
    runs = [(1, "ours", "cold")] + [(n, mode, "warm" if mode == "ours" else "-")
                                    for _ in range(args.jobs) for n in args.ranks
                                    for mode in ("ours", "baseline")]
    try:
        reports_of = [(n, mode, label, launch(path, n, mode, env)) for n, mode, label in runs]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [_summary(n, mode, label, [r for m, md, lb, r in reports_of
                                      if (m, md, lb) == (n, mode, label)])
            for n, mode, label in dict.fromkeys(runs)]
    result = {"rows": args.rows, "file_mib": size / 2**20, "copy_gb_s": bandwidth / 1e9,
              "floor_s": size / bandwidth, "runs": rows}
    table = ["| ranks | loader | cache | jobs | seconds, max over ranks: median [min, max] | "
             "peak RSS MiB | private MiB |", "|---|---|---|---|---|---|---|"]
    table += [f"| {r['ranks']} | {r['mode']} | {r['cache']} | {r['jobs']} | "
              f"{r['seconds_max']:.2f} [{r['seconds_min_job']:.2f}, {r['seconds_max_job']:.2f}] | "
              f"{r['peak_mib_max']:.0f} | {r['private_mib_max']:.0f} |" for r in rows]
    print("\n".join(table))
    print(f"\n{args.rows} rows, {size / 2**20:.0f} MiB parquet; floor {result['floor_s']:.3f} s "
          f"(file bytes / {bandwidth / 1e9:.1f} GB/s memory copy)")
    out = result_path(args.out_dir, "data", quick=args.quick)
    out.write_text(result_header(__file__, argv) + "\n".join(table)
                   + f"\n\n```json\n{json.dumps(result, indent=1)}\n```\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
