"""`k3gate kernels build`: compile a subject's specialized kernels on this machine and check what came out.

Compiling needs no GPU: the subject builds each kernel at its real shapes for a target architecture (`--arch`)
and hands back PTX, cubin and SASS. The gate keeps all three under `--out` and checks every build against the
subject's expectations, kept as data (a TOML file per subject): regular-expression counts over the PTX or SASS
(instructions the kernel must or must not contain, optionally only before an anchor instruction, optionally only
for builds with given tags), a register ceiling and a local-memory (stack frame) ceiling read from the cubin; and,
for every kernel, no butterfly reduction step contracted into an FMA (harness/ptx_lint.py).
Exit 0 only if every build compiled and met every expectation; 1 otherwise; 2 for a usage problem (no kernels,
unknown architecture, a missing toolchain, a malformed expectations file).

The command knows nothing about any model. A subject takes part by giving its adapter a `kernel_builds()` method
that returns a `KernelBuildSet` (protocol below), as stages ask subjects for their suites; `--builds MODULE:ATTR`
names a set directly while it is being developed. The set names the environment its toolchain must find before it
is imported (CuTe DSL reads its target architecture then); the command sets it, so model code never writes the
process environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import json
import os
import re
import struct
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

from harness.errors import UsageError
from harness.ptx_lint import contracted_butterflies
from harness.subjects import load_subject, subject_names
from harness.verdicts import Check, ExitCode

TagValue = str | int | bool


# --- what a subject provides ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelArtifacts:
    """What one compile produced: PTX text, the cubin (ELF) and its SASS disassembly."""

    ptx: str
    cubin: bytes
    sass: str


class KernelBuild(Protocol):
    """One kernel compiled at one shape. Instances cross into worker processes, so they must pickle."""

    @property
    def kernel(self) -> str:
        """The kernel's name in the expectations file."""
        ...

    @property
    def name(self) -> str:
        """Unique within the set; a relative path (letters, digits, `._-` and `/`)."""
        ...

    @property
    def tags(self) -> Mapping[str, TagValue]:
        """Facts about this build that expectations select on (`when`) or count against (`count = "<tag>"`)."""
        ...

    def compile(self, arch: str) -> KernelArtifacts:
        """Compile for `arch` (e.g. sm_90a) without a GPU; raise with a one-line message on failure."""
        ...


class KernelBuildSet(Protocol):
    archs: tuple[str, ...]  # target architectures the set compiles for
    expectations_name: str  # where the expectations come from, for messages

    def environment(self, arch: str) -> Mapping[str, str]:
        """Variables the compiling process needs before the toolchain is imported (the gate sets them)."""
        ...

    def missing(self) -> str | None:
        """Why the toolchain cannot compile here (naming what to install), or None when it can."""
        ...

    def expectations_text(self) -> str: ...

    def builds(self, arch: str) -> list[KernelBuild]: ...


# --- reading a cubin ------------------------------------------------------------------------------------------

# EIATTR codes of the `.nv.info` section (per-function attributes ptxas writes; cuobjdump prints the same values).
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_MIN_STACK_SIZE = 0x12
_EIATTR_MAX_STACK_SIZE = 0x23
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FORMAT_SVAL = 0x04  # a 2-byte length, then that many bytes


@dataclass(frozen=True)
class KernelResources:
    """Per-kernel resource use as ptxas recorded it in the cubin."""

    registers: int
    frame_bytes: int  # the local-memory stack frame: spills and local arrays live here
    stack_bytes: int
    shared_bytes: int  # static shared memory


class CubinError(ValueError):
    pass


def cubin_resources(cubin: bytes) -> dict[str, KernelResources]:
    """Registers, stack frame and shared memory of every kernel in a CUDA cubin (64-bit little-endian ELF)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise CubinError("not a 64-bit little-endian ELF file, so not a cubin")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def text(table_offset: int, at: int) -> str:
        start = table_offset + at
        return cubin[start : cubin.index(b"\0", start)].decode()

    names = [text(sections[shstrndx][4], s[0]) for s in sections]
    by_name = {name: s for name, s in zip(names, sections, strict=True)}
    symtab, strtab = by_name.get(".symtab"), by_name.get(".strtab")
    if symtab is None or strtab is None:
        raise CubinError("the cubin has no symbol table")
    symbols = [text(strtab[4], struct.unpack_from("<I", cubin, symtab[4] + i * 24)[0]) for i in range(symtab[5] // 24)]
    attrs: dict[tuple[int, int], int] = {}  # (attribute, symbol index) -> value, from the global .nv.info
    info = by_name.get(".nv.info")
    if info is not None:
        at, end = info[4], info[4] + info[5]
        while at < end:
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt == _EIATTR_FORMAT_SVAL:
                size = struct.unpack_from("<H", cubin, at + 2)[0]
                if size == 8:
                    sym, value = struct.unpack_from("<II", cubin, at + 4)
                    attrs[(attr, sym)] = value
                at += 4 + size
            else:  # the other formats carry at most 2 bytes inline: a 4-byte entry
                at += 4
    kernels: dict[str, KernelResources] = {}
    for name in names:
        if not name.startswith(".text."):
            continue
        fn = name[len(".text.") :]
        sym = symbols.index(fn) if fn in symbols else -1
        if (_EIATTR_REGCOUNT, sym) not in attrs:
            raise CubinError(f"the cubin records no register count for {fn}")
        shared = by_name.get(f".nv.shared.{fn}")
        kernels[fn] = KernelResources(
            registers=attrs[(_EIATTR_REGCOUNT, sym)],
            frame_bytes=attrs.get((_EIATTR_FRAME_SIZE, sym), 0),
            stack_bytes=max(attrs.get((_EIATTR_MIN_STACK_SIZE, sym), 0), attrs.get((_EIATTR_MAX_STACK_SIZE, sym), 0)),
            shared_bytes=shared[5] if shared is not None else 0,
        )
    if not kernels:
        raise CubinError("the cubin holds no kernel")
    return kernels


# --- expectations -----------------------------------------------------------------------------------------------

_RULE_KEYS = {"in", "pattern", "count", "min", "max", "before", "when", "why"}
_KERNEL_KEYS = {"max_registers", "max_frame_bytes", "frame_allowances", "why", "rules"}
_ALLOWANCE_KEYS = {"when", "max_frame_bytes", "why"}


def tag_sum(expr: str, tags: Mapping[str, TagValue], build: str) -> int:
    """The value of a `count` such as "weight_loads + row_loads": integer literals and integer (or bool) tags."""
    total = 0
    for term in (t.strip() for t in expr.split("+")):
        if term.isdigit():
            total += int(term)
            continue
        value = tags.get(term)
        if not isinstance(value, int):  # bool is an int: a flag counts 0 or 1
            raise UsageError(
                f"`count = {expr!r}` needs an integer tag {term!r}, which build {build} lacks — fix the expectation"
            )
        total += int(value)
    return total


def selects(when: Mapping[str, TagValue], tags: Mapping[str, TagValue], build: str) -> bool:
    """Whether a build's tags hold every `tag = value` of a `when`; a tag the build lacks is a mistake in the file."""
    for key, want in when.items():
        if key not in tags:
            raise UsageError(f"an expectation selects on tag {key!r}, which build {build} lacks — fix its `when`")
        if tags[key] != want:
            return False
    return True


@dataclass(frozen=True)
class FrameAllowance:
    """A local-memory frame the builds a `when` selects may have instead of the kernel's max_frame_bytes: a spill
    measured to cost less than every spill-free alternative, with the measurement in `why`."""

    when: Mapping[str, TagValue]
    max_frame_bytes: int
    why: str


@dataclass(frozen=True)
class Rule:
    """Matches of `pattern` in the PTX or SASS (only those before the first match of `before`, if given), counted
    and compared with `count` (an int or the name of a build tag), or with `min` / `max`."""

    where: str
    pattern: re.Pattern[str]
    why: str
    count: int | str | None = None
    min: int | None = None
    max: int | None = None
    before: re.Pattern[str] | None = None
    when: Mapping[str, TagValue] = field(default_factory=dict)

    def applies(self, tags: Mapping[str, TagValue], build: str) -> bool:
        return selects(self.when, tags, build)

    def checks(self, text: str, tags: Mapping[str, TagValue], build: str) -> list[Check]:
        scope = text
        if self.before is not None:
            anchor = self.before.search(text)
            if anchor is None:
                return [Check(f"{self.where} has {self.before.pattern!r}", False, "==", True, self.why)]
            scope = text[: anchor.start()]
        found = len(self.pattern.findall(scope))
        label = f"{self.where} {self.pattern.pattern!r}" + (f" before {self.before.pattern!r}" if self.before else "")
        out = []
        if self.count is not None:
            want = self.count if isinstance(self.count, int) else tag_sum(self.count, tags, build)
            out.append(Check(label, found, "==", want, self.why))
        if self.min is not None:
            out.append(Check(label, found, ">=", self.min, self.why))
        if self.max is not None:
            out.append(Check(label, found, "<=", self.max, self.why))
        return out


@dataclass(frozen=True)
class KernelExpectations:
    max_registers: int
    max_frame_bytes: int
    rules: tuple[Rule, ...]
    why: str = ""
    frame_allowances: tuple[FrameAllowance, ...] = ()

    def frame_limit(self, tags: Mapping[str, TagValue], build: str) -> tuple[int, str]:
        """The frame bytes a build may have and why: the first allowance selecting it, else max_frame_bytes."""
        for allowance in self.frame_allowances:
            if selects(allowance.when, tags, build):
                return allowance.max_frame_bytes, allowance.why
        return self.max_frame_bytes, "spills and local arrays"


def _regex(text: Any, where: str) -> re.Pattern[str]:
    if not isinstance(text, str) or not text:
        raise UsageError(f"{where}: a pattern must be a non-empty string — write a regular expression")
    try:
        return re.compile(text, re.MULTILINE)
    except re.error as exc:
        raise UsageError(f"{where}: bad regular expression {text!r} ({exc}) — fix the pattern") from None


def _rule(raw: Any, where: str) -> Rule:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: a rule must be a table — write [[...rules]] entries")
    if unknown := set(raw) - _RULE_KEYS:
        raise UsageError(f"{where}: unknown key {sorted(unknown)[0]!r} — use {', '.join(sorted(_RULE_KEYS))}")
    if raw.get("in") not in ("ptx", "sass"):
        raise UsageError(f'{where}: `in` must be "ptx" or "sass"')
    if not isinstance(raw.get("why"), str) or not raw["why"].strip():
        raise UsageError(f"{where}: every rule needs a `why` — say what a miss would mean")
    count = raw.get("count")
    if "count" not in raw and "min" not in raw and "max" not in raw:
        raise UsageError(f"{where}: a rule needs `count`, `min` or `max` — say how many matches are right")
    if count is not None and not isinstance(count, int | str):
        raise UsageError(f"{where}: `count` must be an integer or a tag name")
    for key in ("min", "max"):
        if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 0):
            raise UsageError(f"{where}: `{key}` must be a non-negative integer")
    when = raw.get("when", {})
    if not isinstance(when, dict):
        raise UsageError(f"{where}: `when` must be an inline table of tag = value")
    return Rule(
        where=raw["in"],
        pattern=_regex(raw.get("pattern"), where),
        why=raw["why"].strip(),
        count=count,
        min=raw.get("min"),
        max=raw.get("max"),
        before=_regex(raw["before"], where) if "before" in raw else None,
        when=when,
    )


def _allowance(raw: Any, where: str) -> FrameAllowance:
    if not isinstance(raw, dict):
        raise UsageError(f'{where}: must be a table {{ when = {{...}}, max_frame_bytes = N, why = "..." }}')
    if unknown := set(raw) - _ALLOWANCE_KEYS:
        raise UsageError(f"{where}: unknown key {sorted(unknown)[0]!r} — use {', '.join(sorted(_ALLOWANCE_KEYS))}")
    when = raw.get("when")
    if not isinstance(when, dict) or not when:
        raise UsageError(f"{where}: needs a non-empty `when` — an allowance for every build is max_frame_bytes")
    frame = raw.get("max_frame_bytes")
    if not isinstance(frame, int) or isinstance(frame, bool) or frame < 0:
        raise UsageError(f"{where}: `max_frame_bytes` must be a non-negative integer")
    if not isinstance(raw.get("why"), str) or not raw["why"].strip():
        raise UsageError(f"{where}: needs a `why` — say what was measured that makes the spill the better build")
    return FrameAllowance(when, frame, raw["why"].strip())


def parse_expectations(text: str, source: str, arch: str) -> dict[str, KernelExpectations]:
    """The `[<arch>.<kernel>]` tables of an expectations file; every problem is a one-line UsageError."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{source}: not valid TOML ({exc}) — fix the file") from None
    if arch not in raw:
        raise UsageError(f"{source} has no [{arch}] expectations — add them or build another --arch")
    out: dict[str, KernelExpectations] = {}
    for kernel, table in raw[arch].items():
        where = f"{source} [{arch}.{kernel}]"
        if not isinstance(table, dict):
            raise UsageError(f"{where}: must be a table")
        if unknown := set(table) - _KERNEL_KEYS:
            raise UsageError(f"{where}: unknown key {sorted(unknown)[0]!r} — use {', '.join(sorted(_KERNEL_KEYS))}")
        for key in ("max_registers", "max_frame_bytes"):
            if not isinstance(table.get(key), int) or table[key] < 0:
                raise UsageError(f"{where}: `{key}` must be a non-negative integer")
        rules = table.get("rules", [])
        if not isinstance(rules, list):
            raise UsageError(f"{where}: `rules` must be an array of tables ([[{arch}.{kernel}.rules]])")
        allowances = table.get("frame_allowances", [])
        if not isinstance(allowances, list):
            raise UsageError(f"{where}: `frame_allowances` must be an array of tables")
        out[kernel] = KernelExpectations(
            max_registers=table["max_registers"],
            max_frame_bytes=table["max_frame_bytes"],
            rules=tuple(_rule(r, f"{where} rule {i + 1}") for i, r in enumerate(rules)),
            why=str(table.get("why", "")),
            frame_allowances=tuple(_allowance(a, f"{where} frame allowance {i + 1}") for i, a in enumerate(allowances)),
        )
    return out


# --- running the builds -----------------------------------------------------------------------------------------


@dataclass
class BuildResult:
    build: str
    kernel: str
    tags: Mapping[str, TagValue]
    seconds: float
    checks: list[Check]
    resources: KernelResources | None = None
    files: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "build": self.build,
            "kernel": self.kernel,
            "ok": self.ok,
            "tags": dict(self.tags),
            "seconds": round(self.seconds, 3),
            "resources": None if self.resources is None else dataclasses.asdict(self.resources),
            "files": self.files,
            "checks": [c.to_record() for c in self.checks],
        }


_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")


def _one_line(exc: BaseException) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}"[:400]


def compile_build(build: KernelBuild, arch: str) -> tuple[KernelArtifacts | None, str, float]:
    """Run one compile (in a worker process when --jobs > 1): (artifacts or None, error line, seconds)."""
    start = time.perf_counter()
    try:
        return build.compile(arch), "", time.perf_counter() - start
    except Exception as exc:  # a compiler error fails this build, and the report says which and why
        return None, _one_line(exc), time.perf_counter() - start


def judge(
    build: KernelBuild,
    arch: str,
    artifacts: KernelArtifacts | None,
    error: str,
    expect: KernelExpectations,
    out_dir: Path,
) -> BuildResult:
    """Write a build's artifacts under `out_dir` and check them against its kernel's expectations."""
    result = BuildResult(build.name, build.kernel, dict(build.tags), 0.0, [])
    result.checks.append(Check("compiles", error == "", "==", True, error))
    if artifacts is None:
        return result
    folder = out_dir / build.name
    folder.mkdir(parents=True, exist_ok=True)
    for suffix, data in (("ptx", artifacts.ptx), ("sass", artifacts.sass)):
        (folder / f"kernel.{suffix}").write_text(data)
    (folder / "kernel.cubin").write_bytes(artifacts.cubin)
    result.files = [f"{build.name}/kernel.{s}" for s in ("ptx", "cubin", "sass")]

    targets = re.findall(r"^\s*\.target\s+(\S+)", artifacts.ptx, re.MULTILINE)
    result.checks.append(Check("ptx .target", targets[0] if targets else None, "==", arch, "the requested --arch"))
    try:
        kernels = cubin_resources(artifacts.cubin)
    except CubinError as exc:
        result.checks.append(Check("cubin readable", False, "==", True, str(exc)))
        return result
    result.checks.append(Check("kernels in the cubin", len(kernels), "==", 1, "one kernel per build"))
    res = max(kernels.values(), key=lambda r: r.registers)
    result.resources = res
    result.checks.append(Check("registers", res.registers, "<=", expect.max_registers, expect.why))
    frame, frame_why = expect.frame_limit(build.tags, build.name)
    result.checks.append(Check("local-memory frame bytes", res.frame_bytes, "<=", frame, frame_why))
    contracted = contracted_butterflies(artifacts.ptx)
    result.checks.append(
        Check(
            "butterfly steps contracted into FMAs",
            len(contracted),
            "==",
            0,
            contracted[0].describe() if contracted else "lanes of a warp reduction must hold equal sums",
        )
    )
    texts = {"ptx": artifacts.ptx, "sass": artifacts.sass}
    for rule in expect.rules:
        if rule.applies(build.tags, build.name):
            result.checks.extend(rule.checks(texts[rule.where], build.tags, build.name))
    return result


def select_builds(
    build_set: KernelBuildSet,
    arch: str,
    expectations: dict[str, KernelExpectations],
    match: str | None = None,
    source: str = "the expectations",
) -> list[KernelBuild]:
    """The builds to run (names matching the glob `match`), after checking that every one can be judged."""
    builds = [b for b in build_set.builds(arch) if match is None or fnmatchcase(b.name, match)]
    if not builds:
        raise UsageError(
            f"no kernel build matches {match!r} — list them with --list" if match else f"no builds for {arch}"
        )
    names = [b.name for b in builds]
    if len(set(names)) != len(names):
        raise UsageError("the build set lists two builds with the same name — make build names unique")
    if bad := [n for n in names if not _SAFE_NAME.fullmatch(n) or ".." in n.split("/")]:
        raise UsageError(f"build name {bad[0]!r} is not a relative path of letters, digits, ._- and / — rename it")
    if lacking := sorted({b.kernel for b in builds} - set(expectations)):
        raise UsageError(f"kernel {lacking[0]!r} has no [{arch}.{lacking[0]}] table in {source} — add one")
    for b in builds:  # a `when` or `count` naming an unknown tag is a mistake in the file, found before compiling
        for rule in expectations[b.kernel].rules:
            if rule.applies(b.tags, b.name) and isinstance(rule.count, str):
                tag_sum(rule.count, b.tags, b.name)
    return builds


def run_builds(
    builds: Sequence[KernelBuild],
    arch: str,
    out_dir: Path,
    expectations: dict[str, KernelExpectations],
    jobs: int = 1,
    progress: Any = None,
) -> list[BuildResult]:
    """Compile and check `builds` (from `select_builds`) for `arch`, writing artifacts under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if jobs == 1:
        return _judge_all(builds, (compile_build(b, arch) for b in builds), arch, expectations, out_dir, progress)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        compiled = pool.map(compile_build, builds, [arch] * len(builds))
        return _judge_all(builds, compiled, arch, expectations, out_dir, progress)


def _judge_all(
    builds: Sequence[KernelBuild],
    compiled: Iterable[tuple[KernelArtifacts | None, str, float]],
    arch: str,
    expectations: dict[str, KernelExpectations],
    out_dir: Path,
    progress: Any,
) -> list[BuildResult]:
    results = []
    for build, (artifacts, error, seconds) in zip(builds, compiled, strict=True):
        result = judge(build, arch, artifacts, error, expectations[build.kernel], out_dir)
        result.seconds = seconds
        results.append(result)
        if progress is not None:
            progress(result)
    return results


# --- the command ------------------------------------------------------------------------------------------------


def _named_set(target: str) -> KernelBuildSet:
    """The build set at `module:attribute` (--builds)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--builds {target!r} is not MODULE:ATTRIBUTE — e.g. mypkg.kernels:BUILDS")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--builds {target}: cannot load it ({exc}) — name an importable build set") from None


def _build_sets(subject: str | None, target: str | None) -> list[tuple[str, KernelBuildSet]]:
    if target is not None:
        return [(target.partition(":")[2], _named_set(target))]
    names = [subject] if subject else subject_names()
    sets = []
    for name in names:
        try:
            adapter = load_subject(name)
        except KeyError:
            raise UsageError(f"unknown subject {name!r} — choose from {', '.join(subject_names())}") from None
        make = getattr(adapter, "kernel_builds", None)
        build_set = make() if make is not None else None
        if build_set is not None:
            sets.append((name, build_set))
        elif subject:
            raise UsageError(f"subject {name!r} declares no specialized kernels — pick a subject that has some")
    if not sets:
        raise UsageError("no subject declares specialized kernels, so there is nothing to build")
    return sets


def _expectations_text(path: str | None, build_set: KernelBuildSet) -> str:
    if path is None:
        return build_set.expectations_text()
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read --expectations {path} ({exc.strerror}) — give an existing TOML file") from None


def _print_result(result: BuildResult) -> None:
    from harness.cli import err

    res = result.resources
    facts = f"{res.registers} regs, {res.frame_bytes} B frame" if res else "no cubin"
    mark = "[green]PASS[/]" if result.ok else "[red]FAIL[/]"
    err.print(f"  {mark} {result.build}  ({facts}, {len(result.checks)} checks, {result.seconds:.1f} s)")
    for c in result.checks:
        if not c.passed:
            err.print(f"       {c.describe()}: {c.detail}", markup=False)


def cmd_kernels_build(args: argparse.Namespace) -> int:
    from harness.cli import err

    if args.jobs < 1:
        raise UsageError("--jobs must be at least 1")
    sets = _build_sets(args.subject, args.builds)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    summary: dict[str, Any] = {"arch": args.arch, "subjects": {}}
    all_ok = True
    for name, build_set in sets:
        if args.arch not in build_set.archs:
            archs = ", ".join(build_set.archs)
            raise UsageError(f"subject {name} builds its kernels for {archs}, not {args.arch} — pass one of those")
        if args.list:
            for b in build_set.builds(args.arch):
                if args.match is None or fnmatchcase(b.name, args.match):
                    print(f"{name}: {b.name}")
            continue
        source = args.expectations or build_set.expectations_name
        expectations = parse_expectations(_expectations_text(args.expectations, build_set), source, args.arch)
        # Set before anything imports the toolchain; spawned compile workers inherit it.
        os.environ.update(build_set.environment(args.arch))
        if why := build_set.missing():
            raise UsageError(why)
        builds = select_builds(build_set, args.arch, expectations, args.match, source)
        out = Path(args.out) if args.out else Path("k3gate-out") / f"kernels-{args.arch}-{stamp}"
        out_dir = out / name if len(sets) > 1 else out
        err.print(f"k3gate kernels build: subject {name}, --arch {args.arch}, expectations {source}, into {out_dir}")
        results = run_builds(builds, args.arch, out_dir, expectations, args.jobs, _print_result)
        ok = all(r.ok for r in results)
        all_ok &= ok
        report = {
            "subject": name,
            "arch": args.arch,
            "expectations": source,
            "ok": ok,
            "builds": [r.to_json() for r in results],
        }
        (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        failed = [r.build for r in results if not r.ok]
        line = f"{len(results) - len(failed)} of {len(results)} builds passed"
        if failed:
            line += f"; failed: {', '.join(failed[:3])}{' …' if len(failed) > 3 else ''}"
        verdict = "[green]PASSED[/]" if ok else "[red]FAILED[/]"
        err.print(f"{verdict}: {line}; report {out_dir / 'report.json'}")
        summary["subjects"][name] = report
    if args.json and not args.list:
        print(json.dumps(summary, indent=2))
    return int(ExitCode.PASSED if all_ok else ExitCode.FAILED)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="work with a subject's specialized kernels (compile and check them)")
    kinds = p.add_subparsers(dest="kernels_command", required=True, metavar="ACTION")
    b = kinds.add_parser(
        "build", help="compile every specialized kernel for an architecture (no GPU needed) and check PTX/SASS"
    )
    b.add_argument("--arch", required=True, help="target architecture, e.g. sm_90a")
    which = b.add_mutually_exclusive_group()
    which.add_argument("--subject", help="only this subject (default: every subject that declares kernels)")
    which.add_argument("--builds", help="a build set given as MODULE:ATTRIBUTE instead of a subject's (development)")
    b.add_argument("--out", help="folder for PTX, cubin, SASS and report.json (default: k3gate-out/kernels-<arch>-…)")
    b.add_argument("--expectations", help="check against this TOML instead of the subject's own expectations")
    b.add_argument("--match", help="only builds whose name matches this glob, e.g. 'attn_res/b1/*'")
    b.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default: 1)")
    b.add_argument("--list", action="store_true", help="list the builds and exit")
    b.add_argument("--json", action="store_true", help="print the report on stdout")
    b.set_defaults(fn=cmd_kernels_build)


def main(argv: list[str] | None = None) -> int:
    """Run the command without the rest of the CLI (tests; `python -m harness.kernels_cmd build ...`)."""
    parser = argparse.ArgumentParser(prog="k3gate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["kernels", *(argv if argv is not None else sys.argv[1:])])
    try:
        return args.fn(args)
    except UsageError as exc:
        from harness.cli import err

        err.print(f"k3gate: error: {exc}", soft_wrap=True, markup=False)
        return int(ExitCode.USAGE)


if __name__ == "__main__":
    sys.exit(main())
