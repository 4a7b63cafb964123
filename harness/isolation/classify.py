"""Where each changed path lies against a code scope: the model's own code, an allowed extra, a shared component
that needs core-maintainer review, or outside the model's area. Plus the co-change rules."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from harness.isolation.gitdiff import Change
from harness.isolation.globs import first_match
from harness.isolation.scope import CoChangeRule, CodeScope


class Area(StrEnum):
    MODEL = "model"
    ALLOWED = "allowed"
    REVIEW = "review"
    OUTSIDE = "outside"


PASSING_LABELS = [Area.MODEL.value, Area.ALLOWED.value]


@dataclass(frozen=True)
class PathVerdict:
    path: str
    change: str  # "modified", "renamed from x", ...
    side: str  # "from" / "to" for the two sides of a rename, else ""
    area: Area
    component: str  # the shared component for REVIEW, else ""
    reason: str

    @property
    def label(self) -> str:
        return f"{self.area.value}: {self.component}" if self.component else self.area.value

    @property
    def ok(self) -> bool:
        return self.area in (Area.MODEL, Area.ALLOWED)

    def to_json(self) -> dict[str, str]:
        return {
            "path": self.path,
            "change": self.change,
            "side": self.side,
            "area": self.area.value,
            "component": self.component,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class CoChangeBreach:
    rule: CoChangeRule
    triggers: tuple[str, ...]  # changed paths that match the rule's `when`
    forbidden: tuple[str, ...]  # changed paths that match its `forbids`

    def describe(self) -> str:
        shown = ", ".join(self.forbidden[:5]) + (
            f" and {len(self.forbidden) - 5} more" if len(self.forbidden) > 5 else ""
        )
        return f"{self.triggers[0]} changed together with {shown}: {self.rule.why}"

    def to_json(self) -> dict[str, object]:
        return {
            "rule": self.rule.name,
            "why": self.rule.why,
            "triggers": list(self.triggers),
            "forbidden": list(self.forbidden),
        }


def classify_path(path: str, scope: CodeScope) -> tuple[Area, str, str]:
    """(area, component, reason). A shared component wins over the model's globs, so a scope can fence off
    part of the model's folder (say, its own scope file) for review."""
    for component, globs in scope.review.items():
        if glob := first_match(path, globs):
            return Area.REVIEW, component, f"shared component {component!r} ({glob}) needs core-maintainer review"
    if glob := first_match(path, scope.model):
        return Area.MODEL, "", f"the model's own code ({glob})"
    if glob := first_match(path, scope.allowed):
        return Area.ALLOWED, "", f"outside the model's code, allowed by the scope ({glob})"
    return Area.OUTSIDE, "", f"leaves the model's area: matches no glob of the scope {scope.source}"


def classify(changes: list[Change], scope: CodeScope) -> list[PathVerdict]:
    out = []
    for change in changes:
        for side, path in change.paths():
            area, component, reason = classify_path(path, scope)
            out.append(PathVerdict(path, change.describe(), side, area, component, reason))
    return out


def co_change_breaches(changes: list[Change], scope: CodeScope) -> list[CoChangeBreach]:
    touched = sorted({path for change in changes for _, path in change.paths()})
    breaches = []
    for rule in scope.co_change:
        triggers = tuple(p for p in touched if first_match(p, rule.when))
        forbidden = tuple(p for p in touched if first_match(p, rule.forbids))
        if triggers and forbidden:
            breaches.append(CoChangeBreach(rule, triggers, forbidden))
    return breaches
