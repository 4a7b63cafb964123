"""The interface every gate stage implements, and what the pipeline hands it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.config.loader import GateConfig
from harness.hardware import Hardware
from harness.verdicts import StageRecords

ProgressFn = Callable[[str, float | None], None]  # (what is happening, fraction done or None)


@dataclass
class StageContext:
    config: GateConfig
    hardware: Hardware
    bundle_dir: Path
    progress: ProgressFn

    def stage_dir(self, stage: str) -> Path:
        path = self.bundle_dir / "stages" / stage
        path.mkdir(parents=True, exist_ok=True)
        return path

    def evidence_path(self, stage: str, name: str) -> tuple[Path, str]:
        """(absolute path to write, bundle-relative path to list as evidence)."""
        return self.stage_dir(stage) / name, f"stages/{stage}/{name}"


class Stage(Protocol):
    name: str
    description: str
    # Whether the stage needs the accelerators the config names; if they are absent it is NOT_RUN.
    needs_hardware: bool

    def run(self, ctx: StageContext) -> StageRecords:
        """Collect evidence and return records (never a verdict). Raising makes the stage ERROR."""
        ...
