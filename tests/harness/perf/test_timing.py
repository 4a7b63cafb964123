from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import random

import pytest

from harness.perf.timing import STOP_BROKEN, STOP_NARROW, STOP_REPEATS, STOP_SECONDS, time_pair
from tests.harness.perf.fakes import QUICK, FakeArm, constant


def test_rounds_alternate_which_arm_goes_first_and_warmup_is_not_recorded():
    base, cand = FakeArm("baseline", constant(0.01)), FakeArm("candidate", constant(0.01))
    log: list[str] = []
    base.log = cand.log = log
    t = time_pair(base.run, cand.run, dataclasses.replace(QUICK, warmup=2))
    assert log[:4] == ["baseline", "candidate", "candidate", "baseline"]  # warm-up rounds, ABBA too
    # min_repeats is 3, but intervals are judged on as many rounds of each order: the first check is after round 4.
    assert log[4:] == ["baseline", "candidate", "candidate", "baseline"] * 2
    assert len(t.baseline) == len(t.candidate) == 4 and t.warmup == 2


def test_stops_as_soon_as_the_interval_is_narrow():
    t = time_pair(FakeArm("b", constant(0.010)).run, FakeArm("c", constant(0.012)).run, QUICK)
    assert t.converged and t.stop == STOP_NARROW and t.interval is not None
    assert t.interval.ratio == pytest.approx(1.2)
    assert len(t.baseline) == 4 and t.interval.n == 4


def test_says_when_the_interval_stays_wide_at_the_cap():
    rng = random.Random(0)
    noisy = FakeArm("c", lambda i: 0.01 * rng.uniform(0.5, 2.0))
    t = time_pair(FakeArm("b", constant(0.01)).run, noisy.run, QUICK)
    assert not t.converged and t.stop == STOP_REPEATS and len(t.candidate) == QUICK.max_repeats
    assert t.interval is not None and t.interval.rel_width > QUICK.ci_target_rel_width
    assert not t.to_json()["converged"]


def test_the_time_cap_stops_a_slow_cell_after_min_repeats():
    ticks = itertools.count()
    clock = lambda: float(next(ticks))  # noqa: E731 -- every clock read is a second later
    rng = random.Random(1)
    noisy = FakeArm("c", lambda i: rng.uniform(0.5, 2.0))
    t = time_pair(FakeArm("b", constant(1.0)).run, noisy.run, dataclasses.replace(QUICK, max_seconds_per_cell=1), clock)
    assert t.stop == STOP_SECONDS and len(t.baseline) == 4 and not t.converged


def test_a_broken_timer_stops_the_cell_and_names_the_arm():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        t = time_pair(FakeArm("b", constant(0.01)).run, FakeArm("c", constant(bad)).run, QUICK)
        assert t.stop == STOP_BROKEN and t.interval is None and not t.converged
        assert t.broken.startswith("candidate returned")


class Recorder:
    """An arm whose first step of a call costs `first` and every later step `rest` (steps back to back overlap),
    recording each call's (steps, lead_in) and whether the garbage collector was on during it."""

    def __init__(self, first: float, rest: float) -> None:
        self.first, self.rest = first, rest
        self.calls: list[tuple[int, int]] = []
        self.gc_on: list[bool] = []

    def __call__(self, steps: int, lead_in: int) -> float:
        self.calls.append((steps, lead_in))
        self.gc_on.append(gc.isenabled())
        return (self.first if lead_in == 0 else self.rest) + self.rest * (steps - 1)


CALIBRATED = dataclasses.replace(QUICK, warmup=1, min_sample_s=0.05, lead_in_steps=1)


def test_calibration_reaches_the_target_sample_length_for_both_arms():
    base, cand = Recorder(0.004, 0.004), Recorder(0.004, 0.004)
    t = time_pair(base, cand, CALIBRATED)
    assert t.steps_per_sample == 13 and t.calibration["first_steps"] == 13  # ceil(0.05 / 0.004)
    assert base.calls[0] == (1, 0)  # the warm-up round: one step, no lead-in
    assert base.calls[1] == (1, 1) and base.calls[2] == (13, 1)  # one calibration step, then a check sample
    assert set(base.calls[3:]) == {(13, 1)} and set(cand.calls[3:]) == {(13, 1)}  # every timed sample
    assert t.baseline[0] == pytest.approx(0.004)  # stored per step: the sample's time over its 13 steps
    assert t.to_json()["steps_per_sample"] == 13 and t.to_json()["lead_in_steps"] == 1


def test_calibration_scales_up_when_back_to_back_steps_run_faster_than_one_alone():
    """A host-bound eager step: alone 10 ms, back to back 2 ms each after the first (the host launches the next
    while the device runs this one). One step suggests 5; a 5-step sample lasts 18 ms, so it scales up once."""
    fast = Recorder(0.010, 0.002)
    t = time_pair(fast, Recorder(0.010, 0.002), dataclasses.replace(CALIBRATED, lead_in_steps=0))
    assert t.calibration["first_steps"] == 5 and t.calibration["first_sample_s"][0] == pytest.approx(0.018)
    assert t.steps_per_sample == math.ceil(5 * 0.05 / 0.018) == 14


def test_the_sample_cap_is_recorded_when_it_stops_calibration_short():
    t = time_pair(Recorder(1e-6, 1e-6), Recorder(1e-6, 1e-6), dataclasses.replace(CALIBRATED, max_steps_per_sample=50))
    assert t.steps_per_sample == 50 and "max_steps_per_sample 50" in t.calibration["capped"]


def test_fixed_steps_skip_calibration_and_lead_in():
    base, cand = Recorder(0.5, 0.5), Recorder(0.5, 0.5)
    t = time_pair(base, cand, CALIBRATED, steps=1)
    assert set(base.calls[1:]) == {(1, 0)} and t.steps_per_sample == 1 and t.calibration == {"fixed_steps": 1}


def test_the_collector_is_off_inside_samples_and_restored_after():
    base = Recorder(0.004, 0.004)
    assert gc.isenabled()
    time_pair(base, Recorder(0.004, 0.004), CALIBRATED)
    assert not any(base.gc_on) and gc.isenabled() and gc.get_freeze_count() == 0


def test_a_broken_timer_during_calibration_names_the_arm():
    t = time_pair(Recorder(0.004, 0.004), lambda steps, lead_in: float("nan") if lead_in else 0.004, CALIBRATED)
    assert t.stop == STOP_BROKEN and t.broken == "candidate returned nan s calibrating one step"
