"""The sample contract of a real suite (k3-hopper at k3-mini dims on the CPU): `run(steps, lead_in)` runs the lead-in
and the timed steps back to back, flushes before each where the flush is on, times only the timed ones, and leaves
every request where the cell put it."""

from __future__ import annotations

import pytest

from harness.perf.plan import Cell, Settings
from k3_decode.perf import K3PerfSuite

CELL = Cell("t", "decode", "synthetic", 1, 1, 2, 9, 1)


@pytest.fixture(scope="module")
def suites():
    made = {}
    for flush in (False, True):
        settings = Settings(l2_flush=flush, profile_repeats=1)
        suite = K3PerfSuite("k3-hopper", "k3-mini", (CELL,), settings, "cpu")
        made[flush] = (suite, suite.prepare(CELL, settings).baseline)
    yield made
    for suite, _ in made.values():
        suite.close()


def _count(monkeypatch, arm, method: str) -> list[int]:
    calls: list[int] = []
    real = getattr(arm, method)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(arm, method, counted)
    return calls


@pytest.mark.parametrize("flush", [False, True])
def test_a_sample_runs_its_lead_in_and_timed_steps_and_restores_the_requests(monkeypatch, suites, flush):
    _, arm = suites[flush]
    before = dict(arm.contexts)
    steps = _count(monkeypatch, arm.ex, "step")
    flushes = _count(monkeypatch, arm, "_flush")
    marks = _count(monkeypatch, arm, "_mark")
    seconds = arm.run(3, lead_in=1)
    assert seconds > 0 and len(steps) == 4
    assert len(flushes) == 4  # before every step (a no-op when the flush is off)
    assert len(marks) == (6 if flush else 2)  # a pair per timed step with a flush, one pair around them without
    assert {r: arm.ex.state.context_lens[r] for r in before} == before


def test_a_longer_sample_takes_longer(suites):
    """The timed region spans the timed steps only: 8 steps take longer than 1 (CPU time, so a loaded machine
    stretches neither)."""
    _, arm = suites[False]
    one = min(arm.run(1, lead_in=1) for _ in range(3))
    eight = min(arm.run(8, lead_in=1) for _ in range(3))
    assert eight > 3 * one
