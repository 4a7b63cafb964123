"""The perf verdict's checks: regression budget, roofline ceiling, Amdahl consistency, timers, dispatch path.

- Budget: the upper end of the ITL ratio's interval must stay within the cell's region budget. The upper end, not
  the point estimate: a gate passes a candidate only when the evidence bounds its slowdown, so an interval that
  stayed wide can fail a candidate, never pass one.
- Roofline: the least bytes a step (and each part) must move over the copy bandwidth measured in the same run is the
  least time it can take; a fraction above 1 is a broken measurement (a timer that missed work, work moved off the
  timed stream, a cache that kept what should have been flushed), so it fails instead of being celebrated.
- Amdahl: the per-part times predict the end-to-end ratio: 1 - f * (1 - parts ratio), f the fraction of the step
  the parts cover (capped at 1, since parts measured one by one can add up to more than the whole). A kernel
  speedup the whole step does not show, or a whole-step gain no part explains, fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.perf.measure import ARMS, CellResult, MergedProfile
from harness.perf.suite import Bandwidth
from harness.perf.timing import PairTiming
from harness.verdicts import Check

ROOFLINE_CEILING = 1.0


@dataclass(frozen=True)
class Amdahl:
    predicted: float  # end-to-end ratio the parts predict
    parts_ratio: float  # candidate parts time / baseline parts time
    covered: float  # fraction of the baseline step the parts cover (capped at 1)


def amdahl(baseline: MergedProfile, candidate: MergedProfile) -> Amdahl:
    if baseline.parts_s <= 0 or baseline.total_s <= 0:
        raise ValueError("a baseline profile with no time cannot predict anything")
    covered = min(1.0, baseline.parts_s / baseline.total_s)
    parts_ratio = candidate.parts_s / baseline.parts_s
    return Amdahl(1.0 - covered * (1.0 - parts_ratio), parts_ratio, covered)


def roofline_fraction(nbytes: int, bandwidth: Bandwidth, seconds: float) -> float:
    """Roofline time over measured time; infinite for a time that is not positive (no work takes no time)."""
    return (nbytes / bandwidth.bytes_per_s) / seconds if seconds > 0 else float("inf")


def _fmt_interval(result: CellResult) -> str:
    return interval_text(result.timing)


def interval_text(t: PairTiming) -> str:
    """The ratio's interval in one line, or why there is none."""
    i = t.interval
    if i is None:
        return t.broken
    width = "narrow" if t.converged else f"WIDE ({t.stop})"
    return (
        f"ratio {i.ratio:.4f} [{i.low:.4f}, {i.high:.4f}] at {i.level:.0%} ({i.method}), {i.n} rounds, interval {width}"
    )


def cell_checks(
    result: CellResult, bandwidth: Bandwidth, amdahl_tolerance: float, judge_timing: bool = True
) -> list[Check]:
    """`judge_timing` False (a device whose numbers are not meaningful, e.g. the CPU at toy dims, where A/A ratio
    intervals reached 6x under CI load): budget and Amdahl are recorded in the cell metrics but not judged."""
    cell, t = result.cell, result.timing
    cid = cell.id
    out = [Check(f"{cid}: both arms' timers returned finite, positive times", not t.broken, "==", True, t.broken)]
    region = result.region
    if judge_timing:
        out.append(
            Check(
                f"{cid}: ITL ratio (candidate/baseline) upper bound within the budget of region {region.name!r}",
                None if t.interval is None else t.interval.high,
                "<=",
                region.limit,
                _fmt_interval(result),
            )
        )
    if t.broken:
        return out  # nothing below can be computed from a broken timer; the failed check above says why
    for arm in ARMS:
        median = result.median_s(arm) or 0.0
        frac = roofline_fraction(result.step_bytes, bandwidth, median)
        out.append(
            Check(
                f"{cid} {arm}: step time at or above the HBM roofline (fraction <= 1)",
                frac,
                "<=",
                ROOFLINE_CEILING,
                f"{result.step_bytes} bytes at {bandwidth.bytes_per_s:.4g} B/s in a median {median:.4g} s",
            )
        )
        for part in result.profiles[arm].parts:
            if part.bytes is None:
                continue
            frac = roofline_fraction(part.bytes, bandwidth, part.time_s)
            out.append(
                Check(
                    f"{cid} {arm} {part.name}: part time at or above the roofline (fraction <= 1)",
                    frac,
                    "<=",
                    ROOFLINE_CEILING,
                    f"{part.bytes} bytes in a median {part.time_s:.4g} s over {part.runs} profiled runs",
                )
            )
    a = amdahl(result.profiles["baseline"], result.profiles["candidate"])
    measured = t.interval.ratio if t.interval else float("nan")
    if judge_timing:
        out.append(
            Check(
                f"{cid}: end-to-end ratio consistent with the per-part ratios (Amdahl)",
                abs(measured - a.predicted),
                "<=",
                amdahl_tolerance,
                f"measured {measured:.4f}, predicted {a.predicted:.4f} from parts ratio {a.parts_ratio:.4f} "
                f"covering {a.covered:.0%} of the step",
            )
        )
    for arm in ARMS:
        path = result.paths[arm]
        out.append(
            Check(
                f"{cid} {arm}: dispatch ledger shows the expected {path.expected} path",
                len(path.mismatches),
                "==",
                0,
                "; ".join(path.mismatches[:2]),
            )
        )
    return out


def sweep_checks(
    results: Sequence[CellResult],
    planned: int,
    bandwidth: Bandwidth,
    amdahl_tolerance: float,
    judge_timing: bool = True,
) -> list[Check]:
    out = [
        Check("copy bandwidth measured in this run (bytes/s)", bandwidth.bytes_per_s, ">", 0, bandwidth.method),
        Check("perf cells measured", len(results), "==", planned),
    ]
    for r in results:
        out.extend(cell_checks(r, bandwidth, amdahl_tolerance, judge_timing))
    return out
