"""A perf suite with arms whose times, profiles and ledgers the tests choose (honest ones and red-team ones)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from harness.perf.plan import Cell, Region, Settings
from harness.perf.suite import Bandwidth, PartProfile, PathReport, PreparedCell, StepProfile, SuiteInfo

BANDWIDTH = Bandwidth(bytes_per_s=1e9, bytes_moved=2_000_000, median_s=2e-3, method="fake copy")
STEP_BYTES = 1_000_000  # 1 ms at the fake bandwidth: a 10 ms step is at 10% of its roofline
# One step per sample and no lead-in: a fake arm's run i is sample i (timing tests set calibration up themselves).
QUICK = Settings(
    warmup=1,
    min_repeats=3,
    max_repeats=8,
    ci_target_rel_width=0.05,
    profile_repeats=2,
    min_sample_s=0.0,
    lead_in_steps=0,
)
REGION = Region("all", (1, 64), 0.05)
# Judged like a GPU's numbers, so the verdict logic runs; PLUMBING_INFO is the CPU case (recorded, not judged).
FAKE_INFO = SuiteInfo("fake", "cpu", True, ("fake numbers",), "not measured", "fake numbers")
PLUMBING_INFO = SuiteInfo("fake", "cpu", False, ("fake numbers",), "not measured", "fake numbers")


def cell(batch: int = 2, workload: str = "decode", q: int = 1, **kw) -> Cell:
    extra = {"prefill_tokens": 4} if workload == "mixed" else {}
    if q > 1:
        extra["acceptance_rate"] = 0.5
    return Cell("s", workload, "synthetic", kw.pop("tp", 1), 1, batch, 16, q, **extra, **kw)


@dataclass
class FakeArm:
    """Runs take `seconds(i)` for run i; a profile splits `profile_s` (default: the step time) over two parts."""

    name: str
    seconds: Callable[[int], float]
    profile_s: float | None = None
    mismatches: tuple[str, ...] = ()
    backend: str = "fake"
    runs: int = 0
    log: list[str] = field(default_factory=list)

    def run(self, steps: int = 1, lead_in: int = 0) -> float:
        """Steps are numbered across calls (lead-in ones too); the timed ones' seconds add up."""
        total = 0.0
        for i in range(lead_in + steps):
            t = self.seconds(self.runs)
            self.runs += 1
            if i >= lead_in:
                total += t
        self.log.append(self.name)
        return total

    def profile(self) -> StepProfile:
        total = self.profile_s if self.profile_s is not None else self.seconds(0)
        half = total / 2
        parts = (
            PartProfile("layer 0", half, 3.0, 3, STEP_BYTES // 2),
            PartProfile("layer 1", half, 3.0, 3, STEP_BYTES // 2),
        )
        return StepProfile(parts, total, "fake")

    def path(self) -> PathReport:
        return PathReport("stock", self.mismatches)


def constant(s: float) -> Callable[[int], float]:
    return lambda i: s


def prepared(base: FakeArm, cand: FakeArm, step_bytes: int = STEP_BYTES) -> PreparedCell:
    return PreparedCell(base, cand, step_bytes, "fake", ())


@dataclass
class FakeSuite:
    """Builds each cell's arms with `make(cell)`; `blocked` cells are unsupported."""

    make: Callable[[Cell], tuple[FakeArm, FakeArm]]
    blocked: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    info: SuiteInfo = field(default_factory=lambda: FAKE_INFO)

    def unsupported(self, c: Cell) -> str | None:
        return self.blocked.get(c.id)

    def bandwidth(self) -> Bandwidth:
        return BANDWIDTH

    def prepare(self, c: Cell, settings: Settings) -> PreparedCell:
        return prepared(*self.make(c))

    def close(self) -> None:
        self.closed = True


def honest(c: Cell) -> tuple[FakeArm, FakeArm]:
    return FakeArm("baseline", constant(0.010)), FakeArm("candidate", constant(0.010))
