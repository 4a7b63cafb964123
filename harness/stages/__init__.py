"""The stage registry, in the order stages run.

Each entry names the module and class of a stage; a principle stage that this build does not ship yet is an
explicit `UnavailableStage` (NOT_RUN "not available in this build"), never a silent skip.
"""

from __future__ import annotations

import importlib

from harness.stages.base import Stage, StageContext
from harness.stages.environment import EnvironmentStage
from harness.stages.unavailable import UnavailableStage

BUNDLE_STAGE = "bundle"

# (name, "module:Class" or None for a stage not built yet, description used while it is unavailable)
REGISTRY: tuple[tuple[str, str | None, str], ...] = (
    ("environment", "harness.stages.environment:EnvironmentStage", ""),
    ("isolation", "harness.stages.isolation:IsolationStage", ""),
    ("scope", "harness.stages.scope:ScopeStage", "Principle 2: feature preservation on the optimized path"),
    ("numerics", "harness.stages.numerics:NumericsStage", ""),
    ("evals", "harness.stages.evals:EvalsStage", "Principle 3b: model evals on the optimized path, paired"),
    ("perf", "harness.stages.perf:PerfStage", ""),
)


def _load(target: str) -> Stage:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)()


def registered() -> list[Stage]:
    return [_load(target) if target else UnavailableStage(name, desc) for name, target, desc in REGISTRY]


def stage_names() -> list[str]:
    return [name for name, _, _ in REGISTRY] + [BUNDLE_STAGE]


__all__ = ["BUNDLE_STAGE", "EnvironmentStage", "Stage", "StageContext", "registered", "stage_names"]
