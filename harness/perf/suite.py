"""What a subject's perf suite hands the perf stage: per cell, a baseline and a candidate arm to time and profile.

The subject knows its model (which layers, what bytes a step must move, how to run a step); the stage knows how
to time, decide and report. A subject without a suite gets a NOT_RUN that says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from harness.perf.plan import Cell, Settings


@dataclass(frozen=True)
class PartProfile:
    """One part of a step (a layer) in one profiled run."""

    name: str
    time_s: float
    launches: float | None  # kernels, memsets and copies the profiler saw; None where there are none (the CPU)
    declared_launches: int | None  # what the implementation's op tables declare for the same calls
    bytes: int | None  # least bytes the part must move; None when the subject cannot count them


@dataclass(frozen=True)
class StepProfile:
    """One profiled run of a step, split into parts; `total_s` is the whole step measured the same way."""

    parts: tuple[PartProfile, ...]
    total_s: float
    method: str


@dataclass(frozen=True)
class PathReport:
    """The path an arm expected for its dispatches, and every disagreement its dispatch ledger shows."""

    expected: str
    mismatches: tuple[str, ...]


@dataclass(frozen=True)
class Bandwidth:
    """Copy bandwidth measured in the same run: the ceiling the roofline figures divide by."""

    bytes_per_s: float
    bytes_moved: int
    median_s: float
    method: str

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes_per_s": self.bytes_per_s,
            "bytes_moved": self.bytes_moved,
            "median_s": self.median_s,
            "method": self.method,
        }


class Arm(Protocol):
    name: str  # "baseline" or "candidate"
    backend: str  # what the arm selected (a decode backend name)

    def run(self, steps: int = 1, lead_in: int = 0) -> float:
        """Run `lead_in` untimed steps, then `steps` steps back to back, and return the seconds of the timed region
        over those `steps` (a flush before each step, where there is one, stays outside it)."""
        ...

    def profile(self) -> StepProfile:
        """One profiled run: per-part time and launches."""
        ...

    def path(self) -> PathReport:
        """The arm's dispatch ledger against the path it expects, after it ran."""
        ...


@dataclass
class PreparedCell:
    baseline: Arm
    candidate: Arm
    step_bytes: int  # least bytes one step must move: a lower bound, the same for both arms
    mode: str  # how a step runs, e.g. "cuda-graph replay" or "eager"
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SuiteInfo:
    subject: str
    device: str
    numbers_meaningful: bool  # False: the timings exercise the plumbing only (e.g. the CPU at toy dims)
    notes: tuple[str, ...]  # what a reader must know about every cell (shown in the report)
    ttft: str  # whether and how time to first token is measured
    figure_note: str = ""  # one short line every figure carries (e.g. that the numbers mean nothing)


class PerfSuite(Protocol):
    info: SuiteInfo

    def unsupported(self, cell: Cell) -> str | None:
        """Why this suite cannot measure `cell` (with the fix), or None."""
        ...

    def bandwidth(self) -> Bandwidth: ...

    def prepare(self, cell: Cell, settings: Settings) -> PreparedCell: ...

    def close(self) -> None: ...
