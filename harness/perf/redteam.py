"""Red team of the perf stage: candidates whose numbers lie, each of which the perf verdict must FAIL.

The numbers must be judged, so the cases run on a fake sweep that says its numbers are meaningful (as a GPU's are;
on the CPU the stage records budgets and Amdahl instead of judging them). Everything else is the stage's own path:
the config goes through the `[perf]` grammar, cells through the interleaved timing, profiles, ledgers and checks
of `PerfStage.measure`. The honest step, the config and each case's lie are data (redteam.toml beside this file);
with no lie the same sweep passes (the tests prove it), so every failure is the lie's.
"""

from __future__ import annotations

import math
import random
import tomllib
import zlib
from dataclasses import dataclass, field, fields, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from harness.config.loader import GateConfig
from harness.hardware import Hardware
from harness.perf.plan import Cell, PerfPlan, Settings, parse
from harness.perf.suite import Bandwidth, PartProfile, PathReport, PreparedCell, StepProfile, SuiteInfo
from harness.redteam import RedTeamCase
from harness.stages.base import StageContext
from harness.stages.perf import PerfStage
from harness.verdicts import StageRecords

STAGE = "perf"
SOURCE = "harness/perf/redteam.toml"


@cache
def data() -> dict[str, Any]:
    return tomllib.loads(resources.files("harness.perf").joinpath("redteam.toml").read_text())


@dataclass(frozen=True)
class Step:
    """The honest step both arms start from (redteam.toml [step])."""

    seconds: float
    noise: float
    bandwidth_bytes_per_s: float
    layers: tuple[str, ...]
    layer_bytes: int
    ops: tuple[str, ...]


@dataclass(frozen=True)
class Lie:
    """What a candidate changes; the defaults are the truth."""

    seconds: float | None = None  # its step time (None: the honest one)
    noise: float | None = None
    spread: float = 0.0  # its steps cycle through 1 - spread, 1, 1 + spread times its step time
    seen: float = 1.0  # share of its work its timer sees
    claimed_parts: float = 1.0  # factor on the per-layer times its profile reports
    expected: str = "stock"  # the path it claims
    ran: str = "stock"  # the path its ledger shows
    broken: float | None = None  # what its timer returns instead of a time


@dataclass
class FakeStepArm:
    """One arm of the fake sweep: seeded lognormal step times, a profile of its layers, a ledger of its ops."""

    name: str
    step: Step
    lie: Lie
    seed: int
    backend: str = "fake"
    rng: random.Random = field(init=False)
    steps_run: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @property
    def seconds(self) -> float:
        return self.step.seconds if self.lie.seconds is None else self.lie.seconds

    def _one(self) -> float:
        noise = self.step.noise if self.lie.noise is None else self.lie.noise
        swing = (1.0 - self.lie.spread, 1.0, 1.0 + self.lie.spread)[self.steps_run % 3]
        self.steps_run += 1
        return self.seconds * swing * math.exp(self.rng.gauss(0.0, noise))

    def run(self, steps: int = 1, lead_in: int = 0) -> float:
        for _ in range(lead_in):
            self._one()
        total = sum(self._one() for _ in range(steps))
        return self.lie.broken if self.lie.broken is not None else total * self.lie.seen

    def profile(self) -> StepProfile:
        share = self.seconds * self.lie.seen / len(self.step.layers)
        parts = tuple(
            PartProfile(layer, share * self.lie.claimed_parts, float(len(self.step.ops)), len(self.step.ops), b)
            for layer, b in zip(self.step.layers, _layer_bytes(self.step), strict=True)
        )
        return StepProfile(parts, self.seconds * self.lie.seen, "fake: the step split evenly over its layers")

    def path(self) -> PathReport:
        ledger = [(layer, op, self.lie.ran) for layer in self.step.layers for op in self.step.ops]
        wrong = tuple(
            f"{layer} {op}: ran {ran}, expected {self.lie.expected}"
            for layer, op, ran in ledger
            if ran != self.lie.expected
        )
        return PathReport(self.lie.expected, wrong)


def _layer_bytes(step: Step) -> list[int]:
    return [step.layer_bytes] * len(step.layers)


INFO = SuiteInfo(
    subject="perf-redteam",
    device="fake device",
    numbers_meaningful=True,  # judged, as a GPU's numbers are
    notes=("Red team: fake numbers, judged as a GPU's would be.",),
    ttft="not measured: a fake step has no requests",
    figure_note="red team: fake numbers",
)


@dataclass
class FakeSweep:
    """A PerfSuite whose candidate carries `lie`."""

    step: Step
    lie: Lie
    info: SuiteInfo

    def unsupported(self, cell: Cell) -> str | None:
        return None

    def bandwidth(self) -> Bandwidth:
        moved = 2 * self.step.layer_bytes
        median = moved / self.step.bandwidth_bytes_per_s
        return Bandwidth(self.step.bandwidth_bytes_per_s, moved, median, "fake: stated, not measured")

    def prepare(self, cell: Cell, settings: Settings) -> PreparedCell:
        seed = zlib.crc32(cell.id.encode())
        base = FakeStepArm("baseline", self.step, Lie(), seed)
        cand = FakeStepArm("candidate", self.step, self.lie, seed + 1)
        return PreparedCell(base, cand, sum(_layer_bytes(self.step)), "fake", ())

    def close(self) -> None:
        return None


def step() -> Step:
    raw = data()["step"]
    return Step(
        float(raw["seconds"]),
        float(raw["noise"]),
        float(raw["bandwidth_bytes_per_s"]),
        tuple(raw["layers"]),
        int(raw["layer_bytes"]),
        tuple(raw["ops"]),
    )


def lie(raw: dict[str, Any]) -> Lie:
    known = {f.name for f in fields(Lie)}
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"{SOURCE}: unknown candidate field {unknown[0]!r} — use one of {', '.join(sorted(known))}")
    return replace(Lie(), **raw)


def config() -> GateConfig:
    raw = data()["config"]
    return GateConfig(raw["name"], SOURCE, "", raw, "smoke")


def plan() -> PerfPlan:
    return parse(data()["config"], "smoke")


def judge(tmp: Path, candidate: Lie) -> StageRecords:
    """The perf stage's records for the fake sweep whose candidate carries `candidate`."""
    ctx = StageContext(config(), Hardware("none", 0), tmp, lambda what, frac: None)
    return PerfStage().measure(ctx, FakeSweep(step(), candidate, INFO), plan(), figure=False)


def _case(raw: dict[str, Any]) -> RedTeamCase:
    told = lie(raw["candidate"])
    return RedTeamCase(STAGE, raw["name"], raw["description"], lambda tmp: judge(tmp, told))


CASES = [_case(raw) for raw in data()["cases"]]
