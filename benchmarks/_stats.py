"""The statistics every benchmark reports: median, IQR, and bootstrap CIs of ratios.

Scripts import it as `_stats` (their own folder is first on sys.path).

Measurements come as jobs x repeats: `samples[j][i]` is repeat i of fresh job
j. Jobs differ more than repeats inside one job do (placement of memory,
thread pinning, the machine's load), so a confidence interval resamples both
levels: jobs with replacement, then repeats with replacement inside each
drawn job (a hierarchical bootstrap). Paired samples (methods interleaved
ABAB in one job, repeat i of A beside repeat i of B) are resampled with the
same indices, so what the pair shares cancels.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

__all__ = ["describe", "ratio", "ratio_ci", "flat"]

Jobs = Sequence[Sequence[float]]


def flat(jobs: Jobs) -> list[float]:
    """All repeats of all jobs, in one list."""
    return [x for job in jobs for x in job]


def describe(values: Sequence[float] | Jobs) -> dict[str, float]:
    """{median, q1, q3, iqr, min, max, n} of values (a flat list or jobs x repeats)."""
    xs = sorted(flat(values) if values and isinstance(values[0], (list, tuple)) else values)
    if not xs:
        raise ValueError("describe: no values")
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "iqr": q3 - q1,
            "min": xs[0], "max": xs[-1], "n": len(xs)}


def ratio(num: Jobs, den: Jobs) -> float:
    """median(all num) / median(all den): the point estimate ratio_ci brackets."""
    return statistics.median(flat(num)) / statistics.median(flat(den))


def ratio_ci(num: Jobs, den: Jobs, *, paired: bool = True, level: float = 0.95,
             n_boot: int = 2000, seed: int = 0,
             stat: Callable[[list[float]], float] = statistics.median) -> list[float]:
    """Percentile bootstrap [low, high] of stat(num) / stat(den) (default: medians).

    Args:
        num, den: jobs x repeats, the same jobs in the same order (job j of
            num and of den ran in one process, or side by side).
        paired: repeat i of num and of den belong together (interleaved in
            one job): resampled with the same indices. Needs equal lengths.
        level: coverage (0.95 = the 2.5th and 97.5th percentiles).
        n_boot: resamples; seed: fixed, so a report is reproducible.
        stat: what each side's pooled resample is reduced to (e.g.
            statistics.fmean for a ratio of mean wall times).
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio_ci: {len(num)} jobs of num vs {len(den)} of den")
    if paired and any(len(a) != len(b) for a, b in zip(num, den, strict=True)):
        raise ValueError("ratio_ci: paired samples need equal repeats per job")
    rng = random.Random(seed)
    jobs = range(len(num))
    stats = []
    for _ in range(n_boot):
        xs, ys = [], []
        for j in rng.choices(jobs, k=len(num)):
            a, b = num[j], den[j]
            ia = rng.choices(range(len(a)), k=len(a))
            ib = ia if paired else rng.choices(range(len(b)), k=len(b))
            xs.extend(a[i] for i in ia)
            ys.extend(b[i] for i in ib)
        stats.append(stat(xs) / stat(ys))
    stats.sort()
    lo = stats[int((1 - level) / 2 * (n_boot - 1))]
    hi = stats[int((1 + level) / 2 * (n_boot - 1))]
    return [lo, hi]
