"""Baseline and candidate timed side by side in one process, interleaved, until the ratio's interval is narrow.

- Rounds. Each round takes one sample of each arm, back to back, alternating which goes first (ABBA), so a slow
  drift or a first-run penalty falls on both arms equally; the interval treats the two orders as strata
  (stats.py). Untimed warm-up rounds come first.
- Samples. A sample is `steps` back-to-back steps after `lead_in` untimed ones, timed as one region (CUDA events
  on a GPU, a host clock on the CPU); the recorded value is its time per step. `steps` is calibrated once per cell
  so a sample lasts at least `min_sample_s`, the same count for both arms: one host-bound eager step or one 1 ms
  graph replay is dominated by launch jitter, while the mean of many is not. The lead-in step puts the GPU and the
  host back into their steady state after the pause between samples, so no arm pays for that pause.
- Garbage collection. Python's collector is frozen (`gc.freeze`: what exists is never scanned again) for the cell
  and disabled inside each sample: a collection that lands inside a sample stalls it, and its cost grows with the
  heap, which the executors' logs grow through a sweep.
- Stopping. After `min_repeats` rounds the interval is computed after every even round (as many rounds of each
  order, so neither weighs more); the cell stops when its relative width reaches the target, or at `max_repeats`
  rounds or `max_seconds_per_cell`, and then says that the interval stayed wide.
An arm is a callable `run(steps, lead_in)` that returns the seconds of its own timed region, so set-up such as an
L2 flush stays outside the measurement.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from harness.perf.plan import Settings
from harness.perf.stats import MIN_ROUNDS, RatioInterval, ratio_interval

TimedRun = Callable[[int, int], float]  # (steps, lead_in) -> seconds of the timed region over `steps` steps

STOP_NARROW = "interval narrow"
STOP_REPEATS = "max_repeats reached with the interval still wide"
STOP_SECONDS = "max_seconds_per_cell reached with the interval still wide"
STOP_BROKEN = "an arm returned a time that is not finite and positive"
ORDER = "ABBA: even rounds baseline first, odd rounds candidate first; intervals stratified by order"


@dataclass(frozen=True)
class PairTiming:
    baseline: tuple[float, ...]  # seconds per step, one value per timed sample, in round order
    candidate: tuple[float, ...]
    interval: RatioInterval | None  # None only when an arm's timer broke
    converged: bool
    stop: str
    warmup: int
    wall_s: float
    broken: str = ""  # which arm returned which bad time
    steps_per_sample: int = 1
    lead_in: int = 0
    calibration: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "baseline_s": list(self.baseline),
            "candidate_s": list(self.candidate),
            "interval": None if self.interval is None else self.interval.to_json(),
            "converged": self.converged,
            "stop": self.stop,
            "warmup_rounds": self.warmup,
            "order": ORDER,
            "steps_per_sample": self.steps_per_sample,
            "lead_in_steps": self.lead_in,
            "calibration": self.calibration,
            "wall_s": self.wall_s,
            "broken": self.broken,
        }


class _Broken(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _bad(t: float) -> bool:
    return not (isinstance(t, int | float) and math.isfinite(t) and t > 0)


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _sample(name: str, run: TimedRun, steps: int, lead_in: int, where: str) -> float:
    """One sample's seconds (the whole timed region); _Broken names the arm when its timer returns garbage."""
    with _collector_off():
        t = run(steps, lead_in)
    if _bad(t):
        raise _Broken(f"{name} returned {t!r} s {where}")
    return float(t)


def calibrate(baseline: TimedRun, candidate: TimedRun, settings: Settings) -> tuple[int, dict[str, Any]]:
    """Steps per sample so that both arms' samples last at least `min_sample_s`: one step of each arm sets a first
    count from the faster arm; a sample of that many steps checks it, and a short one scales it up once (steps back
    to back overlap host and device work, so they run faster than one alone)."""
    cap, target, lead = settings.max_steps_per_sample, settings.min_sample_s, settings.lead_in_steps
    if target <= 0:
        return 1, {"target_s": target, "steps": 1, "note": "min_sample_s is 0: one step per sample, not calibrated"}
    arms = (("baseline", baseline), ("candidate", candidate))
    one = [_sample(name, run, 1, lead, "calibrating one step") for name, run in arms]
    steps = max(1, min(cap, math.ceil(target / min(one))))
    record: dict[str, Any] = {"target_s": target, "one_step_s": one, "first_steps": steps}
    if steps > 1:
        check = [_sample(name, run, steps, lead, f"calibrating {steps} steps") for name, run in arms]
        record["first_sample_s"] = check
        if min(check) < target:
            steps = max(1, min(cap, math.ceil(steps * target / min(check))))
    record["steps"] = steps
    if steps == cap and min(one) * cap < target:
        record["capped"] = f"max_steps_per_sample {cap} reached: samples last less than {target} s"
    return steps, record


def time_pair(
    baseline: TimedRun,
    candidate: TimedRun,
    settings: Settings,
    clock: Callable[[], float] = time.perf_counter,
    steps: int | None = None,
) -> PairTiming:
    """`steps` None calibrates the steps per sample; a number fixes it (and skips lead-in steps), for arms whose
    one run is already a long measurement (a serving benchmark round)."""
    started = clock()
    arms = (("baseline", baseline), ("candidate", candidate))
    times: dict[str, list[float]] = {"baseline": [], "candidate": []}
    lead = settings.lead_in_steps if steps is None else 0
    calibration: dict[str, Any] = {"fixed_steps": steps} if steps is not None else {}
    interval: RatioInterval | None = None
    stop, converged = STOP_REPEATS, False
    first_check = max(settings.min_repeats, MIN_ROUNDS)

    def result(broken: str = "") -> PairTiming:
        return PairTiming(
            tuple(times["baseline"]),
            tuple(times["candidate"]),
            None if broken else interval,
            False if broken else converged,
            STOP_BROKEN if broken else stop,
            settings.warmup,
            clock() - started,
            broken,
            steps or 1,
            lead,
            calibration,
        )

    with _frozen_heap():
        try:
            for r in range(settings.warmup):
                for name, run in arms if r % 2 == 0 else arms[::-1]:
                    _sample(name, run, 1, 0, f"in warm-up round {r}")
            if steps is None:
                steps, calibration = calibrate(baseline, candidate, settings)
            for r in range(settings.max_repeats):
                for name, run in arms if r % 2 == 0 else arms[::-1]:
                    times[name].append(_sample(name, run, steps, lead, f"in round {r}") / steps)
                n = r + 1
                if n < first_check or (n % 2 and n < settings.max_repeats):
                    continue  # judge balanced rounds only: as many of each order
                interval = ratio_interval(times["baseline"], times["candidate"], settings.ci_level, settings.ci_method)
                if interval.rel_width <= settings.ci_target_rel_width:
                    stop, converged = STOP_NARROW, True
                    break
                if clock() - started >= settings.max_seconds_per_cell:
                    stop = STOP_SECONDS
                    break
        except _Broken as exc:
            return result(exc.what)
    return result()
