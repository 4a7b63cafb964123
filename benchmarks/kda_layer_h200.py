"""Benchmark (issue 8): the attention side of a Kimi K3 KDA layer on one H200, specialized path against stock.

The attention side of a KDA layer is AttnRes before attention, the input projection, the KDA step and o_proj with
the AttnRes after attention (runtime ops attn_res, in_proj, kda, o_proj: k3_decode/runtime/ops.toml). Under
decode_backend "latency_specialized" the CuTe DSL providers (k3_decode/kernels/providers.py) run attn_res and in_proj;
kda and o_proj stay stock. For each TP size (per-rank shapes of rank 0; one GPU holds the shard, so the TP all-reduce
after o_proj is the identity and takes no time here) and each batch, on layer 6 (KDA + latent MoE) of the stack
"k3-kda-mla" with every request's context filled to --context tokens:

- two executors on the same weights and the same synthetic request state: stock ("auto") and "latency_specialized".
  When the specialized one cannot start (no sm_90 GPU, no CuTe DSL), the reason is recorded and only stock is timed;
  stock numbers are never filed under the specialized path.
- agreement: one eager step of the same inputs on both from the same state; the relative RMS difference of the
  layer's outputs (a BF16 rounding level is expected; recorded, not asserted).
- layer time: one CUDA graph of the layer per path, replayed in interleaved rounds (even rounds stock first, odd
  rounds specialized first), each replay timed by CUDA events after an L2 flush (a read by default: L2Flush);
  median, p10-p90, and the speedup stock / specialized with a bootstrap interval of the paired rounds
  (harness.perf.stats).
- attention side: the kernels of profiled replays (L2 flushed before each), grouped per replay by the graph launch
  that issued them and attributed to runtime ops in launch order (a kernel whose name holds a provider's declared
  kernel name is that provider's op; stock kernels by the stock op tables' names, cuBLAS kernels to the cuBLAS ops
  between two named kernels). Time = the sum of the attention ops' kernel durations (also the span, first start to
  last end), launches = their count, bytes = the least HBM traffic of those ops (k3_decode.executor.roofline), and
  the roofline fraction = bytes / the copy bandwidth measured in this run / that time. The MoE part is reported
  apart, so it is never mixed into the attention side.
- timeline: per side and path, one row per kernel in launch order with its start and end as offsets from the
  side's first kernel start in each replay, its duration and the gap after the kernel before it (negative: an
  overlap under programmatic dependent launch), medians over the profiled replays; none, with why, where the
  replays' kernels differ.
- the issue's targets per cell (specialized path): >= 85% of the roofline at B <= 8 and >= 75% at B = 64 for TP8,
  >= 70% for TP16, at most 4 launches for the attention side; met or missed, both recorded.

Usage (on the GPU machine): python3 benchmarks/kda_layer_h200.py --out kda-layer-h200.json [--tp 8 16]
    [--batches 1 2 4 8 16 32 64] [--reps 200]
Table of a results file (no GPU needed): python3 benchmarks/kda_layer_h200.py --table kda-layer-h200.json
The commit is taken from K3_COMMIT or K3GATE_COMMIT (and K3_DIRTY=1 for a working tree with changes) when set, else
from git.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.stock_h200 import (  # noqa: E402
    FLUSH_BYTES,
    environment,
    log,
    measure_copy_bandwidth,
    profile,
    summarize,
)
from harness.perf.stats import MIN_ROUNDS, bootstrap_interval  # noqa: E402
from k3_decode.config import ModelDims, load_dims  # noqa: E402
from k3_decode.executor import StackExecutor, StepRequest, StepRoutingError, load_stack, random_input  # noqa: E402
from k3_decode.executor.attribution import (  # noqa: E402
    LAUNCH_CATEGORIES,
    DeviceEvent,
    device_events,
    stock_kernel_info,
)
from k3_decode.executor.config import StackConfigError  # noqa: E402
from k3_decode.executor.inputs import entry_blocks  # noqa: E402
from k3_decode.executor.roofline import StepShape, layer_bytes, roofline_seconds  # noqa: E402
from k3_decode.kernels import (  # noqa: E402
    kda_in_proj_choice,
    kda_in_proj_op,
    kda_o_proj_op,
    kda_o_proj_plan,
    kda_step_op,
    kda_step_plan,
    phase_trace,
    providers,
)
from k3_decode.kernels.kda_o_proj_plan import (  # noqa: E402
    capped_at,
    one_pass_at,
    paired_at,
    w_l2_at,
    w_smem_at,
    warm_at,
    wgmma_at,
    wgmma_ctas_per_sm_at,
    wgmma_w_l2_at,
    wgmma_w_l2_late_at,
)
from k3_decode.kernels.kda_step_plan import KdaStepPlan  # noqa: E402
from k3_decode.kernels.providers import (  # noqa: E402
    PROVIDERS,
    ProviderBindError,
    mixing_min_blocks,
    not_built_reason,
)
from k3_decode.runtime.errors import StartupError  # noqa: E402
from k3_decode.runtime.ledger import Expectation  # noqa: E402

STACK = "k3-kda-mla"
SPECIALIZED = {"decode_backend": "latency_specialized"}
PATHS = ("stock", "specialized")
ATTENTION_OPS = ("attn_res", "in_proj", "kda", "o_proj")  # the attention side of a KDA layer (runtime ops)
ENTRY = "entry"  # the executor's copies of the entry state at the start of a layer graph: no op's work
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROFILED_REPLAYS = 3
CONFIDENCE = 0.95

# The targets for the specialized attention side, as data: (tp, lowest batch, highest batch, fraction).
# Batches the issue names no fraction for (TP8, B = 16 and 32) get none, and say so, rather than an invented one.
ROOFLINE_TARGETS = ((8, 1, 8, 0.85), (8, 64, 64, 0.75), (16, 1, 64, 0.70))
TARGET_LAUNCHES = 4
TARGETS_TEXT = (
    "issue 8, for the specialized attention side: >= 85% of the HBM roofline at B <= 8 and >= 75% at B = 64 for "
    "TP8, >= 70% for TP16 (every batch); at most 4 launches"
)


# -- attribution of one graph replay's device events to runtime ops (pure) ----------------------------------------


@dataclass(frozen=True)
class Slot:
    """One step of a layer's launch sequence: a stock op of a runtime op, or the provider running a runtime op."""

    op: str  # the runtime op (k3_decode/runtime/ops.toml)
    path: str  # "stock" or "specialized"
    names: tuple[str, ...]  # substrings of the kernel names this step launches (empty: cuBLAS only)
    absorbs_unnamed: bool  # launches kernels without a fixed name (cuBLAS GEMMs, their split-K reductions, copies)
    stock_op: str | None = None  # the stock op, for a stock step


def layer_slots(
    pairs: Sequence[tuple[str, str]],
    paths: Mapping[str, str],
    catalog: Mapping[tuple[str, str], Mapping[str, int]],
    stock_info: Mapping[str, tuple[Sequence[str], bool]],
) -> list[Slot]:
    """The launch sequence of one layer on the paths a graph's capture recorded.

    `pairs`: (runtime op, stock op) in launch order (StockOpMap.layer_ops); `paths`: runtime op -> path (the ledger's
    records of the graph); `catalog`: (op, path) -> {kernel name: launches} (KernelCatalog.launches); `stock_info`:
    stock op -> (kernel names, runs cuBLAS) (attribution.stock_kernel_info). A specialized op is one step, named by
    its provider's declared kernels, whatever stock ops it replaces."""
    slots: list[Slot] = []
    for op, stock_op in pairs:
        path = paths.get(op)
        if path is None:
            raise ValueError(f"no path recorded for op {op!r}; pass the paths of every op of the layer")
        if path == "specialized":
            if slots and slots[-1].op == op and slots[-1].path == "specialized":
                continue  # the provider replaces every stock op of its runtime op
            names = tuple(catalog.get((op, "specialized"), {}))
            if not names:
                raise ValueError(
                    f"op {op!r} ran specialized but the kernel catalog names none of its provider's kernels"
                )
            slots.append(Slot(op, "specialized", names, False))
        else:
            names, absorbs = stock_info[stock_op]
            slots.append(Slot(op, "stock", tuple(names), bool(absorbs), stock_op))
    return slots


def _anchor(name: str, slots: Sequence[Slot], start: int) -> int | None:
    for j in range(start, len(slots)):
        if any(k in name for k in slots[j].names):
            return j
    return None


def attribute_events(events: Sequence[DeviceEvent], slots: Sequence[Slot], entry_launches: int = 0) -> list[str]:
    """The runtime op of each device event of one replay (events in start order), as a label.

    Up to `entry_launches` unnamed events before the first named kernel are the graph's copies of the entry state
    (`ENTRY`: the executor's own launches, no op's); a named kernel is never taken for one.
    A named kernel anchors the first step at or after the last anchor whose names it holds. Events without such a
    name between two anchors belong to the steps between them (both ends included) that launch unnamed kernels: one
    op takes them all; as many steps as events take one each in order; otherwise the ops are reported together,
    joined with '+', rather than guessed apart. With no such step they belong to the last anchored step (before the
    first anchor: to the step that anchor names)."""
    labels = [""] * len(events)
    pending: list[int] = []
    last = -1
    entry_left = entry_launches

    def settle(upto: int) -> None:
        nonlocal entry_left
        if last < 0 and entry_left:  # the leading unnamed events, up to the entry copies' number
            taken = pending[:entry_left]
            for i in taken:
                labels[i] = ENTRY
            entry_left -= len(taken)
            del pending[: len(taken)]
        if not pending:
            return
        candidates = [s for s in slots[max(last, 0) : upto + 1] if s.absorbs_unnamed]
        ops = list(dict.fromkeys(s.op for s in candidates))
        if not candidates:
            owners = [slots[last if last >= 0 else upto].op] * len(pending)
        elif len(ops) == 1:
            owners = [ops[0]] * len(pending)
        elif len(candidates) == len(pending):
            owners = [s.op for s in candidates]
        else:
            owners = ["+".join(ops)] * len(pending)
        for i, owner in zip(pending, owners, strict=True):
            labels[i] = owner
        pending.clear()

    for i, ev in enumerate(events):
        j = _anchor(ev.name, slots, max(last, 0))
        if j is None:
            pending.append(i)
            continue
        settle(j)
        labels[i] = slots[j].op
        last = j
    settle(len(slots) - 1)
    return labels


def side_of(label: str) -> str:
    """ "attention", "moe" (the layer's MLP part), ENTRY, or "mixed" for a joined label across both sides."""
    if label == ENTRY:
        return ENTRY
    ops = label.split("+")
    inside = [op in ATTENTION_OPS for op in ops]
    if all(inside):
        return "attention"
    return "moe" if not any(inside) else "mixed"


def graph_replays(trace: Mapping[str, Any]) -> list[list[DeviceEvent]]:
    """Device events of each CUDA-graph launch in a chrome trace, in launch order; events that no graph launch
    issued (the L2 flush between replays) are left out. CUPTI gives every kernel of a graph the correlation id of
    the cudaGraphLaunch call that launched it."""
    launches = sorted(
        (float(e["ts"]), e["args"]["correlation"])
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X"
        and e.get("cat") in LAUNCH_CATEGORIES
        and "GraphLaunch" in e.get("name", "")
        and "correlation" in e.get("args", {})
    )
    by_launch: dict[Any, list[DeviceEvent]] = defaultdict(list)
    for ev in device_events(trace):
        if ev.correlation is not None:
            by_launch[ev.correlation].append(ev)
    return [sorted(by_launch[c], key=lambda d: d.start_us) for _, c in launches if by_launch.get(c)]


def split_even(events: Sequence[DeviceEvent], replays: int) -> list[list[DeviceEvent]]:
    """Back-to-back replays of one graph, in start order, cut into `replays` equal runs."""
    if replays < 1 or len(events) % replays:
        raise ValueError(f"{len(events)} device events do not split into {replays} equal replays")
    n = len(events) // replays
    return [list(events[i * n : (i + 1) * n]) for i in range(replays)]


def runtime_op_bytes(pairs: Sequence[tuple[str, str]], stock_bytes: Mapping[str, int]) -> dict[str, int]:
    """Bytes per runtime op from roofline.layer_bytes (per stock op, the AttnRes applications told apart), joined
    with the (runtime op, stock op) pairs of the same layer in the same launch order."""
    if len(pairs) != len(stock_bytes):
        raise ValueError(f"{len(pairs)} (op, stock op) pairs but {len(stock_bytes)} byte counts; not the same layer")
    out: dict[str, int] = defaultdict(int)
    for (op, stock_op), (name, nbytes) in zip(pairs, stock_bytes.items(), strict=True):
        if name != stock_op and not (stock_op == "attn_res" and name.startswith("attn_res_")):
            raise ValueError(f"launch orders differ: stock op {stock_op!r} of op {op!r} against byte count {name!r}")
        out[op] += nbytes
    return dict(out)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _short(name: str) -> str:
    """A kernel name as the results file keeps it: CuTe DSL names run to hundreds of characters of signature."""
    return name[:120]


def side_timeline(
    replays: Sequence[Sequence[tuple[str, DeviceEvent]]],
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """Where one side's time goes: one row per kernel, in the replays' order (start order; the replays of one
    graph launch the same kernels in the same order), with its start and end as offsets from the replay's first
    start of the side, its duration, and the gap after the kernel before it (negative: the two overlapped, as
    under programmatic dependent launch). Each figure is the median over replays of that figure, so a row's end
    need not be its start + duration exactly. Offsets, not trace times: each replay starts at its own time.

    Returns (rows, None), or (None, why) where the replays' kernels differ and row i would mix different kernels."""
    if not replays:
        return [], None
    first = [(label, ev.name) for label, ev in replays[0]]
    for r, rep in enumerate(replays[1:], start=1):
        if len(rep) != len(first):
            return None, f"replay {r} has {len(rep)} kernels on this side against {len(first)} in replay 0"
        for i, ((label, ev), (label0, name0)) in enumerate(zip(rep, first, strict=True)):
            if (label, ev.name) != (label0, name0):
                return None, (
                    f"kernel {i} of replay {r} is {label}: {_short(ev.name)} against {label0}: {_short(name0)} "
                    "in replay 0"
                )
    origins = [min(ev.start_us for _, ev in rep) for rep in replays] if first else []
    rows: list[dict[str, Any]] = []
    for i, (label, name) in enumerate(first):
        at = [rep[i][1] for rep in replays]
        before = [rep[i - 1][1] for rep in replays] if i else []
        rows.append(
            {
                "op": label,
                "name": _short(name),
                "start_us": _median([ev.start_us - t0 for ev, t0 in zip(at, origins, strict=True)]),
                "end_us": _median([ev.start_us + ev.dur_us - t0 for ev, t0 in zip(at, origins, strict=True)]),
                "dur_us": _median([ev.dur_us for ev in at]),
                # None for the side's first kernel: what ran before it belongs to another side (or to no op).
                "gap_before_us": (
                    _median([ev.start_us - (p.start_us + p.dur_us) for ev, p in zip(at, before, strict=True)])
                    if i
                    else None
                ),
            }
        )
    return rows, None


def side_summary(
    replays: Sequence[Sequence[tuple[str, DeviceEvent]]],
    side: str,
    op_bytes: Mapping[str, int] | None,
    bandwidth: float | None,
) -> dict[str, Any]:
    """One side of a layer over profiled replays of its graph ((label, event) per replay): kernel time (sum of
    durations) and span, launches, and with bytes the roofline fraction; per op too; and the per-kernel timeline
    (side_timeline), or `timeline_note` with why there is none. Medians over replays."""
    mine = [[(label, ev) for label, ev in rep if side_of(label) == side] for rep in replays]
    times = [sum(ev.dur_us for _, ev in rep) for rep in mine]
    spans = [
        max(ev.start_us + ev.dur_us for _, ev in rep) - min(ev.start_us for _, ev in rep) if rep else 0.0
        for rep in mine
    ]
    counts = [len(rep) for rep in mine]
    out: dict[str, Any] = {
        "time_us": _median(times),
        "span_us": _median(spans),
        "launches": _median(counts),
        "launches_per_replay": counts,
        "kernels": _median([sum(ev.category == "kernel" for _, ev in rep) for rep in mine]),
        "replays": len(mine),
        "kernel_names": [f"{label}: {_short(ev.name)}" for label, ev in mine[0]] if mine else [],
    }
    timeline, note = side_timeline(mine)
    if timeline is None:
        out["timeline_note"] = f"no timeline: the replays' kernels differ ({note})"
    else:
        out["timeline"] = timeline
    by_op: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(label for rep in mine for label, _ in rep):
        per = [[ev for lab, ev in rep if lab == label] for rep in mine]
        by_op[label] = {
            "launches": _median([len(p) for p in per]),
            "time_us": _median([sum(ev.dur_us for ev in p) for p in per]),
        }
    if op_bytes is not None and bandwidth:
        ops = [op for op in op_bytes if (op in ATTENTION_OPS) == (side == "attention")]
        nbytes = sum(op_bytes[op] for op in ops)
        roof_us = roofline_seconds(nbytes, bandwidth) * 1e6
        out.update(
            bytes=nbytes,
            bytes_by_op={op: op_bytes[op] for op in ops},
            roofline_us=roof_us,
            roofline_fraction=roof_us / out["time_us"] if out["time_us"] else None,
            roofline_fraction_span=roof_us / out["span_us"] if out["span_us"] else None,
        )
        for label, row in by_op.items():
            b = sum(op_bytes.get(op, 0) for op in label.split("+"))
            r_us = roofline_seconds(b, bandwidth) * 1e6
            row.update(bytes=b, roofline_fraction=r_us / row["time_us"] if row["time_us"] else None)
    out["by_op"] = by_op
    return out


# -- statistics and verdicts (pure) --------------------------------------------------------------------------------


def interleave_order(arms: int, round_index: int) -> list[int]:
    """Which arm replays first in a round: stock first in even rounds, last in odd ones (the order groups of
    harness.perf.stats)."""
    order = list(range(arms))
    return order if round_index % 2 == 0 else order[::-1]


def speedup_stats(stock_us: Sequence[float], special_us: Sequence[float], level: float = CONFIDENCE) -> dict[str, Any]:
    """Speedup = stock time / specialized time from interleaved paired rounds (> 1: the specialized path is faster).

    The estimate and its interval are harness.perf.stats' bootstrap of the median log ratio within each order
    group (specialized / stock), inverted; the per-round ratios' median and p10-p90 are given beside it."""
    iv = bootstrap_interval(stock_us, special_us, level)
    ratios = sorted(s / p for s, p in zip(stock_us, special_us, strict=True))

    def pick(q: float) -> float:
        return ratios[min(len(ratios) - 1, int(q * len(ratios)))]

    return {
        "speedup": 1.0 / iv.ratio,
        "low": 1.0 / iv.high,
        "high": 1.0 / iv.low,
        "level": level,
        "method": "bootstrap of the median log ratio per order group (harness.perf.stats), inverted",
        "rounds": len(ratios),
        "ratio_of_medians": statistics.median(stock_us) / statistics.median(special_us),
        "round_ratio_median": statistics.median(ratios),
        "round_ratio_p10": pick(0.1),
        "round_ratio_p90": pick(0.9),
    }


def roofline_target(tp: int, batch: int) -> float | None:
    for t, lo, hi, fraction in ROOFLINE_TARGETS:
        if t == tp and lo <= batch <= hi:
            return fraction
    return None


def span_speedup(stock: Mapping[str, Any], special: Mapping[str, Any]) -> float | None:
    """The attention side's speedup: stock's span / the specialized span, elapsed times as the targets judge."""
    return stock["span_us"] / special["span_us"] if special.get("span_us") else None


def target_verdicts(tp: int, batch: int, attention: Mapping[str, Any] | None, unmeasured: str | None) -> dict:
    """The issue's targets for one cell, judged on the specialized attention side; None where not judged, with why.

    The roofline fraction is judged on the span (the first attention kernel's start to the last one's end), the
    attention side's elapsed time. The sum of kernel durations counts twice every stretch where programmatic
    dependent launch runs a kernel beside the one before it (a kernel that starts early and waits is busy by the
    profiler's clock), so the more a path overlaps its kernels, the more that sum overstates its time."""
    target = roofline_target(tp, batch)
    roof: dict[str, Any] = {"target": target, "value": None, "met": None, "basis": "span"}
    launches: dict[str, Any] = {"target": TARGET_LAUNCHES, "value": None, "met": None}
    if attention is None:
        why = f"the specialized path was not measured: {unmeasured or 'no reason recorded'}"
        roof["why"] = launches["why"] = why
        return {"path": None, "roofline": roof, "launches": launches}
    frac = attention.get("roofline_fraction_span")
    roof["value"] = frac
    if target is None:
        roof["why"] = f"the issue sets no roofline fraction for TP{tp} B{batch}"
    elif frac is None:
        roof["met"], roof["why"] = False, "no attention-side kernel was attributed"
    else:
        roof["met"] = frac >= target
    launches["value"] = attention["launches"]
    launches["met"] = attention["launches"] <= TARGET_LAUNCHES
    return {"path": "specialized", "roofline": roof, "launches": launches}


def assemble_cell(
    *,
    tp: int,
    batch: int,
    context: int,
    layer: int,
    kind: str,
    samples_us: Mapping[str, Sequence[float]],
    replays: Mapping[str, Sequence[Sequence[DeviceEvent]]],
    slots: Mapping[str, Sequence[Slot]],
    paths: Mapping[str, Mapping[str, str]],
    op_bytes: Mapping[str, int],
    bandwidth: float,
    unique_experts: int | None,
    agreement: Mapping[str, Any] | None,
    unmeasured: str | None,
    attribution: str,
    entry_launches: int,
) -> dict[str, Any]:
    """One cell of the results from its measurements (stock always; specialized where it ran). `entry_launches`:
    the copies of the entry state a graph of the layer starts with (the executor's own, not an op's)."""
    cell: dict[str, Any] = {
        "tp": tp,
        "batch": batch,
        "context": context,
        "layer": layer,
        "kind": kind,
        "paths": {p: dict(paths[p]) for p in paths},
        "specialized_unavailable": unmeasured,
        "unique_experts": unique_experts,
        "attribution": attribution,
        "bytes_by_op": dict(op_bytes),
        "agreement": dict(agreement) if agreement is not None else None,
        "layer_time": {p: summarize(list(samples_us[p])) for p in samples_us},
        "samples_us": {p: list(samples_us[p]) for p in samples_us},
    }
    measured = [p for p in PATHS if p in samples_us]
    # Kernels of the providers that ran: found in the specialized replays, and never in the stock ones.
    provider_names = {k for sl in slots.values() for s in sl if s.path == "specialized" for k in s.names}
    sides: dict[str, dict[str, Any]] = {"attention": {}, "moe": {}, ENTRY: {}, "mixed": {}}
    for p in measured:
        labelled = [list(zip(attribute_events(rep, slots[p], entry_launches), rep, strict=True)) for rep in replays[p]]
        for side in sides:
            with_bytes = side in ("attention", "moe")
            sides[side][p] = side_summary(labelled, side, op_bytes if with_bytes else None, bandwidth)
        cell.setdefault("provider_kernels_per_replay", {})[p] = _median(
            [sum(any(k in ev.name for k in provider_names) for ev in rep) for rep in replays[p]]
        )
        cell.setdefault("layer_launches", {})[p] = _median([len(rep) for rep in replays[p]])
        cell.setdefault("kernel_names", {})[p] = [f"{label}: {_short(ev.name)}" for label, ev in labelled[0]]
    cell["attention"], cell["moe"], cell["entry"] = sides["attention"], sides["moe"], sides[ENTRY]
    cell["unresolved"] = {p: s for p, s in sides["mixed"].items() if s["launches"]}  # labels across both sides
    special = "specialized" in measured
    cell["specialized_ran"] = (
        special
        and any(v == "specialized" for v in paths["specialized"].values())
        and cell["provider_kernels_per_replay"]["specialized"] > 0
    )
    if special:
        cell["layer_speedup"] = speedup_stats(samples_us["stock"], samples_us["specialized"])
        cell["attention_speedup"] = span_speedup(cell["attention"]["stock"], cell["attention"]["specialized"])
    verdict_of = cell["attention"].get("specialized") if cell["specialized_ran"] else None
    why = unmeasured if not special else "the specialized executor's graph ran no provider kernel"
    cell["targets"] = target_verdicts(tp, batch, verdict_of, why)
    return cell


# -- the run on the GPU -------------------------------------------------------------------------------------------


def rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (b: the stock side)."""
    a, b = a.double(), b.double()
    den = b.square().mean().sqrt()
    return float((a - b).square().mean().sqrt() / den) if den > 0 else math.inf


class L2Flush:
    """Evicts the L2 before a replay by touching a buffer over four times its size: by reading it (the default) or
    by writing it. A read leaves clean lines, as the layer before this one leaves in a decode step (it reads its
    weights and writes little). A write leaves the whole L2 dirty, and writing those lines back to HBM competes
    with the first kernels' reads, a cost no decode step has; the mode is in the results (config.flush)."""

    def __init__(self, mode: str, device: torch.device, size: int = FLUSH_BYTES) -> None:
        if mode not in ("read", "write"):
            raise ValueError(f"L2 flush mode must be 'read' or 'write', got {mode!r}")
        self.mode = mode
        self.buffer = torch.ones(size // 4, dtype=torch.int32, device=device)
        self.result = torch.zeros((), dtype=torch.int32, device=device)

    def __call__(self) -> None:
        if self.mode == "write":
            self.buffer.zero_()
        else:
            torch.amax(self.buffer, dim=0, out=self.result)


def time_interleaved(arms: Sequence[tuple[StackExecutor, str]], rounds: int, flush: L2Flush) -> list[list[float]]:
    """Per arm, `rounds` replay times (us) by CUDA events, each replay after an L2 flush, the arms alternating
    within every round (interleave_order) so that all see the same machine state."""
    for ex, name in arms:
        ex.replay(name, 3)
    starts = [[torch.cuda.Event(enable_timing=True) for _ in range(rounds)] for _ in arms]
    ends = [[torch.cuda.Event(enable_timing=True) for _ in range(rounds)] for _ in arms]
    for i in range(rounds):
        for a in interleave_order(len(arms), i):
            ex, name = arms[a]
            start, end = starts[a][i], ends[a][i]

            def before(_: int, start: Any = start) -> None:
                flush()  # queued ahead of the replay: the GPU is busy while the host enqueues the events
                start.record()

            ex.replay(name, 1, before, lambda _, end=end: end.record())
    torch.cuda.synchronize()
    return [[s.elapsed_time(e) * 1e3 for s, e in zip(starts[a], ends[a], strict=True)] for a in range(len(arms))]


def profiled_replays(
    arms: Sequence[tuple[StackExecutor, str]], replays: int, flush: L2Flush
) -> tuple[list[list[list[DeviceEvent]]], str]:
    """Per arm, the device events of each of `replays` profiled replays, and how they were told apart."""

    def run() -> None:
        for _ in range(replays):
            for ex, name in arms:
                ex.replay(name, 1, lambda _: flush())

    groups = graph_replays(profile(run))
    if len(groups) == replays * len(arms):
        return [groups[a :: len(arms)] for a in range(len(arms))], "per graph launch, L2 flushed before each replay"
    log(f"graph-launch correlation gave {len(groups)} replays for {replays * len(arms)}; splitting unflushed replays")
    out = []
    for ex, name in arms:
        events = device_events(profile(lambda ex=ex, name=name: ex.replay(name, replays)))
        out.append(split_even(events, replays))
    return out, f"even split of {replays} back-to-back replays without L2 flush (graph-launch grouping failed)"


TRACED = (("kda_in_proj", kda_in_proj_op), ("kda_step", kda_step_op), ("kda_o_proj", kda_o_proj_op))  # launch order


def traced_replay(ex: StackExecutor, name: str, flush: L2Flush) -> dict[str, Any]:
    """One replay of graph `name` after an L2 flush with the traced kernels' stamps cleared first, summarized per
    kernel and phase (phase_trace.summarize). Only meaningful with phase_trace enabled before the executor
    started; the graph's kernels then write their stamps into the counters it captured."""
    device = torch.device("cuda", torch.cuda.current_device())
    counters = {kernel: op.launch_counter(device) for kernel, op in TRACED}
    for c in counters.values():
        c[1:].zero_()
    ex.replay(name, 1, lambda _: flush())
    torch.cuda.synchronize()
    traces = {kernel: phase_trace.decode(c.tolist(), kernel) for kernel, c in counters.items()}
    return phase_trace.summarize({k: t for k, t in traces.items() if t})


def _agreement(stock: Any, special: Any, layer: int, ids: Sequence[int]) -> dict[str, Any]:
    """Relative RMS differences of the specialized step's outputs against the stock step's (same inputs, state)."""
    want = {t.layer: t for t in stock.trace}[layer]
    got = {t.layer: t for t in special.trace}[layer]
    out: dict[str, Any] = {f"layer{layer}.{name}": rms_rel(getattr(got, name), t) for name, t in want.hidden()}
    out["stack_output"] = rms_rel(
        torch.cat([special.outputs[r] for r in ids]), torch.cat([stock.outputs[r] for r in ids])
    )
    out["layer_output_rms_rel"] = out[f"layer{layer}.mlp_output"]
    out["identical"] = all(v == 0 for k, v in out.items() if k != "identical")  # would mean no provider ran
    return out


def run_tp(
    tp: int, args: argparse.Namespace, bandwidth: float, flush: L2Flush, save: Callable[[dict], None]
) -> dict[str, Any]:
    t0 = time.perf_counter()
    config = load_stack(args.stack, tp, graph_batches=tuple(sorted(set(args.batches))))
    stock = StackExecutor.start(config, device="cuda", log=log)
    special: StackExecutor | None = None
    unmeasured = None
    try:
        special = StackExecutor.start(config, SPECIALIZED, device="cuda", weights=stock.weights, log=log)
    except (StartupError, ProviderBindError, StepRoutingError) as exc:  # BackendError is a StartupError
        unmeasured = f"{type(exc).__name__}: {exc}"
        log(f"TP{tp}: the specialized executor did not start, timing stock only: {unmeasured}")
    run: dict[str, Any] = {
        "tp": tp,
        "build_s": time.perf_counter() - t0,
        "specialized_unavailable": unmeasured,
        "providers": [
            {"op": p.op, "name": p.name, "kernels": dict(p.launches)} for p in (special.registry if special else [])
        ],
        "cells": [],
    }
    arms: list[tuple[str, StackExecutor]] = [("stock", stock)] + ([("specialized", special)] if special else [])
    dims, layer = config.dims, config.kda_layers[0]
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if layer != config.layers[0]:
        raise ValueError(
            f"stack {args.stack} must start with its KDA layer (one entry state feeds the step and the graph)"
        )
    kind = f"{dims.layer_kind(layer)}+{dims.mlp_kind(layer)}"
    by = f"benchmarks/kda_layer_h200.py TP{tp}"
    stock.ledger.expect(Expectation("stock", by))
    if special is not None:
        # Ops the op table never specializes must run stock; which of the others ran specialized (a provider may be
        # limited to some batches by the plan) is recorded per cell from the graph's records, with the reasons.
        table = special.planner.table
        special.ledger.expect(
            *(
                Expectation("stock", by, op=op, layer=other)
                for other in config.layers
                for part, op in table.layer_ops(dims, other)
                if op not in part.specialized
            )
        )
    info = {op: (i.names, i.absorbs_unnamed) for op, i in stock_kernel_info().items()}
    log(f"TP{tp}: executors built in {run['build_s']:.1f} s ({', '.join(p for p, _ in arms)})")
    for batch in args.batches:
        t_cell = time.perf_counter()
        try:
            ids = list(range(batch))
            for _, ex in arms:  # the same state on both before every batch
                ex.state.fill_synthetic(range(config.max_requests), args.context, seed=tp)
            entry = random_input(dims, layer, batch, seed=1000 + batch, device="cuda")
            reqs = [StepRequest(r, entry.rows(slice(b, b + 1))) for b, r in enumerate(ids)]
            # One eager step of the same inputs on both (compiles the CuTe kernels for this batch, warms cuBLAS).
            steps = {p: ex.step(reqs, trace=True) for p, ex in arms}
            agreement = _agreement(steps["stock"], steps["specialized"], layer, ids) if special else None
            layer_trace = {t.layer: t for t in steps["stock"].trace}[layer]
            unique = None if layer_trace.expert_ids is None else int(layer_trace.expert_ids.unique().numel())
            names = {}
            for p, ex in arms:
                names[p] = ex.capture(batch, (layer,))
                ex.load_graph_inputs(names[p], reqs)
            graphs = [(ex, names[p]) for p, ex in arms]
            samples = dict(zip([p for p, _ in arms], time_interleaved(graphs, args.reps, flush), strict=True))
            events, source = profiled_replays(graphs, args.profile_replays, flush)
            phases = traced_replay(special, names["specialized"], flush) if args.trace and special else None
            paths, slots = {}, {}
            for p, ex in arms:
                paths[p] = {r.op: r.path for r in ex.ledger.records() if r.graph == names[p] and r.layer == layer}
                pairs = ex.opmap.layer_ops(ex.planner.table, dims, layer)
                slots[p] = layer_slots(pairs, paths[p], ex.kernel_catalog().launches, info)
            pairs = stock.opmap.layer_ops(stock.planner.table, dims, layer)
            seq_lens = tuple(stock.state.context_lens[r] + 1 for r in ids)
            shape = StepShape(batch, seq_lens, stock.graphs[names["stock"]].num_splits, unique)
            op_bytes = runtime_op_bytes(pairs, layer_bytes(dims, tp, layer, shape))
            cell = assemble_cell(
                tp=tp,
                batch=batch,
                context=args.context,
                layer=layer,
                kind=kind,
                samples_us=samples,
                replays={p: e for (p, _), e in zip(arms, events, strict=True)},
                slots=slots,
                paths=paths,
                op_bytes=op_bytes,
                bandwidth=bandwidth,
                unique_experts=unique,
                agreement=agreement,
                unmeasured=unmeasured,
                attribution=source,
                entry_launches=1 + int(entry_blocks(dims, layer) > 0),  # prefix (and bank) copies: forward.py
            )
            if special is not None:
                cell["specialized_stock_reasons"] = {
                    r.op: r.reason
                    for r in special.ledger.records()
                    if r.graph == names["specialized"] and r.layer == layer and r.path == "stock"
                }
            if cell["paths"].get("specialized", {}).get("kda") == "specialized":
                cell["kda_step_plan"] = kda_step_plan_tag(dims, tp, batch, sms)
            if cell["paths"].get("specialized", {}).get("o_proj") == "specialized":
                cell["o_proj_variant"] = o_proj_variant(dims, layer, tp, batch)
            if cell["paths"].get("specialized", {}).get("in_proj") == "specialized":
                # which build kda_in_proj_choice.toml served (files before the wgmma stream have none)
                cell["in_proj_kernel"] = kda_in_proj_op.kernel_for_rows(batch, dims.shard(tp).kda_in_proj_rows)
            if phases is not None:
                cell["phase_trace"] = phases
            cell["cell_s"] = time.perf_counter() - t_cell
            run["cells"].append(cell)
            att = cell["attention"]
            line = [f"TP{tp} B{batch}: layer stock {cell['layer_time']['stock']['median_us']:.1f} us"]
            line.append(f"attention stock {att['stock']['time_us']:.1f} us/{att['stock']['launches']:.0f} launches")
            if special:
                line.append(f"layer specialized {cell['layer_time']['specialized']['median_us']:.1f} us")
                line.append(f"speedup {cell['layer_speedup']['speedup']:.3f}")
                s = att["specialized"]
                line.append(
                    f"attention specialized {s['time_us']:.1f} us/{s['launches']:.0f} launches, "
                    f"{100 * (s.get('roofline_fraction') or 0):.0f}% of roofline, "
                    f"rms_rel {agreement['layer_output_rms_rel']:.1e}"  # type: ignore[index]
                )
            log(", ".join(line) + f" ({cell['cell_s']:.1f} s)")
        except Exception as exc:  # one failing cell must not lose the others: record it and go on
            traceback.print_exc()
            run["cells"].append({"tp": tp, "batch": batch, "error": f"{type(exc).__name__}: {exc}"})
        save(run)
    run["ledger"] = {p: {"summary": ex.ledger.summary(), "expectation_mismatches": ex.ledger.check()} for p, ex in arms}
    return run


def kda_step_plan_tag(dims: ModelDims, tp: int, batch: int, sm_count: int) -> str:
    """The fused KDA step's plan the provider serves at `batch` (cluster, register budget, warming, requests per
    cluster and local decays: KdaStepPlan.for_shape and kda_step_choice.toml), so a results file names the variant it
    timed."""
    shard = dims.shard(tp)
    return KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, batch, sm_count).tag


def o_proj_variant(dims: ModelDims, layer: int, tp: int, batch: int) -> dict[str, bool]:
    """What kda_o_proj_choice.toml serves the fused o_proj at `layer` and `batch` (its launch capped to ctas_per_sm
    CTAs an SM; its stream in one pass; L2 warmed with its late weight runs where it has any; W staged in shared
    memory; W sent to L2 alone before the wait; the wgmma build; its W past the ring's first tiles sent to L2; each
    epilogue cluster's two rows exchanged together; the CTAs an SM the wgmma build's ring is sized for), so a results
    file names the variant it timed."""
    blocks = dims.blocks_before(layer)
    return {
        "capped": capped_at(batch),
        "one_pass": one_pass_at(batch, blocks),
        "warm": warm_at(batch),
        "w_smem": w_smem_at(batch),
        "w_l2": w_l2_at(batch),
        "wgmma": wgmma_at(batch),
        "wgmma_w_l2": wgmma_w_l2_at(batch),
        "wgmma_w_l2_late": wgmma_w_l2_late_at(batch),
        "wgmma_ctas_per_sm": wgmma_ctas_per_sm_at(batch, dims.shard(tp).kda_o_proj[1]),
        "paired_rows": paired_at(batch, blocks),
    }


def providers_declared() -> dict[str, Any]:
    return {
        "declared": [{"op": p.op, "name": p.name, "kernels": dict(p.launches)} for p in PROVIDERS],
        "not_built_reason": not_built_reason(),
    }


# -- the table ----------------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float) -> str:
    return f"{x:g}"


def _side(s: Mapping[str, Any] | None) -> str:
    if not s:
        return "-"
    return f"{s['span_us']:.1f} us (sum {s['time_us']:.1f}), {s['launches']:g}, {_pct(s.get('roofline_fraction_span'))}"


def _verdict(v: Mapping[str, Any], fmt: Callable[[Any], str]) -> str:
    if v.get("value") is None and v["met"] is None:
        return "not judged"
    if v["target"] is None:
        return f"none set ({fmt(v['value'])})"
    if v.get("value") is None:
        return f"MISSED (nothing measured vs {fmt(v['target'])})"
    return f"{'met' if v['met'] else 'MISSED'} ({fmt(v['value'])} vs {fmt(v['target'])})"


def timeline_lines(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """The attention side's timeline per cell and path, one line each: `op start-end` per kernel and the span.

    Results files from before the timeline have none in any cell: they get no section at all, so their tables stay
    what they were; a cell without one in a file that has some says so on its line."""
    sides = [
        (c, p, c["attention"][p])
        for c in cells
        for p in ("specialized", "stock")
        if c["attention"].get(p) and (p == "stock" or c.get("specialized_ran"))
    ]
    if not any("timeline" in s or "timeline_note" in s for _, _, s in sides):
        return []
    out = [
        "",
        "Attention side timeline (specialized and stock), us from the first kernel's start: `op start-end` per "
        "kernel in launch order, medians over the profiled replays (ranges that overlap: programmatic dependent "
        "launch)",
        "",
    ]
    for c, p, s in sides:
        head = f"- TP{c['tp']} B{c['batch']} {p}"
        if "timeline" in s:
            kernels = " | ".join(f"{r['op']} {r['start_us']:.1f}-{r['end_us']:.1f}" for r in s["timeline"])
            out.append(f"{head}: {kernels or 'no kernels'} (span {s['span_us']:.1f})")
        else:
            out.append(f"{head}: {s.get('timeline_note') or 'no timeline (measured before timelines were recorded)'}")
    return out


def span_breakdown(cell: Mapping[str, Any], bandwidth: float) -> dict[str, float | None] | None:
    """Where the specialized attention side's span goes, from its timeline (None without one, or without a
    projection in it): the projection's start and end (its kernels' first start and last end, us from the side's
    first kernel), its bytes and rate and that rate's fraction of the copy bandwidth, how long after it the KDA step
    ends and after that the side, and the span the roofline target allows (roofline / target; None without one)."""
    side = cell["attention"].get("specialized") if cell.get("specialized_ran") else None
    timeline = (side or {}).get("timeline") or []
    proj = [r for r in timeline if r["op"] == "in_proj"]
    step = [r for r in timeline if r["op"] == "kda"]
    if not proj or not step:
        return None
    start, end = min(r["start_us"] for r in proj), max(r["end_us"] for r in proj)
    proj_bytes = side["bytes_by_op"]["in_proj"]
    rate = proj_bytes / ((end - start) * 1e-6)
    step_end = max(r["end_us"] for r in step)
    target = roofline_target(cell["tp"], cell["batch"])
    return {
        "span_us": side["span_us"],
        "target_span_us": side["roofline_us"] / target if target else None,
        "proj_start_us": start,
        "proj_end_us": end,
        "proj_bytes": proj_bytes,
        "proj_bytes_per_s": rate,
        "proj_fraction": rate / bandwidth,
        "step_after_us": step_end - end,
        "rest_after_us": side["span_us"] - step_end,
    }


def span_lines(cells: Sequence[Mapping[str, Any]], bandwidth: float) -> list[str]:
    """The span breakdown (span_breakdown) of every specialized cell with a timeline: what the projection takes,
    what the chain after it takes, and what the roofline target leaves that chain."""
    rows = [(c, span_breakdown(c, bandwidth)) for c in cells]
    rows = [(c, b) for c, b in rows if b]
    if not rows:
        return []
    out = [
        "",
        "Where the specialized span goes (from the timeline above): the projection's kernels, the KDA step's end after "
        "the projection's, the side's end after the step's, and the chain after the projection now against what the "
        "roofline target leaves it (target span = roofline / target)",
        "",
        "| TP | B | span / target span (us) | projection | step ends after it | side ends after the step "
        "| after the projection: now / the target leaves (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, b in rows:
        target = b["target_span_us"]
        after = b["span_us"] - b["proj_end_us"]
        left = "-" if target is None else f"{target - b['proj_end_us']:.1f}"
        proj = (
            f"{b['proj_start_us']:.1f}-{b['proj_end_us']:.1f} us: {b['proj_bytes'] / 1e6:.1f} MB at "
            f"{b['proj_bytes_per_s'] / 1e12:.2f} TB/s, {_pct(b['proj_fraction'])} of copy"
        )
        out.append(
            f"| {c['tp']} | {c['batch']} | {b['span_us']:.1f} / {'-' if target is None else f'{target:.1f}'} | "
            f"{proj} | +{b['step_after_us']:.1f} | +{b['rest_after_us']:.1f} | {after:.1f} / {left} |"
        )
    return out


def phase_lines(cells: Sequence[Mapping[str, Any]], traced: bool) -> list[str]:
    """The phase traces of the cells that have one (a `--trace` run), kernel by kernel and phase by phase."""
    traced_cells = [c for c in cells if c.get("phase_trace")]
    if not traced_cells:
        return []
    out = [
        "",
        "Phase traces of the specialized path, one replay per cell after an L2 flush: us since the first traced "
        "CTA's start (the projection's), median (min-max) over the CTAs that stamped the phase"
        + (" (a traced build: its timings above are diagnostic, not the benchmark's figures)" if traced else ""),
        "",
    ]
    for c in traced_cells:
        out += ["```", f"TP{c['tp']} B{c['batch']}", *phase_trace.lines(c["phase_trace"]), "```"]
    return out


def kda_layers_like(dims: ModelDims, layer: int) -> int:
    """The KDA layers of `dims` a timed `layer` stands for: those on its side of providers.toml's [o_proj.mixing]
    min_blocks (the AttnRes after attention mixing one block or two and more), where the fused o_proj serves other
    rows; every KDA layer when o_proj has no mixing rows."""
    kda = [i for i, kind in enumerate(dims.layer_kinds) if kind == "kda"]
    least = mixing_min_blocks("o_proj")
    if least is None:
        return len(kda)
    return sum((dims.blocks_before(i) >= least) == (dims.blocks_before(layer) >= least) for i in kda)


def cells_by_key(results: Mapping[str, Any]) -> dict[tuple[int, int], Mapping[str, Any]]:
    """A results file's cells by (TP, batch)."""
    return {(c["tp"], c["batch"]): c for run in results["runs"] for c in run.get("cells", [])}


def layer_savings(base: Mapping[str, Any], variant: Mapping[str, Any]) -> tuple[int, dict[tuple[int, int], float]]:
    """The layer two results files of the same stack timed, and per (TP, batch) the specialized layer time (us) the
    variant saved against the base: the base's stock median over each file's interleaved speedup, so that drift
    between the two runs' stock times does not count. Raises ValueError for files of different layers or cells."""
    cells = [cells_by_key(doc) for doc in (base, variant)]
    layers = {c["layer"] for doc in cells for c in doc.values()}
    if len(layers) != 1:
        raise ValueError(f"the two results files time different layers ({sorted(layers)}); compare one stack's runs")
    if set(cells[0]) != set(cells[1]):
        raise ValueError(f"the two results files hold different cells: {sorted(cells[0])} and {sorted(cells[1])}")
    saved = {}
    for key, b in cells[0].items():
        stock = b["layer_time"]["stock"]["median_us"]
        saved[key] = stock / b["layer_speedup"]["speedup"] - stock / cells[1][key]["layer_speedup"]["speedup"]
    return layers.pop(), saved


def _interval_verdict(base: Mapping[str, Any], variant: Mapping[str, Any]) -> str:
    if variant["low"] > base["high"]:
        return "faster"
    if variant["high"] < base["low"]:
        return "slower"
    return "intervals overlap"


def compare_lines(base: Mapping[str, Any], variant: Mapping[str, Any], dims: ModelDims) -> list[str]:
    """A markdown table of a variant run against its base (kda_layer_h200.py results of the same stack and cells):
    per cell the layer speedups over stock with their intervals, the time the variant saves on the layer and on the
    KDA layers it stands for (kda_layers_like), and the attention side's span."""
    layer, saved = layer_savings(base, variant)
    like = kda_layers_like(dims, layer)
    names = [(doc.get("variant") or {}).get("name") or role for doc, role in ((base, "base"), (variant, "variant"))]
    cells = [cells_by_key(doc) for doc in (base, variant)]
    out = [
        f"{names[1]} against {names[0]}, layer {layer} (stands for {like} KDA layers): layer speedup over stock "
        "(95% interval), layer time saved (us; negative: lost), the attention side's span (us)",
        "",
        "| TP | B | base | variant | verdict | saved a layer | saved on its KDA layers | span, base / variant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(saved):
        b, v = (c[key] for c in cells)
        bs, vs = b["layer_speedup"], v["layer_speedup"]
        spans = [c["attention"]["specialized"].get("span_us") for c in (b, v)]
        span = " / ".join("-" if x is None else f"{x:.1f}" for x in spans)
        out.append(
            f"| {key[0]} | {key[1]} | {bs['speedup']:.4f} ({bs['low']:.4f}-{bs['high']:.4f}) | "
            f"{vs['speedup']:.4f} ({vs['low']:.4f}-{vs['high']:.4f}) | {_interval_verdict(bs, vs)} | "
            f"{saved[key]:+.2f} | {like * saved[key]:+.1f} | {span} |"
        )
    return out


def round_savings(
    pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
) -> tuple[int, dict[tuple[int, int], list[float | None]]]:
    """The layer the (base, variant) pairs timed and, per (TP, batch), the layer time each pair's variant saved
    (layer_savings), None where a pair did not time the cell. Raises ValueError for pairs of different layers."""
    layers, per_pair = set(), []
    for base, variant in pairs:
        layer, saved = layer_savings(base, variant)
        layers.add(layer)
        per_pair.append(saved)
    if len(layers) != 1:
        raise ValueError(f"the rounds time different layers ({sorted(layers)}); give one stack's rounds")
    keys = sorted(set().union(*per_pair))
    return layers.pop(), {key: [saved.get(key) for saved in per_pair] for key in keys}


def every_round(saved: Sequence[float | None]) -> str:
    """The rule the choice files are bound by: a variant serves a cell where it saved layer time in every round that
    timed it."""
    timed = [s for s in saved if s is not None]
    if not timed:
        return "not timed"
    if all(s > 0 for s in timed):
        return "saved in every round"
    if all(s < 0 for s in timed):
        return "lost in every round"
    return "mixed"


def model_round_savings(
    per_layer: Mapping[int, Mapping[tuple[int, int], Sequence[float | None]]], dims: ModelDims
) -> dict[tuple[int, int], list[float | None]]:
    """Per (TP, batch) every layer's rounds timed: round i's layer time saved on each layer (round_savings), times the
    KDA layers that layer stands for (kda_layers_like), summed: the model's KDA time the variant saved per decode step
    (us), None where a layer's round i did not time the cell. Round i of one layer is paired with round i of the
    others, so every layer needs as many rounds. Raises ValueError otherwise, or for fewer than two layers."""
    if len(per_layer) < 2:
        raise ValueError(f"model time weighs the rounds of two or more layers, got layer {sorted(per_layer)} only")
    counts = {layer: {len(per_round) for per_round in saved.values()} for layer, saved in per_layer.items()}
    if len({n for c in counts.values() for n in c}) != 1:
        raise ValueError(f"each layer needs as many rounds to pair them, got {counts}")
    weights = {layer: kda_layers_like(dims, layer) for layer in per_layer}
    keys = set.intersection(*(set(saved) for saved in per_layer.values()))
    out = {}
    for key in sorted(keys):
        rounds = zip(*(per_layer[layer][key] for layer in per_layer), strict=True)
        out[key] = [
            None
            if None in per_round
            else sum(weights[layer] * us for layer, us in zip(per_layer, per_round, strict=True))
            for per_round in rounds
        ]
    return out


def rounds_lines(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> list[str]:
    """A markdown table of several rounds of a variant against its base: per cell the layer time each round saved
    (us; -: not timed in that round), their mean and the every-round verdict."""
    layer, saved = round_savings(pairs)
    heads = " | ".join(f"round {i + 1}" for i in range(len(pairs)))
    out = [
        f"{len(pairs)} rounds, layer {layer}: layer time the variant saved (us; negative: lost; -: not timed)",
        "",
        f"| TP | B | {heads} | mean | verdict |",
        "|---|---|" + "---|" * len(pairs) + "---|---|",
    ]
    for (tp, batch), per_round in saved.items():
        out.append(_round_row(tp, batch, per_round))
    return out


def _round_row(tp: int, batch: int, per_round: Sequence[float | None], digits: int = 2) -> str:
    timed = [s for s in per_round if s is not None]
    cells = " | ".join("-" if s is None else f"{s:+.{digits}f}" for s in per_round)
    mean = f"{sum(timed) / len(timed):+.{digits}f}" if timed else "-"
    return f"| {tp} | {batch} | {cells} | {mean} | {every_round(per_round)} |"


def model_rounds_lines(
    stacks: Sequence[Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]], dims: ModelDims
) -> list[str]:
    """Each stack's rounds table (rounds_lines), then the model time each round saved where every stack timed the
    cell (model_round_savings): the verdict the step's and o_proj's choice files are bound by."""
    per_layer, out = {}, []
    for pairs in stacks:
        layer, saved = round_savings(pairs)
        if layer in per_layer:
            raise ValueError(f"two stacks time layer {layer}; give one stack's rounds per layer")
        per_layer[layer] = saved
        out += [*rounds_lines(pairs), ""]
    model = model_round_savings(per_layer, dims)
    weights = " + ".join(f"{kda_layers_like(dims, layer)} x layer {layer}" for layer in per_layer)
    heads = " | ".join(f"round {i + 1}" for i in range(len(stacks[0])))
    out += [
        f"model time the variant saved per decode step (us; {weights}; round i of each stack paired)",
        "",
        f"| TP | B | {heads} | mean | verdict |",
        "|---|---|" + "---|" * len(stacks[0]) + "---|---|",
    ]
    return out + [_round_row(tp, batch, per_round, digits=1) for (tp, batch), per_round in model.items()]


def markdown(results: Mapping[str, Any]) -> str:
    """The tables of docs/kda-layer-h200.md, from a results file (every number there traces to the JSON)."""
    bw = results["copy_bandwidth"]["bandwidth_bytes_per_s"]
    out = [f"Copy bandwidth measured in the run: {bw / 1e12:.2f} TB/s.", ""]
    for p in results.get("providers", {}).get("declared", []):
        out.append(f"- provider `{p['name']}`: op {p['op']}, kernels {', '.join(p['kernels'])}")
    runs = results.get("runs", [])
    for run in runs:
        if run.get("error"):
            out.append(f"- TP{run['tp']}: the run failed: {run['error']}")
        elif run.get("specialized_unavailable"):
            out.append(f"- TP{run['tp']}: specialized path not measured (stock only): {run['specialized_unavailable']}")
    cells = sorted(
        (c for run in runs for c in run.get("cells", []) if "error" not in c), key=lambda c: (c["tp"], c["batch"])
    )
    errors = [c for run in runs for c in run.get("cells", []) if "error" in c]
    out += [f"- TP{c['tp']} B{c['batch']}: failed: {c['error']}" for c in errors]
    what = ", ".join(sorted({f"layer {c['layer']} ({c['kind']})" for c in cells})) or "the KDA layer"
    out += [
        "",
        f"{what}: one CUDA graph per path, interleaved replays after an L2 flush (us, median and p10-p90)",
        "",
        "| TP | B | stock | specialized | speedup (95% interval) | layer output rel. RMS diff | specialized ops |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        t = c["layer_time"]
        cols = [f"{t['stock']['median_us']:.1f} ({t['stock']['p10_us']:.1f}-{t['stock']['p90_us']:.1f})"]
        sp = t.get("specialized")
        ran = [op for op, path in c["paths"].get("specialized", {}).items() if path == "specialized"]
        if sp and c.get("specialized_ran"):
            s = c["layer_speedup"]
            cols.append(f"{sp['median_us']:.1f} ({sp['p10_us']:.1f}-{sp['p90_us']:.1f})")
            cols.append(f"{s['speedup']:.3f} ({s['low']:.3f}-{s['high']:.3f})")
            cols.append(f"{c['agreement']['layer_output_rms_rel']:.1e}")
            cols.append(", ".join(ran))
        elif sp:
            cols += ["ran no provider kernel", "-", "-", ", ".join(ran) or "none"]
        else:
            cols += ["not measured", "-", "-", "-"]
        out.append(f"| {c['tp']} | {c['batch']} | " + " | ".join(cols) + " |")
    out += [
        "",
        "Attention side (AttnRes + in_proj + KDA step + o_proj + AttnRes) in profiled replays: time as the span from "
        "the first kernel's start to the last one's end (the sum of kernel durations beside it, which counts "
        "overlapping kernels twice), launches, and the roofline fraction of the span; the speedup and the roofline "
        "target are judged on the span (the verdicts derived here from the recorded times, by target_verdicts)",
        "",
        "| TP | B | bytes (MB) | roofline (us) | stock | specialized | speedup | roofline target | launches <= 4 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        a = c["attention"]
        st, sp = a["stock"], a.get("specialized") if c.get("specialized_ran") else None
        speed = f"{span_speedup(st, sp):.2f}" if sp and sp.get("span_us") else "-"
        tg = target_verdicts(c["tp"], c["batch"], sp, c.get("specialized_unavailable"))
        out.append(
            f"| {c['tp']} | {c['batch']} | {st['bytes'] / 1e6:.2f} | {st['roofline_us']:.1f} | {_side(st)} | "
            f"{_side(sp)} | {speed} | {_verdict(tg['roofline'], _pct)} | {_verdict(tg['launches'], _num)} |"
        )
    out += [
        "",
        "Attention side per op: launches, kernel us, of roofline (joined ops could not be told apart)",
        "",
        "| TP | B | path | " + " | ".join(ATTENTION_OPS) + " | other |",
        "|---|---|---|" + "---|" * (len(ATTENTION_OPS) + 1),
    ]
    for c in cells:
        for p in PATHS:
            s = c["attention"].get(p)
            if not s or (p == "specialized" and not c.get("specialized_ran")):
                continue
            by = s["by_op"]
            cols = []
            for op in ATTENTION_OPS:
                row = by.get(op)
                cols.append(
                    "-"
                    if row is None
                    else f"{row['launches']:g}, {row['time_us']:.1f}, {_pct(row.get('roofline_fraction'))}"
                )
            joined = [f"{k}: {v['launches']:g}, {v['time_us']:.1f}" for k, v in by.items() if k not in ATTENTION_OPS]
            out.append(f"| {c['tp']} | {c['batch']} | {p} | " + " | ".join(cols) + f" | {'; '.join(joined) or '-'} |")
    out += timeline_lines(cells)
    out += span_lines(cells, bw)
    out += phase_lines(cells, traced=bool(results.get("traced")))
    out += [
        "",
        "MoE part of the same layer (stock on both paths; not part of the attention side)",
        "",
        "| TP | B | bytes (MB) | distinct experts | stock | specialized |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        m = c["moe"]
        sp = m.get("specialized") if c.get("specialized_ran") else None
        out.append(
            f"| {c['tp']} | {c['batch']} | {m['stock']['bytes'] / 1e6:.1f} | {c['unique_experts']} | "
            f"{_side(m['stock'])} | {_side(sp)} |"
        )
    unresolved = [c for c in cells if c.get("unresolved")]
    if unresolved:
        out += ["", "Kernels that could not be placed on either side (counted on neither):", ""]
        out += [f"- TP{c['tp']} B{c['batch']}: {json.dumps(c['unresolved'])}" for c in unresolved]
    return "\n".join(out) + "\n"


# -- main ---------------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--table", metavar="RESULTS", help="print the markdown tables of a results file and exit")
    ap.add_argument("--out", help="where to write the JSON results")
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument(
        "--stack",
        default=STACK,
        help=f"the layer stack (k3_decode/executor/stacks.toml) whose first, KDA layer is timed; default {STACK}",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES))
    ap.add_argument("--context", type=int, default=4096, help="tokens of context every request holds")
    ap.add_argument("--reps", type=int, default=200, help="interleaved rounds (one timed replay per path each)")
    ap.add_argument(
        "--flush",
        choices=("read", "write"),
        default="read",
        help="how the L2 is flushed before each replay: read a large buffer (clean lines, as in decode) or write it",
    )
    ap.add_argument("--profile-replays", type=int, default=PROFILED_REPLAYS, help="profiled replays per path")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="build the projection, the KDA step and o_proj with phase stamps (k3_decode/kernels/phase_trace.py) and "
        "record where each CTA's time goes in one replay per cell; the stamps perturb the timings a little, so write "
        "a separate results file",
    )
    ap.add_argument(
        "--choice",
        action="append",
        default=[],
        metavar="FILE=PATH",
        help=f"serve PATH in place of the choice file FILE ({', '.join(CHOICE_FILES)}) in this run, without editing "
        "the tree; the results record each file's text under `variant`",
    )
    ap.add_argument("--variant", help="a name for what this run timed, recorded under `variant` with the choices")
    ap.add_argument(
        "--compare",
        nargs=2,
        metavar=("BASE", "VARIANT"),
        help="print a variant run's layer speedups and savings against its base (two results files) and exit",
    )
    ap.add_argument(
        "--rounds",
        nargs="+",
        metavar="FILE",
        help="BASE VARIANT [BASE VARIANT ...]: print the layer time each round's variant saved per cell, and whether "
        "it saved in every round that timed the cell, and exit; given the rounds of two stacks (layers 6 and 86, as "
        "many of each, round i of each paired in the order given), also the model time each round saved, each layer "
        "weighed by the KDA layers it stands for (the rule the choice files are bound by)",
    )
    return ap


CHOICE_FILES = {
    "kda_step_choice.toml": (kda_step_plan, kda_step_plan.variant_rules),
    "kda_o_proj_choice.toml": (kda_o_proj_plan, kda_o_proj_plan.choice),
    "providers.toml": (providers, providers.limits),  # the rows each provider serves
    "kda_in_proj_choice.toml": (kda_in_proj_choice, kda_in_proj_choice.choice),
}


def apply_choices(specs: Sequence[str]) -> dict[str, str]:
    """Serve each --choice FILE=PATH in this process (the module's CHOICE now names PATH), after checking it as the
    plan would read it; returns {FILE: PATH's text}. Raises ValueError, one line, naming what is wrong; nothing is
    applied unless every file checks."""
    paths: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise ValueError(f"--choice {spec!r}: write FILE=PATH, FILE one of {', '.join(CHOICE_FILES)}")
        if name not in CHOICE_FILES:
            raise ValueError(f"--choice {spec!r}: no choice file {name!r}; the files are {', '.join(CHOICE_FILES)}")
        if name in paths:
            raise ValueError(f"--choice names {name} twice; give each file once")
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"--choice {name}: no such file {path}")
        try:
            CHOICE_FILES[name][1](file)  # TOML syntax errors are ValueErrors too
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--choice {name}={path}: {exc}") from None
        paths[name] = file
    for name, file in paths.items():
        CHOICE_FILES[name][0].CHOICE = file
    return {name: file.read_text() for name, file in paths.items()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())), end="")
        return 0
    if args.compare:
        try:
            docs = [json.loads(Path(p).read_text()) for p in args.compare]
            stacks = {doc.get("stack", STACK) for doc in docs}
            if len(stacks) != 1:
                raise ValueError(f"the two results files time different stacks ({sorted(stacks)})")
            dims = load_dims(load_stack(stacks.pop(), 8).model)
            print("\n".join(compare_lines(*docs, dims)))
        except (OSError, ValueError, KeyError, StackConfigError) as exc:
            print(f"kda_layer_h200.py --compare: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.rounds:
        try:
            if len(args.rounds) % 2:
                raise ValueError(f"--rounds takes BASE VARIANT pairs, got {len(args.rounds)} files")
            docs = [json.loads(Path(p).read_text()) for p in args.rounds]
            by_stack: dict[str, list[tuple[Mapping[str, Any], Mapping[str, Any]]]] = {}
            for base, variant in zip(docs[::2], docs[1::2], strict=True):
                stacks = {doc.get("stack", STACK) for doc in (base, variant)}
                if len(stacks) != 1:
                    raise ValueError(f"a BASE VARIANT pair times different stacks ({sorted(stacks)})")
                by_stack.setdefault(stacks.pop(), []).append((base, variant))
            pairs = list(by_stack.values())
            if len(pairs) == 1:
                print("\n".join(rounds_lines(pairs[0])))
            else:
                models = {load_stack(stack, 8).model for stack in by_stack}
                if len(models) != 1:
                    raise ValueError(f"the stacks are of different models ({sorted(models)})")
                print("\n".join(model_rounds_lines(pairs, load_dims(models.pop()))))
        except (OSError, ValueError, KeyError) as exc:
            print(f"kda_layer_h200.py --rounds: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        return 0
    if not args.out:
        ap.error("--out is required to run the benchmark (or pass --table RESULTS)")
    if args.reps < MIN_ROUNDS:
        ap.error(f"--reps must be at least {MIN_ROUNDS} (two rounds of each order for the speedup interval)")
    if args.profile_replays < 1 or min(args.batches) < 1:
        ap.error("--profile-replays and every batch must be at least 1")
    try:
        first_layer = load_stack(args.stack, args.tp[0]).layers[0]
    except StackConfigError as exc:
        ap.error(str(exc))
    try:
        choices = apply_choices(args.choice)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        print("kda_layer_h200.py: no CUDA device here; run it on the GPU machine (an H200)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    phase_trace.enable(args.trace)  # before any executor compiles or captures a kernel
    device = torch.device("cuda")
    out = Path(args.out)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "attention side of a Kimi K3 KDA layer: latency_specialized against stock, interleaved (issue 8)",
        "stack": args.stack,
        "notes": [
            "one GPU holds rank 0's shard at each TP size; the TP all-reduce after o_proj is the identity here",
            f"layer times: CUDA-graph replays of layer {first_layer} (KDA + MoE) after an L2 flush, by CUDA events, "
            "the two paths alternating in every round (even rounds stock first); speedup = stock / specialized",
            "attention side: ops attn_res, in_proj, kda, o_proj; the kernels of profiled graph replays (L2 flushed "
            "before each) attributed to ops in launch order; time = sum of kernel durations (span beside it); "
            "timeline: per kernel, median start and end from the side's first kernel start and the gap before it",
            "bytes: least HBM traffic of each op (k3_decode.executor.roofline); roofline: bytes / copy bandwidth "
            "measured in this run",
            "the stock AttnRes kernel takes about 30 us per application at every batch (docs/stock-h200.md): a speedup "
            "of attn_res over it is inflated by that; the per-op times let the reader see by how much",
            "agreement: one eager step of the same inputs from the same state on both paths; rel. RMS difference "
            "(recorded, not asserted)",
        ],
        "traced": args.trace,
        "targets": {
            "text": TARGETS_TEXT,
            "roofline": [{"tp": t, "batches": [lo, hi], "fraction": f} for t, lo, hi, f in ROOFLINE_TARGETS],
            "launches": TARGET_LAUNCHES,
        },
        "env": environment(),
        # file names only: no machine's paths in results
        "config": {**vars(args), "out": out.name, "choice": [c.partition("=")[0] for c in args.choice]},
        "providers": providers_declared(),
        "runs": [],
    }
    if args.variant or choices:
        results["variant"] = {"name": args.variant, "choice_files": choices}
    bw = measure_copy_bandwidth(device)
    results["copy_bandwidth"] = bw
    log(f"copy bandwidth {bw['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    flush = L2Flush(args.flush, device)

    def save(partial: dict | None = None) -> None:
        runs = results["runs"] + ([partial] if partial is not None else [])
        # compact: these files are most of the repository's bytes, and every reader parses them (--table, --rounds)
        out.write_text(json.dumps({**results, "runs": runs}, separators=(",", ":"), default=str))

    for tp in args.tp:
        try:
            results["runs"].append(run_tp(tp, args, bw["bandwidth_bytes_per_s"], flush, save))
        except Exception as exc:
            traceback.print_exc()
            results["runs"].append({"tp": tp, "error": f"{type(exc).__name__}: {exc}"})
        torch.cuda.empty_cache()  # the executors are gone: give their memory back before the next TP
        results["elapsed_s"] = time.perf_counter() - started
        save()
    log(f"wrote {out} in {results['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
