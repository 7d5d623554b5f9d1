"""benchmarks/_stats.py: the medians, IQRs and bootstrap CIs every benchmark reports."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _stats  # noqa: E402


def test_describe_median_and_iqr() -> None:
    d = _stats.describe([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (d["median"], d["q1"], d["q3"], d["iqr"], d["n"]) == (3.0, 2.0, 4.0, 2.0, 5)
    assert _stats.describe([[1.0, 2.0], [3.0, 4.0, 5.0]])["median"] == 3.0  # jobs x repeats
    assert _stats.describe([7.0])["iqr"] == 0.0
    with pytest.raises(ValueError):
        _stats.describe([])


def test_ratio_ci_brackets_the_ratio_and_narrows_with_data() -> None:
    rng = random.Random(1)
    def jobs(mean, n_jobs, n_rep):
        return [[mean * (1 + 0.05 * rng.gauss(0, 1)) for _ in range(n_rep)] for _ in range(n_jobs)]
    num, den = jobs(2.0, 3, 10), jobs(1.0, 3, 10)
    lo, hi = _stats.ratio_ci(num, den)
    assert lo < _stats.ratio(num, den) < hi and 1.8 < lo and hi < 2.2
    lo2, hi2 = _stats.ratio_ci(jobs(2.0, 6, 40), jobs(1.0, 6, 40))
    assert hi2 - lo2 < hi - lo  # more jobs and repeats: a narrower interval
    assert _stats.ratio_ci(num, den) == [lo, hi]  # seeded: reproducible


def test_ratio_ci_pairing_cancels_shared_noise() -> None:
    # Each pair shares a large common factor (the machine's load at that moment).
    rng = random.Random(2)
    load = [[1 + rng.random() for _ in range(12)] for _ in range(3)]
    num = [[2.0 * x for x in job] for job in load]
    den = [[1.0 * x for x in job] for job in load]
    lo, hi = _stats.ratio_ci(num, den, paired=True)
    assert lo == pytest.approx(2.0, rel=0.2) and hi - lo < 0.5
    ulo, uhi = _stats.ratio_ci(num, den, paired=False)
    assert uhi - ulo > hi - lo  # unpaired resampling cannot cancel the load
    with pytest.raises(ValueError):
        _stats.ratio_ci([[1.0, 2.0]], [[1.0]], paired=True)
    with pytest.raises(ValueError):
        _stats.ratio_ci([[1.0]], [[1.0], [2.0]])


def test_ratio_ci_stat_picks_what_each_side_is_reduced_to() -> None:
    import statistics

    skewed = [[1.0, 1.0, 1.0, 1.0, 9.0]] * 3  # median 1, mean 2.6
    flat = [[1.0] * 5] * 3
    assert _stats.ratio_ci(skewed, flat, paired=False) == [1.0, 1.0]  # medians ignore the tail
    lo, hi = _stats.ratio_ci(skewed, flat, paired=False, stat=statistics.fmean)
    assert lo < 2.6 < hi and hi > 3.0  # means see it
