"""The composed reference decoder: Kimi K3 decode for a batch of requests, built from the per-op oracles.

What one step computes, for tokens [B, q] (q = 1 for a decode step, q <= 8 for a speculative verify step), per
vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/model.py and the modules the per-op oracles cite):

    embedding lookup (vocab-parallel: masked gather on each rank, then the all-reduce)
    for each layer i:
        AttnRes before attention (attn_res.before_attention) -> attention input
        KDA layer: in_proj GEMM -> kda_decode_step (q = 1) or kda_verify_step (q <= 8) -> o_proj
        MLA layer: qkv_a_g GEMM -> mla_decode over the paged FP8 cache, one query token at a time -> o_proj
        AttnRes after attention -> MLP input
        layer 0: dense SiTU MLP; other layers: latent MoE with the routed experts dequantized from MXFP4
    final AttnRes with the model's final norm fused (what the specialized decode writes) -> lm_head logits

Tensor parallelism. TP = 1 is the logical model. At tp > 1 every rank's shard (SyntheticWeights rank r) runs,
and each row-parallel output (embedding, o_proj, dense down, the MoE latent sum, the shared experts) is combined
over the ranks in rank order. `Numerics.all_reduce` picks the transport:
    "two_shot"  the specialized decode's all-reduce (reference/allreduce.py): BF16 partials, FP32 sum in rank
                order, one rounding to BF16. The default, because it is what the kernels must reproduce.
    "exact"     the partials summed in the compute dtype with no rounding (moe.sum_rank_order). TP = 1 and
                tp > 1 then differ only by summation order, which makes a tight check of the shard math.
The vocab-parallel lm_head is gathered (concatenated in rank order), not summed.

Rounding points modelled (everything else runs in `Numerics.dtype`, FP32 or FP64):
    - AttnRes prefix and block bank: BF16 (attn_res.py).
    - KDA in_proj output: BF16. The conv state stores these inputs in BF16; rounding them up front gives a
      verify step the same inputs that a chain of decode steps reads back from the conv state.
    - KDA state: BF16 conv, FP32 recurrent (kda.py). MLA cache: FP8 E4M3 with a per-tensor k_scale (mla.py).
    - Row-parallel combines: as the all-reduce mode says.
The kernels also round other GEMM outputs to BF16; comparisons against this oracle need a tolerance for that.

State. `DecodeState` holds, per request, the KDA caches (conv + recurrent, one per KDA layer and rank), the
MLA paged caches (one per MLA layer and rank: the latent cache is replicated on every TP rank), the block
table, the committed context length and the count the last verify step accepted. AttnRes needs no state
across steps: its bank and prefix live within one token's forward pass (b_0 is that token's embedding); the
step trace records the mixings they feed.

Slots and pages. Request b owns KDA slots 1 + b*Q .. b*Q + Q (Q = max tokens per step; slot 0 is the NULL slot
and is never written) and MLA pages j*B + b: the pages of different requests interleave, so a block-table
mistake reads another request's rows instead of passing unnoticed.

Verify steps follow kda.py's accepted-token rules: after `verify_step` the caller reports the accepted counts
with `accept`; the next step reads the KDA state from slot[b, a-1] and overwrites the MLA rows past the accepted
context. A q-token step cannot follow a step that accepted more than q tokens (the state sits in slot a-1,
which a q-token slot row does not address); vLLM keeps q fixed while speculating.

Sensitivity. BF16 prefix rounding, FP8 cache codes and top-k expert choice are discrete: a one-ulp FP32
difference can flip one of them, and a flipped expert changes that token's MLP output by O(1). On the 20-layer
k3-mini stack, FP32 against FP64 compute, or TP = 2 against TP = 1 under the two-shot transport, route some
tokens differently within the first step, and the logits then differ by O(1). Whole-model results are therefore
reproducible only in FP64 with the exact transport, where TP splits, batch composition and verify-vs-decode
agree to ~1e-15 (in FP64 the MoE runs token by token to keep it so, see `latent_moe`); an implementation with other
rounding must be compared with this oracle layer by layer, through the trace (`first_divergence`).

Not modelled: NULL (padding) requests at the decoder level (the KDA and MLA oracles model them per op),
decode context parallelism, prefill kernels (a context is prefilled by running decode steps).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from k3_decode.config import LayerKind, MlpKind, ModelDims
from k3_decode.reference import attn_res, kda, mla, moe
from k3_decode.reference.allreduce import reduce_rank_order
from k3_decode.reference.mxfp import quantize_mxfp8
from k3_decode.weights import (
    AttnResWeights,
    DenseMlpWeights,
    LayerWeights,
    ModelWeights,
    MoeWeights,
    SyntheticWeights,
)
from k3_decode.weights import KdaWeights as KdaLayerWeights
from k3_decode.weights import MlaWeights as MlaLayerWeights

AllReduce = Literal["two_shot", "exact"]
MAX_VERIFY_TOKENS = 8  # what the KDA verify oracle (and KdaSplit) accepts per request


@dataclass(frozen=True)
class Numerics:
    """How the oracle computes: compute dtype, TP transport, MXFP8 on the expert inputs, MLA cache geometry."""

    dtype: torch.dtype = torch.float32
    all_reduce: AllReduce = "two_shot"
    expert_act_quant: bool = False  # MXFP8 fake-quantization of both routed-expert GEMM inputs
    mla_k_scale: float = 1.0  # per-tensor FP8 scale of the latent cache (vLLM's default when uncalibrated)
    mla_page_size: int = 16

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"Numerics.dtype must be torch.float32 or torch.float64, got {self.dtype}")
        if self.all_reduce not in ("two_shot", "exact"):
            raise ValueError(f"Numerics.all_reduce must be 'two_shot' or 'exact', got {self.all_reduce!r}")
        if not self.mla_k_scale > 0:
            raise ValueError(f"Numerics.mla_k_scale must be positive, got {self.mla_k_scale}")
        if self.mla_page_size < 1:
            raise ValueError(f"Numerics.mla_page_size must be at least 1, got {self.mla_page_size}")


def all_reduce(partials: Sequence[Tensor], numerics: Numerics) -> Tensor:
    """Combine row-parallel partials (rank 0 first) with the transport `numerics.all_reduce` names."""
    if numerics.all_reduce == "two_shot":
        return reduce_rank_order([p.to(torch.bfloat16) for p in partials]).to(numerics.dtype)
    return moe.sum_rank_order(partials).to(numerics.dtype)


def mxfp8_fake_quant(x: Tensor) -> Tensor:
    """MXFP8 (E4M3, one UE8M0 scale per 32 along the last dim) and back, in x's dtype."""
    return quantize_mxfp8(x).dequantize(x.dtype)


# --- per-rank weights in the oracles' form ------------------------------------------------------------------------


@dataclass(frozen=True)
class KdaRank:
    """One rank's KDA layer: the packed in_proj, the part the KDA oracle runs, and the row-parallel o_proj."""

    in_proj: Tensor  # [in_proj_rows, hidden]
    core: kda.KdaWeights
    o_proj: Tensor  # [hidden, proj]

    @classmethod
    def from_weights(cls, w: KdaLayerWeights, dtype: torch.dtype) -> KdaRank:
        core = kda.KdaWeights(
            f_b=w.f_b.to(dtype), conv=w.conv.to(dtype), a_log=w.a_log, dt_bias=w.dt_bias, o_norm=w.o_norm
        )
        return cls(in_proj=w.in_proj.to(dtype), core=core, o_proj=w.o_proj.to(dtype))


@dataclass(frozen=True)
class MlaRank:
    """One rank's MLA layer: the fused qkv_a_g projection, the absorbed-decode weights, the row-parallel o_proj."""

    qkv_a_g: Tensor  # [q_lora + cache_row + heads * v, hidden]
    core: mla.MlaWeights
    o_proj: Tensor  # [hidden, heads * v]

    @classmethod
    def from_weights(cls, w: MlaLayerWeights, dtype: torch.dtype) -> MlaRank:
        core = mla.MlaWeights(
            q_a_norm=w.q_a_norm.to(dtype),
            kv_a_norm=w.kv_a_norm.to(dtype),
            q_b=w.q_b.to(dtype),
            w_uk=w.w_uk.to(dtype),
            w_uv=w.w_uv.to(dtype),
        )
        return cls(qkv_a_g=w.qkv_a_g.to(dtype), core=core, o_proj=w.o_proj.to(dtype))


def _gated(w: DenseMlpWeights, dtype: torch.dtype) -> moe.GatedFfn:
    return moe.GatedFfn(w.gate_up.to(dtype), w.down.to(dtype))


def moe_rank(w: MoeWeights, num_experts: int, dtype: torch.dtype) -> moe.LatentMoeWeights:
    """One rank's latent MoE with every routed expert dequantized from MXFP4."""
    if w.expert_ids != tuple(range(num_experts)):
        raise ValueError("the decoder routes over every expert; generate the MoE weights with experts=None")
    return moe.LatentMoeWeights(
        router=w.router,  # the router computes its logits in FP64 from the BF16 values whatever dtype holds them
        e_score_correction_bias=w.router_bias,  # FP32, as route() requires
        latent_down=w.latent_down.to(dtype),
        latent_up=w.latent_up.to(dtype),
        latent_norm=w.latent_norm.to(dtype),
        experts=moe.GatedFfn(w.w13.dequantize(dtype), w.w2.dequantize(dtype)),
        shared=_gated(w.shared, dtype),
    )


def _mix(w: AttnResWeights, out_norm: Tensor, dtype: torch.dtype) -> attn_res.MixWeights:
    return attn_res.MixWeights(res_norm=w.norm.to(dtype), res_proj=w.proj.to(dtype), out_norm=out_norm.to(dtype))


@dataclass(frozen=True)
class LayerRanks:
    """One decoder layer on every rank (rank 0 first). AttnRes weights are replicated, so one copy is kept."""

    layer: int
    kind: LayerKind
    mlp_kind: MlpKind
    attn_mix: attn_res.MixWeights
    mlp_mix: attn_res.MixWeights
    attention: tuple[KdaRank, ...] | tuple[MlaRank, ...]
    mlp: tuple[moe.GatedFfn, ...] | tuple[moe.LatentMoeWeights, ...]

    @classmethod
    def from_weights(cls, dims: ModelDims, ranks: Sequence[LayerWeights], dtype: torch.dtype) -> LayerRanks:
        first = ranks[0]
        if any((w.layer, w.kind, w.mlp_kind) != (first.layer, first.kind, first.mlp_kind) for w in ranks):
            raise ValueError(f"layer {first.layer}: the rank weights disagree on layer index or kind")
        if (first.kind, first.mlp_kind) != (dims.layer_kind(first.layer), dims.mlp_kind(first.layer)):
            raise ValueError(f"layer {first.layer}: weights are {first.kind}/{first.mlp_kind}, the dims say otherwise")
        res = first.residual
        if first.kind == "kda":
            attention = tuple(KdaRank.from_weights(w.attention, dtype) for w in ranks)
        else:
            attention = tuple(MlaRank.from_weights(w.attention, dtype) for w in ranks)
        if first.mlp_kind == "dense":
            mlp = tuple(_gated(w.mlp, dtype) for w in ranks)
        else:
            mlp = tuple(moe_rank(w.mlp, dims.moe.num_experts, dtype) for w in ranks)
        return cls(
            layer=first.layer,
            kind=first.kind,
            mlp_kind=first.mlp_kind,
            attn_mix=_mix(res.attn_res, res.input_norm, dtype),
            mlp_mix=_mix(res.mlp_res, res.post_attn_norm, dtype),
            attention=attention,
            mlp=mlp,
        )


@dataclass(frozen=True)
class ModelRanks:
    """Embedding and lm_head shards (vocab-parallel, rank 0 first) and the final AttnRes with the final norm."""

    embedding: tuple[Tensor, ...]  # [vocab / tp, hidden] each
    lm_head: tuple[Tensor, ...]
    final_mix: attn_res.MixWeights

    @classmethod
    def from_weights(cls, ranks: Sequence[ModelWeights], dtype: torch.dtype) -> ModelRanks:
        return cls(
            embedding=tuple(w.embedding.to(dtype) for w in ranks),
            lm_head=tuple(w.lm_head.to(dtype) for w in ranks),
            final_mix=_mix(ranks[0].final_res, ranks[0].final_norm, dtype),
        )


# --- per-layer computations ---------------------------------------------------------------------------------------


def embed(model: ModelRanks, tokens: Tensor, numerics: Numerics) -> Tensor:
    """Vocab-parallel embedding of tokens [N]: each rank gathers the rows it holds (zeros elsewhere), then reduce."""
    partials, start = [], 0
    for table in model.embedding:
        local = tokens - start
        hit = (local >= 0) & (local < table.shape[0])
        rows = table[local.clamp(0, table.shape[0] - 1)]
        partials.append(torch.where(hit[:, None], rows, torch.zeros_like(rows)))
        start += table.shape[0]
    return all_reduce(partials, numerics)


def kda_rank_attention(
    spec: kda.KdaSpec,
    w: KdaRank,
    x: Tensor,
    cache: kda.KdaCache,
    slots: Tensor,
    num_accepted: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    """One rank's KDA layer for x [B, q, hidden]: its o_proj partial [B, q, hidden]. Mutates `cache`.

    num_accepted None runs the q = 1 decode step on slots[:, 0]; otherwise the verify step on slots [B, q].
    """
    packed = (x.to(dtype) @ w.in_proj.T).to(torch.bfloat16).to(dtype)
    if num_accepted is None:
        if x.shape[1] != 1:
            raise ValueError(f"a decode step takes one token per request, got {x.shape[1]}")
        out = kda.kda_decode_step(spec, w.core, packed[:, 0], cache, slots[:, 0], compute_dtype=dtype)[:, None]
    else:
        out = kda.kda_verify_step(spec, w.core, packed, cache, slots, num_accepted, compute_dtype=dtype)
    return out.to(dtype) @ w.o_proj.T


def mla_rank_attention(
    dims: ModelDims,
    w: MlaRank,
    x: Tensor,
    cache: Tensor,
    block_table: Tensor,
    context_lens: Tensor,
    numerics: Numerics,
) -> Tensor:
    """One rank's MLA layer for x [B, q, hidden] at positions context_lens + t: its o_proj partial [B, q, hidden].

    Token t inserts its row and attends to positions 0 .. context_lens + t, so running the q tokens one after
    another is the causal multi-token verify. Mutates `cache`.
    """
    outs = []
    for t in range(x.shape[1]):
        seq_lens = context_lens + t + 1
        slot_mapping = mla.decode_slot_mapping(block_table, seq_lens, cache.shape[1])
        outs.append(
            mla.mla_decode(
                x[:, t].to(numerics.dtype) @ w.qkv_a_g.T,
                w.core,
                dims.mla,
                cache,
                block_table,
                seq_lens,
                slot_mapping,
                numerics.mla_k_scale,
                dims.rms_norm_eps,
                dtype=numerics.dtype,
            )
        )
    return torch.stack(outs, dim=1) @ w.o_proj.T


def dense_mlp(dims: ModelDims, ranks: Sequence[moe.GatedFfn], x: Tensor, numerics: Numerics) -> Tensor:
    """Layer 0's dense MLP for x [N, hidden]: column-parallel gate/up, row-parallel down, reduced over ranks."""
    return all_reduce([moe.dense_mlp(x, ffn, dims) for ffn in ranks], numerics)


def latent_moe(
    dims: ModelDims, ranks: Sequence[moe.LatentMoeWeights], x: Tensor, numerics: Numerics
) -> tuple[Tensor, Tensor]:
    """The latent MoE for x [N, hidden] on every rank, latent sum and shared experts reduced.

    Returns (output [N, hidden], routed expert ids [N, top_k]).
    """
    hook = mxfp8_fake_quant if numerics.expert_act_quant else None
    reduce = functools.partial(all_reduce, numerics=numerics)
    partials = [moe.latent_moe_partial(x, w, dims, act_quant=hook) for w in ranks]
    trace = moe.latent_moe_combine(partials, ranks[0], dims, reduce=reduce)
    outs, ids = [trace.out], [trace.routing.ids]
    return torch.cat(outs), torch.cat(ids)


def lm_head(model: ModelRanks, hidden: Tensor) -> Tensor:
    """Vocab-parallel logits [N, vocab]: each rank's rows, gathered in rank order."""
    return torch.cat([hidden @ w.T for w in model.lm_head], dim=-1)


# --- decode state -------------------------------------------------------------------------------------------------


@dataclass
class DecodeState:
    """Per-request decode state of one batch, on every rank; the step functions mutate it in place."""

    tp: int
    max_context: int
    max_tokens_per_step: int
    kda: dict[int, list[kda.KdaCache]]  # KDA layer -> its cache on each rank (that rank's heads)
    mla: dict[int, list[Tensor]]  # MLA layer -> its paged FP8 cache [pages, page_size, row] on each rank
    block_table: Tensor  # [B, pages per request] int64
    kda_slots: Tensor  # [B, max_tokens_per_step] int64, all > 0
    context_lens: Tensor  # [B] tokens committed to the context
    num_accepted: Tensor  # [B] what the last step accepted: the next step's KDA state is in slot[b, a - 1]
    pending: int = 0  # tokens per request of a verify step awaiting accept(); 0 when none

    @property
    def batch(self) -> int:
        return self.context_lens.shape[0]


def new_state(
    dims: ModelDims,
    tp: int,
    batch: int,
    max_context: int,
    numerics: Numerics,
    max_tokens_per_step: int = 1,
    device: torch.device | str = "cpu",
) -> DecodeState:
    """Empty caches for `batch` requests of up to `max_context` tokens and steps of up to that many tokens."""
    if batch < 1 or max_context < 1:
        raise ValueError(f"batch ({batch}) and max_context ({max_context}) must be at least 1")
    if not 1 <= max_tokens_per_step <= MAX_VERIFY_TOKENS:
        raise ValueError(f"max_tokens_per_step must lie in 1..{MAX_VERIFY_TOKENS}, got {max_tokens_per_step}")
    spec = kda.KdaSpec.for_rank(dims, tp)
    q, page = max_tokens_per_step, numerics.mla_page_size
    pages = -(-max_context // page)
    num_slots = 1 + batch * q  # slot 0 is NULL
    kda_caches = {
        i: [kda.KdaCache.zeros(spec, num_slots, num_spec=q - 1, device=device) for _ in range(tp)]
        for i in range(dims.num_layers)
        if dims.layer_kind(i) == "kda"
    }
    row = dims.mla.cache_row
    mla_caches = {
        i: [torch.zeros(batch * pages, page, row, dtype=torch.uint8, device=device) for _ in range(tp)]
        for i in range(dims.num_layers)
        if dims.layer_kind(i) == "mla"
    }
    b, j = torch.arange(batch), torch.arange(pages)
    return DecodeState(
        tp=tp,
        max_context=max_context,
        max_tokens_per_step=q,
        kda=kda_caches,
        mla=mla_caches,
        block_table=(j[None, :] * batch + b[:, None]).to(device),
        kda_slots=(1 + b[:, None] * q + torch.arange(q)[None, :]).to(device),
        context_lens=torch.zeros(batch, dtype=torch.int64, device=device),
        num_accepted=torch.ones(batch, dtype=torch.int64, device=device),
    )


# --- traces -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerTrace:
    """What one layer read and wrote in one step, per token [B, q, ...], in the compute dtype."""

    layer: int
    kind: LayerKind
    mlp_kind: MlpKind
    attn_input: Tensor  # the pre-attention AttnRes output (normed)
    attn_output: Tensor  # after the o_proj combine
    mlp_input: Tensor
    mlp_output: Tensor
    expert_ids: Tensor | None  # [B, q, top_k] routed experts by descending key; None for the dense layer

    def hidden(self) -> Iterator[tuple[str, Tensor]]:
        for name in ("attn_input", "attn_output", "mlp_input", "mlp_output"):
            yield name, getattr(self, name)


@dataclass(frozen=True)
class StepOutput:
    logits: Tensor  # [B, q, vocab]
    embedding: Tensor  # [B, q, hidden]
    layers: tuple[LayerTrace, ...]
    final_hidden: Tensor  # [B, q, hidden]: the final AttnRes with the model norm, the lm_head input


def first_divergence(ref: StepOutput, other: StepOutput, *, atol: float, rtol: float = 0.0) -> str | None:
    """The first tensor, in execution order, where `other` leaves `ref`'s tolerance, or None if none does.

    Routed expert choices are compared exactly: a different choice explains any divergence after it.
    """

    def differs(name: str, a: Tensor, b: Tensor) -> str | None:
        b = b.to(device=a.device, dtype=a.dtype)
        if a.shape != b.shape:
            return f"{name}: shape {tuple(b.shape)} vs {tuple(a.shape)}"
        if not torch.allclose(b, a, atol=atol, rtol=rtol):
            return f"{name}: max |diff| {(b - a).abs().max().item():.3g} beyond atol {atol:g}, rtol {rtol:g}"
        return None

    def routing(a: LayerTrace, b: LayerTrace) -> str | None:
        same = a.expert_ids is None or b.expert_ids is None or torch.equal(a.expert_ids, b.expert_ids)
        return None if same else f"layer {a.layer} expert_ids: routed experts differ"

    def in_order() -> Iterator[str | None]:
        yield differs("embedding", ref.embedding, other.embedding)
        for a, b in zip(ref.layers, other.layers, strict=True):
            for (name, x), (_, y) in zip(a.hidden(), b.hidden(), strict=True):
                if name == "mlp_output":
                    yield routing(a, b)
                yield differs(f"layer {a.layer} {name}", x, y)
        yield differs("final_hidden", ref.final_hidden, other.final_hidden)
        yield differs("logits", ref.logits, other.logits)

    return next((found for found in in_order() if found), None)


# --- the decoder --------------------------------------------------------------------------------------------------


class ReferenceDecoder:
    """Kimi K3 decode on every TP rank of a model; the weights are fixed, the state is passed to each step."""

    def __init__(
        self,
        dims: ModelDims,
        tp: int,
        layers: Sequence[LayerRanks],
        model: ModelRanks,
        numerics: Numerics = Numerics(),
    ) -> None:
        if [w.layer for w in layers] != list(range(dims.num_layers)):
            raise ValueError(f"{dims.name}: expected weights for layers 0..{dims.num_layers - 1} in order")
        if any(len(w.attention) != tp for w in layers) or len(model.lm_head) != tp:
            raise ValueError(f"every layer and the model weights need one entry per rank (tp={tp})")
        self.dims, self.tp, self.numerics = dims, tp, numerics
        self.layers, self.model = tuple(layers), model
        self.kda_spec = kda.KdaSpec.for_rank(dims, tp)

    @classmethod
    def synthetic(
        cls,
        dims: ModelDims,
        tp: int = 1,
        seed: int = 0,
        numerics: Numerics = Numerics(),
        device: torch.device | str = "cpu",
    ) -> ReferenceDecoder:
        """The decoder over SyntheticWeights(dims, tp, rank, seed) for every rank."""
        gens = [SyntheticWeights(dims, tp, r, seed=seed, device=device, dtype=torch.float32) for r in range(tp)]
        dtype = numerics.dtype
        layers = [LayerRanks.from_weights(dims, [g.layer(i) for g in gens], dtype) for i in range(dims.num_layers)]
        return cls(dims, tp, layers, ModelRanks.from_weights([g.model() for g in gens], dtype), numerics)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head[0].device

    def new_state(self, batch: int, max_context: int, max_tokens_per_step: int = 1) -> DecodeState:
        return new_state(self.dims, self.tp, batch, max_context, self.numerics, max_tokens_per_step, self.device)

    # -- public steps -------------------------------------------------------------------------------------------

    def decode_step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """One token per request, tokens [B]; returns logits [B, vocab] and commits the token."""
        if tokens.dim() != 1:
            raise ValueError(f"decode_step takes tokens [batch], got shape {tuple(tokens.shape)}")
        return self.step(state, tokens[:, None], verify=False).logits[:, 0]

    def verify_step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """q tokens per request, tokens [B, q]; returns logits [B, q, vocab]. Call `accept` before the next step."""
        if tokens.dim() != 2:
            raise ValueError(f"verify_step takes tokens [batch, q], got shape {tuple(tokens.shape)}")
        return self.step(state, tokens, verify=True).logits

    def accept(self, state: DecodeState, num_accepted: Tensor | Sequence[int]) -> None:
        """Commit the first num_accepted[b] tokens of the pending verify step of each request (1..q)."""
        if state.pending == 0:
            raise ValueError("accept() commits a verify step, and no verify step is pending; call verify_step first")
        counts = torch.as_tensor(num_accepted, dtype=torch.int64, device=state.context_lens.device)
        if counts.shape != (state.batch,):
            raise ValueError(
                f"num_accepted needs one count per request, shape ({state.batch},), got {tuple(counts.shape)}"
            )
        if bool(((counts < 1) | (counts > state.pending)).any()):
            raise ValueError(f"num_accepted {counts.tolist()} must lie in 1..{state.pending} (the verified tokens)")
        state.context_lens += counts
        state.num_accepted = counts.clone()
        state.pending = 0

    def prefill(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """Feed a context tokens [B, T] through T decode steps; returns every step's logits [B, T, vocab]."""
        if tokens.dim() != 2:
            raise ValueError(f"prefill takes tokens [batch, length], got shape {tuple(tokens.shape)}")
        return torch.stack([self.decode_step(state, tokens[:, t]) for t in range(tokens.shape[1])], dim=1)

    # -- one forward pass ---------------------------------------------------------------------------------------

    def step(self, state: DecodeState, tokens: Tensor, *, verify: bool) -> StepOutput:
        """Run tokens [B, q] through the model, update `state`, and return logits and the per-layer trace."""
        self._check_step(state, tokens, verify)
        dims, num = self.dims, self.numerics
        batch, q = tokens.shape
        eps, block, dtype = dims.rms_norm_eps, dims.attn_res_block_size, num.dtype

        emb = embed(self.model, tokens.reshape(-1).to(self.device), num)
        residual = attn_res.init_state(emb)
        delta: Tensor | None = None
        traces = []
        for w in self.layers:
            x_attn, residual = attn_res.before_attention(residual, w.layer, delta, w.attn_mix, block, eps, dtype)
            attn_out = self._attention(w, state, x_attn.view(batch, q, -1), verify).reshape(batch * q, -1)
            x_mlp, residual = attn_res.after_attention(residual, w.layer, attn_out, w.mlp_mix, block, eps, dtype)
            delta, ids = self._mlp(w, x_mlp)
            traces.append(
                LayerTrace(
                    layer=w.layer,
                    kind=w.kind,
                    mlp_kind=w.mlp_kind,
                    attn_input=x_attn.view(batch, q, -1),
                    attn_output=attn_out.view(batch, q, -1),
                    mlp_input=x_mlp.view(batch, q, -1),
                    mlp_output=delta.view(batch, q, -1),
                    expert_ids=None if ids is None else ids.view(batch, q, -1),
                )
            )
        assert delta is not None  # a model has at least one layer (ModelDims checks the layer pattern)
        hidden = attn_res.final(residual, delta, dims.num_layers, self.model.final_mix, block, eps, dtype)
        logits = lm_head(self.model, hidden)

        if verify:
            state.pending = q
        else:
            state.context_lens += 1
        return StepOutput(
            logits=logits.view(batch, q, -1),
            embedding=emb.view(batch, q, -1),
            layers=tuple(traces),
            final_hidden=hidden.view(batch, q, -1),
        )

    def _attention(self, w: LayerRanks, state: DecodeState, x: Tensor, verify: bool) -> Tensor:
        q, num = x.shape[1], self.numerics
        if w.kind == "kda":
            slots = state.kda_slots[:, :q]
            accepted = state.num_accepted if verify else None
            partials = [
                kda_rank_attention(self.kda_spec, rank, x, cache, slots, accepted, num.dtype)
                for rank, cache in zip(w.attention, state.kda[w.layer], strict=True)
            ]
        else:
            partials = [
                mla_rank_attention(self.dims, rank, x, cache, state.block_table, state.context_lens, num)
                for rank, cache in zip(w.attention, state.mla[w.layer], strict=True)
            ]
        return all_reduce(partials, num)

    def _mlp(self, w: LayerRanks, x: Tensor) -> tuple[Tensor, Tensor | None]:
        if w.mlp_kind == "dense":
            return dense_mlp(self.dims, w.mlp, x, self.numerics), None
        return latent_moe(self.dims, w.mlp, x, self.numerics)

    def _check_step(self, state: DecodeState, tokens: Tensor, verify: bool) -> None:
        batch, q = tokens.shape
        if state.tp != self.tp or set(state.kda) | set(state.mla) != set(range(self.dims.num_layers)):
            raise ValueError(
                "this state was made for another model or TP size; create it with this decoder's new_state"
            )
        if state.pending:
            raise ValueError(
                f"a verify step of {state.pending} tokens awaits accept(); call accept before the next step"
            )
        if batch != state.batch:
            raise ValueError(f"tokens hold {batch} requests, the state {state.batch}; pass one row per request")
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
        vocab = self.dims.vocab_size
        if bool(((tokens < 0) | (tokens >= vocab)).any()):
            raise ValueError(f"token ids must lie in 0..{vocab - 1}, got {tokens.min().item()}..{tokens.max().item()}")
        if not 1 <= q <= state.max_tokens_per_step:
            raise ValueError(
                f"{q} tokens per request; this state takes 1..{state.max_tokens_per_step} "
                "(raise max_tokens_per_step in new_state)"
            )
        most = int(state.num_accepted.max())
        if (not verify and most > 1) or most > q:
            raise ValueError(
                f"the last step accepted up to {most} tokens, so the KDA state sits in slot {most - 1}; "
                f"the next step must be a verify step of at least {most} tokens"
            )
        longest = int(state.context_lens.max()) + q
        if longest > state.max_context:
            raise ValueError(
                f"a request would reach {longest} tokens, beyond max_context {state.max_context}; "
                "create the state with a larger max_context"
            )
