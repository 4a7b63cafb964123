"""The perf verdict's checks, and the red team: candidates that fake speed or lose it must fail."""

from __future__ import annotations

import pytest

from harness.perf.checks import amdahl, roofline_fraction, sweep_checks
from harness.perf.measure import MergedPart, MergedProfile, measure_cell
from harness.perf.plan import Region
from tests.harness.perf.fakes import BANDWIDTH, QUICK, REGION, STEP_BYTES, FakeArm, cell, constant, prepared


def _profile(parts_s: float, total_s: float) -> MergedProfile:
    half = parts_s / 2
    return MergedProfile(
        (MergedPart("a", half, None, None, None, 1), MergedPart("b", half, None, None, None, 1)), total_s, "x"
    )


def test_amdahl_prediction():
    a = amdahl(_profile(0.8, 1.0), _profile(0.4, 0.6))  # parts twice as fast, covering 80% of the step
    assert a.covered == pytest.approx(0.8) and a.parts_ratio == pytest.approx(0.5) and a.predicted == pytest.approx(0.6)
    capped = amdahl(_profile(1.2, 1.0), _profile(1.2, 1.0))  # parts timed one by one add up past the whole
    assert capped.covered == 1.0 and capped.predicted == pytest.approx(1.0)


def test_roofline_fraction():
    assert roofline_fraction(STEP_BYTES, BANDWIDTH, 0.002) == pytest.approx(0.5)
    assert roofline_fraction(STEP_BYTES, BANDWIDTH, 0.0) == float("inf")


def _judge(base: FakeArm, cand: FakeArm, region: Region = REGION, step_bytes: int = STEP_BYTES):
    result = measure_cell(prepared(base, cand, step_bytes), cell(), region, QUICK, snapshot=lambda: {})
    checks = sweep_checks([result], 1, BANDWIDTH, QUICK.amdahl_tolerance)
    return {c.name: c for c in checks}, result


def _failed(checks: dict) -> list[str]:
    return sorted(name for name, c in checks.items() if not c.passed)


def test_identical_arms_pass_every_check():
    checks, result = _judge(FakeArm("baseline", constant(0.010)), FakeArm("candidate", constant(0.010)))
    assert _failed(checks) == []
    names = " | ".join(checks)
    for what in ("budget", "HBM roofline", "part time", "Amdahl", "dispatch ledger", "timers", "bandwidth"):
        assert what in names
    assert result.axes["candidate"].itl_s == pytest.approx(0.010)


def test_red_team_faster_than_the_roofline_fails():
    """A candidate whose timer misses its work (side stream, lazy output, patched timer) reports 0.1 ms for a step
    that must move 1 MB at 1 GB/s (1 ms): beyond the roofline, so a measurement error, not a speedup."""
    fake_fast = FakeArm("candidate", constant(0.0001), profile_s=0.0001)
    checks, _ = _judge(FakeArm("baseline", constant(0.010)), fake_fast)
    failed = _failed(checks)
    assert any("candidate: step time at or above the HBM roofline" in f for f in failed)
    assert any("candidate layer 0: part time at or above the roofline" in f for f in failed)
    assert not any("baseline" in f and "roofline" in f for f in failed)


def test_red_team_slower_than_the_budget_fails():
    checks, _ = _judge(FakeArm("baseline", constant(0.010)), FakeArm("candidate", constant(0.0106)))
    assert _failed(checks) == [
        "s/tp1/dcp1/b2/ctx16/q1: ITL ratio (candidate/baseline) upper bound within the budget of region 'all'"
    ]
    budget = next(c for c in checks.values() if "budget" in c.name)
    assert budget.value == pytest.approx(1.06) and budget.limit == pytest.approx(1.05) and "narrow" in budget.detail


def test_a_wide_interval_cannot_pass_a_candidate():
    """The median ratio is 1.0, inside the budget, but the interval reaches past it: the evidence does not bound
    the slowdown, so the gate does not pass it."""
    # After the warm-up run, ABBA blocks (pairs of samples) of ratio 1.0, 1.15, 0.85, 1.0: median 1.0, wide spread.
    times = iter([0.010] + [0.010, 0.010, 0.0115, 0.0115, 0.0085, 0.0085, 0.010, 0.010] * 4)
    checks, result = _judge(FakeArm("baseline", constant(0.010)), FakeArm("candidate", lambda i: next(times)))
    budget = next(c for c in checks.values() if "budget" in c.name)
    assert result.timing.interval.ratio <= 1.05 < budget.value and not budget.passed and "WIDE" in budget.detail


def test_a_slowdown_inside_the_budget_passes():
    checks, _ = _judge(FakeArm("baseline", constant(0.010)), FakeArm("candidate", constant(0.0104)))
    assert _failed(checks) == []


def test_red_team_kernel_speedup_the_step_does_not_show_fails_amdahl():
    """The per-layer profile claims the candidate's layers are twice as fast; the whole step is not faster."""
    checks, _ = _judge(FakeArm("baseline", constant(0.010)), FakeArm("candidate", constant(0.010), profile_s=0.005))
    assert _failed(checks) == ["s/tp1/dcp1/b2/ctx16/q1: end-to-end ratio consistent with the per-part ratios (Amdahl)"]


def test_red_team_a_broken_timer_fails_instead_of_passing():
    checks, result = _judge(FakeArm("baseline", constant(0.010)), FakeArm("candidate", constant(0.0)))
    failed = _failed(checks)
    assert any("timers returned finite, positive times" in f for f in failed) and any("budget" in f for f in failed)
    assert result.axes == {}


def test_a_ledger_disagreement_fails_the_cell():
    cand = FakeArm("candidate", constant(0.010), mismatches=("layer 4 kda ran stock but specialized was expected",))
    checks, _ = _judge(FakeArm("baseline", constant(0.010)), cand)
    assert _failed(checks) == ["s/tp1/dcp1/b2/ctx16/q1 candidate: dispatch ledger shows the expected stock path"]


def test_a_missing_cell_fails_the_sweep():
    checks = sweep_checks([], 3, BANDWIDTH, 0.05)
    assert [c.passed for c in checks] == [True, False]
