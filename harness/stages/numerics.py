"""The numerics stage: every op of the subject's implementations against its oracle, cell by cell of the grid."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from harness.numerics.cells import Case, Implementation
from harness.numerics.compare import ToleranceTable
from harness.numerics.hygiene import CellResult, run_cell
from harness.stages.base import StageContext
from harness.subjects import load_subject
from harness.verdicts import Check, StageRecords


class NumericsSuite(Protocol):
    def cells(self, config: Any, rng: random.Random) -> list[Case]:
        """Grid cells for the config (and tier), plus off-grid cells drawn with `rng`."""
        ...

    def implementations(self, device: torch.device) -> list[Implementation]:
        """What is under test on this device (the stock path until specialized kernels land, then both)."""
        ...

    def forbidden(self) -> tuple:
        """Code objects of the oracle's entry points, which no implementation may call."""
        ...

    # Optional: `not_run() -> list[dict]` ({"name", "reason"}): implementations that exist but cannot run here
    # (e.g. kernels for another GPU), listed in the records so a run never reads as having tested them.


@dataclass(frozen=True)
class NumericsStage:
    name: str = "numerics"
    description: str = "Principle 3a: kernel numerics over shape grids, with kernel hygiene probes"
    needs_hardware: bool = True
    seed: int = 20261129

    def run(self, ctx: StageContext) -> StageRecords:
        subject = load_subject(ctx.config.subject)
        make_suite = getattr(subject, "numerics_suite", None)
        suite: NumericsSuite | None = make_suite(ctx.config) if make_suite else None
        if suite is None:
            return StageRecords.not_run(self.name, f"subject {ctx.config.subject} has no numerics suite in this build")
        device = torch.device("cuda" if ctx.config.hardware["gpu"] != "none" else "cpu")
        table = ToleranceTable.load()
        cells = suite.cells(ctx.config, random.Random(self.seed))
        impls = suite.implementations(device)
        if not impls:
            return StageRecords.not_run(self.name, "no implementation of the subject's ops is available here")
        path, rel = ctx.evidence_path(self.name, "cells.jsonl")
        records = evaluate(cells, impls, device, table, suite.forbidden(), self.seed, ctx.progress, path)
        records.evidence.append(rel)
        records.metrics["not_run"] = list(getattr(suite, "not_run", list)())
        make_tp = getattr(subject, "distributed_numerics", None)
        tp_cells = make_tp(ctx.config) if make_tp else None
        if tp_cells is not None:
            if ctx.progress:
                ctx.progress("tensor-parallel cells", 1.0)
            checks, not_run, metrics = tp_cells.run()
            records.checks.extend(checks)
            records.metrics["tensor_parallel"] = metrics
            if not_run:  # a TP size the config asks for did not run: the stage cannot pass
                records.status, records.reason = "not_run", "; ".join(not_run)
        return records


def evaluate(
    cells: list[Case],
    impls: list[Implementation],
    device: torch.device,
    table: ToleranceTable,
    forbidden: tuple,
    seed: int,
    progress=None,
    cells_file: Path | None = None,
) -> StageRecords:
    """Run every cell for every implementation; the records the numerics stage (and its red team) derive from."""
    results: list[tuple[str, CellResult]] = []
    declined: list[dict[str, str]] = []
    total = len(cells) * len(impls)
    for impl in impls:
        for i, case in enumerate(cells):
            if progress:
                progress(f"{impl.name} {case.id}", len(results) / max(total, 1))
            op = impl.ops.get(case.spec.op)
            if op is None and impl.partial:
                continue  # not one of the ops this implementation replaces
            reason = impl.declines(case) if op is not None and impl.declines is not None else None
            if reason and impl.partial:
                declined.append({"implementation": impl.name, "cell": case.id, "reason": reason})
                continue
            if op is None or reason:
                what = f"{impl.name} implements {case.spec.op}" if op is None else f"{impl.name} serves the cell"
                result = CellResult(case.id, case.axes, [Check(what, False, "==", True, reason or "")])
            else:
                result = run_cell(case, op, device, table, forbidden, seed=seed + i)
            results.append((impl.name, result))
    if cells_file is not None:
        with cells_file.open("w") as fh:
            for impl_name, r in results:
                fh.write(
                    json.dumps(
                        {
                            "implementation": impl_name,
                            "cell": r.case_id,
                            "axes": r.axes,
                            "passed": r.passed,
                            "failed": [c.name for c in r.checks if not c.passed],
                            "metrics": r.metrics,
                        },
                        default=str,
                    )
                    + "\n"
                )
    checks = [
        Check(f"{impl_name} {r.case_id}: {c.name}", c.value, c.op, c.limit, c.detail)
        for impl_name, r in results
        for c in r.checks
    ]
    checks.append(Check("cells tested", len(results), ">=", 1))
    pass_map: dict[str, dict[str, bool]] = {}
    for impl_name, r in results:
        op, _, rest = r.case_id.partition("/")
        pass_map.setdefault(f"{impl_name} {op}", {})[rest] = r.passed
    metrics = {
        "device": str(device),
        "implementations": {i.name: i.backend for i in impls},
        "cells_by_implementation": {i.name: sum(name == i.name for name, _ in results) for i in impls},
        "cells": len(results),
        "cells_failed": sum(not r.passed for _, r in results),
        "declined": declined,
        "seed": seed,
        "tolerances": table.source,
        "tolerance_version": table.entries.get("version"),
        "pass_map": pass_map,
    }
    return StageRecords(stage="numerics", checks=checks, metrics=metrics)
