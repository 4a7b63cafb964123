"""The seeded synthetic weights the K3 cells read, generated once per (dims, TP, layer, device) and reused.

Cells copy what they hand an implementation (so a kernel that writes into a weight is caught by the hygiene
probes, and the cached original stays clean). Which layer each op draws from is fixed here: any layer of a kind
has the same shapes, so one layer per kind is enough for numerics.
"""

from __future__ import annotations

from functools import cache

from k3_decode.config import ModelDims
from k3_decode.reference.mxfp import MxTensor
from k3_decode.weights import (
    AttnResWeights,
    DenseMlpWeights,
    KdaWeights,
    MlaWeights,
    MoeWeights,
    ResidualWeights,
    SyntheticWeights,
)


def replicated_tp(dims: ModelDims) -> int:
    """The TP size to draw weights every rank holds in full (AttnRes, router, latent projections, final norm)
    from: any rank's copy is the same by construction, and the largest TP makes the sharded rest of the layer
    (experts, vocabulary) the smallest to generate alongside."""
    return max(dims.parallel.tp_sizes)


def kda_layer(dims: ModelDims) -> int:
    """The first KDA layer with a MoE (layer 1 of K3); any KDA layer has the same shapes."""
    return next(i for i in range(dims.num_layers) if dims.layer_kind(i) == "kda" and dims.mlp_kind(i) == "moe")


def mla_layer(dims: ModelDims) -> int:
    return next(i for i in range(dims.num_layers) if dims.layer_kind(i) == "mla")


def moe_layer(dims: ModelDims) -> int:
    return next(i for i in range(dims.num_layers) if dims.mlp_kind(i) == "moe")


def dense_layer(dims: ModelDims) -> int:
    return next(i for i in range(dims.num_layers) if dims.mlp_kind(i) == "dense")


@cache
def _synthetic(dims: ModelDims, tp: int, device: str) -> SyntheticWeights:
    return SyntheticWeights(dims, tp, rank=0, device=device)


@cache
def residual(dims: ModelDims, layer: int, device: str) -> ResidualWeights:
    return _synthetic(dims, replicated_tp(dims), device).residual(layer)


@cache
def final_residual(dims: ModelDims, device: str) -> tuple[AttnResWeights, object]:
    """(final AttnRes weights, final norm weight)."""
    model = _synthetic(dims, replicated_tp(dims), device).model()
    return model.final_res, model.final_norm


@cache
def kda(dims: ModelDims, tp: int, device: str) -> KdaWeights:
    """One KDA layer of rank 0 at this TP size: the projections and the step's own weights."""
    w = _synthetic(dims, tp, device).attention(kda_layer(dims))
    assert isinstance(w, KdaWeights)
    return w


@cache
def mla(dims: ModelDims, tp: int, device: str) -> MlaWeights:
    w = _synthetic(dims, tp, device).attention(mla_layer(dims))
    assert isinstance(w, MlaWeights)
    return w


@cache
def moe(dims: ModelDims, tp: int, device: str) -> MoeWeights:
    """The whole MoE layer of one rank, every routed expert included (minutes for a K3 rank on a GPU)."""
    w = _synthetic(dims, tp, device).mlp(moe_layer(dims))
    assert isinstance(w, MoeWeights)
    return w


@cache
def moe_dense_part(dims: ModelDims, tp: int, device: str) -> MoeWeights:
    """Router, bias, latent projections, latent norm and shared experts of one rank; of the routed experts only
    expert 0 (the ops that read no expert need none of the others)."""
    w = _synthetic(dims, tp, device).mlp(moe_layer(dims), experts=(0,))
    assert isinstance(w, MoeWeights)
    return w


@cache
def experts(dims: ModelDims, tp: int, device: str, distinct: int | None = None) -> tuple[MxTensor, MxTensor]:
    """Every routed expert of one rank as MXFP4 (w13, w2). With `distinct`, only that many experts are generated
    and repeated over all expert ids: for runs that check memory accesses, not values (the sanitizer), where
    generating the 896 experts of a K3 rank would take most of the run."""
    if distinct is None:
        w = moe(dims, tp, device)
        return w.w13, w.w2
    w13, w2 = _synthetic(dims, tp, device).experts(moe_layer(dims), range(distinct))
    reps = -(-dims.moe.num_experts // distinct)

    def tile(mx: MxTensor) -> MxTensor:
        n = dims.moe.num_experts
        data = mx.data.repeat(reps, *([1] * (mx.data.dim() - 1)))[:n].contiguous()
        scales = mx.scales.repeat(reps, *([1] * (mx.scales.dim() - 1)))[:n].contiguous()
        return MxTensor(mx.fmt, data, scales)

    return tile(w13), tile(w2)


@cache
def dense(dims: ModelDims, tp: int, device: str) -> DenseMlpWeights:
    w = _synthetic(dims, tp, device).mlp(dense_layer(dims))
    assert isinstance(w, DenseMlpWeights)
    return w
