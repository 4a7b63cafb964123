"""A measured cell as JSON: the full record for the evidence file, and the short one for the stage's metrics."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from harness.perf.checks import amdahl, roofline_fraction
from harness.perf.measure import ARMS, CellResult
from harness.perf.suite import Bandwidth


def _flags(r: CellResult) -> list[str]:
    out = [f"synthetic {s}" for s in r.cell.synthetic]
    if r.timing.interval is not None and not r.timing.converged:
        out.append(f"interval stayed wide: {r.timing.stop}")
    return out


def cell_full(r: CellResult, bandwidth: Bandwidth) -> dict[str, Any]:
    """Everything measured for one cell: raw samples, profiles, clocks and the ledger's verdict per arm."""
    arms: dict[str, Any] = {}
    for arm in ARMS:
        prof = r.profiles.get(arm)
        median = r.median_s(arm)
        arms[arm] = {
            "backend": r.backends[arm],
            "path": {"expected": r.paths[arm].expected, "mismatches": list(r.paths[arm].mismatches)},
            "axes": r.axes[arm].to_json() if arm in r.axes else None,
            "roofline_fraction": roofline_fraction(r.step_bytes, bandwidth, median) if median else None,
            "profile": None
            if prof is None
            else {
                "method": prof.method,
                "total_s": prof.total_s,
                "parts": [
                    {
                        **asdict(p),
                        "roofline_fraction": None
                        if p.bytes is None
                        else roofline_fraction(p.bytes, bandwidth, p.time_s),
                    }
                    for p in prof.parts
                ],
            },
        }
    prediction = amdahl(r.profiles["baseline"], r.profiles["candidate"]) if r.profiles else None
    return {
        "cell": r.cell.id,
        "axes": r.cell.axes(),
        "tokens_per_step": r.cell.tokens_per_step,
        "region": r.region.name,
        "budget_limit": r.region.limit,
        "mode": r.mode,
        "step_bytes": r.step_bytes,
        "timing": r.timing.to_json(),
        "amdahl": None if prediction is None else asdict(prediction),
        "arms": arms,
        "flags": _flags(r),
        "notes": list(r.notes),
        "clocks": {"before": r.clocks_before, "after": r.clocks_after},
    }


def cell_summary(r: CellResult) -> dict[str, Any]:
    """The cell's decision inputs and metrics by axis, for the stage's records."""
    i = r.timing.interval
    return {
        "cell": r.cell.id,
        "workload": r.cell.workload,
        "region": r.region.name,
        "mode": r.mode,
        "itl_ratio": None if i is None else {"ratio": i.ratio, "low": i.low, "high": i.high, "rounds": i.n},
        "interval_narrow": r.timing.converged,
        "metrics": {arm: r.axes[arm].to_json() for arm in r.axes},
        "flags": _flags(r),
    }
