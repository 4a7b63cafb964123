from __future__ import annotations

import dataclasses
import itertools
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
    assert log[4:] == ["baseline", "candidate", "candidate", "baseline", "baseline", "candidate"]
    assert len(t.baseline) == len(t.candidate) == QUICK.min_repeats and t.warmup == 2


def test_stops_as_soon_as_the_interval_is_narrow():
    t = time_pair(FakeArm("b", constant(0.010)).run, FakeArm("c", constant(0.012)).run, QUICK)
    assert t.converged and t.stop == STOP_NARROW and t.interval is not None
    assert t.interval.ratio == pytest.approx(1.2)
    assert len(t.baseline) == QUICK.min_repeats


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
    assert t.stop == STOP_SECONDS and len(t.baseline) == QUICK.min_repeats and not t.converged


def test_a_broken_timer_stops_the_cell_and_names_the_arm():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        t = time_pair(FakeArm("b", constant(0.01)).run, FakeArm("c", constant(bad)).run, QUICK)
        assert t.stop == STOP_BROKEN and t.interval is None and not t.converged
        assert t.broken.startswith("candidate returned")
