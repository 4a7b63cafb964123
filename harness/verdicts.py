"""Stage verdicts, checks, and the gate outcome — all derived from raw records by pure functions.

A stage never writes its own verdict. It writes records: measured values, each compared with a limit. The
verdict is re-derived from those records here, both when the run finishes and again in `k3gate verify`, so an
edited verdict (or an edited `passed` flag) in a bundle cannot pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any


class Verdict(StrEnum):
    PASSED = "PASSED"
    FAILED = "FAILED"
    NOT_RUN = "NOT_RUN"
    ERROR = "ERROR"


class Outcome(StrEnum):
    PASSED = "PASSED"
    FAILED = "FAILED"
    INCOMPLETE = "INCOMPLETE"


class ExitCode(IntEnum):
    PASSED = 0
    FAILED = 1
    USAGE = 2
    INCOMPLETE = 3


OUTCOME_EXIT = {
    Outcome.PASSED: ExitCode.PASSED,
    Outcome.FAILED: ExitCode.FAILED,
    Outcome.INCOMPLETE: ExitCode.INCOMPLETE,
}

RECORDS_SCHEMA_ID = "https://k3gate.dev/records/v1"

_OPS = {
    "<=": lambda v, lim: v <= lim,
    "<": lambda v, lim: v < lim,
    ">=": lambda v, lim: v >= lim,
    ">": lambda v, lim: v > lim,
    "==": lambda v, lim: v == lim,
    "!=": lambda v, lim: v != lim,
    "in": lambda v, lim: v in lim,
}
OPS = tuple(_OPS)


def evaluate(value: Any, op: str, limit: Any) -> bool:
    """Whether `value op limit` holds. Missing values (None) and NaN never pass."""
    if op not in _OPS:
        raise ValueError(f"unknown check operator {op!r}; use one of {OPS}")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    try:
        return bool(_OPS[op](value, limit))
    except TypeError:
        return False


@dataclass(frozen=True)
class Check:
    """One measured fact compared with its limit. `passed` is computed, never given."""

    name: str
    value: Any
    op: str
    limit: Any
    detail: str = ""

    @property
    def passed(self) -> bool:
        return evaluate(self.value, self.op, self.limit)

    def to_record(self) -> dict[str, Any]:
        rec = {
            "name": self.name,
            "value": self.value,
            "op": self.op,
            "limit": self.limit,
            "passed": self.passed,
        }
        if self.detail:
            rec["detail"] = self.detail
        return rec

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Check:
        return cls(rec["name"], rec.get("value"), rec["op"], rec.get("limit"), rec.get("detail", ""))

    def describe(self) -> str:
        return f"{self.name} ({self.value!r} {self.op} {self.limit!r})"


@dataclass
class StageRecords:
    """What a stage hands back: the raw material its verdict is derived from."""

    stage: str
    status: str = "ran"  # ran | not_run | error
    reason: str = ""
    checks: list[Check] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)  # bundle-relative paths

    @classmethod
    def not_run(cls, stage: str, reason: str) -> StageRecords:
        return cls(stage=stage, status="not_run", reason=reason)

    @classmethod
    def error(cls, stage: str, reason: str, evidence: Sequence[str] = ()) -> StageRecords:
        return cls(stage=stage, status="error", reason=reason, evidence=list(evidence))

    def to_json(self) -> dict[str, Any]:
        return {
            "$schema": RECORDS_SCHEMA_ID,
            "stage": self.stage,
            "status": self.status,
            "reason": self.reason,
            "checks": [c.to_record() for c in self.checks],
            "metrics": self.metrics,
            "evidence": sorted(self.evidence),
        }


@dataclass(frozen=True)
class StageVerdict:
    stage: str
    verdict: Verdict
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"stage": self.stage, "verdict": self.verdict.value, "reason": self.reason}


def _summarize_failures(failed: Sequence[Check], total: int) -> str:
    shown = "; ".join(c.describe() for c in failed[:3])
    more = f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
    return f"{len(failed)} of {total} checks failed: {shown}{more}"


def derive_verdict(records: Mapping[str, Any]) -> StageVerdict:
    """The one rule that turns a stage's records (as stored in a bundle) into its verdict."""
    stage = records["stage"]
    status = records["status"]
    if status == "error":
        return StageVerdict(stage, Verdict.ERROR, records.get("reason") or "stage raised an error")
    if status == "not_run":
        return StageVerdict(stage, Verdict.NOT_RUN, records.get("reason") or "no reason given")
    if status != "ran":
        return StageVerdict(stage, Verdict.ERROR, f"unknown record status {status!r}")
    checks = [Check.from_record(r) for r in records.get("checks", [])]
    if not checks:
        # A stage that collected no evidence cannot pass.
        return StageVerdict(stage, Verdict.ERROR, "the stage ran but recorded no checks")
    failed = [c for c in checks if not c.passed]
    if failed:
        return StageVerdict(stage, Verdict.FAILED, _summarize_failures(failed, len(checks)))
    return StageVerdict(stage, Verdict.PASSED, f"all {len(checks)} checks passed")


def stored_flag_mismatches(records: Mapping[str, Any]) -> list[str]:
    """Checks whose stored `passed` flag disagrees with re-evaluating value against limit."""
    return [
        rec["name"] for rec in records.get("checks", []) if bool(rec.get("passed")) != Check.from_record(rec).passed
    ]


@dataclass(frozen=True)
class GateResult:
    outcome: Outcome
    reason: str

    @property
    def exit_code(self) -> ExitCode:
        return OUTCOME_EXIT[self.outcome]


def derive_outcome(verdicts: Iterable[StageVerdict], required: Iterable[str]) -> GateResult:
    """PASSED only if every required stage passed and no stage that ran failed.

    A failure is evidence of a bug wherever it shows up, so a FAILED optional stage fails the gate too; a
    required stage that did not run (or errored) makes the run incomplete, never green.
    """
    by_stage = {v.stage: v for v in verdicts}
    required = list(required)
    failed = [v.stage for v in by_stage.values() if v.verdict is Verdict.FAILED]
    if failed:
        return GateResult(Outcome.FAILED, f"failed: {', '.join(failed)}")
    missing = [s for s in required if s not in by_stage]
    unfinished = [s for s in required if s in by_stage and by_stage[s].verdict is not Verdict.PASSED]
    if missing or unfinished:
        parts = []
        if unfinished:
            parts.append(", ".join(f"{s} {by_stage[s].verdict.value}" for s in unfinished))
        if missing:
            parts.append("no verdict for " + ", ".join(missing))
        return GateResult(Outcome.INCOMPLETE, "required stages did not pass: " + "; ".join(parts))
    if not required:
        return GateResult(Outcome.INCOMPLETE, "no stage was required, so nothing was proven")
    return GateResult(Outcome.PASSED, f"all {len(required)} required stages passed")
