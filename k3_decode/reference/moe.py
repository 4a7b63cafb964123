"""Oracle for the Kimi K3 feed-forward blocks: router, SiTU, routed experts, latent MoE, dense layer-0 MLP.

Pure torch and device-agnostic. Everything is computed in FP32, or in FP64 when any float input is FP64
(tests pass FP64 weights to compare formulations tightly); nothing is rounded to BF16 on the way. The
router is the exception on purpose: its logits, scores and selection keys are always FP32, because the
FP32 values decide which experts win and which ties exist.

Block structure, per vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/model.py `KimiMoE`,
vllm/models/kimi_k3/nvidia/latent_moe_runner.py):

    logits = x @ router^T                          (FP32 from BF16 weights)
    ids, w = top-k by sigmoid(logits) + bias;  w = renormalized raw scores * routed_scaling_factor
    latent = x @ latent_down^T                     ([L, H], replicated on every TP rank)
    routed_r = sum_k w_k * expert_{ids_k}(latent)  (rank r's shard of every expert's intermediate dim)
    routed = all-reduce_r(routed_r);  normed = RMSNorm(routed)
    out = normed @ latent_up^T + all-reduce_r(shared_r(x))

Expert weights arrive dequantized (MXFP4 unpacking lives elsewhere); an optional activation-quantization
hook stands in for the MXFP8 quantization the experts apply to both GEMM inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from k3_decode.config import ModelDims, MoeDims, RankShapes
from k3_decode.reference.norms import rms_norm

ActQuant = Callable[[Tensor], Tensor]
"""Fake-quantizes a [rows, K] GEMM input and returns it dequantized, same shape. It must treat every row
independently (MXFP8 scales blocks of 32 along K), so that batching tokens differently cannot change it."""

Reduce = Callable[[Sequence[Tensor]], Tensor]
"""Turns the per-rank partials of a TP all-reduce (rank 0 first) into the reduced tensor."""

SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0
ROUTING_EPS = 1e-20


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """FP64 if any given tensor is FP64, else FP32: the oracle never computes below FP32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def sum_rank_order(partials: Sequence[Tensor]) -> Tensor:
    """Sum the TP partials in rank order at (at least) FP32, without any BF16 rounding."""
    if not partials:
        raise ValueError("an all-reduce needs at least one rank partial")
    dtype = compute_dtype(*partials)
    acc = partials[0].to(dtype)
    for p in partials[1:]:
        if p.shape != acc.shape:
            raise ValueError(f"rank partials disagree in shape: {tuple(p.shape)} vs {tuple(acc.shape)}")
        acc = acc + p.to(dtype)
    return acc


# --- router --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """Router result for B tokens. `ids` are ordered by descending selection key (score + bias), equal keys
    by ascending id; kernels may emit another slot order, so compare through `by_id()`."""

    logits: Tensor  # [B, E] FP32
    scores: Tensor  # [B, E] FP32, sigmoid(logits)
    ids: Tensor  # [B, k] int64
    weights: Tensor  # [B, k] FP32

    def by_id(self) -> tuple[Tensor, Tensor]:
        """(ids, weights) with the slots of each token sorted by expert id."""
        order = self.ids.argsort(dim=-1)
        return self.ids.gather(-1, order), self.weights.gather(-1, order)


def router_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """FP32 logits [B, E] from hidden [B, H] and the (BF16) router weight [E, H].

    vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/model.py, `GateLinear`) produces FP32 logits from BF16 weights.
    The oracle accumulates in FP64 and rounds once, so it returns the FP32 value nearest the exact dot
    product; an FP32 kernel differs by its own accumulation order, a few FP32 ulps.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"router expects hidden [B, H] and weight [E, H], got {hidden.shape} and {weight.shape}")
    return (hidden.double() @ weight.double().T).float()


def _order_preserving_int64(x: Tensor) -> Tensor:
    """Integers that sort like the FP32 values (no NaN, +0 and -0 already merged)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    # Negative floats sort backwards by their magnitude bits; flipping those bits restores the order.
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def select_experts(keys: Tensor, top_k: int) -> Tensor:
    """The `top_k` largest FP32 keys of each row as int64 ids [B, k], largest first, equal keys to the lower id.

    The specialized routing lets the lower expert id win ties (vLLM 0.33.0,
    vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/moe/routing.py). `torch.topk` promises no order
    among equal values, so the key is made unique first: (float order, -id) packed into one int64.
    """
    if keys.dtype != torch.float32:
        raise TypeError(f"selection keys must be FP32 (score + FP32 bias), got {keys.dtype}")
    num = keys.shape[-1]
    if not 0 < top_k <= num:
        raise ValueError(f"top_k={top_k} must lie in 1..{num}")
    if not bool(torch.isfinite(keys).all()):
        raise ValueError("selection keys contain NaN or inf; the expert choice would be undefined")
    ordered = _order_preserving_int64(keys + 0.0)  # x + 0.0 turns -0.0 into +0.0: they compare equal
    ids = torch.arange(num, dtype=torch.int64, device=keys.device)
    unique = ordered * (1 << 32) - ids  # |ordered| < 2**31 and ids < 2**32, so this cannot overflow or collide
    return torch.topk(unique, top_k, dim=-1, largest=True, sorted=True).indices


def route(
    logits: Tensor,
    bias: Tensor,
    *,
    top_k: int,
    routed_scaling_factor: float = 1.0,
    eps: float = ROUTING_EPS,
) -> Routing:
    """Sigmoid top-k routing with a score-correction bias ("noaux_tc" with one expert group).

    vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/model.py, vllm/models/kimi_k3/nvidia/specialized_decode/
    cutedsl/common/primitives.py `routing_weight`): scores = sigmoid(logits); the experts are chosen by
    score + e_score_correction_bias (FP32); the weights are the chosen *raw* scores over their sum + 1e-20,
    times routed_scaling_factor. With a single group, group-limited selection is the identity. The weight
    arithmetic is done in FP64 and rounded once, so it is the best FP32 answer to compare kernels with.
    """
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise TypeError(f"logits and e_score_correction_bias must be FP32, got {logits.dtype} and {bias.dtype}")
    if bias.shape != logits.shape[-1:]:
        raise ValueError(f"bias shape {tuple(bias.shape)} does not match {logits.shape[-1]} experts")
    # FP64 then one rounding: torch's FP32 sigmoid kernel picks a vectorized or scalar path by tensor size, so its
    # last bit (and with it a tie-breaking expert choice) would depend on how many tokens share the batch.
    scores = torch.sigmoid(logits.double()).float()
    ids = select_experts(scores + bias, top_k)
    chosen = scores.gather(-1, ids).double()  # the bias only picks; it never enters the weights
    weights = chosen / (chosen.sum(dim=-1, keepdim=True) + eps) * routed_scaling_factor
    return Routing(logits=logits, scores=scores, ids=ids, weights=weights.float())


def _check_moe_kind(moe: MoeDims) -> None:
    if (moe.num_expert_group, moe.topk_group, moe.router_activation) != (1, 1, "sigmoid"):
        raise NotImplementedError(
            "only the one-group sigmoid router of Kimi K3 is modelled, got "
            f"groups={moe.num_expert_group}, topk_group={moe.topk_group}, activation={moe.router_activation!r}"
        )


def route_tokens(hidden: Tensor, router_weight: Tensor, bias: Tensor, moe: MoeDims) -> Routing:
    """`route` on the logits of `hidden`, with top-k, scaling factor and eps taken from the model dims."""
    _check_moe_kind(moe)
    return route(
        router_logits(hidden, router_weight),
        bias,
        top_k=moe.top_k,
        routed_scaling_factor=moe.routed_scaling_factor,
        eps=moe.routing_denominator_eps,
    )


# --- SiTU and the gated FFN ----------------------------------------------------------------------------


def situ(gate: Tensor, up: Tensor, *, beta: float = SITU_BETA, beta_lin: float | None = SITU_LINEAR_BETA) -> Tensor:
    """act(g, u) = beta·tanh(g/beta)·sigmoid(g) · beta_lin·tanh(u/beta_lin).

    vLLM 0.33.0 (vllm/model_executor/layers/activation.py `SituAndMul`). A beta_lin of None or <= 0 means
    the up branch is not clamped (used as u). The gate branch tends to beta for g -> +inf and to 0 for
    g -> -inf; the clamped up branch tends to ±beta_lin.
    """
    if beta <= 0:
        raise ValueError(f"SiTU beta must be positive, got {beta}")
    dtype = compute_dtype(gate, up)
    g, u = gate.to(dtype), up.to(dtype)
    gated = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if beta_lin is not None and beta_lin > 0:
        u = beta_lin * torch.tanh(u / beta_lin)
    return gated * u


def situ_and_mul(gate_up: Tensor, *, beta: float = SITU_BETA, beta_lin: float | None = SITU_LINEAR_BETA) -> Tensor:
    """SiTU on a [..., 2I] GEMM output laid out [gate | up]."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up width {gate_up.shape[-1]} is odd")
    gate, up = gate_up.chunk(2, dim=-1)
    return situ(gate, up, beta=beta, beta_lin=beta_lin)


def _quantize(hook: ActQuant | None, x: Tensor) -> Tensor:
    if hook is None:
        return x
    out = hook(x)
    if out.shape != x.shape:
        raise ValueError(f"activation-quantization hook changed the shape {tuple(x.shape)} -> {tuple(out.shape)}")
    return out.to(x.dtype)


@dataclass(frozen=True)
class GatedFfn:
    """A SiTU-gated FFN: `gate_up` [..., 2I, K] with rows [gate; up], `down` [..., N, I].

    Leading dims (if any) index experts. Routed experts map the latent (K = N = L); shared experts and the
    dense MLP map the hidden size.
    """

    gate_up: Tensor
    down: Tensor

    def __post_init__(self) -> None:
        gu, dn = self.gate_up.shape, self.down.shape
        if len(gu) < 2 or len(gu) != len(dn) or gu[:-2] != dn[:-2] or gu[-2] != 2 * dn[-1]:
            raise ValueError(f"gate_up {tuple(gu)} and down {tuple(dn)} are not [..., 2I, K] and [..., N, I]")

    @property
    def intermediate(self) -> int:
        return self.down.shape[-1]

    def expert(self, index: int) -> GatedFfn:
        return GatedFfn(self.gate_up[index], self.down[index])

    def shard(self, tp: int, rank: int, padded: int | None = None) -> GatedFfn:
        """Rank `rank`'s slice of the intermediate dim, zero-padded to `padded` per rank.

        Each rank keeps rows [gate_r; up_r] of gate_up and the matching columns of down (vLLM's merged
        column-parallel layout). The padding adds gate and up rows of zeros and down columns of zeros:
        SiTU(0, 0) = 0 and a zero column contributes nothing, so padding cannot change the result.
        """
        inter = self.intermediate
        if tp < 1 or inter % tp or not 0 <= rank < tp:
            raise ValueError(f"cannot take shard {rank} of {tp} from intermediate size {inter}")
        n = inter // tp
        padded = n if padded is None else padded
        if padded < n:
            raise ValueError(f"padded size {padded} is below the shard size {n}")
        rows = slice(rank * n, (rank + 1) * n)
        gate, up = self.gate_up[..., :inter, :], self.gate_up[..., inter:, :]
        pad_rows = (0, 0, 0, padded - n)
        gate_up = torch.cat([F.pad(gate[..., rows, :], pad_rows), F.pad(up[..., rows, :], pad_rows)], dim=-2)
        return GatedFfn(gate_up, F.pad(self.down[..., rows], (0, padded - n)))


def gated_ffn(
    x: Tensor,
    ffn: GatedFfn,
    *,
    beta: float = SITU_BETA,
    beta_lin: float | None = SITU_LINEAR_BETA,
    act_quant: ActQuant | None = None,
) -> Tensor:
    """x [T, K] -> [T, N] through one FFN; `act_quant` (if given) is applied to both GEMM inputs."""
    if ffn.gate_up.dim() != 2:
        raise ValueError("gated_ffn takes one FFN; index experts with GatedFfn.expert")
    dtype = compute_dtype(x, ffn.gate_up, ffn.down)
    h = _quantize(act_quant, x.to(dtype)) @ ffn.gate_up.to(dtype).T
    a = situ_and_mul(h, beta=beta, beta_lin=beta_lin)
    return _quantize(act_quant, a) @ ffn.down.to(dtype).T


def _check_routed_args(latent: Tensor, ids: Tensor, weights: Tensor, experts: GatedFfn) -> None:
    if experts.gate_up.dim() != 3:
        raise ValueError("experts must be stacked: gate_up [E, 2I, L], down [E, L, I]")
    if latent.dim() != 2 or latent.shape[1] != experts.gate_up.shape[-1]:
        raise ValueError(f"latent {tuple(latent.shape)} does not match expert input size {experts.gate_up.shape[-1]}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != latent.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [B, k]")


def routed_experts(
    latent: Tensor,
    ids: Tensor,
    weights: Tensor,
    experts: GatedFfn,
    *,
    beta: float = SITU_BETA,
    beta_lin: float | None = SITU_LINEAR_BETA,
    act_quant: ActQuant | None = None,
) -> Tensor:
    """Σ_k weights[b, k] · expert_{ids[b, k]}(latent[b]) as [B, L], one expert at a time (memory-light)."""
    _check_routed_args(latent, ids, weights, experts)
    dtype = compute_dtype(latent, experts.gate_up, experts.down)
    out = torch.zeros(latent.shape[0], experts.down.shape[-2], dtype=dtype, device=latent.device)
    for e in torch.unique(ids).tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        y = gated_ffn(latent[tokens], experts.expert(e), beta=beta, beta_lin=beta_lin, act_quant=act_quant)
        out.index_add_(0, tokens, y * weights[tokens, slots, None].to(dtype))
    return out


def routed_experts_batched(
    latent: Tensor,
    ids: Tensor,
    weights: Tensor,
    experts: GatedFfn,
    *,
    beta: float = SITU_BETA,
    beta_lin: float | None = SITU_LINEAR_BETA,
    act_quant: ActQuant | None = None,
) -> Tensor:
    """The same sum as `routed_experts`, by gathering each (token, slot)'s expert weights and using bmm.

    Holds B·k copies of one expert's weights, so it suits small dims or a GPU.
    """
    _check_routed_args(latent, ids, weights, experts)
    dtype = compute_dtype(latent, experts.gate_up, experts.down)
    batch, k = ids.shape
    flat = ids.reshape(-1)
    x = _quantize(act_quant, latent.to(dtype).repeat_interleave(k, dim=0))  # [B*k, L]
    h = torch.bmm(x[:, None, :], experts.gate_up[flat].to(dtype).transpose(1, 2))[:, 0]
    a = _quantize(act_quant, situ_and_mul(h, beta=beta, beta_lin=beta_lin))
    y = torch.bmm(a[:, None, :], experts.down[flat].to(dtype).transpose(1, 2))[:, 0]
    return (y.view(batch, k, -1) * weights.to(dtype)[..., None]).sum(dim=1)


# --- latent MoE ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatentMoeWeights:
    """One MoE layer's weights, logical (TP=1) or one rank's shard.

    Router, bias, latent down/up projections and the latent norm are replicated across TP ranks; the
    routed experts and the shared experts are split along their intermediate dim.
    """

    router: Tensor  # [E, H], BF16 in the checkpoint
    e_score_correction_bias: Tensor  # [E] FP32
    latent_down: Tensor  # [L, H]
    latent_up: Tensor  # [H, L]
    latent_norm: Tensor | None  # [L] RMSNorm weight
    experts: GatedFfn  # gate_up [E, 2I, L], down [E, L, I]
    shared: GatedFfn  # gate_up [2S, H], down [H, S]: the shared experts as one FFN

    def shard(self, dims: ModelDims, tp: int, rank: int) -> LatentMoeWeights:
        """Rank `rank`'s weights at TP=`tp`, with the expert padding of `RankShapes` (192 -> 256 at K3 TP16).

        vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/model.py `min_moe_intermediate_per_partition`,
        vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/moe/experts.py `ExpertsGeometry`).
        """
        shapes = RankShapes.for_tp(dims, tp)
        return LatentMoeWeights(
            router=self.router,
            e_score_correction_bias=self.e_score_correction_bias,
            latent_down=self.latent_down,
            latent_up=self.latent_up,
            latent_norm=self.latent_norm,
            experts=self.experts.shard(tp, rank, padded=shapes.routed_intermediate),
            shared=self.shared.shard(tp, rank, padded=shapes.shared_intermediate),
        )


@dataclass(frozen=True)
class MoePartial:
    """What one TP rank holds before the all-reduces."""

    routing: Routing
    latent: Tensor  # [B, L], x @ latent_down^T (replicated)
    routed: Tensor  # [B, L], this rank's share of the weighted expert sum
    shared: Tensor  # [B, H], this rank's share of the shared-expert output


@dataclass(frozen=True)
class MoeTrace:
    """Every stage of the latent MoE for stage-by-stage comparison with a kernel chain."""

    routing: Routing
    latent: Tensor  # [B, L]
    routed: Tensor  # [B, L] after the all-reduce
    normed: Tensor  # [B, L] after the latent RMSNorm (== routed when latent_norm is off)
    shared: Tensor  # [B, H] after the all-reduce
    out: Tensor  # [B, H]


def latent_moe_partial(
    hidden: Tensor, weights: LatentMoeWeights, dims: ModelDims, *, act_quant: ActQuant | None = None
) -> MoePartial:
    """One rank's routing, latent and partial sums, given that rank's weights (`LatentMoeWeights.shard`).

    Shared experts take the un-projected hidden input and stay BF16 (no activation quantization); only
    the routed experts see `act_quant` (vLLM 0.33.0, vllm/models/kimi_k3/nvidia/model.py).
    """
    moe = dims.moe
    routing = route_tokens(hidden, weights.router, weights.e_score_correction_bias, moe)
    dtype = compute_dtype(hidden, weights.latent_down, weights.experts.gate_up)
    latent = hidden.to(dtype) @ weights.latent_down.to(dtype).T
    kw = {"beta": moe.situ_beta, "beta_lin": moe.situ_linear_beta}
    routed = routed_experts(latent, routing.ids, routing.weights, weights.experts, act_quant=act_quant, **kw)
    shared = gated_ffn(hidden, weights.shared, **kw)
    return MoePartial(routing=routing, latent=latent, routed=routed, shared=shared)


def latent_moe_combine(
    partials: Sequence[MoePartial], weights: LatentMoeWeights, dims: ModelDims, *, reduce: Reduce = sum_rank_order
) -> MoeTrace:
    """All-reduce the rank partials (rank 0 first), then latent RMSNorm, up-projection and the shared add.

    The norm comes after the latent all-reduce: it is not linear, so normalizing per-rank partials would
    be wrong. `reduce` models the transport; the default adds at FP32/FP64 with no BF16 rounding.
    """
    if not partials:
        raise ValueError("no rank partials")
    first = partials[0].routing
    for r, p in enumerate(partials[1:], start=1):
        if not torch.equal(p.routing.ids, first.ids):
            raise ValueError(f"rank {r} routed differently from rank 0; the router is replicated")
    routed = reduce([p.routed for p in partials])
    dtype = compute_dtype(routed, weights.latent_up)
    routed = routed.to(dtype)
    normed = rms_norm(routed, weights.latent_norm, dims.rms_norm_eps, dtype=dtype) if dims.moe.latent_norm else routed
    shared = reduce([p.shared for p in partials]).to(dtype)
    out = normed @ weights.latent_up.to(dtype).T + shared
    return MoeTrace(routing=first, latent=partials[0].latent, routed=routed, normed=normed, shared=shared, out=out)


def latent_moe(
    hidden: Tensor,
    weights: LatentMoeWeights,
    dims: ModelDims,
    *,
    tp: int = 1,
    act_quant: ActQuant | None = None,
    reduce: Reduce = sum_rank_order,
) -> MoeTrace:
    """The whole latent MoE for hidden [B, H], from logical weights, simulated on `tp` ranks."""
    if tp == 1:
        partials = [latent_moe_partial(hidden, weights, dims, act_quant=act_quant)]
    else:
        partials = [
            latent_moe_partial(hidden, weights.shard(dims, tp, r), dims, act_quant=act_quant) for r in range(tp)
        ]
    return latent_moe_combine(partials, weights, dims, reduce=reduce)


# --- dense layer-0 MLP ---------------------------------------------------------------------------------


def dense_mlp(hidden: Tensor, ffn: GatedFfn, dims: ModelDims) -> Tensor:
    """Layer 0: gate_up [2I, H] -> SiTU -> down [H, I], with the same SiTU betas as the experts.

    vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/moe/dense.py `DenseSitu`).
    """
    return gated_ffn(hidden, ffn, beta=dims.moe.situ_beta, beta_lin=dims.moe.situ_linear_beta)


def dense_mlp_partials(hidden: Tensor, ffn: GatedFfn, dims: ModelDims, tp: int) -> list[Tensor]:
    """Each rank's partial output of the dense MLP at TP=`tp` (its sum in rank order is the all-reduce)."""
    shapes = RankShapes.for_tp(dims, tp)
    return [dense_mlp(hidden, ffn.shard(tp, r, padded=shapes.dense_intermediate), dims) for r in range(tp)]


# --- random weights for tests --------------------------------------------------------------------------


def _randn(gen: torch.Generator, *shape: int, fan_in: int, dtype: torch.dtype) -> Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) / fan_in**0.5).to(dtype)


def random_latent_moe_weights(
    dims: ModelDims, *, generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> LatentMoeWeights:
    """Logical weights with unit-scale activations throughout; router BF16 and bias FP32 as in the model.

    Meant for the small dims (K3_MINI): at K3 size the experts alone would be hundreds of GB.
    """
    h, m = dims.hidden_size, dims.moe
    e, lat, inter, s = m.num_experts, m.latent_size, m.routed_intermediate, m.shared_intermediate
    return LatentMoeWeights(
        router=_randn(generator, e, h, fan_in=h, dtype=torch.bfloat16),
        e_score_correction_bias=(0.1 * torch.randn(e, generator=generator, dtype=torch.float64)).float(),
        latent_down=_randn(generator, lat, h, fan_in=h, dtype=dtype),
        latent_up=_randn(generator, h, lat, fan_in=lat, dtype=dtype),
        latent_norm=(1 + 0.1 * torch.randn(lat, generator=generator, dtype=torch.float64)).to(dtype),
        experts=GatedFfn(
            _randn(generator, e, 2 * inter, lat, fan_in=lat, dtype=dtype),
            _randn(generator, e, lat, inter, fan_in=inter, dtype=dtype),
        ),
        shared=GatedFfn(
            _randn(generator, 2 * s, h, fan_in=h, dtype=dtype), _randn(generator, h, s, fan_in=s, dtype=dtype)
        ),
    )


def random_dense_mlp(dims: ModelDims, *, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> GatedFfn:
    h, i = dims.hidden_size, dims.moe.dense_intermediate
    return GatedFfn(_randn(generator, 2 * i, h, fan_in=h, dtype=dtype), _randn(generator, h, i, fan_in=i, dtype=dtype))
