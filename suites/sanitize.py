"""compute-sanitizer (memcheck, racecheck, synccheck) over one small cell per stock kernel, with a JSON result.

    python -m suites.sanitize [--tool memcheck|racecheck|synccheck|all] [--out DIR] [--no-redteam]

Each tool runs `python -m suites.sanitize_child` under compute-sanitizer with only the stock kernels instrumented
(plan: suites/sanitize.toml), the tools in parallel on the one GPU. The sanitizer's log is split into error
reports and each report is attributed to the kernel it names. Per tool and kernel the result says: launched or
not, errors found, the first messages; per tool the sanitizer's exit code and wall time.

A tool's verdict: PASSED (every planned kernel launched, no error), FAILED (errors), ERROR (a cell raised, a
planned kernel never launched, a timeout, or a non-zero exit with nothing parsed), NOT_RUN (no CUDA device or no
compute-sanitizer, with the reason). With memcheck, the deliberately out-of-bounds kernel of
suites/sanitize_redteam.py runs too: if memcheck misses it, the run FAILS (a setup that misses a known bug proves
nothing by staying quiet). Exit codes follow the gate: 0 passed, 1 failed, 2 usage, 3 not run or error.
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

TOOLS = ("memcheck", "racecheck", "synccheck")
ERROR_EXIT = 86  # --error-exitcode: tells "the sanitizer found errors" apart from the child failing on its own
MAX_MESSAGES = 5
SCHEMA = "https://k3gate.dev/sanitize/v1"

# --- the plan ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    op: str
    axes: tuple[tuple[str, Any], ...]
    kernels: tuple[str, ...]


@dataclass(frozen=True)
class ToolPlan:
    env: dict[str, str]
    options: tuple[str, ...]
    filter: bool = True  # instrument only the planned kernels (see sanitize.toml for why racecheck cannot)
    ignore_kernels: tuple[str, ...] = ()  # regexes of non-stock kernels whose reports are listed, not counted
    ignore_reason: str = ""


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
        return tuple(k for c in self.cells for k in c.kernels)


def load_plan(text: str | None = None) -> Plan:
    raw = tomllib.loads(text if text is not None else resources.files("suites").joinpath("sanitize.toml").read_text())
    cells = tuple(Cell(c["op"], tuple(sorted(c["axes"].items())), tuple(c["kernels"])) for c in raw["cells"])
    tools = {
        name: ToolPlan(
            dict(t.get("env", {})),
            tuple(t.get("options", [])),
            bool(t.get("filter", True)),
            tuple(t.get("ignore_kernels", [])),
            t.get("ignore_reason", ""),
        )
        for name, t in raw["tools"].items()
    }
    for name, t in tools.items():
        if t.ignore_kernels and not t.ignore_reason:
            raise ValueError(f"sanitize.toml: [tools.{name}] ignores kernels without an ignore_reason; say why")
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


@dataclass
class Parsed:
    reports: list[str] = field(default_factory=list)  # one per error report, its lines joined
    host_errors: list[str] = field(default_factory=list)  # "Program hit cudaError..." echoes of device faults
    summary_errors: int | None = None
    warnings: int = 0

    def by_kernel(self, names: Sequence[str]) -> tuple[dict[str, list[str]], dict[str, list[str]], list[str]]:
        """Reports per planned kernel (the first one a report names), per other kernel a report names at its
        faulting instruction (`at <kernel>+0x...`: cuBLAS, torch), and the reports naming no kernel."""
        found: dict[str, list[str]] = {n: [] for n in names}
        others: dict[str, list[str]] = {}
        unattributed: list[str] = []
        pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b")
        for report in self.reports:
            if m := pattern.search(report):
                found[m.group(1)].append(report)
            elif m := _AT_KERNEL.search(report):
                others.setdefault(m.group(1), []).append(report)
            else:
                unattributed.append(report)
        return found, others, unattributed


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
    other_kernels: dict[str, int] = field(default_factory=dict)  # errors in kernels outside the plan (cuBLAS, torch)
    ignored_kernels: dict[str, int] = field(default_factory=dict)  # reports listed but not counted (see the plan)
    ignore_reason: str = ""
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


def _kernel_filter(names: Sequence[str]) -> list[str]:
    """Instrument only these kernels (exact names, one regex): the rest of the process runs at full speed."""
    return ["--kernel-name", "regex=^(" + "|".join(re.escape(n) for n in names) + ")$"]


def command(sanitizer: str, tool: str, plan: Plan, report: Path, redteam: bool) -> list[str]:
    names = [plan.redteam_kernel] if redteam else list(plan.kernels)
    child = [sys.executable, "-m", "suites.sanitize_child", "--report", str(report)]
    return [
        sanitizer,
        "--tool",
        tool,
        "--error-exitcode",
        str(ERROR_EXIT),
        *(_kernel_filter(names) if plan.tools[tool].filter else []),
        *plan.tools[tool].options,
        *child,
        *(["--redteam"] if redteam else []),
    ]


def judge(
    tool: str,
    exit_code: int | None,
    log: str,
    child: dict[str, Any] | None,
    expected: Sequence[str],
    plan: ToolPlan | None = None,
) -> ToolResult:
    """A tool's result from its exit code, its log and the child's report (None: the child wrote none)."""
    plan = plan or ToolPlan({}, ())
    parsed = parse_log(log)
    per_kernel, others, unattributed = parsed.by_kernel(expected)
    ignored = {k: v for k, v in others.items() if any(re.search(p, k) for p in plan.ignore_kernels)}
    others = {k: v for k, v in others.items() if k not in ignored}
    launched = set(child["launched"]) if child else set()
    kernels = {n: KernelResult(n in launched, len(per_kernel[n]), per_kernel[n][:MAX_MESSAGES]) for n in expected}
    attributed = sum(k.errors for k in kernels.values()) + sum(len(v) for v in others.values())
    # Errors the summary counts beyond the reports parsed (a print limit) count too, as unattributed.
    unparsed = max(0, (parsed.summary_errors or 0) - len(parsed.reports))
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
        other_kernels={k: len(v) for k, v in others.items()},
        ignored_kernels={k: len(v) for k, v in ignored.items()},
        ignore_reason=plan.ignore_reason if ignored else "",
        cells=(child or {}).get("cells", {}),
        host_errors=parsed.host_errors[:MAX_MESSAGES],
    )
    failed_cells = [f"{op}: {c['error']}" for op, c in result.cells.items() if c["status"] != "ok"]
    missing = [n for n, k in kernels.items() if not k.launched]
    if total:
        where = ", ".join(f"{n} ({k.errors})" for n, k in kernels.items() if k.errors)
        where += "".join(f", {n} ({c}, not a stock kernel)" for n, c in result.other_kernels.items())
        where += (
            f"{', ' if where else ''}unattributed ({result.unattributed_errors})" if result.unattributed_errors else ""
        )
        result.status, result.reason = "FAILED", f"{tool}: {total} error(s): {where}"
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
    elif exit_code not in (0, ERROR_EXIT if ignored else 0):
        result.status, result.reason = "ERROR", f"{tool}: exit code {exit_code} with no error reported"
    else:
        result.reason = f"{tool}: {len(kernels)} kernel(s) launched, no errors"
    return result


def run_tool(sanitizer: str, tool: str, plan: Plan, out: Path, timeout: float, redteam: bool = False) -> ToolResult:
    label = f"{tool}-redteam" if redteam else tool
    report, log_path = out / f"{label}.child.json", out / f"{label}.log"
    report.unlink(missing_ok=True)
    env = {**os.environ, **plan.tools[tool].env, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            command(sanitizer, tool, plan, report, redteam),
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
    expected = [plan.redteam_kernel] if redteam else list(plan.kernels)
    result = judge(label, exit_code, log, child, expected, plan.tools[tool])
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
    except ImportError:
        env["torch"] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
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


def run(tools: Sequence[str], out: Path, timeout: float, redteam: bool = True, jobs: int = 4) -> dict[str, Any]:
    plan = load_plan()
    out.mkdir(parents=True, exist_ok=True)
    sanitizer = find_sanitizer()
    reason = why_not_run(sanitizer)
    result: dict[str, Any] = {"$schema": SCHEMA, "plan": {"model": plan.model, "tp": plan.tp, "tools": list(tools)}}
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
    status = overall(tool_results)
    reasons = [r.reason for r in tool_results if r.status != "PASSED"]
    red = next((r for r, (_, rt) in zip(results, jobs_list, strict=True) if rt), None)
    if red is not None:
        caught = red.kernels[plan.redteam_kernel].errors > 0
        result["redteam"] = {**asdict(red), "caught": caught}
        if not caught:
            status = "FAILED"
            reasons.insert(
                0, f"{plan.redteam_tool} missed the out-of-bounds red-team kernel: its clean runs prove nothing"
            )
    result["status"] = status
    result["reason"] = (
        "; ".join(reasons) if reasons else f"{len(tool_results)} tool(s) clean over {len(plan.kernels)} kernels"
    )
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
    p = sub.add_parser("sanitize", help="compute-sanitizer over one cell per stock kernel (GPU machine)")
    _add_arguments(p)
    p.set_defaults(fn=_run_args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m suites.sanitize", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    return _run_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
