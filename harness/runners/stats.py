"""Small, dependency-free statistics the vLLM stages decide with (the gate's own process has no numpy/scipy)."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def _gamma_p_series(a: float, x: float) -> float:
    term = total = 1.0 / a
    n = a
    for _ in range(10_000):
        n += 1
        term *= x / n
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_q_fraction(a: float, x: float) -> float:
    # Lentz's continued fraction for the upper regularized incomplete gamma function.
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable with df degrees of freedom."""
    if df <= 0:
        raise ValueError("df must be positive")
    if x <= 0:
        return 1.0
    a, half = df / 2, x / 2
    return 1.0 - _gamma_p_series(a, half) if half < a + 1 else _gamma_q_fraction(a, half)


@dataclass(frozen=True)
class GoodnessOfFit:
    chi2: float
    df: int
    p_value: float
    bins: int
    outside_support: int  # draws of tokens the expected distribution gives probability 0


def goodness_of_fit(
    counts: Mapping[int, int], expected: Mapping[int, float], min_expected: float = 5.0
) -> GoodnessOfFit:
    """Pearson's test of observed token counts against expected probabilities.

    Tokens are pooled, smallest expectation first, until each bin expects at least `min_expected` draws (the usual
    validity condition of the chi-square approximation). Draws outside the support are counted separately: they
    are impossible under the expected distribution, so any one of them is a failure by itself.
    """
    n = sum(counts.values())
    outside = sum(c for t, c in counts.items() if expected.get(t, 0.0) <= 0.0)
    support = sorted((p, t) for t, p in expected.items() if p > 0)
    bins: list[tuple[float, int]] = []
    acc_e, acc_o = 0.0, 0
    for p, t in support:
        acc_e += p * n
        acc_o += counts.get(t, 0)
        if acc_e >= min_expected:
            bins.append((acc_e, acc_o))
            acc_e, acc_o = 0.0, 0
    if acc_e > 0 or acc_o:
        if bins:
            e, o = bins.pop()
            bins.append((e + acc_e, o + acc_o))
        else:
            bins.append((acc_e, acc_o))
    if len(bins) < 2:
        return GoodnessOfFit(0.0, 0, 1.0, len(bins), outside)
    chi2 = sum((o - e) ** 2 / e for e, o in bins)
    return GoodnessOfFit(chi2, len(bins) - 1, chi2_sf(chi2, len(bins) - 1), len(bins), outside)


def sampling_distribution(
    raw_logprobs: Mapping[int, float], temperature: float, top_k: int, top_p: float
) -> dict[int, float]:
    """The distribution vLLM's sampler draws from, given raw logprobs that include every token top-k keeps.

    Temperature scales the logits; top-k keeps the k largest; top-p keeps the smallest set of the largest
    probabilities (after temperature and top-k) whose mass reaches p. Raw logprobs differ from logits by a
    constant, so they serve as logits here.
    """
    ranked = sorted(raw_logprobs.items(), key=lambda kv: -kv[1])
    if 0 < top_k < len(ranked):
        ranked = ranked[:top_k]
    scaled = [(t, lp / temperature) for t, lp in ranked]
    top = max(v for _, v in scaled)
    weights = [(t, math.exp(v - top)) for t, v in scaled]
    total = sum(w for _, w in weights)
    probs = [(t, w / total) for t, w in weights]
    if top_p < 1.0:
        kept, mass = [], 0.0
        for t, p in probs:  # already sorted, largest first
            kept.append((t, p))
            mass += p
            if mass >= top_p:
                break
        total = sum(p for _, p in kept)
        probs = [(t, p / total) for t, p in kept]
    return dict(probs)


def total_variation(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    return 0.5 * sum(abs(p.get(t, 0.0) - q.get(t, 0.0)) for t in set(p) | set(q))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b (baseline right only) and c (candidate only)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class PairedInterval:
    mean: float
    low: float
    high: float
    n: int


def paired_bootstrap(diffs: Sequence[float], resamples: int, alpha: float, seed: int) -> PairedInterval:
    """Percentile bootstrap interval (1 - 2*alpha) of the mean paired difference: the interval a one-sided
    non-inferiority test at level alpha reads its lower end from."""
    n = len(diffs)
    if n == 0:
        raise ValueError("no paired items")
    mean = sum(diffs) / n
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    lo = means[max(0, math.floor(alpha * resamples))]
    hi = means[min(resamples - 1, math.ceil((1 - alpha) * resamples) - 1)]
    return PairedInterval(mean, lo, hi, n)


def _probs(top: Mapping[int, float]) -> dict[int, float]:
    probs = {t: math.exp(v) for t, v in top.items()}
    total = sum(probs.values())
    # Listed mass above 1 can only be rounding; renormalise so the "other" bucket is never negative.
    return {t: v / total for t, v in probs.items()} if total > 1.0 else probs


def kl_topk(p_top: Mapping[int, float], q_top: Mapping[int, float]) -> float:
    """KL(p || q) in nats between two distributions known by their top-k logprobs.

    Each side's unlisted mass goes to one shared "other" bucket; a token listed by p but not by q gets q's
    per-token share of q's "other" mass (an upper bound of q there is not known, so this is an estimate that
    is exact when both sides list the same tokens). The result is 0 for identical inputs.
    """
    p = _probs(p_top)
    q = _probs(q_top)
    p_other = max(0.0, 1.0 - sum(p.values()))
    q_other = max(0.0, 1.0 - sum(q.values()))
    missing = [t for t in p if t not in q]
    q_fill = q_other / (len(missing) + 1) if missing else q_other
    kl = 0.0
    for t, pt in p.items():
        qt = q.get(t, q_fill)
        if pt > 0:
            kl += pt * math.log(pt / max(qt, 1e-30))
    rest_q = q_fill if missing else q_other
    if p_other > 1e-12:
        kl += p_other * math.log(p_other / max(rest_q, 1e-30))
    return max(0.0, kl)


def topk_overlap(p_top: Mapping[int, float], q_top: Mapping[int, float], k: int) -> float:
    top_p = {t for t, _ in sorted(p_top.items(), key=lambda kv: -kv[1])[:k]}
    top_q = {t for t, _ in sorted(q_top.items(), key=lambda kv: -kv[1])[:k]}
    return len(top_p & top_q) / max(1, min(k, len(top_p), len(top_q)))


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    idx = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[idx]
