"""The head-ordered projection probe against the served projection on one GPU, side by side in one run.

Why this exists (issue 8). The one-kernel plan for the attention side (docs/kda-layer-h200.md, "What each missed
target needs") needs W's rows to stream in head order, every row published on its head's counter, at the rate the
served projection streams them in row order. This script measures that first: per (TP, batch) cell it times the
served build (kda_in_proj_choice.toml: at B1 the CUDA-core stream at TP8, tensor cores at TP16), the CUDA-core
stream where that is not the served one, and the head stream (kda_head_stream.py) at each K split, each as a CUDA
graph of back-to-back calls, interleaved round by round, and reads one isolated head-stream launch's stamps: when
each head's rows were all published, and the stream's rate from the first CTA's start to the last row, beside the
served build's rate from one isolated launch of its traced build (phase_trace.py), first CTA start to last CTA end.
The head-stream arms: K split over 2 and over 4 warps a row, and at B1 also with the watching warp and copy-fed
through a shared-memory ring (builds.toml [kda_head_stream]).

    python3 benchmarks/head_stream_h200.py --out benchmarks/results/head-stream-h200.json
    python3 benchmarks/head_stream_h200.py --table benchmarks/results/head-stream-h200.json   # no GPU

Each call reads a different copy of W, round robin over enough copies to hold three times the L2, so no call finds
its weight in L2 (TP16's 46 MB would otherwise partly stay there between calls). Without a CUDA device the script
prints one line of error and exits with status 2. The file is rewritten after every cell.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CALLS = 12  # back-to-back launches per graph
SPLITS = (2, 4)


def variants(batch: int) -> list[tuple[int, bool, int]]:
    """(split, watch, stages) of the head-stream arms at `batch`: both splits; with the watching warp, and copy-fed,
    at the batches builds.toml builds those at (the watcher's 288 threads cap registers at 112, under what split 2
    takes from B4; the ring leaves two CTAs an SM room only to B2)."""
    from k3_decode.kernels.builds import K3_KERNEL_BUILDS

    spec = K3_KERNEL_BUILDS.table["kda_head_stream"]
    arms = [(s, False, 0) for s in SPLITS]
    if batch in spec["watch_batches"]:
        arms += [(s, True, 0) for s in SPLITS]
    if batch in spec["copies"]["batches"]:
        arms.append((spec["copies"]["split"], False, spec["copies"]["stages"]))
    return arms


def arm_name(split: int, watch: bool, stages: int = 0) -> str:
    return f"s{split}" + ("w" if watch else "") + (f"r{stages}" if stages else "")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", help="where to write the JSON results")
    ap.add_argument("--table", metavar="JSON", help="print the results file as markdown tables (no GPU)")
    ap.add_argument("--tp", nargs="+", type=int, default=[8, 16], help="TP sizes (default: 8 16)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8], help="batches 1..8 (default: 1 4 8)")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds per cell (default: 30)")
    return ap


def shapes(tp: int) -> tuple[int, int, int, int]:
    """(rows, K, heads, head_dim) of the rank's packed input projection."""
    from k3_decode.config import K3

    s = K3.shard(tp)
    return s.kda_in_proj_rows, s.hidden, s.kda_heads, K3.kda.head_dim


def run_cell(tp: int, batch: int, rounds: int, bandwidth: float) -> dict[str, Any]:
    import torch

    from benchmarks.mma_stream_shapes import graph_of_calls, replay_seconds
    from k3_decode.kernels import kda_head_stream_op, kda_in_proj_op
    from k3_decode.kernels.kda_head_stream_trace import HeadStreamTimeline
    from k3_decode.kernels.kda_in_proj_choice import kernel_for_rows

    rows, k, heads, head_dim = shapes(tp)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(tp * 100 + batch)
    weight_bytes = rows * k * 2
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    copies = max(2, math.ceil(3 * l2 / weight_bytes))  # each call's W comes from HBM, not L2
    ws = [(torch.randn(rows, k, device=dev, generator=gen) * 0.02).bfloat16() for _ in range(copies)]
    x = torch.randn(batch, k, device=dev, generator=gen).bfloat16()
    out = torch.empty(batch, rows, dtype=torch.bfloat16, device=dev)
    moved = weight_bytes + x.numel() * 2 + out.numel() * 2

    served_kernel = kernel_for_rows(batch, rows)
    arms: dict[str, Callable[[int], None]] = {}
    for kernel in dict.fromkeys((served_kernel, "cuda_core")):  # the served build, and the CUDA-core one beside it

        def projection(i: int, kernel: str = kernel) -> None:
            kda_in_proj_op.linear(x, ws[i % copies], out, kernel=kernel)

        arms[kernel] = projection
    want = kda_in_proj_op.linear(x, ws[0], kernel=served_kernel).float()
    probes: dict[str, tuple[Any, Any]] = {}  # per head-stream arm: its plan and its trace words
    for split, watch, stages in variants(batch):
        name = arm_name(split, watch, stages)
        plan = kda_head_stream_op.plan_for(x, ws[0], heads, head_dim, split, watch, stages)
        trace = kda_head_stream_op.trace_buffer(plan, dev)
        probes[name] = plan, trace

        def head(i: int, plan: Any = plan, trace: Any = trace) -> None:
            kda_head_stream_op.project(
                x,
                ws[i % copies],
                out,
                trace,
                heads=heads,
                head_dim=head_dim,
                split=plan.split,
                watch=plan.watch,
                stages=plan.stages,
            )

        head(0)
        torch.cuda.synchronize()
        if not torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2):  # the GPU test holds the exact bound
            raise RuntimeError(f"TP{tp} B{batch} {name}: the head stream's product differs from the served one")
        arms[name] = head

    graphs = {name: graph_of_calls(name, fn, CALLS, out) for name, fn in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):  # a rotating order, so no arm always runs first or after the same one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(replay_seconds(graphs[name], CALLS) * 1e6)

    del graphs  # the served stream's trace below grows its launch counter: no graph may still hold the old one
    flush = torch.empty(4 * l2, dtype=torch.uint8, device=dev)
    cell: dict[str, Any] = {
        "tp": tp,
        "batch": batch,
        "rows": rows,
        "bytes": moved,
        "weight_copies": copies,
        "served": {"kernel": served_kernel, **arm_result(times[served_kernel], moved, bandwidth)},
        "served_timeline": served_timeline(lambda: arms[served_kernel](0), flush, weight_bytes, bandwidth),
        "cuda_core": None if served_kernel == "cuda_core" else arm_result(times["cuda_core"], moved, bandwidth),
        "head_stream": [],
    }
    for name, (plan, trace) in probes.items():
        flush.fill_(1)  # an isolated launch: W cold, nothing before it in flight
        torch.cuda.synchronize()
        trace.zero_()  # counters, epoch and stamps from zero: this launch is launch 1
        arms[name](0)
        torch.cuda.synchronize()
        timeline = HeadStreamTimeline.from_words(plan, trace.tolist())
        ratios = [h / c for h, c in zip(times[name], times[served_kernel], strict=True)]
        cell["head_stream"].append(
            {
                "split": plan.split,
                "watch": plan.watch,
                "stages": plan.stages,
                "ctas": plan.ctas,
                "trips": plan.trips,
                **arm_result(times[name], moved, bandwidth),
                "time_vs_served": {
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                },
                "timeline": {
                    "end_us": timeline.end_us,
                    "start_spread_us": timeline.start_spread_us,
                    "stream_pct_of_copy": 100 * timeline.stream_rate(plan) / bandwidth,
                    "group_first_us": list(timeline.group_first_us),
                    "group_done_us": list(timeline.group_done_us),
                    "trip_median_us": list(timeline.trip_median_us),
                    "seen_first_us": list(timeline.seen_first_us),
                    "seen_median_us": list(timeline.seen_median_us),
                    "seen_last_us": list(timeline.seen_last_us),
                },
            }
        )
    return cell


def served_timeline(call: Callable[[], None], flush: Any, weight_bytes: int, bandwidth: float) -> dict[str, float]:
    """One isolated launch of the served stream compiled with its phase stamps (phase_trace.py): its end and its
    rate from the first CTA's start to the last CTA's end, as the head stream's timeline reads its own."""
    import torch

    from k3_decode.kernels import kda_in_proj_op, phase_trace

    phase_trace.enable(True)
    try:
        flush.fill_(1)
        call()  # compiles the traced build and grows the counter
        flush.fill_(2)
        counter = kda_in_proj_op.launch_counter(flush.device)
        counter[1:].zero_()
        torch.cuda.synchronize()
        call()
        torch.cuda.synchronize()
        ctas = phase_trace.decode(counter.tolist(), "kda_in_proj")
    finally:
        phase_trace.enable(False)
    if not ctas or any(t.timer[2] is None for t in ctas):
        raise RuntimeError("the served stream's traced launch left CTAs without their end stamp")
    (kernel,) = phase_trace.summarize({"kda_in_proj": ctas})["kernels"]
    end_us = kernel["phases"][-1]["max_us"]  # since the earliest CTA start
    return {"end_us": end_us, "stream_pct_of_copy": 100 * weight_bytes / (end_us * 1e-6) / bandwidth}


def arm_result(us: Sequence[float], moved: int, bandwidth: float) -> dict[str, Any]:
    median = statistics.median(us)
    return {"us": median, "us_rounds": list(us), "pct_of_copy": 100 * moved / (median * 1e-6) / bandwidth}


def table(results: Mapping[str, Any]) -> str:
    """Markdown: per cell the served stream and each head-stream arm per call, and each arm's isolated launch."""
    env = results["env"]
    arms = sorted({_arm_key(h) for c in results["cells"] for h in c["head_stream"]}, key=lambda a: (a[2], a[1], a[0]))
    lines = [
        f"{env['gpu']}, commit {env['commit'][:7]}{' (dirty)' if env.get('dirty') else ''}; copy bandwidth "
        f"{results['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; {results['calls_per_graph']} calls a graph, "
        f"{results['rounds']} rounds. Per call (% of copy bandwidth), and time over the served build's: median "
        "[min, max] of the rounds.",
        "",
        "| TP | B | served build | CUDA-core stream | " + " | ".join(_arm_title(*a) for a in arms) + " |",
        "|---|---|---|---|" + "---|" * len(arms),
    ]
    for c in results["cells"]:
        heads = {_arm_key(h): h for h in c["head_stream"]}
        served, core = c["served"], c["cuda_core"]
        row = [
            str(c["tp"]),
            str(c["batch"]),
            f"{served['kernel']}: {served['us']:.2f} us ({served['pct_of_copy']:.0f} %)",
            "served" if core is None else f"{core['us']:.2f} us ({core['pct_of_copy']:.0f} %)",
        ]
        for arm in arms:
            h = heads.get(arm)
            row.append(
                "-"
                if h is None
                else f"{h['us']:.2f} us ({h['pct_of_copy']:.0f} %), x{h['time_vs_served']['median']:.3f} "
                f"[{h['time_vs_served']['min']:.3f}, {h['time_vs_served']['max']:.3f}]"
            )
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "One isolated launch each (W cold), by its stamps: the end and the rate from the first CTA's start (% of "
        "copy), when each group's last row was published, and with the watching warp how long after that the "
        "watchers saw it (median over groups of the median watcher; the latest watcher of any group).",
        "",
        "| TP | B | served stream | head stream | end | shared rows done | heads done (first, middle, last) "
        "| seen after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in results["cells"]:
        s = c["served_timeline"]
        served = f"{s['end_us']:.2f} us ({s['stream_pct_of_copy']:.0f} %)"
        for h in c["head_stream"]:
            t = h["timeline"]
            done = t["group_done_us"][1:]
            seen = "-"
            if t.get("seen_median_us"):
                after = [m - d for m, d in zip(t["seen_median_us"], t["group_done_us"], strict=True)]
                worst = max(v - d for v, d in zip(t["seen_last_us"], t["group_done_us"], strict=True))
                seen = f"{statistics.median(after):.2f} us, latest {worst:.2f} us"
            lines.append(
                f"| {c['tp']} | {c['batch']} | {served} | {_arm_title(*_arm_key(h))} | "
                f"{t['end_us']:.2f} us ({t['stream_pct_of_copy']:.0f} %) | {t['group_done_us'][0]:.2f} us | "
                f"{done[0]:.2f}, {done[len(done) // 2]:.2f}, {done[-1]:.2f} us | {seen} |"
            )
    return "\n".join(lines)


def _arm_key(h: Mapping[str, Any]) -> tuple[int, bool, int]:
    return h["split"], h.get("watch", False), h.get("stages", 0)


def _arm_title(split: int, watch: bool, stages: int) -> str:
    return f"split {split}" + (", watched" if watch else "") + (f", ring of {stages}" if stages else "")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.table:
        try:
            print(table(json.loads(Path(args.table).read_text())))
        except (OSError, ValueError, KeyError) as exc:
            print(f"head_stream_h200.py: cannot read {args.table} as results: {exc}", file=sys.stderr)
            return 2
        return 0
    if not args.out:
        parser().error("--out is required (or --table JSON)")
    if bad := [b for b in args.batches if not 1 <= b <= 8]:
        parser().error(f"--batches takes 1..8 (the head stream stages one x chunk), got {bad}")
    if args.rounds < 3:
        parser().error(f"--rounds must be at least 3, got {args.rounds}")
    for tp in args.tp:
        try:
            shapes(tp)
        except ValueError as exc:
            parser().error(f"--tp {tp}: {exc}")
    import torch

    if not torch.cuda.is_available():
        print("head_stream_h200.py: no CUDA device here; run it on the GPU machine (an H200)", file=sys.stderr)
        return 2
    from benchmarks.stock_h200 import environment, log, measure_copy_bandwidth

    started = time.perf_counter()
    bandwidth = measure_copy_bandwidth(torch.device("cuda"))["bandwidth_bytes_per_s"]
    results: dict[str, Any] = {
        "benchmark": "head-ordered projection probe against the served projection (issue 8)",
        "env": environment(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "calls_per_graph": CALLS,
        "rounds": args.rounds,
        "cells": [],
    }
    for tp in args.tp:
        for batch in args.batches:
            cell = run_cell(tp, batch, args.rounds, bandwidth)
            results["cells"].append(cell)
            results["wall_s"] = time.perf_counter() - started
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
            heads = ", ".join(
                f"{arm_name(h['split'], h['watch'], h['stages'])} {h['us']:.2f} us x{h['time_vs_served']['median']:.3f}"
                for h in cell["head_stream"]
            )
            log(f"TP{tp} B{batch}: served {cell['served']['kernel']} {cell['served']['us']:.2f} us; {heads}")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
