"""Benchmark: Kimi K3's stock decode path on one H200, per layer, under CUDA graphs, against the HBM roofline.

For each TP size (per-rank shapes of rank 0; one GPU holds one rank's shard, so the TP all-reduces are the identity
and take no time here) and each batch, on a stack of one KDA+MoE and one MLA+MoE layer (k3_decode/executor/
stacks.toml, "k3-kda-mla") with every request's context filled to --context tokens:

- time: one CUDA graph per layer (and one for the two-layer stack), replayed --reps times, each replay timed with
  CUDA events after a write of a buffer larger than L2 (no weight stays cached between replays); median and spread.
- launches per layer: kernels (and memsets/copies) the profiler sees per replay of the layer's graph, next to the
  launches the stock op tables declare for the ops the capture called.
- bytes: what each stock op must move (k3_decode.executor.roofline; routed experts counted as the distinct experts
  the batch routes to) and the HBM-roofline time at the device-to-device copy bandwidth measured in this run.
- each stock op's own roofline fraction: its kernels' time in an eager step profiled with one range per stock call
  (k3_decode.executor.attribution), after an L2 flush.
- the dispatch ledger of the run: every dispatch stock, the graph records joined with their replays, and the Triton
  kernel names the ledger claims found in the profile.

Usage (on the GPU machine): python benchmarks/stock_h200.py --out stock-h200.json [--tp 8 16] [--batches 1 8 64]
Tables of docs/stock-h200.md: python benchmarks/stock_h200.py --table benchmarks/results/stock-h200.json
The commit is taken from K3_COMMIT or K3GATE_COMMIT (and K3_DIRTY=1 for a working tree with changes) when set, else
from git.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from k3_decode.executor import StackExecutor, StepRequest, StepResult, load_stack, random_input  # noqa: E402
from k3_decode.executor.attribution import (  # noqa: E402
    attribute,
    device_events,
    kernels_by_range,
    stock_kernel_info,
)
from k3_decode.executor.inputs import entry_blocks  # noqa: E402
from k3_decode.executor.roofline import StepShape, layer_bytes, roofline_seconds  # noqa: E402
from k3_decode.runtime.ledger import Expectation  # noqa: E402

STACK = "k3-kda-mla"
FULL_STACK = "k3-kda3-mla"  # the four-layer stack (KDA, KDA, KDA, MLA), timed whole as one graph per batch
FLUSH_BYTES = 256 << 20  # over four times the H200's 60 MB L2
COPY_BYTES = 1 << 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def environment() -> dict[str, Any]:
    import triton

    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }
    try:
        q = "driver_version,clocks.max.sm,clocks.max.mem,memory.total"
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True
        )
        driver, sm, mem, total = (x.strip() for x in smi.stdout.strip().splitlines()[0].split(","))
        out.update(driver=driver, max_sm_clock=sm, max_mem_clock=mem, memory_total=total)
    except (OSError, ValueError, IndexError) as exc:
        out["driver"] = f"unknown ({exc})"
    out["commit"], out["dirty"] = commit_state()
    return out


DECLARED_COMMIT = ("K3_COMMIT", "K3GATE_COMMIT")  # the benchmarks' name first, then the gate's (harness/environment.py)


def commit_state(root: Path = REPO) -> tuple[str, bool]:
    """(commit, dirty) of the code that runs. A declared commit wins (K3_COMMIT, else K3GATE_COMMIT, with K3_DIRTY=1
    for a tree with changes): a copied working tree may carry a git folder whose HEAD is not the code that runs (a
    device's copy recorded an older commit, dirty, for every run of a session). Else git's HEAD and status; else
    ("unknown", False)."""
    declared = next((os.environ[name].strip() for name in DECLARED_COMMIT if os.environ.get(name, "").strip()), "")
    if declared:
        return declared, os.environ.get("K3_DIRTY") == "1"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=root, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    return commit.stdout.strip(), bool(dirty.stdout.strip())


def measure_copy_bandwidth(device: torch.device, reps: int = 20) -> dict[str, float]:
    """Device-to-device copy of 1 GiB; bandwidth counts the bytes read and written."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    t = statistics.median(times)
    return {"bytes_moved": 2 * COPY_BYTES, "median_s": t, "bandwidth_bytes_per_s": 2 * COPY_BYTES / t}


def summarize(us: list[float]) -> dict[str, float]:
    s = sorted(us)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"median_us": statistics.median(s), "p10_us": pick(0.1), "p90_us": pick(0.9), "min_us": s[0], "reps": len(s)}


def time_graph(ex: StackExecutor, name: str, reps: int, flush: torch.Tensor) -> dict[str, float]:
    ex.replay(name, 3)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]

    def before(i: int) -> None:
        flush.zero_()  # queued ahead of the replay: the GPU is busy while the host enqueues the events
        starts[i].record()

    ex.replay(name, reps, before, lambda i: ends[i].record())
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)])


def profile(fn: Callable[[], None]) -> dict[str, Any]:
    """A chrome trace of fn() with CPU and CUDA activity."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def graph_launches(ex: StackExecutor, name: str, replays: int = 4) -> dict[str, Any]:
    trace = profile(lambda: ex.replay(name, replays))
    events = device_events(trace)
    kinds = Counter(e.category for e in events)
    names = Counter(e.name[:100] for e in events if e.category == "kernel")
    return {
        "kernels_per_replay": kinds["kernel"] / replays,
        "memsets_per_replay": kinds["gpu_memset"] / replays,
        "copies_per_replay": kinds["gpu_memcpy"] / replays,
        "kernel_time_us_per_replay": sum(e.dur_us for e in events) / replays,
        "kernel_names": {k: v / replays for k, v in names.most_common()},
    }


def declared_launches(ex: StackExecutor, graph: str) -> dict[int, int]:
    """Launches the stock op tables declare for the ops a graph's capture called, per layer."""
    out: Counter[int] = Counter()
    for entry in ex.op_log:
        if entry.graph == graph:
            out[entry.layer] += entry.record.launches
    return dict(out)


def run_tp(tp: int, args: argparse.Namespace, bandwidth: float, flush: torch.Tensor) -> dict[str, Any]:
    t0 = time.perf_counter()
    config = load_stack(STACK, tp)
    ex = StackExecutor.start(config, device="cuda", log=log)
    built = time.perf_counter() - t0
    log(f"TP{tp}: stack built in {built:.1f} s")
    dims, kda_layer = config.dims, config.layers[0]
    ex.state.fill_synthetic(range(config.max_requests), args.context, seed=tp)
    ex.ledger.expect(Expectation("stock", by=f"benchmarks/stock_h200.py TP{tp}"))
    info = stock_kernel_info()
    cells: list[dict[str, Any]] = []
    stack_times: list[dict[str, Any]] = []
    for batch in args.batches:
        try:
            ids = list(range(batch))
            # The profiled eager step: per-op kernel times and the experts this batch routes to in each layer.
            entry = random_input(dims, kda_layer, batch, seed=1000 + batch, device="cuda")
            reqs = [StepRequest(r, entry.rows(slice(b, b + 1))) for b, r in enumerate(ids)]
            ex.step(reqs)  # warm-up (Triton compiles, cuBLAS picks its kernels); advances the context by one
            flush.zero_()
            ex.runner.ranges = True
            traced: list[StepResult] = []
            trace = profile(lambda: traced.append(ex.step(reqs, trace=True)))  # noqa: B023 (run at once)
            ex.runner.ranges = False
            step = traced[0]
            ranges, loose = kernels_by_range(trace)
            per_op = attribute(ranges, info)
            unique = {tr.layer: int(tr.expert_ids.unique().numel()) for tr in step.trace if tr.expert_ids is not None}
            seq_lens = tuple(ex.state.context_lens[r] + 1 for r in ids)
            names = {}
            for layer in config.layers:
                names[layer] = ex.capture(batch, (layer,))
                first = random_input(dims, layer, batch, seed=2000 + 10 * batch + layer, device="cuda")
                ex.load_graph_inputs(
                    names[layer], [StepRequest(r, first.rows(slice(b, b + 1))) for b, r in enumerate(ids)]
                )
            stack = ex.capture(batch)
            ex.load_graph_inputs(stack, reqs)
            stack_times.append(
                {"tp": tp, "batch": batch, "layers": list(config.layers), **time_graph(ex, stack, args.reps, flush)}
            )
            for layer in config.layers:
                g = ex.graphs[names[layer]]
                shape = StepShape(batch, seq_lens, g.num_splits, unique.get(layer))
                nbytes = layer_bytes(dims, tp, layer, shape)
                timing = time_graph(ex, names[layer], args.reps, flush)
                launches = graph_launches(ex, names[layer])
                total = sum(nbytes.values())
                roof_us = roofline_seconds(total, bandwidth) * 1e6
                ops = []
                for op in (o for o in per_op if o.layer == layer):
                    b = sum(nbytes.get(x, 0) for x in op.ops)
                    r_us = roofline_seconds(b, bandwidth) * 1e6
                    ops.append(
                        {
                            "op": op.label,
                            "kernels": len(op.events),
                            "time_us": op.time_us,
                            "bytes": b,
                            "roofline_us": r_us,
                            "roofline_fraction": r_us / op.time_us if op.time_us else None,
                            "kernel_names": [e.name[:100] for e in op.events],
                        }
                    )
                eager_kernels = sum(len(rk.events) for rk in ranges if rk.layer == layer)
                cells.append(
                    {
                        "tp": tp,
                        "batch": batch,
                        "context": args.context,
                        "layer": layer,
                        "kind": f"{dims.layer_kind(layer)}+{dims.mlp_kind(layer)}",
                        "graph_time": timing,
                        "launches": {
                            # What replaying the layer launches, less the executor's copies of the entry state
                            # (prefix, and the bank when the layer is entered with blocks) at the graph's start.
                            "layer": launches["kernels_per_replay"]
                            + launches["memsets_per_replay"]
                            + launches["copies_per_replay"]
                            - (1 + int(entry_blocks(dims, layer) > 0)),
                            "graph_profiler": launches["kernels_per_replay"],
                            "graph_memsets": launches["memsets_per_replay"],
                            "graph_copies": launches["copies_per_replay"],
                            "eager_profiler": eager_kernels,
                            "declared": declared_launches(ex, names[layer]).get(layer),
                        },
                        "graph_kernel_time_us": launches["kernel_time_us_per_replay"],
                        "graph_kernel_names": launches["kernel_names"],
                        "bytes": total,
                        "bytes_by_op": nbytes,
                        "unique_experts": unique.get(layer),
                        "mla_num_splits": g.num_splits if dims.layer_kind(layer) == "mla" else None,
                        "roofline_us": roof_us,
                        "roofline_fraction": roof_us / timing["median_us"],
                        "ops": ops,
                    }
                )
                log(
                    f"TP{tp} B{batch} layer {layer} {cells[-1]['kind']}: {timing['median_us']:.1f} us, "
                    f"roofline {roof_us:.1f} us ({100 * roof_us / timing['median_us']:.0f}%), "
                    f"{launches['kernels_per_replay']:.0f} kernels"
                )
            if loose:
                log(f"TP{tp} B{batch}: {len(loose)} device events outside the executor's ranges (step set-up copies)")
        except Exception as exc:  # one failing cell must not lose the others: record it and go on
            traceback.print_exc()
            cells.append({"tp": tp, "batch": batch, "error": f"{type(exc).__name__}: {exc}"})
    ledger = ex.ledger
    ledger.report_profiler_kernels(Counter(n for c in cells for n in c.get("graph_kernel_names", {})))
    out = {
        "tp": tp,
        "build_s": built,
        "memory_plan": ex.memory.to_json(),
        "cells": cells,
        "stack": stack_times,
        "ledger": {
            "summary": ledger.summary(),
            "expectation_mismatches": ledger.check(),
            "execution_mismatches": ledger.check_execution(ex.kernel_catalog()),
        },
    }
    return out


def time_full_stack(tp: int, args: argparse.Namespace, flush: torch.Tensor) -> list[dict[str, Any]]:
    """One CUDA graph of the four-layer stack per batch: the step time of KDA, KDA, KDA, MLA with their MoEs."""
    config = load_stack(FULL_STACK, tp)
    ex = StackExecutor.start(config, device="cuda", log=log)
    ex.state.fill_synthetic(range(config.max_requests), args.context, seed=tp)
    out = []
    for batch in args.batches:
        entry = random_input(config.dims, config.layers[0], batch, seed=3000 + batch, device="cuda")
        reqs = [StepRequest(r, entry.rows(slice(b, b + 1))) for b, r in enumerate(range(batch))]
        name = ex.capture(batch)
        ex.load_graph_inputs(name, reqs)
        out.append({"tp": tp, "batch": batch, "layers": list(config.layers), **time_graph(ex, name, args.reps, flush)})
        log(f"TP{tp} B{batch} stack {FULL_STACK}: {out[-1]['median_us']:.1f} us")
    out.append({"tp": tp, "ledger_mismatches": ex.ledger.check([Expectation("stock", by="stock_h200 full stack")])})
    return out


def markdown(results: dict[str, Any]) -> str:
    """The tables of docs/stock-h200.md, from a results file (so every number there traces to the JSON)."""
    bw = results["copy_bandwidth"]["bandwidth_bytes_per_s"]
    rows = [
        "| TP | batch | layer | time (us, p10-p90) | launches (declared) | bytes (MB) | roofline (us) | of roofline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cells = [c for run in results["runs"] for c in run.get("cells", []) if "error" not in c]
    for c in sorted(cells, key=lambda c: (c["tp"], c["layer"], c["batch"])):
        t = c["graph_time"]
        launches = c["launches"]
        rows.append(
            f"| {c['tp']} | {c['batch']} | {c['layer']} {c['kind']} | {t['median_us']:.1f} ({t['p10_us']:.1f}-"
            f"{t['p90_us']:.1f}) | {launches['layer']:.0f} ({launches['declared']}) | {c['bytes'] / 1e6:.1f} | "
            f"{c['roofline_us']:.1f} | {100 * c['roofline_fraction']:.1f}% |"
        )
    out = [f"Copy bandwidth measured in the run: {bw / 1e12:.2f} TB/s.", "", *rows, ""]
    stacks = [("two-layer stack", s) for run in results["runs"] for s in run.get("stack", [])]
    stacks += [("four-layer stack", s) for s in results.get("full_stack", []) if "median_us" in s]
    out += ["| TP | batch | graph | layers | time (us, p10-p90) |", "|---|---|---|---|---|"]
    for what, s in sorted(stacks, key=lambda x: (x[1]["tp"], len(x[1]["layers"]), x[1]["batch"])):
        layers = ", ".join(map(str, s["layers"]))
        out.append(
            f"| {s['tp']} | {s['batch']} | {what} | {layers} | "
            f"{s['median_us']:.1f} ({s['p10_us']:.1f}-{s['p90_us']:.1f}) |"
        )
    for tp in sorted({c["tp"] for c in cells}):
        for layer in sorted({c["layer"] for c in cells if c["tp"] == tp}):
            mine = sorted((c for c in cells if c["tp"] == tp and c["layer"] == layer), key=lambda c: c["batch"])
            batches = [c["batch"] for c in mine]
            out += ["", f"TP{tp}, layer {layer} ({mine[0]['kind']}): each stock op's kernels in one eager step", ""]
            out.append("| op | " + " | ".join(f"B{b}: kernels, us, of roofline" for b in batches) + " |")
            out.append("|---|" + "---|" * len(batches))
            for i, op in enumerate(mine[0]["ops"]):
                cols = []
                for c in mine:
                    o = c["ops"][i] if i < len(c["ops"]) and c["ops"][i]["op"] == op["op"] else None
                    frac = o and o["roofline_fraction"]
                    cols.append("-" if o is None else f"{o['kernels']}, {o['time_us']:.1f}, {100 * (frac or 0):.1f}%")
                out.append(f"| {op['op']} | " + " | ".join(cols) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", metavar="RESULTS", help="print the markdown tables of a results file and exit")
    ap.add_argument("--out", help="where to write the JSON results")
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=4096, help="tokens of context every request holds")
    ap.add_argument("--reps", type=int, default=30, help="timed replays per graph")
    args = ap.parse_args()
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())), end="")
        return 0
    if not args.out:
        ap.error("--out is required to run the benchmark (or pass --table RESULTS)")
    if not torch.cuda.is_available():
        print("stock_h200.py needs a CUDA GPU (run it on the accelerator machine)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    results: dict[str, Any] = {
        "benchmark": "stock decode path per layer under CUDA graphs, against the HBM roofline",
        "stack": STACK,
        "notes": [
            "one GPU holds rank 0's shard at each TP size; the TP all-reduces are the identity and take no time",
            "times: CUDA-graph replays after an L2 flush, by CUDA events",
            "per-op times: the kernels of each stock op in one profiled eager step after an L2 flush",
            "bytes: least HBM traffic of each stock op; roofline: bytes / copy bandwidth measured in this run",
        ],
        "env": environment(),
        "config": {**vars(args), "out": Path(args.out).name},  # the file name only: no machine's paths in results
    }
    bw = measure_copy_bandwidth(device)
    results["copy_bandwidth"] = bw
    log(f"copy bandwidth {bw['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    results["runs"] = []
    out = Path(args.out)
    results["full_stack"] = []
    for tp in args.tp:
        parts: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("runs", lambda: run_tp(tp, args, bw["bandwidth_bytes_per_s"], flush)),  # noqa: B023 (called at once)
            ("full_stack", lambda: time_full_stack(tp, args, flush)),  # noqa: B023
        )
        for key, run in parts:
            try:
                got = run()
                results[key].extend(got if isinstance(got, list) else [got])
            except Exception as exc:
                traceback.print_exc()
                results[key].append({"tp": tp, "error": f"{type(exc).__name__}: {exc}"})
            torch.cuda.empty_cache()  # the executor is gone: give its memory back before the next one
            out.write_text(json.dumps(results, indent=1, default=str))  # after every part: a failure keeps these
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
