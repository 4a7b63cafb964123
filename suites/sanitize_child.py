"""What runs inside compute-sanitizer: one numerics cell per stock kernel through the stock path, once.

`python -m suites.sanitize_child --report FILE [--cells op,op] [--redteam]`. Every Triton launch is recorded by
name through Triton's launch hook, per cell, so the runner can tell a kernel that ran clean from one that never
ran. Markers on stdout (`K3SAN-BEGIN op` / `K3SAN-END op`) bracket each cell in the sanitizer's log. A cell that
raises is recorded and the next one still runs (after a device fault they will fail too, and say so).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from suites import sanitize_redteam
from suites.sanitize import load_plan

MARK_BEGIN = "K3SAN-BEGIN"
MARK_END = "K3SAN-END"


def _install_launch_hook(record: Callable[[str], None]) -> None:
    """Call `record(kernel name)` at every Triton launch (Triton >= 3.4 keeps a hook chain; older a single hook)."""
    from triton import knobs

    def hook(metadata: Any) -> None:
        data = metadata.get() if hasattr(metadata, "get") else metadata
        record(str(data["name"]))

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        previous = chain

        def both(metadata: Any) -> None:
            if previous is not None:
                previous(metadata)
            hook(metadata)

        knobs.runtime.launch_enter_hook = both


def _run_one(name: str, fn: Callable[[], None], launched: list[str]) -> dict[str, Any]:
    start = len(launched)
    print(f"{MARK_BEGIN} {name}", flush=True)
    try:
        fn()
        torch.cuda.synchronize()
        status, error = "ok", ""
    except Exception as exc:  # recorded for the runner, which turns it into an ERROR with this text
        status, error = "error", "".join(traceback.format_exception_only(type(exc), exc)).strip()
    print(f"{MARK_END} {name}", flush=True)
    return {"status": status, "error": error, "launched": sorted(set(launched[start:]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m suites.sanitize_child")
    p.add_argument("--report", required=True, type=Path)
    p.add_argument("--cells", default="", help="comma-separated ops of the plan (default: all)")
    p.add_argument("--redteam", action="store_true", help="run only the deliberately out-of-bounds kernel")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    launched: list[str] = []
    _install_launch_hook(launched.append)
    results: dict[str, Any] = {}
    if args.redteam:
        results[sanitize_redteam.NAME] = _run_one(sanitize_redteam.NAME, lambda: sanitize_redteam.run(device), launched)
    else:
        from suites.k3.suite import K3Suite

        plan = load_plan()
        suite = K3Suite("k3-hopper", plan.model)
        ops = suite.implementations(device)[0].ops
        wanted = [c for c in args.cells.split(",") if c]
        for cell in plan.cells:
            if wanted and cell.op not in wanted:
                continue
            case = suite.case(cell.op, dict(cell.axes))

            def run(case: Any = case, op: str = cell.op) -> None:
                ops[op](case.make(plan.seed, device))

            results[cell.op] = _run_one(cell.op, run, launched)
    args.report.write_text(json.dumps({"cells": results, "launched": sorted(set(launched))}, indent=1))
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
