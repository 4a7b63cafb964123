"""The runtime half of the isolation stage: what a subject's runtime isolation suite hands the gate, and the checks,
evidence and fallback timeline the gate makes of it.

The subject runs its own code (executor, providers, write-set audit) and reports through this small protocol: checks
that ran, checks that could not run here (each with its reason, never a pass), and per run (one executor) its
dispatch ledger and what each step wrote. The ledger's record fields (step, layer, op, path, reason, mode, graph,
replays) are the design's dispatch-ledger contract, not a model's facts, so the gate can lay them out as a timeline
for any subject: when the specialized path was chosen, what the step wrote, where and why execution returned to
stock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from harness.verdicts import Check, StageRecords

ProgressFn = Callable[[str, float | None], None]
PREFIX = "runtime: "
TIMELINE_TITLE = "Fallback timeline"


@dataclass(frozen=True)
class NotRun:
    """A check that could not run here, and why (shown in the report; never counted as a pass)."""

    name: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class StepWrites:
    """What one audited step wrote: its declared write set, and what the audit found outside it."""

    step: int  # the ledger's step number (for a graph step, the step its graph was captured at)
    graph: str | None  # the graph a replay ran, None for an eager step
    cell: str  # the suite cell the step belongs to
    wrote: str


@dataclass
class RunEvidence:
    """One executor's run: its dispatch ledger as JSON (records, replays, expectations, summary) and its steps."""

    name: str
    ledger: dict[str, Any]
    steps: list[StepWrites] = field(default_factory=list)
    cells: dict[int, str] = field(default_factory=dict)  # ledger step -> the cell it belongs to (captures included)


@dataclass
class RuntimeEvidence:
    checks: list[Check]
    not_run: list[NotRun]
    runs: list[RunEvidence]
    metrics: dict[str, Any] = field(default_factory=dict)
    # Why nothing could run here at all (e.g. the config's GPU is absent); the stage cannot pass on the static half.
    unavailable: str = ""


class RuntimeSuite(Protocol):
    def run(self, progress: ProgressFn) -> RuntimeEvidence:
        """Run every cell on this machine and report; a crash is the stage's ERROR, never a pass."""
        ...


# -- the fallback timeline --------------------------------------------------------------------------------------


def _ranges(values: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _where(records: Sequence[dict[str, Any]]) -> str:
    """'layers 4-6: attn_res, in_proj, kda, o_proj; layer 7: attn_res' for the records of one timeline row."""
    ops_of: dict[int, list[str]] = {}
    for r in records:
        ops = ops_of.setdefault(r["layer"], [])
        if r["op"] not in ops:
            ops.append(r["op"])
    by_ops: dict[tuple[str, ...], list[int]] = {}
    for layer, ops in ops_of.items():
        by_ops.setdefault(tuple(ops), []).append(layer)
    parts = []
    for ops, layers in by_ops.items():
        noun = "layer" if len(layers) == 1 else "layers"
        parts.append(f"{noun} {_ranges(layers)}: {', '.join(ops)}")
    return "; ".join(parts)


def _mode(graph: str | None, replays: dict[str, int]) -> str:
    if graph is None:
        return "eager"
    n = replays.get(graph, 0)
    return f"graph {graph}: {n} replay{'s' if n != 1 else ''}" if n else f"graph {graph}: captured, never replayed"


def timeline(run: RunEvidence) -> list[dict[str, Any]]:
    """Rows in step order; within a step, one row per (path, reason) in the order the layers met them."""
    records = run.ledger.get("records", [])
    replays = run.ledger.get("replays", {})
    steps: dict[tuple[int, str | None], list[dict[str, Any]]] = {}
    for r in records:
        steps.setdefault((r["step"], r.get("graph")), []).append(r)
    wrote: dict[tuple[int, str | None], list[StepWrites]] = {}
    for w in run.steps:
        # A graph's records sit at its capture step; every replay of it is one of its steps.
        wrote.setdefault((w.step, None) if w.graph is None else (-1, w.graph), []).append(w)
    rows: list[dict[str, Any]] = []
    previous_specialized = False
    for (step, graph), recs in sorted(steps.items(), key=lambda kv: kv[0][0]):
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        # The specialized decisions of a step first, then where (and why) execution stayed on or returned to stock.
        for r in sorted(recs, key=lambda r: r["path"] != "specialized"):
            groups.setdefault((r["path"], r["reason"]), []).append(r)
        any_specialized = any(path == "specialized" for path, _ in groups)
        writes = wrote.get((step, None) if graph is None else (-1, graph), [])
        for i, ((path, reason), group) in enumerate(groups.items()):
            if path == "specialized":
                event = "specialized path chosen"
            elif any_specialized:
                event = "returns to stock within the step"
            elif previous_specialized:
                event = "returns to stock"
            else:
                event = "stock"
            rows.append(
                {
                    "step": step,
                    "cell": run.cells.get(step, ", ".join(sorted({w.cell for w in writes}))),
                    "mode": _mode(graph, replays),
                    "path": path,
                    "where": _where(group),
                    "reason": reason,
                    "event": event,
                    "wrote": " | ".join(w.wrote for w in writes) if i == 0 else "",
                }
            )
        previous_specialized = any_specialized
    return rows


# -- records --------------------------------------------------------------------------------------------------


def slug(name: str) -> str:
    """A file-name-safe form of a run's name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"


def records_parts(evidence: RuntimeEvidence) -> tuple[list[Check], dict[str, Any]]:
    """The runtime half's checks (named `runtime: ...`) and metrics (`runtime`, `not_run`, `timelines`)."""
    checks = [Check(PREFIX + c.name, c.value, c.op, c.limit, c.detail) for c in evidence.checks]
    not_run = [NotRun(PREFIX + n.name, n.reason) for n in evidence.not_run]
    metrics: dict[str, Any] = {
        "runtime": {
            "ran": not evidence.unavailable,
            "unavailable": evidence.unavailable,
            "checks": len(checks),
            # Dispatches by path per run; the whole summary is in each run's ledger file.
            "runs": {
                r.name: r.ledger.get("summary", {}).get("dispatches", {}).get("by_path", {}) for r in evidence.runs
            },
            **evidence.metrics,
        },
        "not_run": [n.to_json() for n in not_run],
        "timelines": [{"title": f"{TIMELINE_TITLE}: {r.name}", "rows": timeline(r)} for r in evidence.runs if r.ledger],
    }
    return checks, metrics


def evidence_files(evidence: RuntimeEvidence) -> dict[str, str]:
    """File name -> text: each run's dispatch ledger, and the whole timeline."""
    files = {
        f"ledger-{slug(r.name)}.json": json.dumps(r.ledger, indent=1, sort_keys=True) + "\n" for r in evidence.runs
    }
    rows = {r.name: timeline(r) for r in evidence.runs}
    files["timeline.json"] = json.dumps(rows, indent=1, sort_keys=True) + "\n"
    return files


def to_records(stage: str, evidence: RuntimeEvidence) -> StageRecords:
    """The runtime half on its own, as a stage's records (the red team judges its cases by these)."""
    if evidence.unavailable:
        return StageRecords.not_run(stage, f"runtime isolation suite cannot run here: {evidence.unavailable}")
    checks, metrics = records_parts(evidence)
    return StageRecords(stage=stage, checks=checks, metrics=metrics)
