"""Per-step path counts kept in the worker and rewritten to a JSON snapshot that the gate reads.

A snapshot holds counts, not a per-step log, so a long eval cannot fill the disk: steps by CUDA-graph runtime
mode and batch descriptor, by batch shape, by decode path, fallback reasons, plus a short timeline of the first
steps for the report. Under FULL CUDA graphs a model's Python planning runs only while a graph is captured, so
a decision made during capture is remembered per graph and credited to every later replay of it:
- V1 model runner: capture and replay both run under a forward context whose batch descriptor names the graph, so
  `decide()` during a FULL capture files the decision under that descriptor and `end_step` finds it on replay;
- V2 model runner: neither names the graph (see graphs.py), so the graph manager reports each stored graph
  (`graph_stored`, which takes the decision of the forward pass just captured into it) and each replay (`replay`).

Only the target model is recorded. Another model in the process (a speculative drafter) is named in the snapshot,
and a step that ran only that model is counted under `other_steps`, not as a step of the target.
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


@dataclass(frozen=True)
class Attribution:
    path: str  # specialized, stock or unrecorded
    reason: str
    source: str  # planned (the probe decided in this step), replay (a captured decision), none


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
        self.replays = ""  # how FULL-graph replays are followed (graphs.FOLLOWED, graphs.NOT_V2, or why not)
        self.other_models: set[str] = set()
        self.other_steps: Counter[str] = Counter()  # steps that ran only another model, by its class name
        self._step: StepInfo | None = None
        self._decisions: list[tuple[str, str]] = []
        self._step_others: set[str] = set()
        self._last: Attribution | None = None  # the last forward pass, for the graph stored right after it
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

    def set_replays(self, note: str) -> None:
        with self._lock:
            self.replays, self._dirty = note, True

    def note_other_model(self, architecture: str) -> None:
        """A model other than the target was loaded in this process (a speculative drafter)."""
        with self._lock:
            self.other_models.add(architecture)
            self._dirty = True

    def other_ran(self, architecture: str) -> None:
        """Another model's forward ran in the current step."""
        with self._lock:
            if self._step is not None:
                self._step_others.add(architecture)

    def decide(self, path: str, reason: str = "") -> None:
        """What a probe calls when the model's decode planned (`specialized`) or fell back (`stock`)."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        with self._lock:
            step = self._step
            # V1 FULL capture: the forward context names the graph. (A V2 capture pass runs in mode NONE with a
            # token-count descriptor that names no graph; graph_stored files its decision instead.)
            if _capturing() and step is not None and step.mode == "FULL" and step.descriptor is not None:
                self.captured[step.descriptor] = {"path": path, "reason": reason}
            self._decisions.append((path, reason))

    def begin_step(self, info: StepInfo) -> None:
        with self._lock:
            self._step, self._decisions, self._step_others = info, [], set()

    def end_step(self) -> None:
        with self._lock:
            info, decisions, others = self._step, self._decisions, self._step_others
            self._step, self._decisions, self._step_others = None, [], set()
            if info is None:
                return
            if others and not decisions:
                # Only another model ran (the drafter's own forward): not a step of the target. A step where the
                # target's probe decided is the target's whatever else ran.
                self.other_steps[",".join(sorted(others))] += 1
                self._last, self._dirty = None, True
                return
            hit = self._attribute(info, decisions)
            self._last = hit if hit.source == "planned" else None
            self._count(info, hit)

    # --- V2 model runner: graphs and replays (graphs.py) ---------------------------------------------------------
    def graph_stored(self, key: str) -> None:
        """A FULL graph was stored right after the forward pass captured into it: that pass's decision is the
        graph's. Without one (no probe, or it did not decide) any older decision for the key is dropped."""
        with self._lock:
            last, self._last = self._last, None
            if last is not None:
                self.captured[key] = {"path": last.path, "reason": last.reason}
            else:
                self.captured.pop(key, None)
            self._dirty = True

    def graphs_dropped(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self.captured.pop(key, None)
            self._dirty = True

    def replay(self, key: str, shape: str, tokens: int | None, reqs: int | None) -> None:
        """One FULL-graph replay: a step that runs no model Python, credited with its graph's decision."""
        info = StepInfo(mode="FULL", descriptor=key, shape=shape, tokens=tokens, reqs=reqs)
        with self._lock:
            self._last = None
            hit = self.captured.get(key)
            if hit is None:
                self._count(info, Attribution("unrecorded", "", "none"))
            else:
                self._count(info, Attribution(hit["path"], hit["reason"], "replay"))

    def _count(self, info: StepInfo, hit: Attribution) -> None:
        """Count one step of the target (the caller holds the lock)."""
        path, reason, source = hit.path, hit.reason, hit.source
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

    def _attribute(self, info: StepInfo, decisions: list[tuple[str, str]]) -> Attribution:
        if decisions:
            stock = [d for d in decisions if d[0] == "stock"]
            path, reason = stock[-1] if stock else decisions[-1]
            return Attribution(path, reason, "planned")
        if info.mode == "FULL" and info.descriptor in self.captured:
            hit = self.captured[info.descriptor]
            return Attribution(hit["path"], hit["reason"], "replay")
        return Attribution("unrecorded", "", "none")

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
            "replays": self.replays,
            "other_models": sorted(self.other_models),
            "other_steps": dict(self.other_steps),
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
