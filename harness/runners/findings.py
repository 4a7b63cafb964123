"""Collect a stage's checks and the checks it could not run, and turn them into records.

The rule: any failed check makes the stage FAILED (a failure is evidence wherever it shows up). Otherwise, if a
check the stage owes could not run (no proof-of-path probe, no forcing processor), the stage is NOT_RUN with
every reason listed: the checks that did run are kept in the records, but a partial proof is never PASSED.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.verdicts import Check, StageRecords


@dataclass
class Findings:
    stage: str
    checks: list[Check] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)

    def cannot(self, reason: str) -> None:
        if reason not in self.not_run:
            self.not_run.append(reason)

    def records(self) -> StageRecords:
        metrics = {**self.metrics, "not_run_checks": list(self.not_run)}
        failed = [c for c in self.checks if not c.passed]
        if failed or not self.not_run:
            return StageRecords(self.stage, checks=self.checks, metrics=metrics, evidence=self.evidence)
        shown = "; ".join(self.not_run[:3]) + (f"; and {len(self.not_run) - 3} more" if len(self.not_run) > 3 else "")
        reason = f"{shown} ({len(self.checks)} checks that did run all passed; see records)"
        return StageRecords(
            self.stage, status="not_run", reason=reason, checks=self.checks, metrics=metrics, evidence=self.evidence
        )
