"""compute-sanitizer (memcheck, racecheck, synccheck) over one small cell per stock and CuTe DSL kernel, JSON result.

    python -m suites.sanitize [--tool memcheck|racecheck|synccheck|all] [--out DIR] [--no-redteam]

Each tool runs `python -m suites.sanitize_child` under compute-sanitizer with only the planned kernels instrumented
(plan: suites/sanitize.toml), the tools in parallel on the one GPU. The sanitizer's log is split into error
reports and each report is attributed to the kernel it names. Per tool and kernel the result says: launched or
not (or not run, with the reason), errors found, the first messages; per tool the sanitizer's exit code and wall
time.

A plan names stock Triton kernels by their exact CUDA names and CuTe DSL kernels by a pattern: a substring of the
long name CuTe DSL generates (`kernel_patterns`). Both kinds are instrumented, attributed and required to launch
alike; a stock kernel's launch is seen by Triton's launch hook, a CuTe DSL kernel's by its device-side counter.

A tool's verdict: PASSED (every planned kernel launched, no error), FAILED (errors), ERROR (a cell raised, a
planned kernel never launched, a timeout, or a non-zero exit with nothing parsed), NOT_RUN (no CUDA device or no
compute-sanitizer; or the CuTe DSL kernels cannot run here, so their cells did not run while the rest was checked:
the reason names them). With memcheck, the deliberately out-of-bounds kernel of suites/sanitize_redteam.py runs
too: if memcheck misses it, the run FAILS (a setup that misses a known bug proves nothing by staying quiet). Exit
codes follow the gate: 0 passed, 1 failed, 2 usage, 3 not run or error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from harness import hardware

TOOLS = ("memcheck", "racecheck", "synccheck")
ERROR_EXIT = 86  # --error-exitcode: tells "the sanitizer found errors" apart from the child failing on its own
MAX_MESSAGES = 5
SCHEMA = "https://k3gate.dev/sanitize/v1"

# --- the plan ------------------------------------------------------------------------------------------------


RUNNERS = ("stock", "cute")
# A kernel pattern is matched as a substring of CUDA kernel names (compute-sanitizer's `kns=` filter, the reports'
# attribution): one identifier, so it cannot break the filter's `key=value,...` syntax (an ill-formed filter is
# ignored, see `_kernel_filter`) and reads the same to the sanitizer and to Python.
_PATTERN_SYNTAX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CELL_KEYS = {"op", "axes", "kernels", "kernel_patterns", "runner"}


@dataclass(frozen=True)
class Cell:
    op: str
    axes: tuple[tuple[str, Any], ...]
    kernels: tuple[str, ...]  # exact CUDA kernel names (stock Triton kernels)
    patterns: tuple[str, ...] = ()  # substrings of generated CUDA kernel names (CuTe DSL kernels)
    runner: str = "stock"  # "stock": a numerics case through the stock ops; "cute": the child calls a CuTe DSL op

    @property
    def names(self) -> tuple[str, ...]:
        """Every kernel this cell must launch: exact names, then patterns (the keys of every per-kernel result)."""
        return self.kernels + self.patterns


@dataclass(frozen=True)
class ToolPlan:
    env: dict[str, str]
    options: tuple[str, ...]
    filter: bool = True  # instrument only the planned kernels (see sanitize.toml for why racecheck cannot)
    ignore_kernels: tuple[str, ...] = ()  # regexes of non-stock kernels whose reports are listed, not counted
    ignore_reason: str = ""
    ignore_api_calls: tuple[str, ...] = ()  # regexes of driver calls whose API-error reports are listed, not counted
    ignore_api_reason: str = ""


@dataclass(frozen=True)
class Plan:
    model: str
    tp: int
    seed: int
    cells: tuple[Cell, ...]
    tools: dict[str, ToolPlan]
    redteam_kernel: str
    redteam_tool: str

    @property
    def kernels(self) -> tuple[str, ...]:
        """Every planned kernel, exact names and patterns, in plan order."""
        return tuple(k for c in self.cells for k in c.names)

    @property
    def patterns(self) -> frozenset[str]:
        """The planned kernels named by a substring of their CUDA names."""
        return frozenset(p for c in self.cells for p in c.patterns)

    @property
    def cute_kernels(self) -> frozenset[str]:
        """The kernels of CuTe DSL cells: the only ones whose cells may be NOT_RUN (where CuTe DSL cannot run)."""
        return frozenset(k for c in self.cells if c.runner == "cute" for k in c.names)


def _axis(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # hashable, like every other field of a Cell


def _cell(c: dict[str, Any]) -> Cell:
    where = f"sanitize.toml: cell {c.get('op', '?')!r}"
    unknown = sorted(set(c) - _CELL_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; use {', '.join(sorted(_CELL_KEYS))}")
    cell = Cell(
        c["op"],
        tuple(sorted((k, _axis(v)) for k, v in c["axes"].items())),
        tuple(c.get("kernels", [])),
        tuple(c.get("kernel_patterns", [])),
        c.get("runner", "stock"),
    )
    if cell.runner not in RUNNERS:
        raise ValueError(f"{where}: runner {cell.runner!r} is not one of {', '.join(RUNNERS)}")
    if not cell.names:
        raise ValueError(f"{where}: names no kernel; list `kernels` (exact names) or `kernel_patterns`")
    bad = [p for p in cell.patterns if not _PATTERN_SYNTAX.fullmatch(p)]
    if bad:
        raise ValueError(f"{where}: kernel pattern(s) {bad} must be one identifier ([A-Za-z_][A-Za-z0-9_]*)")
    if cell.runner == "cute" and (cell.kernels or len(cell.patterns) != 1):
        raise ValueError(
            f"{where}: a CuTe DSL cell names exactly one kernel, by `kernel_patterns`: its launches are read from "
            "that kernel's device counter, and CuTe DSL generates its CUDA name"
        )
    return cell


def _check_names(cells: Sequence[Cell], redteam: str) -> None:
    """Every planned kernel once; no pattern inside another planned name (a report or a launch naming one kernel
    would be attributed to two, and the sanitizer would instrument a kernel under the wrong name)."""
    names = [k for c in cells for k in c.names]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"sanitize.toml: kernel(s) {repeated} planned twice; each kernel belongs to one cell")
    for pattern in (p for c in cells for p in c.patterns):
        inside = [n for n in [*names, redteam] if n != pattern and pattern in n]
        if inside:
            raise ValueError(
                f"sanitize.toml: kernel pattern {pattern!r} also matches {inside}; make it specific to its kernel"
            )


def load_plan(text: str | None = None) -> Plan:
    raw = tomllib.loads(text if text is not None else resources.files("suites").joinpath("sanitize.toml").read_text())
    cells = tuple(_cell(c) for c in raw["cells"])
    ops = [c.op for c in cells]
    if len(set(ops)) != len(ops):
        raise ValueError(f"sanitize.toml: op(s) {sorted({o for o in ops if ops.count(o) > 1})} have two cells")
    _check_names(cells, raw["redteam"]["kernel"])
    tools = {
        name: ToolPlan(
            dict(t.get("env", {})),
            tuple(t.get("options", [])),
            bool(t.get("filter", True)),
            tuple(t.get("ignore_kernels", [])),
            t.get("ignore_reason", ""),
            tuple(t.get("ignore_api_calls", [])),
            t.get("ignore_api_reason", ""),
        )
        for name, t in raw["tools"].items()
    }
    for name, t in tools.items():
        if t.ignore_kernels and not t.ignore_reason:
            raise ValueError(f"sanitize.toml: [tools.{name}] ignores kernels without an ignore_reason; say why")
        if t.ignore_api_calls and not t.ignore_api_reason:
            raise ValueError(f"sanitize.toml: [tools.{name}] ignores API calls without an ignore_api_reason; say why")
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        raise ValueError(f"sanitize.toml: unknown tool(s) {unknown}; use {', '.join(TOOLS)}")
    return Plan(raw["model"], raw["tp"], raw["seed"], cells, tools, raw["redteam"]["kernel"], raw["redteam"]["tool"])


# --- parsing the sanitizer's log ---------------------------------------------------------------------------------

_PREFIX = "========= "
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
# Header lines that open no error report: the banner, summaries, and the host-side echo of a device fault.
_AT_KERNEL = re.compile(r"\bat (?:0x[0-9a-f]+ in )?([A-Za-z_][\w:<>, ]*?)\+0x[0-9a-f]+")
_NOT_A_REPORT = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application")
_API_CALL = re.compile(r"on CUDA API call to (\w+)")


@dataclass
class Parsed:
    reports: list[str] = field(default_factory=list)  # one per error report, its lines joined
    host_errors: list[str] = field(default_factory=list)  # "Program hit cudaError..." echoes of device faults
    summary_errors: int | None = None
    warnings: int = 0

    def api_errors(self, calls: Collection[str]) -> tuple[dict[str, int], list[str]]:
        """The host-side API-error reports on driver/runtime calls matching a regex of `calls`, counted per call,
        and the host errors left."""
        ignored: dict[str, int] = {}
        left: list[str] = []
        for line in self.host_errors:
            m = _API_CALL.search(line)
            if m and any(re.search(c, m.group(1)) for c in calls):
                ignored[m.group(1)] = ignored.get(m.group(1), 0) + 1
            else:
                left.append(line)
        return ignored, left

    def by_kernel(
        self, names: Sequence[str], patterns: Collection[str] = ()
    ) -> tuple[dict[str, list[str]], dict[str, list[str]], list[str]]:
        """Reports per planned kernel (the first one a report names), per other kernel a report names at its
        faulting instruction (`at <kernel>+0x...`: cuBLAS, torch), and the reports naming no kernel.

        A name in `patterns` is found anywhere inside a kernel name (CuTe DSL's generated names are one long
        identifier, e.g. kernel_cutlass_kernel_k3_decodekernelsattn_resAttnResKernel_object_at__tensorptr...);
        any other name only as a whole word."""
        found: dict[str, list[str]] = {n: [] for n in names}
        others: dict[str, list[str]] = {}
        unattributed: list[str] = []
        finder = _name_finder(names, patterns)
        for report in self.reports:
            if finder is not None and (m := finder.search(report)):
                found[m.group(m.lastgroup or 0)].append(report)
            elif m := _AT_KERNEL.search(report):
                others.setdefault(m.group(1), []).append(report)
            else:
                unattributed.append(report)
        return found, others, unattributed


def _name_finder(names: Sequence[str], patterns: Collection[str]) -> re.Pattern[str] | None:
    """One regex finding the leftmost planned name in a text: exact names as whole words, patterns anywhere."""

    def alternatives(group: Sequence[str]) -> str:
        return "|".join(re.escape(n) for n in sorted(group, key=len, reverse=True))

    exact = [n for n in names if n not in patterns]
    within = [n for n in names if n in patterns]
    parts = ([rf"\b(?P<exact>{alternatives(exact)})\b"] if exact else []) + (
        [f"(?P<pattern>{alternatives(within)})"] if within else []
    )
    return re.compile("|".join(parts)) if parts else None


def parse_log(text: str) -> Parsed:
    """Split compute-sanitizer output into error reports (memcheck, racecheck and synccheck share the layout: a
    header line after the prefix, then indented detail lines)."""
    out = Parsed()
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith(_PREFIX):
            current = None if line.strip() else current
            continue
        body = line[len(_PREFIX) :]
        if m := _SUMMARY.search(body):
            out.summary_errors = int(m.group(1))
        if m := _RACE_SUMMARY.search(body):
            out.summary_errors, out.warnings = int(m.group(1)), int(m.group(2))
        if body.startswith(" "):
            if current is not None:
                current.append(body.strip())
            continue
        current = None
        if not body.strip() or body.startswith(_NOT_A_REPORT):
            continue
        if body.startswith("Program hit"):
            out.host_errors.append(body.strip())
            continue
        if body.startswith("Warning"):
            continue  # racecheck warnings are counted from its summary, not reported as errors
        current = [body.strip()]
        blocks.append(current)
    out.reports = ["\n".join(b) for b in blocks]
    return out


# --- running one tool ------------------------------------------------------------------------------------------


@dataclass
class KernelResult:
    launched: bool
    errors: int
    messages: list[str]
    not_run: str = ""  # why its cell did not run (CuTe DSL kernels where they cannot run); "" when it ran


@dataclass
class ToolResult:
    tool: str
    status: str  # PASSED | FAILED | ERROR | NOT_RUN
    reason: str
    exit_code: int | None = None
    wall_s: float = 0.0
    errors: int = 0
    unattributed_errors: int = 0
    warnings: int = 0
    kernels: dict[str, KernelResult] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)  # planned kernels whose cells did not run: the reason
    other_kernels: dict[str, int] = field(default_factory=dict)  # errors in kernels outside the plan (cuBLAS, torch)
    ignored_kernels: dict[str, int] = field(default_factory=dict)  # reports listed but not counted (see the plan)
    ignore_reason: str = ""
    ignored_api_errors: dict[str, int] = field(default_factory=dict)  # API-error reports per call, not counted
    ignore_api_reason: str = ""
    cells: dict[str, Any] = field(default_factory=dict)
    host_errors: list[str] = field(default_factory=list)
    log: str = ""


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, under $CUDA_HOME, or in the usual toolkit folders."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    roots += sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True)
    for root in roots:
        if root and (p := Path(root, "bin", "compute-sanitizer")).is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def _kernel_filter(names: Sequence[str], patterns: Collection[str] = ()) -> list[str]:
    """Instrument only these kernels: the rest of the process runs at full speed. Exact names go into one anchored
    regex, each pattern into a substring filter of its own.

    NVIDIA Compute Sanitizer user manual, "Specifying Filters" (docs.nvidia.com/compute-sanitizer/ComputeSanitizer/
    index.html#specifying-filters): `--kernel-name` may be given several times and a kernel satisfying any filter is
    checked; its keys are `kernel_name`/`kne` (the complete mangled name), `kernel_substring`/`kns` (any substring
    of the mangled name) and `regex` (searched in the mangled name, so it is anchored here for exact names); a
    filter incorrectly specified in any component is ignored entirely, which is why load_plan allows a pattern to be
    one identifier only. Triton's and CuTe DSL's kernels are plain C identifiers (no C++ mangling: CuTe DSL's PTX
    entry is e.g. kernel_cutlass_kernel_k3_decodekernelskda_in_projKdaInProjKernel_object_at__tensorptrbf16...), so
    the mangled name is the name the reports print and the launch records use.
    """
    exact = [n for n in names if n not in patterns]
    flags = ["--kernel-name", "regex=^(" + "|".join(re.escape(n) for n in exact) + ")$"] if exact else []
    for pattern in (n for n in names if n in patterns):
        flags += ["--kernel-name", f"kns={pattern}"]
    return flags


def targets(plan: Plan, redteam: bool = False, cells: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(the kernels a run checks, the child's arguments that select them): the red team's kernel, the kernels of
    the cells named (ops of the plan), or every planned kernel."""
    if redteam:
        return [plan.redteam_kernel], ["--redteam"]
    unknown = sorted(set(cells) - {c.op for c in plan.cells})
    if unknown:
        raise ValueError(f"no cell(s) {unknown} in the plan; choose from {', '.join(c.op for c in plan.cells)}")
    chosen = [c for c in plan.cells if not cells or c.op in cells]
    return [k for c in chosen for k in c.names], (["--cells", ",".join(c.op for c in chosen)] if cells else [])


def command(sanitizer: str, tool: str, plan: Plan, report: Path, redteam: bool, cells: Sequence[str] = ()) -> list[str]:
    names, selection = targets(plan, redteam, cells)
    child = [sys.executable, "-m", "suites.sanitize_child", "--report", str(report), *selection]
    return [
        sanitizer,
        "--tool",
        tool,
        "--error-exitcode",
        str(ERROR_EXIT),
        *(_kernel_filter(names, plan.patterns) if plan.tools[tool].filter else []),
        *plan.tools[tool].options,
        *child,
    ]


def judge(
    tool: str,
    exit_code: int | None,
    log: str,
    child: dict[str, Any] | None,
    expected: Sequence[str],
    plan: ToolPlan | None = None,
    patterns: Collection[str] = (),
    may_not_run: Collection[str] = (),
) -> ToolResult:
    """A tool's result from its exit code, its log and the child's report (None: the child wrote none).

    `patterns`: the expected names matched as substrings of CUDA kernel names (CuTe DSL kernels). `may_not_run`:
    the expected kernels whose cells the child may report not run, with a reason (the CuTe DSL cells, where those
    kernels cannot run); the child saying so of any other kernel is ignored, so that kernel counts as never
    launched."""
    plan = plan or ToolPlan({}, ())
    parsed = parse_log(log)
    per_kernel, others, unattributed = parsed.by_kernel(expected, patterns)
    ignored = {k: v for k, v in others.items() if any(re.search(p, k) for p in plan.ignore_kernels)}
    others = {k: v for k, v in others.items() if k not in ignored}
    launched = set(child["launched"]) if child else set()
    said = (child or {}).get("not_run", {})
    not_run = {n: str(said[n]) for n in expected if n in said and n in may_not_run and n not in launched}
    kernels = {
        n: KernelResult(n in launched, len(per_kernel[n]), per_kernel[n][:MAX_MESSAGES], not_run.get(n, ""))
        for n in expected
    }
    attributed = sum(k.errors for k in kernels.values()) + sum(len(v) for v in others.values())
    ignored_api, host_errors = parsed.api_errors(plan.ignore_api_calls)
    # Errors the summary counts beyond the reports parsed (a print limit, API errors) count too, as unattributed;
    # the summary counts the API errors the plan ignores, so they come off.
    unparsed = max(0, (parsed.summary_errors or 0) - len(parsed.reports) - sum(ignored_api.values()))
    total = attributed + len(unattributed) + unparsed
    result = ToolResult(
        tool,
        "PASSED",
        "",
        exit_code=exit_code,
        errors=total,
        unattributed_errors=total - attributed,
        warnings=parsed.warnings,
        kernels=kernels,
        not_run=not_run,
        other_kernels={k: len(v) for k, v in others.items()},
        ignored_kernels={k: len(v) for k, v in ignored.items()},
        ignore_reason=plan.ignore_reason if ignored else "",
        ignored_api_errors=ignored_api,
        ignore_api_reason=plan.ignore_api_reason if ignored_api else "",
        cells=(child or {}).get("cells", {}),
        host_errors=host_errors[:MAX_MESSAGES],
    )
    failed_cells = [f"{op}: {c['error']}" for op, c in result.cells.items() if c["status"] not in ("ok", "not_run")]
    missing = [n for n, k in kernels.items() if not k.launched and not k.not_run]
    ran = len(kernels) - len(not_run)
    # The verdict, most serious first. Errors found are FAILED even when part of the plan did not run: they are
    # findings about what did run. A cell that raised or a planned kernel that never launched is ERROR. A plan whose
    # CuTe DSL cells could not run here, the rest launched and clean, is NOT_RUN, not PASSED: PASSED says every
    # planned kernel was checked clean, and "clean" about a kernel that was not checked proves nothing. It is the
    # gate's rule for a required stage that did not run (incomplete, exit 3, never green); the reason still says
    # how many kernels were checked, and the JSON lists each kernel not run with its reason.
    if total:
        where = ", ".join(f"{n} ({k.errors})" for n, k in kernels.items() if k.errors)
        where += "".join(f", {n} ({c}, not a planned kernel)" for n, c in result.other_kernels.items())
        where += (
            f"{', ' if where else ''}unattributed ({result.unattributed_errors})" if result.unattributed_errors else ""
        )
        result.status, result.reason = "FAILED", f"{tool}: {total} error(s): {where.removeprefix(', ')}"
    elif child is None:
        result.status = "ERROR"
        result.reason = f"{tool}: the child wrote no report (exit code {exit_code}); see the log's last lines"
    elif failed_cells:
        result.status, result.reason = "ERROR", f"{tool}: a cell raised: {failed_cells[0]}"
    elif missing:
        result.status = "ERROR"
        result.reason = (
            f"{tool}: planned kernels never launched: {', '.join(missing)} (a clean result would prove nothing)"
        )
    elif exit_code not in (0, ERROR_EXIT if ignored or ignored_api else 0):
        result.status, result.reason = "ERROR", f"{tool}: exit code {exit_code} with no error reported"
    elif not_run:
        result.status = "NOT_RUN"
        unchecked = _not_run_text(not_run)
        result.reason = f"{tool}: {ran} kernel(s) launched, no errors; not run, so not checked: {unchecked}"
    else:
        result.reason = f"{tool}: {len(kernels)} kernel(s) launched, no errors"
    return result


def _not_run_text(not_run: dict[str, str]) -> str:
    """`a, b (reason); c (other reason)`: kernels grouped by the reason they did not run."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in not_run.items():
        by_reason.setdefault(reason, []).append(name)
    return "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())


def run_tool(
    sanitizer: str,
    tool: str,
    plan: Plan,
    out: Path,
    timeout: float,
    redteam: bool = False,
    cells: Sequence[str] = (),
) -> ToolResult:
    """One tool over the plan (or only `cells`, ops of the plan; or the red team), judged."""
    label = f"{tool}-redteam" if redteam else "-".join([tool, *cells])
    report, log_path = out / f"{label}.child.json", out / f"{label}.log"
    report.unlink(missing_ok=True)
    env = {**os.environ, **plan.tools[tool].env, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            command(sanitizer, tool, plan, report, redteam, cells),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        exit_code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        exit_code = None
        log = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    wall = time.monotonic() - start
    log_path.write_text(log)
    child = json.loads(report.read_text()) if report.is_file() else None
    expected, _ = targets(plan, redteam, cells)
    result = judge(label, exit_code, log, child, expected, plan.tools[tool], plan.patterns, plan.cute_kernels)
    result.wall_s, result.log = round(wall, 1), log_path.name
    if exit_code is None:
        result.status, result.reason = "ERROR", f"{label}: timed out after {timeout:.0f} s; raise --timeout"
    return result


# --- the whole run -----------------------------------------------------------------------------------------------


def _environment(sanitizer: str | None) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "commit": os.environ.get("K3GATE_COMMIT", "")}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
            env["driver"] = hardware.detect().driver or "unknown (nvidia-smi gave none)"
    except ImportError:
        env["torch"] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        from k3_decode.kernels.providers import not_built_reason

        # What this process sees; the child decides for itself, under the sanitizer, and its cells say so.
        env["cute_dsl_kernels"] = not_built_reason() or "can run"
    except ImportError as exc:
        env["cute_dsl_kernels"] = f"unknown ({exc})"
    if sanitizer:
        version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, check=False).stdout
        env["compute_sanitizer"] = version.strip().splitlines()[-1] if version.strip() else ""
    if not env["commit"]:
        git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
        env["commit"] = git.stdout.strip() if git.returncode == 0 else "unknown"
    return env


def why_not_run(sanitizer: str | None) -> str | None:
    """The reason the sanitizer cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: install the k3 extra (pip install -e '.[k3]')"
    if not torch.cuda.is_available():
        return "no CUDA device: run it on the GPU machine"
    if sanitizer is None:
        return "compute-sanitizer not found on PATH, $CUDA_HOME/bin or /usr/local/cuda*/bin: install the CUDA toolkit"
    return None


def overall(results: Sequence[ToolResult]) -> str:
    statuses = {r.status for r in results}
    for status in ("FAILED", "ERROR", "NOT_RUN"):
        if status in statuses:
            return status
    return "PASSED"


def summarize(plan: Plan, tool_results: Sequence[ToolResult], red: ToolResult | None = None) -> dict[str, Any]:
    """The run's status, reason and kernels not run, from the tools' results and the red team's (None: not run)."""
    status = overall(tool_results)
    reasons = [r.reason for r in tool_results if r.status != "PASSED"]
    not_run: dict[str, str] = {}
    for r in tool_results:
        not_run |= r.not_run
    if reasons and all(r.status == "PASSED" or (r.status == "NOT_RUN" and r.not_run) for r in tool_results):
        # Only cells that could not run keep it from PASSED: one line that says what was checked and what was not.
        names = ", ".join(r.tool for r in tool_results)
        reasons = [
            f"{len(plan.kernels) - len(not_run)} of {len(plan.kernels)} planned kernels launched with no errors under "
            f"{names}; not run, so not checked: {_not_run_text(not_run)}. A partly checked plan is not a pass"
        ]
    out: dict[str, Any] = {}
    if red is not None:
        caught = red.kernels[plan.redteam_kernel].errors > 0
        out["redteam"] = {**asdict(red), "caught": caught}
        if not caught:
            status = "FAILED"
            reasons.insert(
                0, f"{plan.redteam_tool} missed the out-of-bounds red-team kernel: its clean runs prove nothing"
            )
    out["status"] = status
    out["reason"] = (
        "; ".join(reasons) if reasons else f"{len(tool_results)} tool(s) clean over {len(plan.kernels)} kernels"
    )
    out["not_run"] = not_run
    return out


def run(tools: Sequence[str], out: Path, timeout: float, redteam: bool = True, jobs: int = 4) -> dict[str, Any]:
    plan = load_plan()
    out.mkdir(parents=True, exist_ok=True)
    sanitizer = find_sanitizer()
    reason = why_not_run(sanitizer)
    result: dict[str, Any] = {
        "$schema": SCHEMA,
        "plan": {
            "model": plan.model,
            "tp": plan.tp,
            "tools": list(tools),
            "kernels": list(plan.kernels),
            "kernel_patterns": sorted(plan.patterns),  # matched as substrings of CUDA kernel names
            "cute_kernels": sorted(plan.cute_kernels),  # NOT_RUN, with the reason, where CuTe DSL cannot run
        },
    }
    result["environment"] = _environment(sanitizer if reason is None else None)
    if reason is not None:
        skipped = [ToolResult(t, "NOT_RUN", reason) for t in tools]
        result |= {"status": "NOT_RUN", "reason": reason, "tools": {r.tool: asdict(r) for r in skipped}}
        return result
    assert sanitizer is not None
    jobs_list: list[tuple[str, bool]] = [(t, False) for t in tools]
    if redteam and plan.redteam_tool in tools:
        jobs_list.append((plan.redteam_tool, True))
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(run_tool, sanitizer, t, plan, out, timeout, rt) for t, rt in jobs_list]
        results = [f.result() for f in futures]
    tool_results = [r for r, (_, rt) in zip(results, jobs_list, strict=True) if not rt]
    result["tools"] = {r.tool: asdict(r) for r in tool_results}
    red = next((r for r, (_, rt) in zip(results, jobs_list, strict=True) if rt), None)
    result |= summarize(plan, tool_results, red)
    result["wall_s"] = round(time.monotonic() - start, 1)
    return result


EXIT = {"PASSED": 0, "FAILED": 1, "ERROR": 3, "NOT_RUN": 3}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool", default="all", choices=[*TOOLS, "all"])
    p.add_argument(
        "--out", type=Path, default=Path("k3gate-out/sanitize"), help="folder for sanitize.json and the logs"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per tool run")
    p.add_argument("--no-redteam", action="store_true", help="skip the out-of-bounds kernel memcheck must flag")
    p.add_argument("--jobs", type=int, default=4, help="sanitizer processes at once on the GPU")


def _run_args(args: argparse.Namespace) -> int:
    tools = list(TOOLS) if args.tool == "all" else [args.tool]
    result = run(tools, args.out, args.timeout, redteam=not args.no_redteam, jobs=args.jobs)
    path = args.out / "sanitize.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['status']}: {result['reason']} ({path})")
    return EXIT[result["status"]]


def register(sub: argparse._SubParsersAction) -> None:
    """`k3gate sanitize`, for harness/cli.py's EXTRA_COMMANDS (the same as `python -m suites.sanitize`)."""
    p = sub.add_parser("sanitize", help="compute-sanitizer over one cell per stock and CuTe DSL kernel (GPU machine)")
    _add_arguments(p)
    p.set_defaults(fn=_run_args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m suites.sanitize", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    return _run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
