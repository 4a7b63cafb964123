"""Line coverage (coverage.py) of a subject's specialized modules while its runtime isolation suite runs.

Proof of path at the level of source lines: the specialized code a change ships must actually run under the gate's
suites, or a test that silently took the stock path looks like a passing one. The subject's scope file names the
modules (repository-relative globs), the floor and why, in `[isolation.coverage]`. Coverage that cannot be
measured here is a NotRun with the reason — no module matches yet, coverage.py is missing, another tracer is active
— and never passes, least of all on zero files.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.isolation.globs import GlobError, compile_glob
from harness.isolation.runtime import NotRun
from harness.verdicts import Check

CHECK_NAME = "line coverage of the specialized modules"
_KEYS = {"modules": "globs of the specialized modules", "floor": "least line coverage, 0..1", "why": "why that floor"}
# Optional: files matching `modules` that are not measured, each glob with the reason a reviewer accepted (a kernel
# that is compiled and checked but not yet selectable, say). Listed in the evidence and the check's detail.
_OPTIONAL = {"exclude": "table: glob -> why those files are not measured"}
DETAIL_FILES = 5  # least-covered files named in the check's detail; the evidence file has all of them


class CoverageScopeError(ValueError):
    pass


@dataclass(frozen=True)
class CoverageScope:
    modules: tuple[str, ...]  # repository-relative globs of Python files
    floor: float  # least fraction of their statements that must run
    why: str
    source: str  # where the table came from, for messages
    exclude: Mapping[str, str] = field(default_factory=dict)  # glob -> why it is not measured


def parse(table: Any, source: str) -> CoverageScope:
    """The `[isolation.coverage]` table; every problem is one line naming the key and the fix."""

    def fail(key: str, problem: str, fix: str) -> CoverageScopeError:
        return CoverageScopeError(f"scope {source}: isolation.coverage.{key}: {problem} — {fix}")

    if not isinstance(table, Mapping):
        raise fail("", "is not a table", "write [isolation.coverage] with modules, floor and why")
    if extra := sorted(set(table) - set(_KEYS) - set(_OPTIONAL)):
        raise fail(extra[0], "is not a key of the coverage table", f"use only: {', '.join([*_KEYS, *_OPTIONAL])}")
    if missing := [k for k in _KEYS if k not in table]:
        raise fail(missing[0], "is missing", f"give {', '.join(f'{k} ({v})' for k, v in _KEYS.items())}")
    modules = table["modules"]
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise fail("modules", f"{modules!r} is not a non-empty list of globs", 'write e.g. ["pkg/kernels/**/*.py"]')
    for glob in modules:
        try:
            compile_glob(glob)
        except GlobError as exc:
            raise fail("modules", str(exc), "fix the glob") from None
    floor = table["floor"]
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 < floor <= 1:
        raise fail("floor", f"{floor!r} is not a fraction in (0, 1]", "write e.g. floor = 0.9")
    why = table["why"]
    if not isinstance(why, str) or not why.strip():
        raise fail("why", "is empty", "say why a reviewer accepted this floor")
    exclude = table.get("exclude", {})
    if not isinstance(exclude, Mapping) or not all(
        isinstance(g, str) and isinstance(w, str) and w.strip() for g, w in exclude.items()
    ):
        raise fail("exclude", f"{exclude!r} is not a table of glob = why", 'write e.g. {"pkg/x.py" = "why"}')
    for glob in exclude:
        try:
            compile_glob(glob)
        except GlobError as exc:
            raise fail("exclude", str(exc), "fix the glob") from None
    return CoverageScope(tuple(modules), float(floor), why, source, dict(exclude))


@dataclass(frozen=True)
class FileCoverage:
    path: str  # repository-relative
    statements: int
    missing: tuple[int, ...]

    @property
    def covered(self) -> int:
        return self.statements - len(self.missing)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "statements": self.statements, "covered": self.covered, "missing": self.missing}


def _lines(numbers: tuple[int, ...]) -> str:
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


@dataclass
class CoverageResult:
    scope: CoverageScope
    during: str  # what ran while coverage was measured
    files: list[FileCoverage] = field(default_factory=list)
    not_run: str = ""  # why nothing was measured

    @property
    def statements(self) -> int:
        return sum(f.statements for f in self.files)

    @property
    def fraction(self) -> float | None:
        total = self.statements
        return sum(f.covered for f in self.files) / total if total else None

    def name(self) -> str:
        return f"{CHECK_NAME} ({', '.join(self.scope.modules)}) during {self.during}"

    def check(self) -> Check | None:
        """The floor check, or None when nothing was measured (see `not_run_item`)."""
        fraction = self.fraction
        if self.not_run or fraction is None:
            return None
        lowest = sorted(self.files, key=lambda f: f.covered / f.statements if f.statements else 1.0)
        named = "; ".join(
            f"{f.path} {f.covered}/{f.statements}" + (f" (missed lines {_lines(f.missing)})" if f.missing else "")
            for f in lowest[:DETAIL_FILES]
        )
        detail = f"{self.scope.why}; {len(self.files)} files, lowest first: {named}"
        if self.scope.exclude:
            detail += "; not measured: " + "; ".join(f"{g} ({w})" for g, w in self.scope.exclude.items())
        return Check(self.name(), round(fraction, 4), ">=", self.scope.floor, detail)

    def not_run_item(self) -> NotRun | None:
        if self.not_run:
            return NotRun(self.name(), self.not_run)
        if self.fraction is None:
            return NotRun(self.name(), f"the {len(self.files)} files matching the globs hold no statements to cover")
        return None

    def to_json(self) -> dict[str, Any]:
        fraction = self.fraction
        return {
            "modules": list(self.scope.modules),
            "floor": self.scope.floor,
            "why": self.scope.why,
            "exclude": dict(self.scope.exclude),
            "during": self.during,
            "not_run": self.not_run,
            "statements": self.statements,
            "fraction": None if fraction is None or math.isnan(fraction) else fraction,
            "files": [f.to_json() for f in self.files],
        }


def _static_prefix(glob: str) -> str:
    """The folder part of a glob before its first wildcard: the only folder its files can be under."""
    head: list[str] = []
    for part in glob.split("/")[:-1]:
        if any(ch in part for ch in "*?["):
            break
        head.append(part)
    return "/".join(head)


def matching_files(scope: CoverageScope, root: Path) -> list[str]:
    """Repository-relative Python files under `root` that match one of the scope's globs and none of its
    exclusions, sorted."""
    excluded = [compile_glob(g) for g in scope.exclude]
    found: set[str] = set()
    for glob in scope.modules:
        pattern = compile_glob(glob)
        base = root / _static_prefix(glob)
        if not base.is_dir():
            continue
        for folder, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in files:
                rel = (Path(folder) / name).relative_to(root).as_posix()
                if name.endswith(".py") and pattern.match(rel) and not any(x.match(rel) for x in excluded):
                    found.add(rel)
    return sorted(found)


@contextlib.contextmanager
def measure(scope: CoverageScope, root: Path, during: str) -> Iterator[CoverageResult]:
    """Measure line coverage of the scope's files under `root` while the block runs; the yielded result is filled
    in when the block ends (or says why nothing was measured)."""
    result = CoverageResult(scope, during)
    files = matching_files(scope, root)
    globs = ", ".join(scope.modules)
    if not files:
        excluded = ", ".join(f"{g}: {w}" for g, w in scope.exclude.items())
        skipped = f" (not measured: {excluded})" if excluded else ""
        result.not_run = (
            f"no file matches {globs}: no specialized module exists yet, so there is nothing to cover "
            f"(the floor {scope.floor} applies as soon as one does){skipped}"
        )
        yield result
        return
    try:
        import coverage
    except ImportError:
        result.not_run = "coverage.py is not installed here — pip install coverage (k3gate's test extra has it)"
        yield result
        return
    if sys.gettrace() is not None or coverage.Coverage.current() is not None:
        result.not_run = (
            "another tracer (a debugger, or a coverage run such as pytest --cov) is active in this process, so "
            "coverage.py cannot measure on top of it — run the gate outside it"
        )
        yield result
        return
    paths = {rel: str((root / rel).resolve()) for rel in files}
    cov = coverage.Coverage(data_file=None, config_file=False, include=list(paths.values()))
    # A module that never ran is reported as 0% below, not as a warning on stderr.
    cov.set_option("run:disable_warnings", ["no-data-collected", "module-not-imported"])
    cov.start()
    try:
        yield result
    finally:
        cov.stop()
    for rel, path in paths.items():
        _, statements, _, missing, _ = cov.analysis2(path)
        result.files.append(FileCoverage(rel, len(statements), tuple(missing)))
