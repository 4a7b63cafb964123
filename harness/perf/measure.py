"""One cell measured: clocks, interleaved timing, interleaved profiles, the ledger of each arm, clocks again."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.perf import clocks
from harness.perf.axes import AxisMetrics, axis_metrics
from harness.perf.plan import Cell, Region, Settings
from harness.perf.suite import Arm, PartProfile, PathReport, PreparedCell, StepProfile
from harness.perf.timing import PairTiming, time_pair

ARMS = ("baseline", "candidate")


@dataclass(frozen=True)
class MergedPart:
    """A part's medians over the profiled runs of one arm."""

    name: str
    time_s: float
    launches: float | None
    declared_launches: int | None
    bytes: int | None
    runs: int


@dataclass(frozen=True)
class MergedProfile:
    parts: tuple[MergedPart, ...]
    total_s: float
    method: str

    @property
    def parts_s(self) -> float:
        return sum(p.time_s for p in self.parts)


@dataclass
class CellResult:
    cell: Cell
    region: Region
    mode: str
    step_bytes: int
    timing: PairTiming
    profiles: dict[str, MergedProfile]
    paths: dict[str, PathReport]
    backends: dict[str, str]
    notes: tuple[str, ...]
    clocks_before: dict[str, Any]
    clocks_after: dict[str, Any]
    axes: dict[str, AxisMetrics] = field(default_factory=dict)

    def median_s(self, arm: str) -> float | None:
        samples = self.timing.baseline if arm == "baseline" else self.timing.candidate
        return statistics.median(samples) if samples else None


def merge(profiles: list[StepProfile]) -> MergedProfile:
    """Per-part medians over runs; parts are matched by name, and every run must list the same parts."""
    names = [p.name for p in profiles[0].parts]
    if any([p.name for p in prof.parts] != names for prof in profiles):
        raise ValueError("profiled runs of one arm list different parts; a profile must be the same step each time")
    parts = []
    for i, name in enumerate(names):
        runs: list[PartProfile] = [prof.parts[i] for prof in profiles]
        launches = [r.launches for r in runs if r.launches is not None]
        parts.append(
            MergedPart(
                name=name,
                time_s=statistics.median(r.time_s for r in runs),
                launches=statistics.median(launches) if launches else None,
                declared_launches=runs[0].declared_launches,
                bytes=runs[0].bytes,
                runs=len(runs),
            )
        )
    return MergedProfile(tuple(parts), statistics.median(p.total_s for p in profiles), profiles[0].method)


def _profiles(prepared: PreparedCell, repeats: int) -> dict[str, MergedProfile]:
    pairs: tuple[tuple[str, Arm], ...] = (("baseline", prepared.baseline), ("candidate", prepared.candidate))
    got: dict[str, list[StepProfile]] = {name: [] for name in ARMS}
    for r in range(repeats):  # interleaved like the timing, so drift falls on both arms
        for name, arm in pairs if r % 2 == 0 else pairs[::-1]:
            got[name].append(arm.profile())
    return {name: merge(runs) for name, runs in got.items()}


def measure_cell(
    prepared: PreparedCell,
    cell: Cell,
    region: Region,
    settings: Settings,
    snapshot: Callable[[], dict[str, Any]] = clocks.snapshot,
    ttft_s: float | None = None,
) -> CellResult:
    before = snapshot()
    timing = time_pair(prepared.baseline.run, prepared.candidate.run, settings)
    profiles = _profiles(prepared, settings.profile_repeats) if not timing.broken else {}
    paths = {name: arm.path() for name, arm in zip(ARMS, (prepared.baseline, prepared.candidate), strict=True)}
    after = snapshot()
    result = CellResult(
        cell=cell,
        region=region,
        mode=prepared.mode,
        step_bytes=prepared.step_bytes,
        timing=timing,
        profiles=profiles,
        paths=paths,
        backends={"baseline": prepared.baseline.backend, "candidate": prepared.candidate.backend},
        notes=prepared.notes,
        clocks_before=before,
        clocks_after=after,
    )
    if not timing.broken:
        result.axes = {arm: axis_metrics(cell, result.median_s(arm) or 0.0, ttft_s) for arm in ARMS}
    return result
