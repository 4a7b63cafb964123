"""Confidence intervals of a time ratio (candidate / baseline) from interleaved, paired runs.

Dependency-free on purpose: the stage may run where numpy and scipy are absent. Runs come in rounds, one baseline
and one candidate sample each, taken back to back, so each round's log ratio log(c / b) pairs the two samples
closest in time: drift that moves both arms together (clocks, temperature, a neighbour's load) cancels within it.
Rounds alternate which arm goes first (ABBA), and every statistic here treats the two orders as strata: it is
computed in each order group (baseline first: even rounds; candidate first: odd rounds) and the two are averaged.
An order effect (the sample taken first after a pause is slower, which on the H200 reached 8% for a 1 ms graph
replay) shifts the groups in opposite directions and cancels in that average, where pooling all rounds would let
it widen every interval.
- "bootstrap" (the default): the mean of the two groups' median log ratios, exponentiated; the interval is a
  percentile interval of that statistic over rounds resampled with replacement within each group (seeded, so a
  bundle's interval can be recomputed exactly from its samples). Medians keep a round hit by a stall (garbage
  collection, another process, a burst of slow host launches on the H200's eager steps) from moving the estimate.
- "t": the mean of the two groups' mean log ratios (the geometric-mean ratio) with a Welch t interval. Efficient
  when the noise is Gaussian, pulled by outliers when it is not.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

METHODS = ("bootstrap", "t")
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 20261129


@dataclass(frozen=True)
class RatioInterval:
    ratio: float  # point estimate of candidate time / baseline time (< 1: the candidate is faster)
    low: float
    high: float
    level: float
    method: str
    n: int  # rounds

    @property
    def rel_width(self) -> float:
        return (self.high - self.low) / self.ratio if self.ratio > 0 else math.inf

    def to_json(self) -> dict[str, float | int | str]:
        return {
            "ratio": self.ratio,
            "low": self.low,
            "high": self.high,
            "level": self.level,
            "method": self.method,
            "rounds": self.n,
            "rel_width": self.rel_width,
        }


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function, evaluated by the modified Lentz method."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete_beta needs 0 <= x <= 1, got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # The fraction converges fast only below the mean a / (a + b); above it, use I_x(a, b) = 1 - I_{1-x}(b, a).
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, by bisection on the cdf (monotone), to 1e-12."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile needs 0 < p < 1, got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


MIN_ROUNDS = 4  # two of each order: the least both order groups can give a spread from


def _check_pairs(baseline: Sequence[float], candidate: Sequence[float]) -> None:
    if len(baseline) != len(candidate):
        raise ValueError(f"paired samples differ in length: {len(baseline)} baseline, {len(candidate)} candidate")
    if len(baseline) < MIN_ROUNDS:
        raise ValueError(f"an interval needs at least {MIN_ROUNDS} rounds (two of each order), got {len(baseline)}")
    if min(*baseline, *candidate) <= 0 or not all(map(math.isfinite, (*baseline, *candidate))):
        raise ValueError("timings must be finite and positive; a zero or negative time is a broken timer")


def order_groups(baseline: Sequence[float], candidate: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per-round log(c / b) of the baseline-first rounds (even) and of the candidate-first rounds (odd)."""
    _check_pairs(baseline, candidate)
    logs = [math.log(c / b) for b, c in zip(baseline, candidate, strict=True)]
    return logs[0::2], logs[1::2]


def t_interval(baseline: Sequence[float], candidate: Sequence[float], level: float) -> RatioInterval:
    first, second = order_groups(baseline, candidate)
    mean = (statistics.fmean(first) + statistics.fmean(second)) / 2.0
    a = statistics.variance(first) / len(first)
    b = statistics.variance(second) / len(second)
    half = 0.0
    if a + b > 0:
        # Welch-Satterthwaite degrees of freedom for the mean of two groups with their own spreads.
        df = (a + b) ** 2 / (a**2 / (len(first) - 1) + b**2 / (len(second) - 1))
        half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(a + b) / 2.0
    n = len(first) + len(second)
    return RatioInterval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), level, "t", n)


def bootstrap_interval(
    baseline: Sequence[float],
    candidate: Sequence[float],
    level: float,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> RatioInterval:
    first, second = order_groups(baseline, candidate)
    rng = random.Random(seed)

    def stat(x: Sequence[float], y: Sequence[float]) -> float:
        return (statistics.median(x) + statistics.median(y)) / 2.0

    draws = sorted(stat(rng.choices(first, k=len(first)), rng.choices(second, k=len(second))) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    low = draws[max(0, math.floor(tail * resamples))]
    high = draws[min(resamples - 1, math.ceil((1.0 - tail) * resamples) - 1)]
    n = len(first) + len(second)
    return RatioInterval(math.exp(stat(first, second)), math.exp(low), math.exp(high), level, "bootstrap", n)


def ratio_interval(baseline: Sequence[float], candidate: Sequence[float], level: float, method: str) -> RatioInterval:
    if method == "t":
        return t_interval(baseline, candidate, level)
    if method == "bootstrap":
        return bootstrap_interval(baseline, candidate, level)
    raise ValueError(f"unknown interval method {method!r}; use one of {', '.join(METHODS)}")


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median and spread of one arm's timings (seconds)."""
    s = sorted(samples)
    if not s:
        raise ValueError("no samples to summarize")

    def pick(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"median_s": statistics.median(s), "p10_s": pick(0.1), "p90_s": pick(0.9), "min_s": s[0], "n": len(s)}
