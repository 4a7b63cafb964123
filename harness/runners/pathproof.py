"""Read the vLLM plugin's proof-of-path snapshots and turn a request cell's share of them into coverage.

The plugin rewrites `path-<pid>.json` (one per worker, so one per TP rank) every 0.1 s. A cell takes a snapshot
before its requests and one after (newer than its last response), and the difference is what the cell ran. A
snapshot counts the target model's steps only; steps that ran only another model of the worker (a speculative
drafter) are kept apart in `other_steps`, and `replays` says how FULL-graph replays were followed.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.verdicts import Check

SETTLE_TIMEOUT_S = 10.0


def read(path_dir: Path) -> dict[str, dict[str, Any]]:
    snaps = {}
    for file in sorted(path_dir.glob("path-*.json")):
        try:
            snaps[file.stem] = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # mid-rename on a filesystem without atomic replace; the next read gets it
    return snaps


def settle(path_dir: Path, after: float, timeout_s: float = SETTLE_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """Snapshots all written after wall time `after` (so they include every step up to then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snaps = read(path_dir)
        if snaps and all(s.get("written_at", 0) > after for s in snaps.values()):
            return snaps
        if time.monotonic() > deadline:
            return snaps  # stale or absent: the caller reports missing proof rather than hanging
        time.sleep(0.05)


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    out = Counter(after)
    out.subtract(Counter(before))
    return {k: v for k, v in out.items() if v}


@dataclass
class CellPath:
    """What one cell ran, on the worst rank: the rank with the fewest specialized decode steps."""

    ranks: int = 0
    steps: int = 0
    decode_steps: int = 0
    specialized_decode: int = 0
    probe: str | None = None
    probe_note: str = ""
    architecture: str = ""
    additional_config: dict[str, Any] = field(default_factory=dict)
    by_mode: dict[str, int] = field(default_factory=dict)
    by_descriptor: dict[str, int] = field(default_factory=dict)
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    other_models: list[str] = field(default_factory=list)
    other_steps: dict[str, int] = field(default_factory=dict)
    replays: str = ""
    stale: bool = False

    @property
    def coverage(self) -> float | None:
        return self.specialized_decode / self.decode_steps if self.decode_steps else None

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "specialized_decode_steps": self.specialized_decode,
            "coverage": self.coverage,
            "probe": self.probe,
            "probe_note": self.probe_note,
            "architecture": self.architecture,
            "by_mode": self.by_mode,
            "by_descriptor": self.by_descriptor,
            "fallback_reasons": self.fallback_reasons,
            "other_models": self.other_models,
            "other_steps": self.other_steps,
            "replays": self.replays,
        }


def cell_path(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], after_time: float) -> CellPath:
    if not after:
        return CellPath(probe_note="the k3gate vLLM plugin wrote no proof-of-path snapshot", stale=True)
    worst: CellPath | None = None
    for rank, snap in after.items():
        prev = before.get(rank, {})
        by_path = _diff(snap.get("by_path", {}), prev.get("by_path", {}))
        by_shape = _diff(snap.get("by_shape", {}), prev.get("by_shape", {}))
        cell = CellPath(
            ranks=len(after),
            steps=snap.get("steps", 0) - prev.get("steps", 0),
            decode_steps=by_shape.get("decode", 0),
            specialized_decode=by_path.get("decode:specialized", 0),
            probe=snap.get("probe"),
            probe_note=snap.get("probe_note", ""),
            architecture=snap.get("architecture", ""),
            additional_config=snap.get("additional_config", {}),
            by_mode=_diff(snap.get("by_mode", {}), prev.get("by_mode", {})),
            by_descriptor=_diff(snap.get("by_descriptor", {}), prev.get("by_descriptor", {})),
            fallback_reasons=_diff(snap.get("fallback_reasons", {}), prev.get("fallback_reasons", {})),
            other_models=list(snap.get("other_models", [])),
            other_steps=_diff(snap.get("other_steps", {}), prev.get("other_steps", {})),
            replays=snap.get("replays", ""),
            stale=snap.get("written_at", 0) <= after_time,
        )
        if worst is None or (cell.coverage or 0.0) < (worst.coverage or 0.0) or cell.probe is None:
            worst = cell
    assert worst is not None
    return worst


def coverage_check(label: str, path: CellPath, floor: float) -> tuple[Check | None, str | None]:
    """(the coverage check, None) or (None, why coverage cannot be judged) for one cell."""
    if path.stale:
        return None, f"{label}: no fresh proof-of-path snapshot ({path.probe_note or 'plugin silent'})"
    if path.probe is None:
        return None, f"{label}: coverage not judged: {path.probe_note}"
    if path.decode_steps == 0:
        # A cell that ran no decode step proves nothing about the decode path: that is a failure of the cell.
        detail = "the cell ran no decode step" + (f" the plugin saw ({path.replays})" if path.replays else "")
        return Check(f"{label}: decode steps observed", 0, ">=", 1, detail), None
    top = ", ".join(f"{k} x{v}" for k, v in sorted(path.fallback_reasons.items(), key=lambda kv: -kv[1])[:2])
    return (
        Check(
            f"{label}: decode steps on the specialized path (fraction)",
            round(path.coverage or 0.0, 6),
            ">=",
            floor,
            f"{path.specialized_decode}/{path.decode_steps} decode steps specialized"
            + (f"; fallbacks: {top}" if top else ""),
        ),
        None,
    )
