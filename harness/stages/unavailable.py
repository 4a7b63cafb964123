"""Placeholder registration for a principle stage this build does not ship: it reports NOT_RUN, never PASSED."""

from __future__ import annotations

from dataclasses import dataclass

from harness.stages.base import StageContext
from harness.verdicts import StageRecords


@dataclass(frozen=True)
class UnavailableStage:
    name: str
    description: str
    needs_hardware: bool = False

    def run(self, ctx: StageContext) -> StageRecords:
        return StageRecords.not_run(self.name, "not available in this build")
