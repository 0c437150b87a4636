"""Confidence intervals for experiment results: pure functions on lists of numbers, no I/O.

Means get Student-t 95 % intervals: a point averages generations of different prompts, repeated,
and a prompt's tokens/s is close enough to normal over its repeats for the t interval to be honest
at n ≥ 3. Ratios and crossovers (a speed-up, the RTT where it falls to 1) have no closed form, so
they get a percentile bootstrap that resamples prompts — the unit a reader generalises over — with
each prompt's repeats kept together (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993,
ch. 13).
"""
from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scipy import stats as scipy_stats

LEVEL = 0.95
BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Estimate:
    """A mean (or other statistic) with its confidence interval; lo == hi == value for n = 1."""

    value: float
    lo: float
    hi: float
    n: int

    @property
    def half_width(self) -> float:
        """The larger distance from the value to an end of the interval (for symmetric error bars)."""
        return max(self.value - self.lo, self.hi - self.value)

    def excludes(self, x: float) -> bool:
        """True when x lies outside the interval."""
        return x < self.lo or x > self.hi


def mean_ci(values: Sequence[float], level: float = LEVEL) -> Estimate:
    """The mean and its Student-t interval."""
    if not values:
        raise ValueError("mean_ci of no values")
    n = len(values)
    mean = statistics.fmean(values)
    if n == 1:
        return Estimate(mean, mean, mean, 1)
    half = scipy_stats.t.ppf((1 + level) / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n)


def bootstrap_ci(groups: Sequence[object], statistic: Callable[[list], float | None], level: float = LEVEL,
                 samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> Estimate | None:
    """A percentile-bootstrap interval of `statistic` over resamples (with replacement) of `groups`.

    `statistic` takes a list of groups and returns a number, or None where it is undefined for that
    resample (such resamples are left out; if more than half are, the result is None). The value is
    the statistic of the groups as given."""
    value = statistic(list(groups))
    if value is None:
        return None
    if len(groups) < 2:
        return Estimate(value, value, value, len(groups))
    rng = random.Random(seed)
    draws = []
    for _ in range(samples):
        resample = [groups[rng.randrange(len(groups))] for _ in groups]
        drawn = statistic(resample)
        if drawn is not None:
            draws.append(drawn)
    if len(draws) < samples / 2:
        return None
    draws.sort()
    tail = (1 - level) / 2
    lo = draws[int(math.floor(tail * (len(draws) - 1)))]
    hi = draws[int(math.ceil((1 - tail) * (len(draws) - 1)))]
    return Estimate(value, min(lo, value), max(hi, value), len(groups))


def crossing(curve: Sequence[tuple[float, float]], level: float = 1.0) -> float | None:
    """First x at which a curve of (x, y) points sorted by x falls to `level`, linearly interpolated:
    the first x itself if it starts at or below, None if it never gets there."""
    points = sorted(curve)
    if not points:
        return None
    if points[0][1] <= level:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 <= level < y0:
            return x0 + (y0 - level) / (y0 - y1) * (x1 - x0)
    return None
