"""The stage registry, in the order stages run. Principle stages replace their placeholders as they land."""

from __future__ import annotations

from harness.stages.base import Stage, StageContext
from harness.stages.environment import EnvironmentStage
from harness.stages.unavailable import UnavailableStage

BUNDLE_STAGE = "bundle"


def registered() -> list[Stage]:
    return [
        EnvironmentStage(),
        UnavailableStage("isolation", "Principle 1: blast radius, write-set audit, proof of path"),
        UnavailableStage("scope", "Principle 2: scope checks and feature preservation on the optimized path"),
        UnavailableStage("numerics", "Principle 3a: kernel numerics over shape grids, with a red team"),
        UnavailableStage("evals", "Principle 3b: model evals on the optimized path, paired against baseline"),
        UnavailableStage("perf", "Principle 4: performance sweeps with a verdict"),
    ]


def stage_names() -> list[str]:
    return [s.name for s in registered()] + [BUNDLE_STAGE]


__all__ = ["BUNDLE_STAGE", "Stage", "StageContext", "registered", "stage_names"]
