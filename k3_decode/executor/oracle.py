"""The reference decoder's layers, teacher-forced with the executor's own layer inputs, for layer-by-layer checks.

End-to-end outputs of a BF16 stock path and an FP32/FP64 oracle part ways through discrete choices (a routed
expert flips, and that token's MLP output moves by O(1); see k3_decode.reference.decoder), so a stack is compared
one sublayer at a time: each oracle sublayer gets exactly the input the executor's sublayer got.

    AttnRes before attention: the oracle's state chain from the stack's entry state, with the executor's deltas
    attention (KDA or MLA): the executor's attention input, and a copy of the caches as they were before the step
    AttnRes after attention: the same chain, with the executor's attention output
    MLP (dense or latent MoE): the executor's MLP input

The AttnRes prefix and bank take only exact BF16 sums of BF16 rows, so the oracle's chain and the executor's stay
bit-identical as long as the executor keeps its state right; a wrong block or prefix shows up in the mixing.
The per-layer functions are the reference decoder's (KdaRank, MlaRank, kda_rank_attention, latent_moe, dense_mlp),
run on this one rank's shard with the all-reduce over that single rank (the executor's identity all-reduce). The MLA
core is the oracle's mla_decode with the stock path's FP8 query scale and BF16 cache-row rounding, the rounding
points the decoder's own MLA call leaves out. Routed experts are dequantized to BF16 in chunks (exact: MXFP4 values
are BF16 values; k3_decode.stock.moe.as_reference), so a real-size K3 layer's 896 experts fit on one GPU; the
oracle still computes in `dtype`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from k3_decode.config import ModelDims
from k3_decode.executor.inputs import StackInput
from k3_decode.executor.state import StepTables
from k3_decode.reference import attn_res as ra
from k3_decode.reference import mla as rm
from k3_decode.reference import moe as rmoe
from k3_decode.reference.decoder import (
    KdaRank,
    LayerTrace,
    MlaRank,
    Numerics,
    dense_mlp,
    kda_rank_attention,
    latent_moe,
)
from k3_decode.reference.kda import KdaCache, KdaSpec
from k3_decode.reference.moe import GatedFfn
from k3_decode.stock.moe import as_reference
from k3_decode.weights import AttnResWeights, DenseMlpWeights, KdaWeights, LayerWeights, MoeWeights


@dataclass(frozen=True)
class OracleInputs:
    """What the step saw before it ran: the entry state, the tables of its one iteration and copies of the caches."""

    entry: StackInput
    tables: StepTables
    kda: Mapping[int, KdaCache]  # copies, taken before the step (the oracle updates them)
    mla: Mapping[int, Tensor]
    k_scale: float
    q_scale: float


def _mla_attention(
    dims: ModelDims, w: MlaRank, x: Tensor, cache: Tensor, inp: OracleInputs, dtype: torch.dtype
) -> Tensor:
    projected = (x.to(dtype) @ w.qkv_a_g.T).to(torch.bfloat16).to(dtype)  # the stock qkv_a_g GEMM output is BF16
    t = inp.tables
    o = rm.mla_decode(
        projected,
        w.core,
        dims.mla,
        cache,
        t.block_table.to(cache.device),
        t.seq_lens.to(cache.device),
        t.slot_mapping.to(cache.device),
        inp.k_scale,
        dims.rms_norm_eps,
        q_scale=inp.q_scale,
        kv_row_dtype=torch.bfloat16,
        dtype=dtype,
    )
    return o @ w.o_proj.T


Reduce = Callable[[Tensor], Tensor]
"""An all-reduce across the TP ranks of the oracle's row-parallel partial (every rank calls it in the same order)."""


def teacher_forced(
    dims: ModelDims,
    tp: int,
    weights: Mapping[int, LayerWeights],
    trace: Sequence[LayerTrace],
    inp: OracleInputs,
    dtype: torch.dtype = torch.float64,
    reduce: Reduce | None = None,
) -> tuple[LayerTrace, ...]:
    """The oracle's trace of the same layers, each sublayer fed the executor's input to it (see module doc).

    `reduce`: for an executor that runs its all-reduces across processes (k3_decode.distributed), each rank's oracle
    computes its own shard's partials and combines them through `reduce`; None keeps the all-reduce over this one
    rank, as the single-rank executor does.
    """
    numerics = Numerics(dtype=dtype, all_reduce="two_shot", mla_k_scale=inp.k_scale)
    spec = KdaSpec.for_rank(dims, tp)
    block, eps = dims.attn_res_block_size, dims.rms_norm_eps
    state = ra.AttnResState(inp.entry.prefix, inp.entry.blocks)
    delta = inp.entry.delta
    slots = inp.tables.kda_slots.long()
    out = []
    for tr in trace:
        layer, w = tr.layer, weights[tr.layer]
        res = w.residual
        attn_mix = _mix(res.attn_res, res.input_norm, dtype)
        x_attn, state = ra.before_attention(state, layer, delta, attn_mix, block, eps, dtype)
        x = tr.attn_input[:, 0]
        if isinstance(w.attention, KdaWeights):
            rank = KdaRank.from_weights(w.attention, dtype)
            kda_slots = slots.to(x.device)[:, None]
            attn = kda_rank_attention(spec, rank, x[:, None], inp.kda[layer], kda_slots, None, dtype)[:, 0]
        else:
            attn = _mla_attention(dims, MlaRank.from_weights(w.attention, dtype), x, inp.mla[layer], inp, dtype)
        if reduce is not None:
            attn = reduce(attn)
        mlp_mix = _mix(res.mlp_res, res.post_attn_norm, dtype)
        x_mlp, state = ra.after_attention(state, layer, tr.attn_output[:, 0], mlp_mix, block, eps, dtype)
        y = tr.mlp_input[:, 0].to(dtype)
        ids = None
        if isinstance(w.mlp, DenseMlpWeights):
            ffn = GatedFfn(w.mlp.gate_up.to(dtype), w.mlp.down.to(dtype))
            mlp = dense_mlp(dims, [ffn], y, numerics) if reduce is None else reduce(rmoe.dense_mlp(y, ffn, dims))
        else:
            assert isinstance(w.mlp, MoeWeights)
            ref = as_reference(w.mlp, torch.bfloat16)
            if reduce is None:
                mlp, ids = latent_moe(dims, [ref], y, numerics)
            else:
                combined = rmoe.latent_moe_combine(
                    [rmoe.latent_moe_partial(y, ref, dims)], ref, dims, reduce=lambda parts: reduce(parts[0])
                )
                mlp, ids = combined.out, combined.routing.ids
        out.append(
            LayerTrace(
                layer=layer,
                kind=tr.kind,
                mlp_kind=tr.mlp_kind,
                attn_input=x_attn[:, None],
                attn_output=attn[:, None],
                mlp_input=x_mlp[:, None],
                mlp_output=mlp[:, None],
                expert_ids=None if ids is None else ids[:, None],
            )
        )
        delta = tr.mlp_output[:, 0]
    return tuple(out)


def _mix(w: AttnResWeights, out_norm: Tensor, dtype: torch.dtype) -> ra.MixWeights:
    return ra.MixWeights(res_norm=w.norm.to(dtype), res_proj=w.proj.to(dtype), out_norm=out_norm.to(dtype))


@dataclass(frozen=True)
class LayerError:
    layer: int
    field: str  # attn_input, attn_output, mlp_input, mlp_output
    rms_rel: float  # rms(got - ref) / rms(ref)
    peak_rel: float  # max|got - ref| / max|ref|
    rms_ratio: float  # rms(got) / rms(ref): a zero or wrongly scaled output shows here
    constant: bool  # the output is constant (a stuck kernel)


def layer_errors(got: Sequence[LayerTrace], ref: Sequence[LayerTrace]) -> list[LayerError]:
    out = []
    for g, r in zip(got, ref, strict=True):
        for (field, a), (_, b) in zip(g.hidden(), r.hidden(), strict=True):
            x, y = a.double().cpu(), b.double().cpu()
            rms_ref = float(y.square().mean().sqrt())
            err = x - y
            out.append(
                LayerError(
                    layer=g.layer,
                    field=field,
                    rms_rel=float(err.square().mean().sqrt()) / max(rms_ref, 1e-300),
                    peak_rel=float(err.abs().max()) / max(float(y.abs().max()), 1e-300),
                    rms_ratio=float(x.square().mean().sqrt()) / max(rms_ref, 1e-300),
                    constant=bool(x.numel() > 1 and float(x.std()) == 0.0),
                )
            )
    return out


def routing_mismatches(got: Sequence[LayerTrace], ref: Sequence[LayerTrace]) -> list[str]:
    """Layers whose routed experts differ (as sets per token: the stock top-k lists them in its own order)."""
    out = []
    for g, r in zip(got, ref, strict=True):
        if g.expert_ids is None or r.expert_ids is None:
            continue
        a = g.expert_ids.cpu().sort(dim=-1).values
        b = r.expert_ids.cpu().sort(dim=-1).values
        if not torch.equal(a, b):
            rows = (a != b).any(dim=-1).flatten().nonzero().flatten().tolist()
            out.append(f"layer {g.layer}: routed experts differ for rows {rows}")
    return out
