"""Baseline and candidate timed side by side in one process, interleaved, until the ratio's interval is narrow.

Each round runs both arms once, alternating which goes first (ABBA), so a slow drift or a first-run penalty falls
on both arms equally. Untimed warm-up rounds come first. After `min_repeats` rounds the interval of the ratio is
computed after every round; the cell stops when its relative width reaches the target, or at `max_repeats` rounds
or `max_seconds_per_cell`, and then says that the interval stayed wide. An arm is a callable that runs once and
returns the seconds of its own timed region (CUDA events on a GPU, a host clock on the CPU), so set-up such as an
L2 flush stays outside the measurement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from harness.perf.plan import Settings
from harness.perf.stats import RatioInterval, ratio_interval

TimedRun = Callable[[], float]

STOP_NARROW = "interval narrow"
STOP_REPEATS = "max_repeats reached with the interval still wide"
STOP_SECONDS = "max_seconds_per_cell reached with the interval still wide"
STOP_BROKEN = "an arm returned a time that is not finite and positive"


@dataclass(frozen=True)
class PairTiming:
    baseline: tuple[float, ...]  # seconds per timed run, in round order
    candidate: tuple[float, ...]
    interval: RatioInterval | None  # None only when an arm's timer broke
    converged: bool
    stop: str
    warmup: int
    wall_s: float
    broken: str = ""  # which arm returned which bad time

    def to_json(self) -> dict[str, object]:
        return {
            "baseline_s": list(self.baseline),
            "candidate_s": list(self.candidate),
            "interval": None if self.interval is None else self.interval.to_json(),
            "converged": self.converged,
            "stop": self.stop,
            "warmup_rounds": self.warmup,
            "order": "ABBA: even rounds baseline first, odd rounds candidate first",
            "wall_s": self.wall_s,
            "broken": self.broken,
        }


def _bad(t: float) -> bool:
    return not (isinstance(t, int | float) and math.isfinite(t) and t > 0)


def time_pair(
    baseline: TimedRun,
    candidate: TimedRun,
    settings: Settings,
    clock: Callable[[], float] = time.perf_counter,
) -> PairTiming:
    started = clock()
    arms = (("baseline", baseline), ("candidate", candidate))
    for r in range(settings.warmup):
        for _, run in arms if r % 2 == 0 else arms[::-1]:
            run()
    times: dict[str, list[float]] = {"baseline": [], "candidate": []}
    interval: RatioInterval | None = None
    stop, converged = STOP_REPEATS, False
    for r in range(settings.max_repeats):
        for name, run in arms if r % 2 == 0 else arms[::-1]:
            t = run()
            if _bad(t):
                return PairTiming(
                    tuple(times["baseline"]),
                    tuple(times["candidate"]),
                    None,
                    False,
                    STOP_BROKEN,
                    settings.warmup,
                    clock() - started,
                    f"{name} returned {t!r} s in round {r}",
                )
            times[name].append(float(t))
        n = r + 1
        if n < settings.min_repeats:
            continue
        interval = ratio_interval(times["baseline"], times["candidate"], settings.ci_level, settings.ci_method)
        if interval.rel_width <= settings.ci_target_rel_width:
            stop, converged = STOP_NARROW, True
            break
        if clock() - started >= settings.max_seconds_per_cell:
            stop = STOP_SECONDS
            break
    return PairTiming(
        tuple(times["baseline"]),
        tuple(times["candidate"]),
        interval,
        converged,
        stop,
        settings.warmup,
        clock() - started,
    )
