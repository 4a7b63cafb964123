from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.perf.stats import (
    bootstrap_interval,
    incomplete_beta,
    order_groups,
    ratio_interval,
    summary,
    t_cdf,
    t_interval,
    t_quantile,
)

# Two-sided 95% and one-sided 95% critical values of Student's t (standard tables).
T_TABLE = [(0.975, 1, 12.7062), (0.975, 4, 2.7764), (0.975, 9, 2.2622), (0.975, 29, 2.0452), (0.95, 3, 2.3534)]


@pytest.mark.parametrize(("p", "df", "want"), T_TABLE)
def test_t_quantile_matches_tables(p, df, want):
    assert t_quantile(p, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(1 - p, df) == pytest.approx(-want, abs=1e-4)


@given(x=st.floats(0.0, 1.0), a=st.floats(0.2, 20))
def test_incomplete_beta_closed_forms(x, a):
    assert incomplete_beta(1.0, 1.0, x) == pytest.approx(x, abs=1e-12)
    assert incomplete_beta(a, 1.0, x) == pytest.approx(x**a, abs=1e-10)


@given(t=st.floats(-50, 50), df=st.integers(1, 200))
def test_t_cdf_is_symmetric_and_inverts(t, df):
    assert t_cdf(t, df) + t_cdf(-t, df) == pytest.approx(1.0, abs=1e-12)
    p = t_cdf(t, df)
    if 1e-6 < p < 1 - 1e-6:
        assert t_quantile(p, df) == pytest.approx(t, abs=1e-6 * max(1.0, abs(t)))


@pytest.mark.parametrize("method", ["t", "bootstrap"])
def test_a_constant_ratio_gives_a_point_interval(method):
    base = [1.0, 1.2, 0.9, 1.1]
    iv = ratio_interval(base, [1.3 * b for b in base], 0.95, method)
    assert iv.ratio == pytest.approx(1.3) and iv.low == pytest.approx(1.3) and iv.high == pytest.approx(1.3)
    assert iv.rel_width == pytest.approx(0.0, abs=1e-12) and iv.n == 4 and iv.method == method


def test_rounds_split_into_order_groups():
    base = [1.0, 2.0, 1.0, 2.0, 1.0]
    cand = [2.0, 1.0, 1.0, 2.0, 4.0]
    first, second = order_groups(base, cand)
    assert first == pytest.approx([math.log(2), 0.0, math.log(4)]) and second == pytest.approx([math.log(0.5), 0.0])


def test_t_interval_is_welchs_interval_of_the_two_order_groups():
    first = [0.0, 0.1, -0.1, 0.2, 0.05]
    second = [0.02, -0.04, 0.06, 0.0, 0.01]
    cand = [math.exp(x) for pair in zip(first, second, strict=True) for x in pair]
    iv = t_interval([1.0] * 10, cand, 0.95)
    a, b = statistics.variance(first) / 5, statistics.variance(second) / 5
    df = (a + b) ** 2 / (a**2 / 4 + b**2 / 4)
    mean = (statistics.fmean(first) + statistics.fmean(second)) / 2
    half = t_quantile(0.975, df) * math.sqrt(a + b) / 2
    assert iv.ratio == pytest.approx(math.exp(mean)) and iv.n == 10
    assert iv.low == pytest.approx(math.exp(mean - half)) and iv.high == pytest.approx(math.exp(mean + half))
    assert 4 < df < 8  # between one group's and both groups' degrees of freedom


@pytest.mark.parametrize("method", ["t", "bootstrap"])
def test_order_strata_cancel_an_order_effect(method):
    """A/A arms where the sample taken first in a round is 8% slower (what a 1 ms graph replay showed on the H200
    after the pause between rounds): per-round ratios alternate 1/1.08 and 1.08, each order group is constant, and
    their average is exactly 1."""
    rng = random.Random(5)
    base, cand = [], []
    for r in range(20):
        level = math.exp(rng.gauss(0, 0.05))  # drift shared by the round
        first, second = 1.08 * level, level
        b, c = (first, second) if r % 2 == 0 else (second, first)
        base.append(b)
        cand.append(c)
    iv = ratio_interval(base, cand, 0.95, method)
    rounds = [c / b for b, c in zip(base, cand, strict=True)]
    assert max(rounds) / min(rounds) > 1.15  # what per-round ratios would have had to span
    assert iv.ratio == pytest.approx(1.0, abs=1e-12) and iv.rel_width == pytest.approx(0.0, abs=1e-12)


def _coverage(method: str, sims: int, n: int, seed: int) -> float:
    """How often the interval holds the true ratio 1.1 when rounds share a drift and each run has lognormal noise."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(sims):
        base, cand = [], []
        for _ in range(n):
            drift = math.exp(rng.gauss(0, 0.2))  # shared by both arms of a round: pairing must cancel it
            base.append(drift * math.exp(rng.gauss(0, 0.03)))
            cand.append(1.1 * drift * math.exp(rng.gauss(0, 0.03)))
        iv = ratio_interval(base, cand, 0.95, method)
        hits += iv.low <= 1.1 <= iv.high
    return hits / sims


def test_t_interval_covers_the_true_ratio_and_pairing_cancels_drift():
    assert _coverage("t", 300, 10, 1) >= 0.9
    # Unpaired, a 20% drift would make the interval ~10x wider; paired it stays at the per-run noise.
    rng = random.Random(2)
    drift = [math.exp(rng.gauss(0, 0.2)) for _ in range(20)]
    iv = t_interval(drift, [1.1 * d * math.exp(rng.gauss(0, 0.03)) for d in drift], 0.95)
    assert iv.rel_width < 0.05


def test_bootstrap_interval_covers_the_true_ratio_and_is_reproducible():
    assert _coverage("bootstrap", 120, 12, 3) >= 0.85  # percentile bootstrap of medians runs a bit narrow at n=12
    b, c = [1.0, 1.1, 0.95, 1.05, 1.0], [1.1, 1.2, 1.0, 1.2, 1.05]
    assert bootstrap_interval(b, c, 0.95) == bootstrap_interval(b, c, 0.95)


def test_an_outlier_round_moves_the_median_interval_less_than_the_t_interval():
    base = [1.0] * 10
    cand = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01, 5.0, 1.0]  # one round hit by a neighbour's load
    assert bootstrap_interval(base, cand, 0.95).ratio == pytest.approx(1.0, abs=0.01)
    assert t_interval(base, cand, 0.95).ratio > 1.1


@pytest.mark.parametrize(
    ("base", "cand", "match"),
    [
        ([1.0] * 4, [1.0] * 3, "differ in length"),
        ([1.0] * 3, [1.0] * 3, "at least 4 rounds"),
        ([1.0, 0.0, 1.0, 1.0], [1.0] * 4, "finite and positive"),
        ([1.0] * 4, [1.0, float("nan"), 1.0, 1.0], "finite and positive"),
    ],
)
def test_bad_samples_are_refused(base, cand, match):
    with pytest.raises(ValueError, match=match):
        t_interval(base, cand, 0.95)
    with pytest.raises(ValueError, match=match):
        bootstrap_interval(base, cand, 0.95)


def test_unknown_method_names_the_choices():
    with pytest.raises(ValueError, match="bootstrap, t"):
        ratio_interval([1.0] * 4, [1.0] * 4, 0.95, "jackknife")


@settings(max_examples=50)
@given(st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=40))
def test_summary_orders_its_quantiles(samples):
    s = summary(samples)
    assert s["min_s"] <= s["p10_s"] <= s["median_s"] <= s["p90_s"] and s["n"] == len(samples)
