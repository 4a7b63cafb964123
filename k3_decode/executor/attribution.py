"""Which profiled GPU kernels belong to which stock op, from a torch.profiler chrome trace.

The executor wraps every stock call in a profiler range naming its layer and the stock ops inside it
(k3_decode.executor.forward.range_name). A kernel belongs to the range that was open on the CPU when it was
launched: the trace links each kernel to its launch call (cudaLaunchKernel, cuLaunchKernel, ...) by correlation id,
and the launch call's CPU time falls inside the range. The chrome trace format is what every torch version writes,
so this needs no profiler internals.

Inside a range holding several stock ops, kernels the stock tables name (the Triton kernels) anchor their op;
unnamed kernels (cuBLAS picks its own) between two anchors belong to the cuBLAS ops between those anchors: one
op takes them all, as many ops as kernels take one each in order, and otherwise the ops are reported together
under one joined label rather than guessed apart.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k3_decode.executor.forward import parse_range_name

DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class DeviceEvent:
    name: str
    category: str  # kernel, gpu_memset or gpu_memcpy
    start_us: float
    dur_us: float
    correlation: int | None


@dataclass(frozen=True)
class RangeKernels:
    layer: int
    ops: tuple[str, ...]  # stock ops inside the range, in order
    start_us: float
    events: tuple[DeviceEvent, ...]  # in launch order


@dataclass(frozen=True)
class OpKernels:
    """Kernels of one stock op (or of several, joined with '+', when they cannot be told apart)."""

    layer: int
    label: str
    ops: tuple[str, ...]
    events: tuple[DeviceEvent, ...]

    @property
    def time_us(self) -> float:
        return sum(e.dur_us for e in self.events)


@dataclass(frozen=True)
class OpKernelInfo:
    names: tuple[str, ...]  # kernel names (or name prefixes) the op's Triton kernels have
    absorbs_unnamed: bool  # the op runs cuBLAS, whose kernels have no fixed names


def device_events(trace: Mapping[str, Any]) -> list[DeviceEvent]:
    """Kernels, memsets and copies on the GPU, in start order."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES:
            corr = e.get("args", {}).get("correlation")
            out.append(DeviceEvent(e["name"], e["cat"], float(e["ts"]), float(e.get("dur", 0.0)), corr))
    return sorted(out, key=lambda d: d.start_us)


def kernels_by_range(trace: Mapping[str, Any]) -> tuple[list[RangeKernels], list[DeviceEvent]]:
    """Device events grouped by the executor range that launched them, and the events no such range launched."""
    events = trace.get("traceEvents", [])
    launched_at = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    ranges = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "user_annotation":
            continue
        parsed = parse_range_name(e.get("name", ""))
        if parsed is not None:
            ranges.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), parsed))
    ranges.sort(key=lambda r: r[0])
    grouped: dict[int, list[DeviceEvent]] = defaultdict(list)
    loose = []
    for dev in device_events(trace):
        at = launched_at.get(dev.correlation)
        owner = None
        if at is not None:
            for i, (start, end, _) in enumerate(ranges):
                if start <= at <= end:
                    owner = i  # ranges do not nest; the last match is the innermost if they ever do
        if owner is None:
            loose.append(dev)
        else:
            grouped[owner].append(dev)
    out = [
        RangeKernels(layer, ops, start, tuple(sorted(grouped[i], key=lambda d: launched_at[d.correlation])))
        for i, (start, _, (layer, ops)) in enumerate(ranges)
    ]
    return out, loose


def _anchor(name: str, ops: Sequence[str], info: Mapping[str, OpKernelInfo]) -> int | None:
    for j, op in enumerate(ops):
        if any(k in name for k in info[op].names):
            return j
    return None


def split_range(rk: RangeKernels, info: Mapping[str, OpKernelInfo]) -> list[OpKernels]:
    """The kernels of one range, per stock op (see the module doc for the rule)."""
    ops = rk.ops
    if len(ops) == 1:
        return [OpKernels(rk.layer, ops[0], ops, rk.events)]
    anchors = [_anchor(e.name, ops, info) for e in rk.events]
    per_op: dict[tuple[str, ...], list[DeviceEvent]] = defaultdict(list)
    pending: list[DeviceEvent] = []
    last = -1

    def flush(next_anchor: int) -> None:
        if not pending:
            return
        between = [op for op in ops[last + 1 : next_anchor] if info[op].absorbs_unnamed]
        if not between:  # no cuBLAS op there: the kernels are part of the neighbouring anchored op
            owner = ops[last] if last >= 0 else ops[min(next_anchor, len(ops) - 1)]
            per_op[(owner,)].extend(pending)
        elif len(between) == 1:
            per_op[(between[0],)].extend(pending)
        elif len(between) == len(pending):
            for op, ev in zip(between, pending, strict=True):
                per_op[(op,)].append(ev)
        else:
            per_op[tuple(between)].extend(pending)
        pending.clear()

    for ev, j in zip(rk.events, anchors, strict=True):
        if j is None:
            pending.append(ev)
            continue
        flush(j)
        per_op[(ops[j],)].append(ev)
        last = j
    flush(len(ops))
    order = {op: i for i, op in enumerate(ops)}
    keys = sorted(per_op, key=lambda k: order[k[0]])
    return [OpKernels(rk.layer, "+".join(k), k, tuple(per_op[k])) for k in keys]


def attribute(ranges: Sequence[RangeKernels], info: Mapping[str, OpKernelInfo]) -> list[OpKernels]:
    """Kernels per stock op over every range; the two AttnRes ranges of a layer become attn_res_before/_after."""
    out: list[OpKernels] = []
    seen_attn_res: dict[int, int] = defaultdict(int)
    for rk in ranges:
        if rk.ops == ("attn_res",):
            which = "attn_res_before" if seen_attn_res[rk.layer] == 0 else "attn_res_after"
            seen_attn_res[rk.layer] += 1
            out.append(OpKernels(rk.layer, which, (which,), rk.events))
            continue
        out.extend(split_range(rk, info))
    return out


def stock_kernel_info() -> dict[str, OpKernelInfo]:
    """Kernel names and cuBLAS use of every stock op, from the stock op tables."""
    from k3_decode.executor.opmap import stock_op_info
    from k3_decode.stock.dispatch import op_names
    from k3_decode.stock.moe import MOE_OPS

    out = {}
    for part, names in (("kda", op_names()), ("moe", (*MOE_OPS, "dense"))):
        for op in names:
            row = stock_op_info(part, op, "cuda")
            out[op] = OpKernelInfo(tuple(row.kernels), "cublas" in row.implementation)
    return out
