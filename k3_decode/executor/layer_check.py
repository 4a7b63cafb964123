"""The layer-by-layer check of a stack step against the teacher-forced oracle: tolerances (data:
layer_tolerances.toml, each with its reason) and the failures of one step's trace. Tests, the numerics stage's TP
cells and the benchmarks share it."""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from k3_decode.executor.executor import StackExecutor, StepRequest
from k3_decode.executor.inputs import StackInput
from k3_decode.executor.oracle import OracleInputs, layer_errors, routing_mismatches
from k3_decode.reference.decoder import LayerTrace
from k3_decode.reference.kda import KdaCache


@dataclass(frozen=True)
class Tolerance:
    rms_rel: float
    peak_rel: float
    reason: str


@functools.cache
def _tolerances() -> dict[str, Any]:
    return tomllib.loads(resources.files(__package__).joinpath("layer_tolerances.toml").read_text())


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


def snapshot(ex: StackExecutor, requests: Sequence[StepRequest]) -> OracleInputs:
    """What the oracle needs to replay the next step: taken before it runs."""
    return OracleInputs(
        entry=StackInput.cat([r.inputs for r in requests]),
        tables=ex.state.tables([r.request for r in requests]),
        kda={i: KdaCache(c.conv.clone(), c.recurrent.clone()) for i, c in ex.state.kda.items()},
        mla={i: c.clone() for i, c in ex.state.mla.items()},
        k_scale=ex.config.k_scale,
        q_scale=ex.config.q_scale,
    )
