"""Benchmark: stack equivalence on one H200, the long-generation check of Principle 3 (issue #8).

The four-layer stack k3-kda3-mla (Kimi K3 layers 4..7: KDA, KDA, KDA, MLA, each with its latent MoE; k3_decode/
executor/stacks.toml) at --tp's per-rank shapes of rank 0 is built twice on one set of weights: the stock executor
(the reference) and the latency_specialized one (the candidate: the registered CuTe DSL providers, the rest stock).
Every request of both gets the same synthetic context of --context tokens (state.fill_synthetic, one seed), then
--batch requests decode --steps steps teacher-forced, each step one CUDA-graph replay on each executor with the same
entry state while each keeps its own KDA states and MLA cache (k3_decode.executor.equivalence.compare_stacks: the
per-step metrics, the end-state comparison and the checks against equivalence.toml).

Writes --out (JSON: environment, the providers and what ran specialized from the candidate's ledger, the summary,
the checks and the per-step series to 4 significant digits) and, with --plot, a PNG of the per-step divergence on a
log scale with the limits. Exit 0 when every check passed, 1 when one failed or when the specialized executor cannot
start or ran nothing specialized (stock is never compared with stock), 2 on a usage error or without CUDA.

Usage (on the GPU machine):
    python benchmarks/stack_equivalence_h200.py --out stack-equivalence-h200.json --plot stack-equivalence-h200.png
The commit is taken from K3_COMMIT or K3GATE_COMMIT (and K3_DIRTY=1 for a working tree with changes) when set, else
from git.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.stock_h200 import environment, log  # noqa: E402
from k3_decode.executor import StackExecutor, load_stack  # noqa: E402
from k3_decode.executor.equivalence import (  # noqa: E402
    Equivalence,
    compare_stacks,
    run_settings,
    specialized_dispatches,
)

STACK = "k3-kda3-mla"
SPECIALIZED = {"decode_backend": "latency_specialized"}
PROG = Path(__file__).name
LOG_FLOOR = 1e-8  # where an exact 0 sits on the log axes


def fail(message: str, code: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no message'}"


def specialized_ops(summary: dict[str, Any]) -> dict[str, int]:
    """op -> dispatches on the specialized path, from a ledger summary."""
    by_op = summary["dispatches"]["by_op"]
    return {op: paths["specialized"] for op, paths in by_op.items() if paths.get("specialized")}


def plot(result: Equivalence, path: Path) -> None:
    """Per-step divergence of the outputs and logits (log y) with the limits; the growth windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tol, s, n = result.tolerances, result.series, result.steps
    x = list(range(n))

    def shown(values: Sequence[float]) -> list[float]:
        return [max(v, LOG_FLOOR) if math.isfinite(v) else math.nan for v in values]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 8), sharex=True)
    for ax in (top, bottom):
        for lo, hi in ((0, result.window), (n - result.window, n)):
            ax.axvspan(lo, hi, color="grey", alpha=0.12, lw=0)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.25)
    top.plot(x, shown(s["out_rms_rel"]), lw=0.5, alpha=0.45, color="tab:blue", label="outputs, batch")
    top.plot(x, shown(s["logit_rms_rel"]), lw=0.5, alpha=0.45, color="tab:green", label="logits, batch")
    top.plot(x, shown(s["out_median_rms_rel"]), lw=1.0, color="tab:blue", label="outputs, median request")
    top.plot(x, shown(s["logit_median_rms_rel"]), lw=1.0, color="tab:green", label="logits, median request")
    top.axhline(tol.step_rms_rel, color="tab:red", ls="--", lw=1, label=f"every step (batch) <= {tol.step_rms_rel:g}")
    top.axhline(
        tol.typical_rms_rel,
        color="tab:orange",
        ls=":",
        lw=1.5,
        label=f"median request, typical <= {tol.typical_rms_rel:g}",
    )
    top.set_ylabel("rms(C - R) / rms(R)")
    top.legend(loc="lower right", fontsize=8, ncol=2)
    bottom.plot(x, shown(s["out_peak_rel"]), lw=0.6, color="tab:blue", label="outputs, max|C - R| / rms(R)")
    bottom.plot(x, shown(s["logit_peak_rel"]), lw=0.6, color="tab:green", label="logits, max|C - R| / rms(R)")
    bottom.plot(
        x, shown([1 - c for c in s["logit_cos_min"]]), lw=0.6, color="tab:purple", label="1 - cosine, worst request"
    )
    bottom.axhline(tol.step_peak_rel, color="tab:red", ls="--", lw=1, label=f"peak <= {tol.step_peak_rel:g}")
    bottom.axhline(1 - tol.cosine_floor, color="tab:purple", ls="--", lw=1, label=f"cosine >= {tol.cosine_floor:g}")
    bottom.set_xlabel(f"decode step (shaded: the growth check's first and last {result.window} steps)")
    bottom.legend(loc="lower right", fontsize=8, ncol=2)
    failed = [c.name for c in result.failures()]
    verdict = "PASSED" if not failed else "FAILED " + ", ".join(failed)
    fig.suptitle(
        f"{result.model} layers {result.layers[0]}-{result.layers[-1]} TP{result.tp}, {len(result.requests)} requests, "
        f"{n} teacher-forced steps ({result.mode}): specialized vs stock, {verdict}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    run = run_settings()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write the JSON results")
    ap.add_argument("--plot", help="where to write the PNG of the per-step divergence (needs matplotlib)")
    ap.add_argument("--tp", type=int, default=8, help="TP size whose rank-0 shard the stack holds")
    ap.add_argument("--batch", type=int, default=8, help="requests decoding together (requests 0..batch-1)")
    ap.add_argument("--steps", type=int, default=run.steps, help="teacher-forced decode steps")
    ap.add_argument("--context", type=int, default=512, help="tokens of synthetic context every request starts with")
    ap.add_argument("--seed", type=int, default=0, help="seed of the context, the entry states and the projection")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        return fail("needs a CUDA GPU (run it on the accelerator machine)", 2)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return fail("--plot needs matplotlib (pip install 'k3gate[plots]')", 2)
    try:
        config = load_stack(STACK, args.tp)
    except ValueError as exc:
        return fail(f"--tp {args.tp}: {_first_line(exc)}", 2)
    if not 1 <= args.batch <= config.max_requests:
        return fail(f"--batch {args.batch} outside 1..{config.max_requests} (the stack's max_requests)", 2)
    if args.steps < run.min_steps:
        return fail(f"--steps {args.steps}: the growth check needs at least {run.min_steps}", 2)
    if args.context < 0 or args.context + args.steps > config.max_context:
        return fail(
            f"--context {args.context} + --steps {args.steps} must stay within the stack's max_context "
            f"{config.max_context}",
            2,
        )
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    stock = StackExecutor.start(config, device="cuda", log=log)
    try:
        cand = StackExecutor.start(config, SPECIALIZED, device="cuda", weights=stock.weights, log=log)
    except (ValueError, RuntimeError, ImportError) as exc:  # start-up refusals, bind errors, a missing CuTe DSL
        return fail(f"the specialized executor cannot start, so nothing was compared: {_first_line(exc)}", 1)
    providers = {p.op: p.name for p in cand.registry}
    if cand.planner.backend != "latency_specialized" or not providers:
        return fail(
            f"the candidate runs decode_backend {cand.planner.backend!r} with providers {providers}: that would "
            "compare stock with stock",
            1,
        )
    for ex in (stock, cand):
        ex.state.fill_synthetic(range(config.max_requests), args.context, seed=args.seed)
    built = time.perf_counter() - t0
    log(f"{config.describe()}: both executors built and filled to {args.context} tokens in {built:.1f} s")
    every = max(1, args.steps // 8)

    def progress(step: int) -> None:
        if (step + 1) % every == 0:
            log(f"step {step + 1}/{args.steps} queued")

    t1 = time.perf_counter()
    result = compare_stacks(stock, cand, range(args.batch), args.steps, args.seed, mode="graph", progress=progress)
    ran_s = time.perf_counter() - t1
    ran = specialized_dispatches(cand)
    summary = cand.ledger.summary()
    report: dict[str, Any] = {
        "benchmark": "stack equivalence: specialized against stock, teacher-forced, every step a CUDA-graph replay",
        "stack": STACK,
        "notes": [
            "one GPU holds rank 0's shard at --tp; the TP all-reduces are the identity",
            "both executors share one set of weights and start from the same synthetic context",
            "every step both get the same entry state; each keeps its own KDA states and MLA cache",
            "limits: k3_decode/executor/equivalence.toml (each with its reason); K3's are reasoned, not calibrated",
        ],
        "config": {**vars(args), "out": Path(args.out).name, "plot": Path(args.plot).name if args.plot else None},
        "env": environment(),
        "describe": config.describe(),
        "timing": {"build_s": built, "run_s": ran_s, "per_step_ms": 1e3 * ran_s / args.steps},
        "providers": providers,
        "specialized_ops": specialized_ops(summary),
        "specialized_dispatches": ran,
        "reference_specialized_dispatches": specialized_dispatches(stock),
        "ledger": {"candidate": summary, "reference": stock.ledger.summary()},
        "passed": result.passed and bool(ran),
        "result": result.to_json(digits=4),
    }
    if not ran:
        report["error"] = "the candidate ran no dispatch on the specialized path: the comparison was stock with stock"
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1))
    log(f"wrote {out}")
    if args.plot:
        plot(result, Path(args.plot))
        log(f"wrote {args.plot}")
    for c in result.checks:
        log(f"{'PASS' if c.passed else 'FAIL'} {c.describe()}: {c.detail}")
    log(f"specialized dispatches: {ran}")
    if not ran:
        return fail(report["error"], 1)
    return 0 if result.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
