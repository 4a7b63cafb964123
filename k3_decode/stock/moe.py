"""Stock latent MoE of Kimi K3 decode: the op provider the executor and the numerics suites call.

Launch structure on an H200, one MoE layer, one rank at per-rank shapes: 13 launches (moe_ops.toml beside this file
lists them op by op with their vLLM 0.33.0 counterparts): route 2 (router GEMM with FP32 logits, top-k), latent_down
1, experts 5 (align, FC1, SiTU, FC2, slot sum; MXFP4 W4A16 in Triton), shared 3, latent_tail 2 (RMSNorm, up GEMM
with the shared add). vLLM's stock path on an H200 (tail tier 1, Marlin/Humming MXFP4 experts; k3_facts section 2.F)
runs about 14 plus the TP all-reduces.

One launch fewer than vLLM (the shared add in the up GEMM's epilogue) makes the baseline slightly stronger than
vLLM's, never weaker. vLLM overlaps the latent down-projection and the shared experts on an
aux stream; here everything runs on one stream. Both are memory-bound GEMMs that share the same HBM bandwidth, so
the overlap can hide launch gaps but not bytes (docs/stock-path.md, "MoE", gives the measured per-op times).

The TP all-reduces (latent, shared) are elided on one GPU holding one rank's shapes: `latent_tail` takes this
rank's partials as they are. Given the partials of every rank (a list, rank 0 first) it reduces them with the
two-shot rule of the specialized decode instead (FP32 sum in rank order, one BF16 rounding, -0.0 -> +0.0), so TP > 1
numerics can be simulated on one device.

Implementations, reported for the dispatch ledger as `StockMoeOps.implementation`:
- "triton": cuBLAS GEMMs through torch and the Triton kernels of k3_decode.stock.triton_moe (CUDA tensors, or CPU
  tensors when the kernels were imported under TRITON_INTERPRET=1).
- "torch-cpu": the same rounding points in plain torch on the CPU; MXFP4 experts are dequantized with the
  reference codec (exact: every MXFP4 value is a BF16 value) and looped over per expert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3_decode.config import ModelDims, RankShapes
from k3_decode.reference.moe import GatedFfn, LatentMoeWeights
from k3_decode.reference.mxfp import MxTensor
from k3_decode.stock.dispatch import Implementation, OpInfo, OpRecord, implementation_for, table_info
from k3_decode.stock.mlp import check_gated_weights, gated_mlp, linear_bf16, situ_and_mul_torch
from k3_decode.stock.mlp import dense_mlp as _dense_mlp
from k3_decode.stock.triton_moe.limits import MAX_PAIRS, check_expert_weights
from k3_decode.stock.triton_moe.tiles import TileTable, default_tiles
from k3_decode.weights import DenseMlpWeights, MoeWeights


def moe_op_info(op: str, device: torch.device | str) -> OpInfo:
    """The moe_ops.toml row of `op` for `device` (on the CPU: "torch-cpu", no launches, no kernel names)."""
    return table_info(op, device, "moe_ops.toml")


MOE_OPS = ("route", "latent_down", "experts", "shared", "latent_tail")
"""The ops of one MoE layer, in the order `StockMoeOps.moe` runs them."""


@dataclass(frozen=True)
class StockRouting:
    logits: Tensor  # [B, E] FP32
    ids: Tensor  # [B, k] int32, slots by descending score + bias, equal keys to the lower expert id
    weights: Tensor  # [B, k] FP32, renormalized chosen scores times routed_scaling_factor


@dataclass(frozen=True)
class StockMoeOutput:
    routing: StockRouting
    latent: Tensor  # [B, L] BF16
    routed: Tensor  # [B, L] BF16, this rank's routed partial (before the latent all-reduce)
    shared: Tensor  # [B, H] BF16, this rank's shared-expert partial (before its all-reduce)
    out: Tensor  # [B, H] BF16


def rank_order_all_reduce(partials: Sequence[Tensor]) -> Tensor:
    """BF16 all-reduce of per-rank partials (rank 0 first): FP32 sum in rank order, one rounding, -0.0 -> +0.0.

    The two-shot rule of vLLM 0.33.0's specialized decode (vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/
    common/twoshot.py); every owner chunk follows it elementwise, so applying it to whole rows gives the same bits.
    """
    if not partials:
        raise ValueError("an all-reduce needs at least one rank partial")
    first = partials[0]
    for r, p in enumerate(partials):
        if p.dtype != torch.bfloat16 or p.shape != first.shape:
            raise ValueError(f"rank {r} partial is {p.dtype} {tuple(p.shape)}; all must be BF16 {tuple(first.shape)}")
    acc = first.float()
    for p in partials[1:]:
        acc = acc + p.float()
    out = acc.to(torch.bfloat16)
    return torch.where(out == 0, torch.zeros_like(out), out)


def _reduce(partials: Tensor | Sequence[Tensor]) -> Tensor:
    """One rank's partial stays as it is (all-reduce elided on one GPU); a list is all-reduced in rank order."""
    return partials if isinstance(partials, Tensor) else rank_order_all_reduce(partials)


@dataclass
class StockMoeOps:
    """Stock MoE and dense-MLP ops for one rank (dims, TP) on one device; every call is a ledger record.

    Each call appends an OpRecord (op, implementation, launches, batch, tokens per request) to `records` and hands
    it to `listener` when one is set, like k3_decode.stock.StockAttentionOps.
    """

    dims: ModelDims
    tp: int
    device: torch.device | str = "cpu"
    implementation: Implementation | None = None  # None: "triton" on CUDA, "torch-cpu" on the CPU
    tiles: TileTable = field(default_factory=default_tiles)
    listener: Callable[[OpRecord], None] | None = None
    records: list[OpRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.shapes: RankShapes = self.dims.shard(self.tp)  # raises ShardError for an unsupported TP size
        impl = self.implementation or implementation_for(self.device)
        if impl not in ("triton", "torch-cpu"):
            raise ValueError(f"unknown stock implementation {impl!r}; use 'triton' or 'torch-cpu'")
        if impl == "torch-cpu" and self.device.type != "cpu":
            raise ValueError(f"'torch-cpu' runs on the CPU, not {self.device}; leave implementation unset on a GPU")
        if impl == "triton" and self.device.type != "cuda" and not _kernels_interpreted():
            raise ValueError(
                "the Triton stock MoE needs a CUDA device (or its kernels imported under TRITON_INTERPRET=1); "
                "use 'torch-cpu' on the CPU"
            )
        self.implementation = impl
        moe = self.dims.moe
        if (moe.num_expert_group, moe.topk_group, moe.router_activation) != (1, 1, "sigmoid"):
            raise ValueError(
                f"{self.dims.name}: the stock MoE models the one-group sigmoid router of Kimi K3 only, got "
                f"groups={moe.num_expert_group}, topk_group={moe.topk_group}, activation={moe.router_activation!r}"
            )
        if moe.expert_weight_format != "mxfp4":
            raise ValueError(f"{self.dims.name}: stock experts need MXFP4 weights, got {moe.expert_weight_format!r}")

    # -- ledger -------------------------------------------------------------------------------------------------

    def _record(self, op: str, batch: int, repeats: int = 1) -> None:
        info = moe_op_info(op, "cuda" if self.implementation == "triton" else "cpu")
        rec = OpRecord(op, info.implementation, info.launches * repeats, batch, 1)
        self.records.append(rec)
        if self.listener is not None:
            self.listener(rec)

    def expected_launches(self, ops: Sequence[str] = MOE_OPS, batch: int = 1) -> int:
        """Kernel launches the named ops issue for `batch` tokens on CUDA, from moe_ops.toml."""
        total = 0
        for op in ops:
            launches = moe_op_info(op, "cuda").launches
            total += launches * (_expert_chunks(batch, self.dims.moe.top_k) if op == "experts" else 1)
        return total

    # -- checks -------------------------------------------------------------------------------------------------

    def check_weights(self, weights: MoeWeights) -> None:
        """Load-time checks of one MoE layer's weights for this rank (reads the expert scales: once, not per step)."""
        s, moe, h = self.shapes, self.dims.moe, self.dims.hidden_size
        if weights.expert_ids != tuple(range(moe.num_experts)):
            raise ValueError(
                f"stock MoE needs all {moe.num_experts} experts in id order; load the layer with experts=None"
            )
        want = {
            "router": (weights.router, s.router),
            "latent_down": (weights.latent_down, s.latent_down),
            "latent_up": (weights.latent_up, s.latent_up),
            "shared.gate_up": (weights.shared.gate_up, (2 * s.shared_intermediate, h)),
            "shared.down": (weights.shared.down, (h, s.shared_intermediate)),
        }
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"MoE {name} is {tuple(t.shape)}, want {shape} at TP={self.tp}; load this rank's shard"
                )
            if t.dtype != torch.bfloat16:
                raise ValueError(f"MoE {name} is {t.dtype}, the stock path runs BF16; load with dtype=torch.bfloat16")
            self._check_device(t, f"MoE {name}")
        if weights.router_bias.dtype != torch.float32 or tuple(weights.router_bias.shape) != (moe.num_experts,):
            raise ValueError(f"router_bias must be FP32 [{moe.num_experts}] (the e_score_correction_bias)")
        if tuple(weights.w13.shape) != (moe.num_experts, *s.expert_w13):
            raise ValueError(
                f"experts w13 {tuple(weights.w13.shape)} do not match TP={self.tp} ({s.expert_w13} per expert)"
            )
        check_expert_weights(weights.w13, weights.w2, moe.latent_size)
        self._check_device(weights.w13.data, "MoE experts")

    def _check_device(self, t: Tensor, what: str) -> None:
        want = self.device
        assert isinstance(want, torch.device)
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise ValueError(f"{what} is on {t.device} but these ops run on {self.device}; move it with .to()")

    def _check_hidden(self, hidden: Tensor, what: str) -> None:
        h = self.dims.hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != h or hidden.dtype != torch.bfloat16:
            raise ValueError(f"{what}: hidden must be BF16 [B, {h}], got {hidden.dtype} {tuple(hidden.shape)}")
        self._check_device(hidden, f"{what} input")

    # -- ops ----------------------------------------------------------------------------------------------------

    def route(self, hidden: Tensor, weights: MoeWeights) -> StockRouting:
        """FP32 router logits, then sigmoid top-k with the correction bias, ties to the lower id (2 launches)."""
        self._check_hidden(hidden, "route")
        moe = self.dims.moe
        if self.implementation == "triton":
            from k3_decode.stock.triton_moe import routing  # triton is imported only on this path

            logits = _router_logits(hidden, weights.router)
            ids, w = routing.route(
                logits, weights.router_bias, moe.top_k, moe.routing_denominator_eps, moe.routed_scaling_factor
            )
        else:
            logits = hidden.float() @ weights.router.float().T
            ids, w = _route_torch(
                logits, weights.router_bias, moe.top_k, moe.routing_denominator_eps, moe.routed_scaling_factor
            )
        self._record("route", hidden.shape[0])
        return StockRouting(logits, ids, w)

    def latent_down(self, hidden: Tensor, weights: MoeWeights) -> Tensor:
        """latent [B, L] BF16 = hidden @ latent_down^T (1 launch)."""
        self._check_hidden(hidden, "latent_down")
        out = linear_bf16(hidden, weights.latent_down, self.implementation)
        self._record("latent_down", hidden.shape[0])
        return out

    def experts(self, latent: Tensor, routing: StockRouting, weights: MoeWeights) -> Tensor:
        """This rank's routed partial [B, L] BF16 (4 launches per chunk of MAX_PAIRS pairs)."""
        moe = self.dims.moe
        batch = latent.shape[0]
        if latent.dim() != 2 or latent.shape[1] != moe.latent_size or latent.dtype != torch.bfloat16:
            raise ValueError(
                f"experts: latent must be BF16 [B, {moe.latent_size}], got {latent.dtype} {tuple(latent.shape)}"
            )
        if tuple(routing.ids.shape) != (batch, moe.top_k) or routing.weights.shape != routing.ids.shape:
            raise ValueError(
                f"experts: routing ids {tuple(routing.ids.shape)} / weights {tuple(routing.weights.shape)} are not "
                f"[B={batch}, k={moe.top_k}]"
            )
        if tuple(weights.w13.shape) != (moe.num_experts, *self.shapes.expert_w13):
            raise ValueError(
                f"experts: w13 {tuple(weights.w13.shape)} is not [{moe.num_experts}, {self.shapes.expert_w13}] at "
                f"TP={self.tp}; load all experts of this rank"
            )
        self._check_device(latent, "experts latent")
        if self.implementation == "triton":
            from k3_decode.stock.triton_moe import experts

            out = experts.experts(
                latent,
                routing.ids,
                routing.weights,
                weights.w13,
                weights.w2,
                beta=moe.situ_beta,
                beta_lin=moe.situ_linear_beta,
                tiles=self.tiles.for_batch(batch),
            )
        else:
            out = _experts_torch(latent, routing.ids, routing.weights, weights.w13, weights.w2, self.dims)
        self._record("experts", batch, _expert_chunks(batch, moe.top_k))
        return out

    def shared(self, hidden: Tensor, weights: MoeWeights) -> Tensor:
        """This rank's shared-expert partial [B, H] BF16 (3 launches)."""
        self._check_hidden(hidden, "shared experts")
        check_gated_weights(hidden, weights.shared, "shared experts")
        out = gated_mlp(hidden, weights.shared, self.dims.moe, self.implementation)
        self._record("shared", hidden.shape[0])
        return out

    def latent_tail(
        self, routed: Tensor | Sequence[Tensor], shared: Tensor | Sequence[Tensor], weights: MoeWeights
    ) -> Tensor:
        """[B, H] BF16 = RMSNorm(all-reduce(routed)) @ latent_up^T + all-reduce(shared) (2 launches).

        A tensor is this rank's partial with the all-reduce elided; a list is every rank's partial, rank 0 first,
        reduced here by the rank-order two-shot rule (a simulation of TP > 1 on one device, extra launches).
        """
        routed, shared = _reduce(routed), _reduce(shared)
        moe, h = self.dims.moe, self.dims.hidden_size
        if routed.dim() != 2 or routed.shape[1] != moe.latent_size or tuple(shared.shape) != (routed.shape[0], h):
            raise ValueError(
                f"latent_tail: routed {tuple(routed.shape)} and shared {tuple(shared.shape)} are not "
                f"[B, {moe.latent_size}] and [B, {h}]"
            )
        if routed.dtype != torch.bfloat16 or shared.dtype != torch.bfloat16:
            raise ValueError(f"latent_tail: partials must be BF16, got {routed.dtype} and {shared.dtype}")
        self._check_device(routed, "latent_tail input")
        norm_w = weights.latent_norm if moe.latent_norm else None
        if self.implementation == "triton":
            normed = routed
            if norm_w is not None:
                from k3_decode.stock.triton_moe import elementwise

                normed = elementwise.rms_norm(routed, norm_w, self.dims.rms_norm_eps)
            out = torch.addmm(shared, normed, weights.latent_up.T)
        else:
            normed = routed
            if norm_w is not None:
                x = routed.float()
                inv = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.dims.rms_norm_eps)
                normed = (x * inv * norm_w.float()).to(torch.bfloat16)
            out = (normed.float() @ weights.latent_up.float().T + shared.float()).to(torch.bfloat16)
        self._record("latent_tail", routed.shape[0])
        return out

    def dense(self, hidden: Tensor, weights: DenseMlpWeights) -> Tensor:
        """The dense layer-0 MLP, this rank's partial [B, H] BF16 (3 launches)."""
        self._check_hidden(hidden, "dense MLP")
        want = (2 * self.shapes.dense_intermediate, self.dims.hidden_size)
        if tuple(weights.gate_up.shape) != want:
            raise ValueError(f"dense MLP gate_up {tuple(weights.gate_up.shape)} is not {want} at TP={self.tp}")
        out = _dense_mlp(hidden, weights, self.dims.moe, self.implementation)
        self._record("dense", hidden.shape[0])
        return out

    def moe(self, hidden: Tensor, weights: MoeWeights) -> StockMoeOutput:
        """The whole latent MoE of one rank, all-reduces elided (13 launches on "triton")."""
        routing = self.route(hidden, weights)
        latent = self.latent_down(hidden, weights)
        routed = self.experts(latent, routing, weights)
        shared = self.shared(hidden, weights)
        out = self.latent_tail(routed, shared, weights)
        return StockMoeOutput(routing=routing, latent=latent, routed=routed, shared=shared, out=out)


def _expert_chunks(batch: int, top_k: int) -> int:
    chunk = max(1, MAX_PAIRS // top_k)
    return -(-batch // chunk)


# --- implementations -----------------------------------------------------------------------------------------


def _kernels_interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from k3_decode.stock.triton_moe import routing
    except ImportError:
        return False
    return isinstance(routing.k3_moe_route, InterpretedFunction)


def _router_logits(hidden: Tensor, router: Tensor) -> Tensor:
    """FP32 logits from BF16 operands in one cuBLAS GEMM (torch's mm with out_dtype; CUDA only)."""
    if hidden.is_cuda:
        return torch.mm(hidden, router.T, out_dtype=torch.float32)
    return hidden.float() @ router.float().T  # the interpreter path: the same products, FP32 sums


def _route_torch(logits: Tensor, bias: Tensor, top_k: int, eps: float, scale: float) -> tuple[Tensor, Tensor]:
    """The routing kernel's algorithm in torch: k rounds of (max key, then the lowest id holding it)."""
    scores = torch.sigmoid(logits)
    keys = scores + bias
    if not bool(torch.isfinite(keys).all()):
        raise ValueError("router keys contain NaN or inf; the expert choice would be undefined")
    batch, num = keys.shape
    ids_all = torch.arange(num, device=keys.device).expand(batch, num)
    ids = torch.empty(batch, top_k, dtype=torch.int64, device=keys.device)
    for slot in range(top_k):
        best = keys.max(dim=-1, keepdim=True).values
        ids[:, slot] = torch.where(keys == best, ids_all, num).min(dim=-1).values
        keys = keys.scatter(-1, ids[:, slot : slot + 1], float("-inf"))
    chosen = scores.gather(-1, ids)
    weights = chosen / (chosen.sum(dim=-1, keepdim=True) + eps) * scale
    return ids.to(torch.int32), weights


def _experts_torch(
    latent: Tensor, ids: Tensor, weights: Tensor, w13: MxTensor, w2: MxTensor, dims: ModelDims
) -> Tensor:
    """The Triton experts' rounding points in torch: FC1 FP32 -> SiTU -> BF16, FC2 FP32 x weight, slot sum."""
    moe = dims.moe
    batch, top_k = ids.shape
    per_slot = torch.zeros(batch, top_k, latent.shape[1], dtype=torch.float32, device=latent.device)
    x = latent.float()
    for e in torch.unique(ids).tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = MxTensor("mxfp4", w13.data[e], w13.scales[e]).dequantize()
        down = MxTensor("mxfp4", w2.data[e], w2.scales[e]).dequantize()
        act = situ_and_mul_torch(x[tokens] @ gate_up.T, moe.situ_beta, moe.situ_linear_beta)
        per_slot[tokens, slots] = (act.float() @ down.T) * weights[tokens, slots, None]
    acc = per_slot[:, 0]
    for slot in range(1, top_k):  # slot order, as k3_moe_sum adds them
        acc = acc + per_slot[:, slot]
    return acc.to(torch.bfloat16)


# --- oracle containers -----------------------------------------------------------------------------------------


def as_reference(weights: MoeWeights, dtype: torch.dtype = torch.float32) -> LatentMoeWeights:
    """The oracle's container (k3_decode.reference.moe) for the same layer, experts dequantized to `dtype`.

    Dequantization is exact (MXFP4 values are BF16 values), so BF16 halves the memory at real K3 shapes.
    """
    return LatentMoeWeights(
        router=weights.router,
        e_score_correction_bias=weights.router_bias,
        latent_down=weights.latent_down,
        latent_up=weights.latent_up,
        latent_norm=weights.latent_norm,
        experts=GatedFfn(_dequantize(weights.w13, dtype), _dequantize(weights.w2, dtype)),
        shared=GatedFfn(weights.shared.gate_up, weights.shared.down),
    )


def _dequantize(mx: MxTensor, dtype: torch.dtype, experts_per_chunk: int = 32) -> Tensor:
    """Expert by expert chunks: the codec's int64 temporaries for all 896 K3 experts at once would take ~50 GB."""
    out = torch.empty(mx.shape, dtype=dtype, device=mx.data.device)
    for e0 in range(0, mx.data.shape[0], experts_per_chunk):
        part = slice(e0, e0 + experts_per_chunk)
        out[part] = MxTensor(mx.fmt, mx.data[part], mx.scales[part]).dequantize(dtype)
    return out
