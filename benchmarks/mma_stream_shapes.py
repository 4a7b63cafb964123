"""Tilings of the tensor-core weight stream timed side by side against cuBLAS, per shape, on one GPU.

The stream (k3_decode/kernels/kda_in_proj_mma.py) serves the KDA input projection and, inside the fused o_proj +
AttnRes kernel, o_proj. Its CTA tiling (W rows a CTA, m-tiles x K split, loads in flight, x in registers or in a
cp.async ring, CTAs an SM) is data: `benchmarks/mma_stream_shapes.toml` lists the shapes and the tilings to try and
says why. For each shape this compiles every tiling, checks its output against an FP32 product (within one BF16
rounding, and whether its bits equal the baseline tiling's), then times all of them and cuBLAS in interleaved
rounds (each round in a rotated order), every call of a CUDA graph streaming its own copy of W from HBM:

    python3 benchmarks/mma_stream_shapes.py --out mma-stream-shapes-h200.json [--shapes NAME ...] [--rounds 20]
    python3 benchmarks/mma_stream_shapes.py --table mma-stream-shapes-h200.json     # off the GPU

Without a CUDA device (or CuTe DSL) it prints one line and exits 2. The variants file is checked before any device
work: a tiling the stream cannot run (rows a CTA not covered by its m-tiles, a K split that does not divide the k
steps, more shared memory or threads than an SM holds for its CTAs) is a one-line error naming it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from k3_decode.kernels.kda_in_proj_mma_plan import STEP, TILE_M, InProjMmaPlan  # noqa: E402
from k3_decode.kernels.wgmma_stream_plan import WgmmaStreamPlan  # noqa: E402

VARIANTS = Path(__file__).with_name("mma_stream_shapes.toml")
SMEM_PER_SM = 227 * 1024  # what CTAs of one SM may take on an H100/H200 (228 KiB less the driver's 1 KiB per SM)
THREADS_PER_SM = 2048
MAX_THREADS = 1024
CUBLAS = "cublas"
VARIANT_KEYS = ("rows_per_cta", "m_tiles", "k_splits", "w_loads", "x_ahead", "n_tiles", "x_stages", "ctas_per_sm")
WGMMA = "wgmma"  # a variant of the TMA + warpgroup-MMA stream (wgmma_stream.py) instead of the mma.sync one
WGMMA_KEYS = ("m_rows", "k_tile", "stages", "k_splits")


class VariantsError(ValueError):
    """The variants file cannot be run as written; the message names the entry and the fix."""


@dataclass(frozen=True)
class Variant:
    name: str
    plan: InProjMmaPlan | WgmmaStreamPlan
    why: str


@dataclass(frozen=True)
class Shape:
    name: str
    rows: int
    k: int
    batch: int
    baseline: str
    variants: tuple[Variant, ...]


def load_shapes(path: Path = VARIANTS) -> list[Shape]:
    """The shapes and tilings of `path`, each tiling checked against what the stream and an SM can hold."""
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise VariantsError(f"{path.name}: cannot read it ({exc})") from None
    shapes = []
    for i, spec in enumerate(table.get("shape", [])):
        where = f"{path.name} shape {spec.get('name', i)!r}"
        try:
            rows, k, batch, baseline = int(spec["rows"]), int(spec["k"]), int(spec["batch"]), str(spec["baseline"])
        except (KeyError, TypeError, ValueError) as exc:
            raise VariantsError(f"{where}: needs integer rows, k, batch and a baseline name ({exc})") from None
        variants = tuple(_variant(where, rows, k, batch, v) for v in spec.get("variant", []))
        names = [v.name for v in variants]
        if len(set(names)) != len(names) or CUBLAS in names:
            raise VariantsError(f"{where}: variant names must be distinct and not {CUBLAS!r}, got {names}")
        if baseline not in names:
            raise VariantsError(f"{where}: baseline {baseline!r} is not one of its variants {names}")
        shapes.append(Shape(str(spec["name"]), rows, k, batch, baseline, variants))
    if not shapes:
        raise VariantsError(f"{path.name}: no [[shape]] entries")
    return shapes


def _variant(where: str, rows: int, k: int, batch: int, spec: dict[str, Any]) -> Variant:
    name = spec.get("name", "?")
    kind = spec.get("kind", "mma_sync")
    if kind == WGMMA:
        return _wgmma_variant(where, rows, k, batch, spec)
    if kind != "mma_sync":
        raise VariantsError(f"{where} variant {name!r}: kind must be 'mma_sync' (the default) or {WGMMA!r}, "
                            f"got {kind!r}")  # fmt: skip
    try:
        v = {key: int(spec[key]) for key in VARIANT_KEYS}
    except (KeyError, TypeError, ValueError) as exc:
        raise VariantsError(f"{where} variant {name!r}: needs integer {', '.join(VARIANT_KEYS)} ({exc})") from None
    w_smem = spec.get("w_smem", False)
    if not isinstance(w_smem, bool):
        raise VariantsError(f"{where} variant {name!r}: w_smem must be true or false, got {w_smem!r}")
    w_ring = spec.get("w_ring", 0)
    if not isinstance(w_ring, int) or isinstance(w_ring, bool):
        raise VariantsError(f"{where} variant {name!r}: w_ring must be a number of k steps (0: off), got {w_ring!r}")
    plan = InProjMmaPlan(
        rows, k, batch, v["rows_per_cta"], v["m_tiles"], v["k_splits"], v["w_loads"], v["x_ahead"], v["n_tiles"],
        v["x_stages"], w_smem, w_ring, ctas_per_sm=v["ctas_per_sm"],
    )  # fmt: skip
    problems = []
    if rows % TILE_M or k % STEP:
        problems.append(f"the shape needs rows a multiple of {TILE_M} and K of {STEP}")
    if not 0 < plan.rows_per_cta <= plan.m_tiles * TILE_M:
        problems.append(f"rows_per_cta {plan.rows_per_cta} is not covered by {plan.m_tiles} m-tiles of {TILE_M}")
    if plan.k_splits < 1 or plan.steps % plan.k_splits:
        problems.append(f"k_splits {plan.k_splits} does not divide the {plan.steps} k steps")
    if plan.ctas_per_sm < 1 or plan.threads > MAX_THREADS or plan.threads * plan.ctas_per_sm > THREADS_PER_SM:
        problems.append(f"{plan.ctas_per_sm} CTAs of {plan.threads} threads do not fit an SM")
    if plan.smem_bytes * max(plan.ctas_per_sm, 1) > SMEM_PER_SM:
        problems.append(f"{plan.ctas_per_sm} CTAs of {plan.smem_bytes} bytes of shared memory do not fit an SM")
    if min(plan.w_loads_in_flight, plan.x_steps_ahead, plan.max_n_tiles) < 1 or plan.x_stages == 1 or plan.x_stages < 0:
        problems.append("w_loads, x_ahead and n_tiles must be positive and x_stages 0 or at least 2")
    ring_problem = plan.w_ring_problem() if not problems else None
    if ring_problem:
        problems.append(ring_problem)
    if problems:
        raise VariantsError(f"{where} variant {name!r}: {'; '.join(problems)} — fix the entry")
    return Variant(str(name), plan, str(spec.get("why", "")))


def _wgmma_variant(where: str, rows: int, k: int, batch: int, spec: dict[str, Any]) -> Variant:
    name = spec.get("name", "?")
    try:
        v = {key: int(spec[key]) for key in WGMMA_KEYS}
    except (KeyError, TypeError, ValueError) as exc:
        raise VariantsError(f"{where} variant {name!r}: a {WGMMA} variant needs integer {', '.join(WGMMA_KEYS)} "
                            f"({exc})") from None  # fmt: skip
    plan = WgmmaStreamPlan(rows, k, batch, **v)
    problem = plan.problem()
    if problem is None and wgmma_ctas_per_sm(plan) < 1:
        problem = f"a CTA of {plan.threads} threads and {plan.smem_bytes} bytes of shared memory does not fit an SM"
    if problem:
        raise VariantsError(f"{where} variant {name!r}: {problem} — fix the entry")
    return Variant(str(name), plan, str(spec.get("why", "")))


def wgmma_ctas_per_sm(plan: WgmmaStreamPlan) -> int:
    return min(SMEM_PER_SM // plan.smem_bytes, THREADS_PER_SM // plan.threads)


def plan_record(plan: InProjMmaPlan | WgmmaStreamPlan) -> dict[str, Any]:
    if isinstance(plan, WgmmaStreamPlan):
        return {
            "kind": WGMMA,
            "ctas": plan.ctas,
            "threads": plan.threads,
            **{key: getattr(plan, key) for key in WGMMA_KEYS},
            "n": plan.n,
            "passes": [plan.n],
            "smem_bytes": plan.smem_bytes,
            "ctas_per_sm": wgmma_ctas_per_sm(plan),
        }
    return {
        "ctas": plan.ctas,
        "threads": plan.threads,
        "rows_per_cta": plan.rows_per_cta,
        "m_tiles": plan.m_tiles,
        "k_splits": plan.k_splits,
        "depth": plan.depth,
        "w_loads": plan.w_loads_in_flight,
        "x_ahead": plan.x_depth,
        "n_tiles": plan.n_tiles,
        "passes": list(plan.passes),
        "x_stages": plan.x_stages,
        "w_smem": plan.w_smem,
        "smem_bytes": plan.smem_bytes,
        "ctas_per_sm": plan.ctas_per_sm,
        # only where on, so the records of runs before the ring still match their plans
        **({"w_ring": plan.w_ring} if plan.w_ring else {}),
    }


# --- on the GPU --------------------------------------------------------------------------------------------------


def graph_of_calls(name: str, fn: Any, calls: int, out: Any) -> Any:
    """`calls` calls of `fn` captured in one CUDA graph. A launch sent to any stream but the capturing one runs once,
    eagerly, and the graph replays nothing of it (timed at 0.25 us for 3.7 MB: 93 TB/s), so the graph must write
    `out` from a poisoned start, or no time is recorded for it."""
    import torch

    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    if bool(out.isnan().any()):
        raise RuntimeError(f"the CUDA graph of {name} left its output unwritten: its launches escaped the capture")
    return graph


def replay_seconds(graph: Any, calls: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def measure_shape(shape: Shape, rounds: int, device: Any) -> dict[str, Any]:
    """Every tiling of `shape` and cuBLAS: agreement with an FP32 product, then interleaved timing rounds."""
    import torch

    from k3_decode.kernels import kda_in_proj_op

    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    w_bytes = shape.rows * shape.k * 2
    copies = max(2, math.ceil(3 * l2 / w_bytes))  # each call's W comes from HBM, not L2
    gen = torch.Generator(device=device).manual_seed(7)
    x = (torch.randn(shape.batch, shape.k, device=device, generator=gen) * 0.5).bfloat16()
    weights = [
        (torch.randn(shape.rows, shape.k, device=device, generator=gen) * 0.02).bfloat16() for _ in range(copies)
    ]
    exact = x.float() @ weights[0].float().T
    counter = kda_in_proj_op.launch_counter(device)
    outs: dict[str, Any] = {}
    buffers: dict[str, Any] = {}  # what each variant's calls write
    fns: dict[str, Any] = {}
    cells: dict[str, dict[str, Any]] = {}
    not_compiled: dict[str, str] = {}
    for v in shape.variants:
        try:
            compiled = kda_in_proj_op._compiled(v.plan)  # any of the projection's builds, by its plan
        except Exception as exc:  # a tiling the compiler refuses is a result; the baseline must build
            if v.name == shape.baseline:
                raise
            not_compiled[v.name] = (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0][:300]
            continue
        out = torch.empty(shape.batch, shape.rows, dtype=torch.bfloat16, device=device)
        # The stream is read at each call: under capture it is the capturing stream, not the one before it.
        fns[v.name] = lambda i, c=compiled, out=out, ws=weights: kda_in_proj_op.launch(
            c, x, ws[i % copies], out, counter, torch.cuda.current_stream(device).cuda_stream
        )
        fns[v.name](0)
        torch.cuda.synchronize()
        outs[v.name], buffers[v.name] = out.clone(), out
        cells[v.name] = {"plan": plan_record(v.plan), "why": v.why}
    cublas_out = torch.empty(shape.batch, shape.rows, dtype=torch.bfloat16, device=device)
    fns[CUBLAS] = lambda i, out=cublas_out, ws=weights: torch.matmul(x, ws[i % copies].T, out=out)
    fns[CUBLAS](0)
    torch.cuda.synchronize()
    outs[CUBLAS], buffers[CUBLAS] = cublas_out.clone(), cublas_out
    cells[CUBLAS] = {"plan": None, "why": "torch.matmul (cuBLAS), as the stock op runs it"}

    # One BF16 rounding of the exact product, plus FP32 summation-order slack: 2^-8 relative, with a floor.
    bound = exact.abs() * 2.0**-8 + 1e-3
    for name, out in outs.items():
        err = (out.float() - exact).abs()
        cells[name]["within_one_bf16_rounding"] = bool((err <= bound).all())
        cells[name]["max_abs_error"] = float(err.max())
        cells[name]["bits_equal_baseline"] = bool(torch.equal(out, outs[shape.baseline]))

    calls = 4 * copies
    graphs = {name: graph_of_calls(name, fn, calls, buffers[name]) for name, fn in fns.items()}
    names = list(graphs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            samples[name].append(replay_seconds(graphs[name], calls))
    moved = w_bytes + (shape.batch * shape.k + shape.batch * shape.rows) * 2
    for name in names:
        s = samples[name]
        cells[name]["us"] = {
            "median": statistics.median(s) * 1e6,
            "p10": sorted(s)[int(0.1 * (len(s) - 1))] * 1e6,
            "p90": sorted(s)[int(0.9 * (len(s) - 1))] * 1e6,
            "rounds": len(s),
        }
        cells[name]["tb_per_s"] = moved / statistics.median(s) / 1e12
        for ref in (shape.baseline, CUBLAS):
            ratios = [a / b for a, b in zip(s, samples[ref], strict=True)]
            cells[name][f"ratio_to_{'baseline' if ref == shape.baseline else 'cublas'}"] = statistics.median(ratios)
    del graphs, fns, weights
    torch.cuda.empty_cache()
    return {
        "shape": {"name": shape.name, "rows": shape.rows, "k": shape.k, "batch": shape.batch},
        "baseline": shape.baseline,
        "weight_copies": copies,
        "calls_per_replay": calls,
        "bytes_per_call": moved,
        "variants": cells,
        "not_compiled": not_compiled,
    }


def _environment() -> dict[str, Any]:
    from benchmarks.stock_h200 import environment

    return environment()


def run(args: argparse.Namespace) -> int:
    try:
        shapes = load_shapes(Path(args.variants))
    except VariantsError as exc:
        print(f"mma_stream_shapes.py: {exc}", file=sys.stderr)
        return 2
    if args.shapes:
        unknown = sorted(set(args.shapes) - {s.name for s in shapes})
        if unknown:
            print(f"mma_stream_shapes.py: no shape {unknown} in {args.variants}; pick from "
                  f"{[s.name for s in shapes]}", file=sys.stderr)  # fmt: skip
            return 2
        shapes = [s for s in shapes if s.name in args.shapes]
    import torch

    if not torch.cuda.is_available():
        print("mma_stream_shapes.py: no CUDA device here; run it on the GPU machine (an H100 or H200)", file=sys.stderr)
        return 2
    try:
        import cutlass.cute  # noqa: F401
    except ImportError as exc:
        print(f"mma_stream_shapes.py: CuTe DSL is not importable ({exc}); install nvidia-cutlass-dsl", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    results: dict[str, Any] = {"benchmark": "mma_stream_shapes", "env": _environment(), "rounds": args.rounds,
                               "variants_file": Path(args.variants).read_text(), "shapes": []}  # fmt: skip
    out = Path(args.out)
    for shape in shapes:
        results["shapes"].append(measure_shape(shape, args.rounds, device))
        out.write_text(json.dumps(results, indent=1) + "\n")  # a crash keeps the shapes measured before it
        print(table(results).split("\n\n")[-1], flush=True)
    return 0


def table(results: dict[str, Any]) -> str:
    """Markdown, one table per shape: per-call time, TB/s, ratios, agreement."""
    env = results.get("env", {})
    parts = [f"{env.get('gpu', '?')}, commit {str(env.get('commit', '?'))[:7]}, {results.get('rounds')} rounds"]
    for s in results["shapes"]:
        sh = s["shape"]
        lines = [
            f"{sh['name']}: [{sh['batch']}, {sh['k']}] x [{sh['rows']}, {sh['k']}]^T, baseline {s['baseline']}",
            "",
            "| variant | CTAs x threads | per SM | smem KB | passes | us (p10-p90) | TB/s | / baseline | / cuBLAS "
            "| one rounding | baseline bits |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, c in s["variants"].items():
            p = c["plan"]
            shape_cols = (
                f"{p['ctas']} x {p['threads']} | {p['ctas_per_sm']} | {p['smem_bytes'] / 1024:.0f} | {len(p['passes'])}"
                if p
                else "- | - | - | -"
            )
            us = c["us"]
            lines.append(
                f"| {name} | {shape_cols} | {us['median']:.2f} ({us['p10']:.2f}-{us['p90']:.2f}) | "
                f"{c['tb_per_s']:.2f} | {c['ratio_to_baseline']:.3f} | {c['ratio_to_cublas']:.3f} | "
                f"{'yes' if c['within_one_bf16_rounding'] else 'NO'} | {'yes' if c['bits_equal_baseline'] else 'no'} |"
            )
        lines += [f"- {name} did not compile: {why}" for name, why in s.get("not_compiled", {}).items()]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", help="where to write the JSON results (rewritten after every shape)")
    ap.add_argument("--table", metavar="FILE", help="print the tables of a results file and exit (no GPU)")
    ap.add_argument("--variants", default=str(VARIANTS), help="the shapes and tilings (default: %(default)s)")
    ap.add_argument("--shapes", nargs="+", metavar="NAME", help="only these shapes (default: all)")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds (default: %(default)s)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.table:
        try:
            print(table(json.loads(Path(args.table).read_text())))
        except (OSError, ValueError, KeyError) as exc:
            print(f"mma_stream_shapes.py: cannot read {args.table} as a results file ({exc!r})", file=sys.stderr)
            return 2
        return 0
    if not args.out:
        print("mma_stream_shapes.py: --out FILE is needed to measure (or --table FILE to print one)", file=sys.stderr)
        return 2
    if args.rounds < 2:
        print(f"mma_stream_shapes.py: --rounds must be at least 2, got {args.rounds}", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
