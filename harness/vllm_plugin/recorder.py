"""Per-step path counts kept in the worker and rewritten to a JSON snapshot that the gate reads.

A snapshot holds counts, not a per-step log, so a long eval cannot fill the disk: steps by CUDA-graph runtime
mode and batch descriptor, by batch shape, by decode path, fallback reasons, plus a short timeline of the first
steps for the report. Under FULL CUDA graphs a model's Python planning runs only while a graph is captured, so
a decision made during capture is remembered per batch descriptor and credited to every later replay of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLUSH_INTERVAL_S = 0.1
TIMELINE_STEPS = 256
PATHS = ("specialized", "stock")


@dataclass(frozen=True)
class StepInfo:
    mode: str  # CUDA-graph runtime mode: NONE, PIECEWISE or FULL
    descriptor: str | None  # the batch descriptor dispatched on, None in eager mode
    shape: str  # decode, prefill_or_mixed, no_metadata (profiling/dummy), unknown
    tokens: int | None
    reqs: int | None


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


class PathRecorder:
    def __init__(self, out_dir: Path, architecture: str, additional_config: dict[str, Any]) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"path-{os.getpid()}.json"
        self.architecture = architecture
        self.additional_config = additional_config
        self.probe: str | None = None
        self.probe_note = ""
        self.perturbation: str | None = None
        self.steps = 0
        self.by_mode: Counter[str] = Counter()
        self.by_descriptor: Counter[str] = Counter()
        self.by_shape: Counter[str] = Counter()
        self.by_path: Counter[str] = Counter()  # "<shape>:<path>" for every step once a probe is installed
        self.fallback_reasons: Counter[str] = Counter()
        self.captured: dict[str, dict[str, str]] = {}
        self.timeline: list[dict[str, Any]] = []
        self._step: StepInfo | None = None
        self._decisions: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._dirty = True
        self._thread: threading.Thread | None = None

    # --- called by hooks and probes -------------------------------------------------------------------------
    def set_probe(self, target: str | None, note: str) -> None:
        with self._lock:
            self.probe, self.probe_note, self._dirty = target, note, True

    def note_perturbation(self, mode: str) -> None:
        with self._lock:
            self.perturbation, self._dirty = mode, True

    def decide(self, path: str, reason: str = "") -> None:
        """What a probe calls when the model's decode planned (`specialized`) or fell back (`stock`)."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        with self._lock:
            if _capturing() and self._step is not None and self._step.descriptor is not None:
                self.captured[self._step.descriptor] = {"path": path, "reason": reason}
            self._decisions.append((path, reason))

    def begin_step(self, info: StepInfo) -> None:
        with self._lock:
            self._step, self._decisions = info, []

    def end_step(self) -> None:
        with self._lock:
            info, decisions = self._step, self._decisions
            self._step, self._decisions = None, []
            if info is None:
                return
            path, reason, source = self._attribute(info, decisions)
            self.steps += 1
            self.by_mode[info.mode] += 1
            self.by_descriptor[f"{info.mode}:{info.descriptor or 'eager'}"] += 1
            self.by_shape[info.shape] += 1
            if self.probe is not None:
                self.by_path[f"{info.shape}:{path}"] += 1
                if path == "stock":
                    self.fallback_reasons[f"{info.shape}: {reason or 'no reason given'}"] += 1
            if len(self.timeline) < TIMELINE_STEPS:
                self.timeline.append(
                    {
                        "step": self.steps,
                        "mode": info.mode,
                        "descriptor": info.descriptor,
                        "shape": info.shape,
                        "tokens": info.tokens,
                        "reqs": info.reqs,
                        "path": path,
                        "reason": reason,
                        "source": source,
                    }
                )
            self._dirty = True

    def _attribute(self, info: StepInfo, decisions: list[tuple[str, str]]) -> tuple[str, str, str]:
        if decisions:
            stock = [d for d in decisions if d[0] == "stock"]
            path, reason = stock[-1] if stock else decisions[-1]
            return path, reason, "planned"
        if info.mode == "FULL" and info.descriptor in self.captured:
            hit = self.captured[info.descriptor]
            return hit["path"], hit["reason"], "replay"
        return "unrecorded", "", "none"

    # --- snapshots -------------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "written_at": time.time(),
            "architecture": self.architecture,
            "additional_config": self.additional_config,
            "probe": self.probe,
            "probe_note": self.probe_note,
            "perturbation": self.perturbation,
            "steps": self.steps,
            "by_mode": dict(self.by_mode),
            "by_descriptor": dict(self.by_descriptor),
            "by_shape": dict(self.by_shape),
            "by_path": dict(self.by_path),
            "fallback_reasons": dict(self.fallback_reasons),
            "captured": self.captured,
            "timeline": self.timeline,
        }

    def flush(self, force: bool = False) -> None:
        with self._lock:
            if not (self._dirty or force):
                return
            data = self.snapshot()
            self._dirty = False
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, self.path)

    def start(self) -> None:
        self.flush(force=True)
        self._thread = threading.Thread(target=self._run, name="k3gate-path-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            # force: the gate waits for a snapshot newer than its request. A full disk must not kill the server;
            # the gate then sees a stale snapshot and says so.
            with contextlib.suppress(OSError):
                self.flush(force=True)
