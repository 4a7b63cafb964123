"""A subject's code scope: which paths are the model's own code, which are shared components, which co-changes
are forbidden, and which environment switches a reviewer has accepted. Read from the `[isolation]` table of the
subject's scope file; every key is data, checked here so a typo is a one-line error instead of a looser gate.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from harness.errors import UsageError
from harness.isolation.globs import GlobError, compile_glob

SECTION = "isolation"
SELF = "self"
EXTERNAL = "external"

_KEYS = {
    "model": "globs of the model's own code (a change may touch these)",
    "allowed": "globs outside the model's code that a change may also touch (its tests, docs)",
    "review": "table: shared component -> globs; a change there needs core-maintainer review",
    "co_change": "array of tables {name, when, forbids, why}: paths that may not change together",
    "env": "table: environment variable -> why a reviewer accepted model code reading it",
    "env_modules": "modules whose attributes are environment variables (a project's env accessor)",
    "registrations": "table: dotted registry call (glob) -> why a reviewer accepted calling it on import",
    "repository": "'self' (the repository that holds the gate) or 'external' (found through repository_env)",
    "repository_env": "environment variable that names the repository's folder when repository = 'external'",
    "coverage": "table {modules, floor, why}: line coverage of the specialized modules (the runtime half reads it)",
}
_RULE_KEYS = ("name", "when", "forbids", "why")


class ScopeError(UsageError):
    pass


class NoCodeScope(ScopeError):
    """The subject exists but its scope file has no code scope: nothing to judge a change against."""


@dataclass(frozen=True)
class CoChangeRule:
    name: str
    when: tuple[str, ...]  # if any changed path matches one of these ...
    forbids: tuple[str, ...]  # ... no changed path may match one of these
    why: str


@dataclass(frozen=True)
class CodeScope:
    source: str  # where the scope came from, for messages
    model: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    review: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    co_change: tuple[CoChangeRule, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    env_modules: tuple[str, ...] = ()
    registrations: Mapping[str, str] = field(default_factory=dict)
    repository: str = SELF
    repository_env: str = ""

    def model_packages(self) -> tuple[str, ...]:
        """Dotted packages of the model's code (`a/b/**` -> `a.b`), so imports of the model's own modules are
        not mistaken for imports of someone else's."""
        out = []
        for glob in self.model:
            head = glob.split("*", 1)[0].rstrip("/")
            if head and "?" not in head and "[" not in head:
                out.append(head.removesuffix(".py").replace("/", "."))
        return tuple(out)

    def repository_path(self) -> tuple[Path | None, str]:
        """(folder, why not) for an external repository; (None, '') means the gate's own repository."""
        if self.repository == SELF:
            return None, ""
        value = os.environ.get(self.repository_env, "")
        if not value:
            return None, f"set {self.repository_env} to a git checkout of the repository this scope judges"
        return Path(value), ""


@runtime_checkable
class HasCodeScope(Protocol):
    """A subject adapter whose scope file has an `[isolation]` table."""

    name: str

    def code_scope(self) -> Mapping[str, Any] | None: ...


def _fail(source: str, key: str, problem: str, fix: str) -> ScopeError:
    return ScopeError(f"scope {source}: {SECTION}.{key}: {problem} — {fix}")


def _globs(source: str, key: str, value: Any, *, required: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(source, key, f"{value!r} is not a list of globs", 'write e.g. ["pkg/models/name/**"]')
    if required and not value:
        raise _fail(source, key, "is empty", "name at least one glob of the model's own code")
    for glob in value:
        try:
            compile_glob(glob)
        except GlobError as exc:
            raise _fail(source, key, str(exc), "fix the glob") from None
    return tuple(value)


def _why_table(source: str, key: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) and v.strip() for v in value.values()):
        raise _fail(source, key, "must map each name to a non-empty reason", 'write NAME = "why it was accepted"')
    return dict(value)


def _rules(source: str, value: Any) -> tuple[CoChangeRule, ...]:
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise _fail(source, "co_change", "is not an array of tables", "write [[isolation.co_change]] blocks")
    rules = []
    for i, raw in enumerate(value):
        key = f"co_change[{i}]"
        if missing := [k for k in _RULE_KEYS if k not in raw]:
            raise _fail(source, key, f"misses {', '.join(missing)}", f"give each rule {', '.join(_RULE_KEYS)}")
        if extra := sorted(set(raw) - set(_RULE_KEYS)):
            raise _fail(source, key, f"unknown key {', '.join(extra)}", f"allowed keys: {', '.join(_RULE_KEYS)}")
        if not isinstance(raw["name"], str) or not isinstance(raw["why"], str) or not raw["why"].strip():
            raise _fail(source, key, "name and why must be non-empty strings", "say what the rule protects")
        rules.append(
            CoChangeRule(
                raw["name"],
                _globs(source, f"{key}.when", raw["when"], required=True),
                _globs(source, f"{key}.forbids", raw["forbids"], required=True),
                raw["why"],
            )
        )
    return tuple(rules)


def parse(section: Any, source: str) -> CodeScope:
    if not isinstance(section, dict):
        raise ScopeError(f"scope {source}: has no [{SECTION}] table — add one with at least `model = [globs]`")
    if extra := sorted(set(section) - set(_KEYS)):
        allowed = ", ".join(_KEYS)
        raise _fail(source, extra[0], "is not a key of the code scope", f"use only: {allowed}")
    if "model" not in section:
        raise _fail(source, "model", "is missing", "list the globs of the model's own code")
    review = section.get("review", {})
    if not isinstance(review, dict):
        raise _fail(source, "review", "is not a table", 'write [isolation.review] with component = ["glob", ...]')
    repository = section.get("repository", SELF)
    if repository not in (SELF, EXTERNAL):
        raise _fail(source, "repository", f"{repository!r} is not allowed", f"use {SELF!r} or {EXTERNAL!r}")
    repository_env = section.get("repository_env", "")
    if repository == EXTERNAL and not (isinstance(repository_env, str) and repository_env):
        raise _fail(source, "repository_env", "is missing", "name the variable that holds the repository's folder")
    env_modules = section.get("env_modules", [])
    if not isinstance(env_modules, list) or not all(isinstance(m, str) and m for m in env_modules):
        raise _fail(source, "env_modules", f"{env_modules!r} is not a list of module names", 'write ["pkg.envs"]')
    return CodeScope(
        source=source,
        model=_globs(source, "model", section["model"], required=True),
        allowed=_globs(source, "allowed", section.get("allowed", [])),
        review={name: _globs(source, f"review.{name}", globs, required=True) for name, globs in review.items()},
        co_change=_rules(source, section.get("co_change", [])),
        env=_why_table(source, "env", section.get("env", {})),
        env_modules=tuple(env_modules),
        registrations=_why_table(source, "registrations", section.get("registrations", {})),
        repository=repository,
        repository_env=repository_env,
    )


def load_file(path: Path) -> CodeScope:
    if not path.is_file():
        raise ScopeError(f"--scope {path} does not exist — give a TOML scope file with an [{SECTION}] table")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ScopeError(f"--scope {path} is not valid TOML ({exc}) — fix its syntax") from None
    return parse(data.get(SECTION), str(path))


def for_subject(name: str) -> CodeScope:
    from harness.subjects import load_subject, subject_names

    try:
        subject = load_subject(name)
    except KeyError:
        raise ScopeError(f"unknown subject {name!r} — use one of {', '.join(subject_names())}") from None
    section = subject.code_scope() if isinstance(subject, HasCodeScope) else None
    if section is None:
        raise NoCodeScope(f"subject {name} declares no code scope — add an [{SECTION}] table to its scope file")
    return parse(section, f"of subject {name}")
