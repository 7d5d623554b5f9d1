"""One train step profiled, for the benchmarks: where its wall time goes.

Job: with `HYBRID_ENGINE_PROFILE_TRAIN=<n>:<dir>` in the environment, the n-th
`Trainer.train_step` call (1-based) runs under torch.profiler (`maybe_profile`)
and each rank writes `<dir>/train_profile_rank<r>.json`: the step's wall
seconds split into optimizer (gradient clipping + AdamW, the
`OPTIMIZER_RANGE` the trainer marks), communication (wall time while a
gloo/NCCL collective or the shared-memory gradient all-reduce runs outside
the optimizer, overlap with compute counted as communication) and compute
(the rest), plus the top ops (`profile_split`). Unset, nothing is profiled.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["OPTIMIZER_RANGE", "PROFILE_ENV", "maybe_profile", "profile_split"]

PROFILE_ENV = "HYBRID_ENGINE_PROFILE_TRAIN"
OPTIMIZER_RANGE = "hybrid_engine::optimizer"
# the last two: train.cpu_shm_allreduce (rollout/shm_allreduce.py)
_COMM_PREFIXES = ("gloo:", "nccl:", "_C::shm_allreduce", "_C::shm_all_gather")


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans (any unit)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profile_split(events: list, wall_s: float) -> dict[str, float]:
    """The profiled step's wall seconds as optimizer + comm + compute.

    Args:
        events: torch.profiler FunctionEvents of the step (`prof.events()`).
        wall_s: the step's wall seconds (measured around the profiled call).

    Returns:
        {wall_s, optimizer_s: the `hybrid_engine::optimizer` range (grad clip +
        AdamW), comm_s: wall time while any gloo/NCCL collective runs outside
        it (union of spans, whatever thread), compute_s: the rest}.
    """
    def span(e: Any) -> tuple[float, float]:
        return e.time_range.start / 1e6, e.time_range.end / 1e6

    opt = [span(e) for e in events if e.name == OPTIMIZER_RANGE]
    comm = []
    for e in events:
        if e.name.startswith(_COMM_PREFIXES):
            a, b = span(e)
            for oa, ob in opt:  # the optimizer's own all-reduce counts as optimizer
                if a < ob and b > oa:
                    a, b = (a, oa) if a < oa else (max(a, ob), max(b, ob))
            if b > a:
                comm.append((a, b))
    optimizer_s, comm_s = _union_s(opt), _union_s(comm)
    return {"wall_s": wall_s, "optimizer_s": optimizer_s, "comm_s": comm_s,
            "compute_s": max(wall_s - optimizer_s - comm_s, 0.0)}


@contextlib.contextmanager
def maybe_profile(call: int, rank: int) -> Iterator[None]:
    """Profiles this train_step call if PROFILE_ENV names it; writes the split."""
    spec = os.environ.get(PROFILE_ENV, "")
    n, _, folder = spec.partition(":")
    if not spec or not n.strip().isdigit() or int(n) != call:
        if spec and (not n.strip().isdigit() or not folder):
            raise ValueError(f"{PROFILE_ENV}={spec!r} is not '<call number>:<dir>'")
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    wall_s = time.perf_counter() - t0
    out = profile_split(list(prof.events()), wall_s)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    out["top_self_s"] = {e.key: e.self_cpu_time_total / 1e6 for e in top}
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"train_profile_rank{rank}.json").write_text(json.dumps(out, indent=1))
