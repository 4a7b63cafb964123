"""Benchmark: Kimi K3's TP collectives and per-layer decode on several GPUs of one host (one process per GPU).

- all-reduce latency per call for BF16 rows [B, width], width = hidden (o_proj, shared experts, dense MLP) and the
  MoE latent: NCCL's all_reduce ("nccl"), the rank-order two-shot through collectives ("ordered") and the same rule
  in one Triton launch over peer memory ("peer"). Each is captured as a CUDA graph of --inner back-to-back calls and
  replayed --reps times; the time per call is the replay's median / inner. Each transport's bits are checked against
  the oracle (k3_decode.reference.allreduce) and across ranks.
- fused epilogues: the peer all-reduce + latent RMSNorm and the peer all-reduce + AttnRes after attention, each one
  launch, against the unfused compositions (ordered or nccl all-reduce, then the stock kernel); bits compared with
  the ordered composition.
- per-layer decode: the TP stack k3-kda-mla (layer 6 KDA+MoE, layer 7 MLA+MoE, each rank its shard) with every
  request's context filled to --context tokens, one CUDA graph per layer (and one for both layers) per batch and
  variant, an L2 flush before each replay: nccl (unfused, what a deployment without our collectives runs),
  ordered (unfused) and peer (fused epilogues).
- the specialized path: not built yet; the runtime's refusal is recorded as NOT_RUN, never a time.

Usage (on a multi-GPU machine): python benchmarks/tp_h200.py --world 2 --out tp2-h200.json
Tables for docs/tp-h200.md: python benchmarks/tp_h200.py --table benchmarks/results/tp2-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.stock_h200 import (  # noqa: E402
    FLUSH_BYTES,
    environment,
    measure_copy_bandwidth,
    summarize,
    time_graph,
)
from harness.parallel import RankFailure, run_ranks  # noqa: E402
from k3_decode.config import K3  # noqa: E402
from k3_decode.distributed.allreduce import TRANSPORTS, build  # noqa: E402
from k3_decode.distributed.group import TpGroup  # noqa: E402
from k3_decode.distributed.tp_stack import TpStackSpec, replication_errors, start_rank, trace_tensors  # noqa: E402
from k3_decode.executor import StackExecutor, StepRequest, load_stack, random_input  # noqa: E402
from k3_decode.reference.allreduce import TwoShotMismatch, bf16_bits, reduce_rank_order, verify_two_shot  # noqa: E402
from k3_decode.reference.attn_res import MixWeights, blocks_before_mlp  # noqa: E402
from k3_decode.runtime.errors import StartupError  # noqa: E402
from k3_decode.stock import AttnResBuffers  # noqa: E402
from k3_decode.stock.attn_res import after_attention, after_attention_reduced  # noqa: E402
from k3_decode.stock.triton_moe.elementwise import rms_norm  # noqa: E402

STACK = "k3-kda-mla"
VARIANTS = (("nccl", False), ("ordered", False), ("peer", True))
AR_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def time_graph_calls(fn: Callable[[], Any], group: TpGroup, inner: int, reps: int) -> dict[str, float]:
    """Per-call time of fn: a CUDA graph of `inner` calls, replayed `reps` times (every rank in lockstep)."""
    for _ in range(3):
        fn()
    group.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    group.barrier()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    group.barrier()
    return summarize(times)


def partials(rank: int, batch: int, width: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn(batch, width, generator=gen).bfloat16().to(device)


def bits_verdict(group: TpGroup, x: torch.Tensor, got: torch.Tensor) -> str:
    outs, parts = group.gather_tensors(got), group.gather_tensors(x)
    if any(not torch.equal(bf16_bits(o), bf16_bits(outs[0])) for o in outs):
        return "ranks differ"
    try:
        verify_two_shot(outs, parts)
        return "rank-order rule"
    except TwoShotMismatch:
        differ = int((bf16_bits(outs[0]) != bf16_bits(reduce_rank_order(parts))).sum())
        return f"replicated; {differ} of {got.numel()} values differ from the rank-order rule"


def bench_all_reduce(group: TpGroup, opts: dict[str, Any]) -> list[dict[str, Any]]:
    objs = {t: build(t, group) for t in TRANSPORTS}
    cells = []
    for width, use in ((K3.hidden_size, "hidden"), (K3.moe.latent_size, "latent")):
        for batch in opts["ar_batches"]:
            x = partials(group.rank, batch, width, batch, group.device)
            for name, ar in objs.items():
                verdict = bits_verdict(group, x, ar(x))
                timing = time_graph_calls(lambda ar=ar, x=x: ar(x), group, opts["inner"], opts["reps"])
                cells.append({"width": width, "row": use, "batch": batch, "transport": name, "bits": verdict, **timing})
                log(group.rank, f"all-reduce {use} B{batch} {name}: {timing['median_us']:.1f} us ({verdict})")
    return cells


def bench_fused(group: TpGroup, opts: dict[str, Any]) -> list[dict[str, Any]]:
    dev, h, lat, eps, block = group.device, K3.hidden_size, K3.moe.latent_size, K3.rms_norm_eps, K3.attn_res_block_size
    peer, ordered, nccl = (build(t, group) for t in ("peer", "ordered", "nccl"))
    gen = torch.Generator().manual_seed(5)
    norm = (1 + 0.1 * torch.randn(lat, generator=gen)).bfloat16().to(dev)
    mix = MixWeights(
        res_norm=(1 + 0.1 * torch.randn(h, generator=gen)).bfloat16().to(dev),
        res_proj=(0.05 * torch.randn(h, generator=gen)).bfloat16().to(dev),
        out_norm=(1 + 0.1 * torch.randn(h, generator=gen)).bfloat16().to(dev),
    )
    layer = 6  # a mid-block layer: the AttnRes after attention adds to the prefix and mixes 1 bank block
    n = blocks_before_mlp(layer, block)
    cells = []
    for batch in opts["ar_batches"]:
        routed = partials(group.rank, batch, lat, 100 + batch, dev)
        variants = {
            "fused peer": lambda: peer(routed, norm=norm, eps=eps),  # noqa: B023 (timed at once)
            "ordered + norm": lambda: rms_norm(ordered(routed), norm, eps),  # noqa: B023
            "nccl + norm": lambda: rms_norm(nccl(routed), norm, eps),  # noqa: B023
        }
        same = torch.equal(bf16_bits(variants["fused peer"]()), bf16_bits(variants["ordered + norm"]()))
        times = {k: time_graph_calls(f, group, opts["inner"], opts["reps"])["median_us"] for k, f in variants.items()}
        cells.append({"epilogue": "latent rms_norm", "batch": batch, "bits_equal_unfused": same, "median_us": times})
        log(group.rank, f"AR+norm B{batch}: {times} equal={same}")

        state = torch.randn(batch, h, generator=gen).bfloat16().to(dev), torch.randn(batch, 2, h, generator=gen)
        partial = partials(group.rank, batch, h, 200 + batch, dev) * 1e-2
        bufs = {k: AttnResBuffers(state[0].clone(), state[1].bfloat16().to(dev), n) for k in ("fused", "ordered")}
        got = after_attention_reduced(bufs["fused"], layer, partial, mix, block, eps, peer)
        want = after_attention(bufs["ordered"], layer, ordered(partial), mix, block, eps)
        same = all(
            torch.equal(bf16_bits(a), bf16_bits(b))
            for a, b in ((got, want), (bufs["fused"].prefix, bufs["ordered"].prefix))
        )
        work = AttnResBuffers(state[0].clone(), state[1].bfloat16().to(dev), n)
        variants = {
            "fused peer": lambda: after_attention_reduced(work, layer, partial, mix, block, eps, peer),  # noqa: B023
            "ordered + attn_res": lambda: after_attention(work, layer, ordered(partial), mix, block, eps),  # noqa: B023
            "nccl + attn_res": lambda: after_attention(work, layer, nccl(partial), mix, block, eps),  # noqa: B023
        }
        times = {k: time_graph_calls(f, group, opts["inner"], opts["reps"])["median_us"] for k, f in variants.items()}
        cells.append(
            {"epilogue": "attn_res after attention", "batch": batch, "bits_equal_unfused": same, "median_us": times}
        )
        log(group.rank, f"AR+AttnRes B{batch}: {times} equal={same}")
    return cells


def bench_layers(group: TpGroup, opts: dict[str, Any]) -> dict[str, Any]:
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=group.device)
    cells: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    weights = None
    for transport, fused in VARIANTS:
        spec = TpStackSpec(STACK, transport, fused)
        t0 = time.perf_counter()
        ex = start_rank(group, spec, weights=weights, log=lambda line: None)
        weights = ex.weights
        config, dims = ex.config, ex.dims
        ex.state.fill_synthetic(range(config.max_requests), opts["context"], seed=1)
        log(group.rank, f"{spec.label}: stack ready in {time.perf_counter() - t0:.1f} s")
        first = config.layers[0]
        for batch in opts["batches"]:
            ids = list(range(batch))
            entry = random_input(dims, first, batch, seed=1000 + batch, device=group.device)
            reqs = [StepRequest(r, entry.rows(slice(b, b + 1))) for b, r in enumerate(ids)]
            step = ex.step(reqs, trace=True)  # warm-up (kernels compile); also the replication check
            assert step.trace is not None
            outputs = {f"output {r}": t for r, t in step.outputs.items()}
            errors = replication_errors(group, trace_tensors(step.trace) | outputs)
            digest = {r: bf16_bits(t).cpu() for r, t in step.outputs.items()}
            checks.append({"variant": spec.label, "batch": batch, "replication_errors": errors, "outputs": digest})
            names = {layer: ex.capture(batch, (layer,)) for layer in config.layers}
            for layer, name in names.items():
                x = random_input(dims, layer, batch, seed=2000 + 10 * batch + layer, device=group.device)
                ex.load_graph_inputs(name, [StepRequest(r, x.rows(slice(b, b + 1))) for b, r in enumerate(ids)])
            stack = ex.capture(batch)
            ex.load_graph_inputs(stack, reqs)
            for layer, name in [*names.items(), (None, stack)]:
                group.barrier()  # the ranks start timing together: every replay all-reduces
                timing = time_graph(ex, name, opts["reps_layer"], flush)
                kind = "stack" if layer is None else f"{dims.layer_kind(layer)}+{dims.mlp_kind(layer)}"
                cells.append(
                    {"variant": spec.label, "batch": batch, "layer": layer, "kind": kind, "context": opts["context"]}
                    | timing
                )
                log(group.rank, f"{spec.label} B{batch} {kind}: {timing['median_us']:.1f} us")
        calls = dict(ex.runner.row_parallel.calls)
        checks.append({"variant": spec.label, "row_parallel_calls": calls})
        del ex
        torch.cuda.empty_cache()
    # Same weights, same states, same inputs: the ordered (unfused) and peer (fused) stacks must agree bit for bit.
    by = {(c["variant"], c["batch"]): c["outputs"] for c in checks if "outputs" in c}
    agree = {
        f"B{b}": all(torch.equal(by[("ordered", b)][r], by[("peer+fused", b)][r]) for r in by[("ordered", b)])
        for b in opts["batches"]
    }
    for c in checks:
        c.pop("outputs", None)
    return {"cells": cells, "checks": checks, "ordered_equals_peer_fused": agree}


def specialized_status(group: TpGroup) -> dict[str, Any]:
    config = load_stack(STACK, group.world, rank=group.rank)
    try:
        StackExecutor.start(config, {"decode_backend": "latency_specialized"}, device=group.device)
    except StartupError as exc:
        return {"status": "NOT_RUN", "reason": str(exc)}
    return {"status": "ERROR", "reason": "latency_specialized started although its kernels are not built"}


def bench_rank(rank: int, world: int, address: str, port: int, kind: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank's parts; rank 0 also saves what it has after each part (`opts["partial"]`), so a rank that hangs
    later loses nothing measured. The process exits after returning (harness.parallel), without a teardown."""
    group = TpGroup.join(rank, world, address, port, kind)
    out: dict[str, Any] = {"rank": rank, "gpu": torch.cuda.get_device_name(group.device)}
    if rank == 0:
        out["copy_bandwidth"] = measure_copy_bandwidth(group.device)
    out["specialized"] = specialized_status(group)
    parts = {"allreduce": bench_all_reduce, "fused": bench_fused, "layers": bench_layers}
    for part, fn in parts.items():
        if part in opts["parts"]:
            out[part] = fn(group, opts)
            if rank == 0:
                Path(opts["partial"]).write_text(json.dumps(out, default=str))
    group.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parts", nargs="+", default=["allreduce", "fused", "layers"])
    parser.add_argument("--ar-batches", type=int, nargs="+", default=list(AR_BATCHES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--reps-layer", type=int, default=50)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=540)
    parser.add_argument("--table", type=Path, help="print the markdown tables of a result file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(tables(json.loads(args.table.read_text())))
        return 0
    if args.out is None:
        parser.error("--out is required unless --table is given")
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.world:
        print(f"error: --world {args.world} needs {args.world} CUDA devices; this host has "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", file=sys.stderr)  # fmt: skip
        return 2
    opts = {k: getattr(args, k) for k in ("parts", "ar_batches", "batches", "inner", "reps", "reps_layer", "context")}
    opts["partial"] = str(args.out.with_suffix(".partial.json"))
    started = time.time()
    failure = None
    try:
        results = run_ranks(bench_rank, args.world, "cuda", (opts,), timeout_s=args.timeout)
    except RankFailure as exc:  # keep what rank 0 measured before the failure, and say what failed
        failure = str(exc)
        saved = Path(opts["partial"])
        results = [json.loads(saved.read_text())] if saved.exists() else []
        if not results:
            print(f"error: {failure}", file=sys.stderr)
            return 1
    Path(opts["partial"]).unlink(missing_ok=True)
    env = environment()
    env["gpus"] = [r["gpu"] for r in results]
    report = {
        "benchmark": "benchmarks/tp_h200.py",
        "world": args.world,
        "stack": STACK,
        "options": opts,
        "environment": env,
        "wall_s": round(time.time() - started, 1),
        "failure": failure,
        "copy_bandwidth": results[0].get("copy_bandwidth"),
        "specialized": results[0]["specialized"],
        "allreduce": results[0].get("allreduce"),
        "fused": results[0].get("fused"),
        "layers": results[0].get("layers"),
        "per_rank_medians_us": {r["rank"]: [c["median_us"] for c in r.get("allreduce", [])] for r in results},
    }
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(tables(report))
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0


def tables(report: dict[str, Any]) -> str:
    lines = [f"TP{report['world']} on {', '.join(report['environment']['gpus'])}", ""]
    if report.get("allreduce"):
        lines += [
            "| row | B | nccl us | ordered us | peer us | nccl bits | peer bits |",
            "|---|---|---|---|---|---|---|",
        ]
        cells: dict[tuple, dict[str, Any]] = {}
        for c in report["allreduce"]:
            cells.setdefault((c["row"], c["width"], c["batch"]), {})[c["transport"]] = c
        for (row, width, batch), t in cells.items():
            lines.append(
                f"| {row} ({width}) | {batch} | {t['nccl']['median_us']:.1f} | {t['ordered']['median_us']:.1f} | "
                f"{t['peer']['median_us']:.1f} | {t['nccl']['bits']} | {t['peer']['bits']} |"
            )
        lines.append("")
    if report.get("fused"):
        lines += [
            "| epilogue | B | fused peer us | ordered + op us | nccl + op us | bits = unfused |",
            "|---|---|---|---|---|---|",
        ]
        for c in report["fused"]:
            t = list(c["median_us"].values())
            lines.append(
                f"| {c['epilogue']} | {c['batch']} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {c['bits_equal_unfused']} |"
            )
        lines.append("")
    if report.get("layers"):
        layers = report["layers"]
        lines += ["| B | layer | nccl us | ordered us | peer+fused us |", "|---|---|---|---|---|"]
        cells2: dict[tuple, dict[str, float]] = {}
        for c in layers["cells"]:
            cells2.setdefault((c["batch"], c["kind"]), {})[c["variant"]] = c["median_us"]
        for (batch, kind), t in cells2.items():
            lines.append(
                f"| {batch} | {kind} | {t.get('nccl', 0):.1f} | {t.get('ordered', 0):.1f} | "
                f"{t.get('peer+fused', 0):.1f} |"
            )
        lines += ["", f"ordered == peer+fused bit for bit: {layers['ordered_equals_peer_fused']}"]
        errs = [c for c in layers["checks"] if c.get("replication_errors")]
        lines.append(f"replication errors: {errs if errs else 'none'}")
    lines.append(f"specialized path: {report['specialized']['status']} ({report['specialized']['reason']})")
    if report.get("copy_bandwidth"):
        lines.append(f"copy bandwidth: {report['copy_bandwidth']['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
