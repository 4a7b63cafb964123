"""The statistics the vLLM stages decide with: known values, and each test's power against a real error."""

from __future__ import annotations

import math
import random

import pytest

from harness.runners import stats


@pytest.mark.parametrize(("x", "df", "p"), [(3.841459, 1, 0.05), (18.307038, 10, 0.05), (6.0, 2, math.exp(-3.0))])
def test_chi2_sf_known_values(x, df, p):
    assert stats.chi2_sf(x, df) == pytest.approx(p, rel=1e-5)


RAW = {t: -0.25 * t for t in range(20)}  # a peaked but not degenerate distribution over 20 tokens


def draw(dist: dict[int, float], n: int, seed: int) -> dict[int, int]:
    rng = random.Random(seed)
    tokens, weights = zip(*dist.items(), strict=True)
    counts: dict[int, int] = {}
    for t in rng.choices(tokens, weights, k=n):
        counts[t] = counts.get(t, 0) + 1
    return counts


def test_sampling_distribution_applies_temperature_top_k_and_top_p():
    sharp = stats.sampling_distribution(RAW, 0.5, 20, 1.0)
    flat = stats.sampling_distribution(RAW, 1.0, 20, 1.0)
    assert sharp[0] > flat[0] and sum(sharp.values()) == pytest.approx(1.0)
    assert set(stats.sampling_distribution(RAW, 1.0, 6, 1.0)) == set(range(6))
    nucleus = stats.sampling_distribution(RAW, 1.0, 20, 0.5)
    kept = sorted(nucleus)
    mass_before_last = sum(flat[t] for t in kept[:-1])
    assert mass_before_last < 0.5 <= sum(flat[t] for t in kept)  # the smallest prefix reaching p


def test_goodness_of_fit_accepts_the_right_sampler_and_rejects_an_ignored_temperature():
    want = stats.sampling_distribution(RAW, 0.5, 20, 1.0)
    wrong = stats.sampling_distribution(RAW, 1.0, 20, 1.0)  # what a sampler that ignores temperature draws
    right_p = [stats.goodness_of_fit(draw(want, 384, s), want).p_value for s in range(20)]
    wrong_p = [stats.goodness_of_fit(draw(wrong, 384, s), want).p_value for s in range(20)]
    assert min(right_p) > 1e-4
    assert max(wrong_p) < 1e-4


def test_goodness_of_fit_counts_draws_outside_the_support():
    want = stats.sampling_distribution(RAW, 1.0, 6, 1.0)
    counts = draw(want, 200, 1)
    counts[15] = 1  # a token top-k removed
    assert stats.goodness_of_fit(counts, want).outside_support == 1


def test_mcnemar_exact():
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(0, 10) == pytest.approx(2 * 0.5**10)
    assert stats.mcnemar_exact(5, 5) == 1.0


def test_paired_bootstrap_interval():
    same = stats.paired_bootstrap([0.0] * 50, 500, 0.05, 1)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)
    worse = stats.paired_bootstrap([-1.0] * 5 + [0.0] * 45, 2000, 0.05, 1)
    assert worse.mean == pytest.approx(-0.1) and worse.low < -0.1 < worse.high <= 0.0


def test_kl_and_overlap():
    p = {t: lp for t, lp in ((t, math.log(w)) for t, w in zip(range(4), (0.5, 0.3, 0.1, 0.05), strict=True))}
    assert stats.kl_topk(p, p) == pytest.approx(0.0, abs=1e-12)
    shifted = {t: v + (0.3 if t == 1 else 0.0) for t, v in p.items()}
    assert stats.kl_topk(p, shifted) > 1e-3
    assert stats.topk_overlap(p, p, 3) == 1.0
    other = {10: -0.1, 11: -2.0, 1: -3.0}
    assert stats.topk_overlap(p, other, 3) == pytest.approx(1 / 3)
