"""The stack equivalence check (k3_decode.executor.equivalence) on the CPU at k3-mini, TP1.

The candidate is a real alternative implementation of the KDA decode step, the red-team "honest" provider (the
reference oracle's FP32 math, not the stock code), in a private registry under latency_specialized, as in
tests/k3_decode/runtime/test_providers.py. It must pass with a small, nonzero and bounded divergence; a state update
that drifts, NaN, and a write into another request's state must each fail, naming the check that caught them; stock
against stock must be exactly 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

from benchmarks import stack_equivalence_h200 as driver
from k3_decode.executor import StackExecutor, load_stack
from k3_decode.executor.equivalence import (
    METRICS,
    Equivalence,
    EquivalenceError,
    compare_stacks,
    projection,
    run_settings,
    specialized_dispatches,
    step_metrics,
    step_metrics_and_cosines,
    tolerances,
)
from k3_decode.executor.equivalence import _checks as equivalence_checks
from k3_decode.executor.equivalence import _summary as equivalence_summary
from k3_decode.executor.executor import ProviderTarget
from k3_decode.isolation_redteam import RedTeamKdaProvider, private_scope, private_table
from k3_decode.reference.kda import KdaCache
from k3_decode.runtime.backend import ProviderRegistry
from tests.k3_decode.executor.helpers import build, prefill, stack_weights

STACK = "k3-mini-kda3-mla"
CONTEXT = 4  # tokens prefilled (through the stock path, identically on both) before the compared steps


def specialized(provider: Any) -> StackExecutor:
    registry = ProviderRegistry()
    registry.register(provider)
    return StackExecutor.start(
        load_stack(STACK, 1),
        {"decode_backend": "latency_specialized"},
        device="cpu",
        weights=stack_weights(STACK, 1),
        registry=registry,
        scope=private_scope(),
        table=private_table(),
        log=lambda line: None,
    )


def run(candidate: StackExecutor, requests: list[int], steps: int) -> tuple[Equivalence, StackExecutor]:
    reference = build(STACK)
    for ex in (reference, candidate):
        prefill(ex, {r: CONTEXT for r in requests}, seed=11)
    return compare_stacks(reference, candidate, requests, steps, seed=3), reference


def failed(result: Equivalence) -> set[str]:
    return {c.name for c in result.failures()}


@dataclass(frozen=True)
class AfterHonest:
    """The honest red-team KDA step, then `spoil(cache, live slots, n)` on the state it wrote (n: this layer's
    steps so far, from 1), or on the output it returns when `spoil` returns a tensor."""

    spoil: Callable[[KdaCache, Tensor, int, Tensor], Tensor | None]
    name: str = "test-kda-after-honest"
    op: str = "kda"
    launches: Mapping[str, int] = field(default_factory=lambda: {"K3TestKda": 1})

    def bind(self, target: ProviderTarget) -> Mapping[str, Callable[..., Any]]:
        bound = RedTeamKdaProvider("honest").bind(target)
        honest = bound["kda_decode"]
        steps: dict[int, int] = {}

        def kda_decode(packed: Tensor, weights: Any, cache: KdaCache, slots: Tensor) -> Tensor:
            out = honest(packed, weights, cache, slots)
            n = steps[id(cache)] = steps.get(id(cache), 0) + 1
            spoiled = self.spoil(cache, slots[slots > 0].long(), n, out)
            return out if spoiled is None else spoiled

        # The equivalence run makes decode steps only; the verify call is bound because the executor demands
        # every call of the op, and it stays honest.
        return {"kda_decode": kda_decode, "kda_verify": bound["kda_verify"]}


def drifting(eps: float) -> AfterHonest:
    """A state update that drifts: after n steps the stored state is off by a factor 1 +- ((1 + eps)^n - 1), a fixed
    sign per element, so the error compounds with the generation. (The synthetic KDA decays forget within a few
    steps: a state merely 1% too large after every update stays about 1-2% off, inside the honest provider's
    spread, and never grows; in a slowly decaying channel of a real model that same bug compounds like this.)"""
    signs: dict[tuple[int, ...], Tensor] = {}

    def spoil(cache: KdaCache, live: Tensor, n: int, out: Tensor) -> None:
        shape = tuple(cache.recurrent.shape[1:])
        if shape not in signs:
            signs[shape] = torch.randn(shape, generator=torch.Generator().manual_seed(7)).sign()
        cache.recurrent[live] *= 1 + ((1 + eps) ** n - 1) * signs[shape]

    return AfterHonest(spoil, name="test-kda-drifting")


def nan_from(step: int) -> AfterHonest:
    def spoil(cache: KdaCache, live: Tensor, n: int, out: Tensor) -> Tensor | None:
        return torch.full_like(out, math.nan) if n > step else None

    return AfterHonest(spoil, name="test-kda-nan")


@pytest.fixture(scope="module")
def honest() -> tuple[Equivalence, StackExecutor, StackExecutor]:
    candidate = specialized(RedTeamKdaProvider("honest"))
    result, reference = run(candidate, [0, 1, 2], 30)
    return result, reference, candidate


def test_the_honest_provider_passes_with_a_small_nonzero_bounded_divergence(honest) -> None:
    result, reference, candidate = honest
    tol = tolerances("k3-mini")
    assert result.passed, [c.describe() for c in result.failures()]
    assert result.mode == "eager" and result.steps == 30 and result.window == 3
    assert all(len(result.series[m]) == 30 for m in METRICS)
    typical = result.summary["out_median_rms_rel"]["median"]
    assert 1e-3 < typical < tol.typical_rms_rel, typical  # FP32 reference math against stock: nonzero, small
    assert min(result.series["out_median_rms_rel"]) > 0
    growth = {c.name: c.value for c in result.checks}["outputs.growth"]
    assert 0.25 < growth < 2, growth  # no drift: the last steps sit where the first did
    # Every KDA layer's state moved a little, never beyond the limit.
    assert all(0 < v < tol.state_rms_rel for by in result.states.values() for v in by.values()), result.states
    assert sorted(result.states) == [4, 5, 6] and all(sorted(by) == [0, 1, 2] for by in result.states.values())
    # Each request's typical cosine is its own median over the steps, at least the median of each step's worst.
    assert sorted(result.request_cosines) == [0, 1, 2]
    assert min(result.request_cosines.values()) >= result.summary["logit_cos_min"]["median"] - 1e-12
    # Proof of path: the candidate ran its provider in every KDA layer of every step, the reference nothing of it.
    assert specialized_dispatches(candidate) == {"L4.kda": 30, "L5.kda": 30, "L6.kda": 30}
    assert specialized_dispatches(reference) == {}


def test_the_result_is_strict_json_with_rounded_series(honest) -> None:
    result = honest[0]
    data = json.loads(json.dumps(result.to_json(), allow_nan=False))
    assert data["passed"] is True and data["model"] == "k3-mini" and data["requests"] == [0, 1, 2]
    assert data["series"]["out_rms_rel"] == [float(f"{x:.4g}") for x in result.series["out_rms_rel"]]
    assert all(x == float(f"{x:.4g}") for xs in data["series"].values() for x in xs)
    assert {c["name"] for c in data["checks"]} >= {"finite", "outputs.growth", "kda_state.rms_rel", "untouched_state"}
    assert set(data["tolerances"]["why"]) == set(data["tolerances"]) - {"model", "why"}


def test_stock_against_stock_is_exactly_zero() -> None:
    result, _ = run(build(STACK), [2], 20)
    assert result.passed
    for name in ("out_rms_rel", "out_peak_rel", "out_median_rms_rel", "logit_rms_rel", "logit_median_rms_rel"):
        assert set(result.series[name]) == {0.0}, name
    assert min(result.series["logit_cos_min"]) > 1 - 1e-6
    assert {v for by in result.states.values() for v in by.values()} == {0.0}


def test_a_drifting_state_update_fails_the_growth_and_state_checks() -> None:
    result, _ = run(specialized(drifting(5e-3)), [0, 1], 30)
    names = failed(result)
    assert {"outputs.growth", "logits.growth", "kda_state.rms_rel", "kda_state.first_layer.rms_rel"} <= names, names
    assert {"finite", "untouched_state"}.isdisjoint(names)
    growth = next(c for c in result.checks if c.name == "outputs.growth")
    assert growth.value > 1.5 * tolerances("k3-mini").growth, growth.describe()
    # It starts where the honest provider does: the first steps alone would pass.
    assert result.series["out_median_rms_rel"][0] < tolerances("k3-mini").typical_rms_rel


def test_nan_in_the_candidate_fails_and_names_the_first_step() -> None:
    result, _ = run(specialized(nan_from(5)), [1], 20)
    # On the CPU the stock router below the NaN refuses it (ValueError): the candidate's step 5 is a failure.
    assert {"candidate_steps", "finite", "outputs.typical_rms_rel"} <= failed(result)
    assert next(c.detail for c in result.checks if c.name == "candidate_steps").startswith("step 5 raised ValueError")
    assert result.summary["out_rms_rel"]["worst_step"] == 5 and math.isnan(result.series["out_rms_rel"][5])
    assert all(math.isfinite(x) for x in result.series["out_rms_rel"][:5])
    data = json.loads(json.dumps(result.to_json(), allow_nan=False))
    assert data["series"]["out_rms_rel"][5] == "nan"


def test_a_write_into_another_requests_state_fails_the_untouched_state_check() -> None:
    # Request 0 (slot 1): the provider also copies its state into slot 2, request 1's, which no step touches.
    result, _ = run(specialized(RedTeamKdaProvider("writes-neighbour")), [0], 20)
    assert "untouched_state" in failed(result)
    detail = next(c.detail for c in result.checks if c.name == "untouched_state")
    assert "layer 4 KDA recurrent state of the slots outside the steps" in detail


def test_executors_that_do_not_start_alike_are_refused() -> None:
    reference, candidate = build(STACK), build(STACK)
    prefill(reference, {0: 2})
    with pytest.raises(EquivalenceError, match="different context lengths"):
        compare_stacks(reference, candidate, [0], 20)
    prefill(candidate, {0: 2}, seed=5)  # the same lengths, other values
    with pytest.raises(EquivalenceError, match="different KDA states in layer 4"):
        compare_stacks(reference, candidate, [0], 20)
    with pytest.raises(EquivalenceError, match="run at least 20"):
        compare_stacks(reference, reference, [0], 19)
    with pytest.raises(EquivalenceError, match="graph mode needs CUDA"):
        compare_stacks(reference, reference, [0], 20, mode="graph")
    with pytest.raises(EquivalenceError, match=r"requests \[0\] would pass max_context 48"):
        compare_stacks(reference, reference, [0], 47)


def test_every_number_of_the_data_has_its_reason() -> None:
    settings = run_settings()
    assert settings.steps >= 2000 and settings.logit_columns == 256 and settings.window == 0.1
    assert all(settings.why[k].strip() for k in ("steps", "min_steps", "window", "logit_columns"))
    for model in ("k3", "k3-mini"):
        tol = tolerances(model)
        assert all(len(tol.why[k]) > 40 for k in tol.why), model
        assert tol.growth_floor == 2**-8 and tol.typical_rms_rel < tol.step_rms_rel
    with pytest.raises(EquivalenceError, match=r"no \[k3-huge\]"):
        tolerances("k3-huge")


def test_step_metrics_on_known_differences() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    proj = projection(64, 256, seed=1, device="cpu")
    same = dict(zip(METRICS, step_metrics(ref, ref.clone(), proj).tolist(), strict=True))
    assert same["out_rms_rel"] == same["out_peak_rel"] == same["logit_rms_rel"] == 0
    assert same["logit_cos_min"] == pytest.approx(1, abs=1e-6)
    cand = ref.clone()
    cand[3] = -cand[3]  # one request negated: the batch is off by twice that request's share, the median request not
    got = dict(zip(METRICS, step_metrics(ref, cand, proj).tolist(), strict=True))
    share = ref[3].float().square().sum() / ref.float().square().sum()
    assert got["out_rms_rel"] == pytest.approx(float(2 * share.sqrt()), rel=1e-5)
    assert got["out_median_rms_rel"] == 0 and got["logit_median_rms_rel"] == 0
    assert got["logit_cos_min"] == pytest.approx(-1, abs=1e-5)
    _, rows = step_metrics_and_cosines(ref, cand, proj)
    assert rows[:3].tolist() == pytest.approx([1, 1, 1], abs=1e-6) and float(rows[3]) == pytest.approx(-1, abs=1e-5)
    cand[0, 0] = math.nan
    assert not torch.isfinite(step_metrics(ref, cand, proj)).all()


def typical_cosine(per_request: dict[int, list[float]]) -> Any:
    """The logits.typical_cosine check of synthetic per-step cosines (every other metric zero)."""
    steps = len(next(iter(per_request.values())))
    series = {m: [0.0] * steps for m in METRICS}
    series["logit_cos_min"] = [min(xs[i] for xs in per_request.values()) for i in range(steps)]
    medians = {r: sorted(xs)[steps // 2] for r, xs in per_request.items()}
    checks = equivalence_checks(equivalence_summary(series, 2), medians, {}, [], 0, tolerances("k3"), 2)
    return next(c for c in checks if c.name == "logits.typical_cosine")


def test_the_typical_cosine_judges_each_request_not_each_steps_worst() -> None:
    """Eight requests, each off (cosine 0.2) in a different eighth of the steps plus the steps after it, as routing
    flips scatter over a larger batch: every step's worst request is off in most steps, yet each request is right in
    most of its own, so it passes. One request off by a few percent (cosine 0.99) in most of its steps fails, and names
    that request."""
    steps = 40
    flips = {r: [0.2 if r * 5 <= i < r * 5 + 10 else 0.9999 for i in range(steps)] for r in range(8)}
    check = typical_cosine(flips)
    assert check.passed and check.value == pytest.approx(0.9999)
    assert sum(min(xs[i] for xs in flips.values()) < 0.8 for i in range(steps)) > steps // 2  # the old statistic fails
    broken = {**flips, 5: [0.99] * 30 + [0.9999] * 10}
    check = typical_cosine(broken)
    assert not check.passed and check.value == pytest.approx(0.99) and "request 5" in check.detail


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_the_driver_refuses_without_cuda_in_one_line(capsys, tmp_path) -> None:
    assert driver.main(["--out", str(tmp_path / "eq.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "stack_equivalence_h200.py: needs a CUDA GPU (run it on the accelerator machine)"
    assert not (tmp_path / "eq.json").exists()


def test_the_driver_plots_a_result(honest, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "eq.png"
    driver.plot(honest[0], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = honest[2].ledger.summary()
    assert driver.specialized_ops(summary) == {"kda": 90}
