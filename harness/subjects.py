"""The subject registry: which adapter judges a config's subject-specific keys (scope, model dims)."""

from __future__ import annotations

import importlib
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Protocol


@dataclass(frozen=True)
class ConfigIssue:
    """One problem with a config: the key, what is wrong, and how to fix it."""

    key: str
    problem: str
    fix: str

    def line(self) -> str:
        return f"{self.key}: {self.problem} — {self.fix}"


class Subject(Protocol):
    name: str

    def config_issues(self, config: dict[str, Any]) -> list[ConfigIssue]:
        """Problems of a schema-valid config against the subject's scope (empty when it is in scope)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Facts about the subject recorded in every bundle (scope file digest, model dims)."""
        ...


@cache
def _registry() -> dict[str, str]:
    raw = tomllib.loads(resources.files("harness").joinpath("subjects.toml").read_text())
    return {name: entry["adapter"] for name, entry in raw.items()}


def subject_names() -> list[str]:
    return sorted(_registry())


def load_subject(name: str) -> Subject:
    try:
        target = _registry()[name]
    except KeyError:
        raise KeyError(name) from None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
