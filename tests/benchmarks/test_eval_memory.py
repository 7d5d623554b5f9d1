"""benchmarks/bench_eval_memory.py's measurement, on a child that holds a known
amount: the sampler sees the whole process tree (a grandchild's memory too),
its total and its biggest process; the table reads what was measured. (The
commands it compares are tested as commands: tests/test_faults.py runs
`hybrid-engine eval` on 2 ranks.)"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import bench_eval_memory as bem
finally:
    sys.path.pop(0)

_HOLD = ("import subprocess, sys, time\n"
         "b = bytearray({n} * 2**20)\n"  # touched: resident
         "{child}"
         "time.sleep(0.6)\n")


def test_the_sampler_sees_the_whole_tree_and_its_biggest_process(tmp_path) -> None:
    grandchild = _HOLD.format(n=120, child="")
    child = _HOLD.format(n=60, child=f"subprocess.run([sys.executable, '-c', {grandchild!r}])\n")
    peak = bem._run([sys.executable, "-c", child], tmp_path)
    mb = 2**20
    assert 120 * mb < peak["biggest"] < 170 * mb  # the grandchild, with its interpreter
    assert peak["total"] > peak["biggest"] + 60 * mb  # both, at once
    table = bem._table({"eval": [peak], "train": [peak]})
    assert f"| eval | 1 | {peak['total'] / mb:.0f} [" in table
