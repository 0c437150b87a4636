"""Confidence intervals for experiment results: pure functions on lists of numbers, no I/O.

Means get Student-t 95 % intervals: a point averages generations of different prompts, repeated,
and a prompt's tokens/s is close enough to normal over its repeats for the t interval to be honest
at n ≥ 3. Ratios and crossovers (a speed-up, the RTT where it falls to 1) have no closed form, so
they get a percentile bootstrap that resamples prompts — the unit a reader generalises over — with
each prompt's repeats kept together (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993,
ch. 13).

Standard library only: `hybridspec demo`, which any install runs, prints its interval with mean_ci.
"""
from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    half = t_quantile((1 + level) / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n)


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (0.5 <= p < 1) of Student's t distribution with df degrees of freedom, by
    bisection on its CDF, 1 - I_x(df/2, 1/2) / 2 with x = df / (df + t²)."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def _t_cdf(t: float, df: int) -> float:
    """P(T <= t) for t >= 0."""
    return 1 - 0.5 * _incomplete_beta(df / (df + t * t), df / 2, 0.5)


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Press et al.,
    *Numerical Recipes*, 3rd ed., §6.4), evaluated where it converges fast."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1 - _incomplete_beta(1 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)) / a
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return front * f


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
