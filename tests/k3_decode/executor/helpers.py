"""Builders and the layer check shared by the stack executor tests (CPU and GPU)."""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3_decode.executor import StackExecutor, StepRequest, load_stack, random_input
from k3_decode.executor.oracle import OracleInputs, layer_errors, routing_mismatches, teacher_forced
from k3_decode.reference.decoder import LayerTrace
from k3_decode.reference.kda import KdaCache
from k3_decode.weights import LayerWeights, SyntheticWeights

TOLERANCE_FILE = Path(__file__).with_name("tolerances.toml")


@dataclass(frozen=True)
class Tolerance:
    rms_rel: float
    peak_rel: float
    reason: str


@functools.cache
def _tolerances() -> dict[str, Any]:
    return tomllib.loads(TOLERANCE_FILE.read_text())


def tolerance(field: str, trace: LayerTrace) -> Tolerance:
    row = _tolerances()[field]
    if "rms_rel" not in row:
        row = row[trace.kind if field == "attn_output" else trace.mlp_kind]
    return Tolerance(row["rms_rel"], row["peak_rel"], row["reason"])


def layer_failures(got: Sequence[LayerTrace], ref: Sequence[LayerTrace]) -> list[str]:
    """Every sublayer outside its tolerance, or trivial (non-finite, constant, wrongly scaled), and routing flips."""
    out = routing_mismatches(got, ref)
    by_layer = {t.layer: t for t in got}
    for e in layer_errors(got, ref):
        trace = by_layer[e.layer]
        tol = tolerance(e.field, trace)
        value = getattr(trace, e.field)
        where = f"layer {e.layer} {e.field}"
        if not bool(torch.isfinite(value).all()):
            out.append(f"{where}: non-finite output")
        elif e.constant:
            out.append(f"{where}: constant output")
        elif not 0.5 < e.rms_ratio < 2.0:
            out.append(f"{where}: output rms is {e.rms_ratio:.3g}x the reference's")
        elif e.rms_rel > tol.rms_rel or e.peak_rel > tol.peak_rel:
            out.append(
                f"{where}: rms_rel {e.rms_rel:.3g} (tol {tol.rms_rel}), peak_rel {e.peak_rel:.3g} (tol {tol.peak_rel})"
            )
    return out


@functools.cache
def stack_weights(stack: str, tp: int, device: str = "cpu") -> dict[int, LayerWeights]:
    """One generation of a stack's weights per process: tests share them and never write them."""
    config = load_stack(stack, tp)
    gen = SyntheticWeights(config.dims, tp, config.rank, seed=config.seed, device=device)
    return {i: gen.layer(i) for i in config.layers}


def build(stack: str = "k3-mini-kda3-mla", tp: int = 1, device: str = "cpu", **kwargs: Any) -> StackExecutor:
    """An executor started through the runtime (decode_backend auto) on shared weights; the memory plan it prints
    goes to `log` (default: dropped)."""
    config = load_stack(stack, tp)
    kwargs.setdefault("log", lambda line: None)
    return StackExecutor.start(config, device=device, weights=stack_weights(stack, tp, device), **kwargs)


def decode_requests(ex: StackExecutor, requests: Sequence[int], seed: int) -> list[StepRequest]:
    """One decode token per request, with seeded unit-normal entry states."""
    first = ex.config.layers[0]
    entry = random_input(ex.dims, first, len(requests), seed, ex.device)
    return [StepRequest(r, entry.rows(slice(b, b + 1))) for b, r in enumerate(requests)]


def prefill(ex: StackExecutor, lengths: dict[int, int], seed: int = 0) -> None:
    first = ex.config.layers[0]
    ex.prefill({r: random_input(ex.dims, first, n, seed + r, ex.device) for r, n in lengths.items()})


def snapshot(ex: StackExecutor, requests: Sequence[StepRequest]) -> OracleInputs:
    """What the oracle needs to replay the next step: taken before it runs."""
    from k3_decode.executor.inputs import StackInput

    return OracleInputs(
        entry=StackInput.cat([r.inputs for r in requests]),
        tables=ex.state.tables([r.request for r in requests]),
        kda={i: KdaCache(c.conv.clone(), c.recurrent.clone()) for i, c in ex.state.kda.items()},
        mla={i: c.clone() for i, c in ex.state.mla.items()},
        k_scale=ex.config.k_scale,
        q_scale=ex.config.q_scale,
    )


def oracle_failures(
    ex: StackExecutor, requests: Sequence[StepRequest], dtype: torch.dtype = torch.float64
) -> list[str]:
    """Run one traced eager step and compare it layer by layer with the teacher-forced oracle."""
    before = snapshot(ex, requests)
    result = ex.step(requests, trace=True)
    assert result.trace is not None
    ref = teacher_forced(ex.dims, ex.config.tp, ex.weights, result.trace, before, dtype)
    return layer_failures(result.trace, ref)
