"""Cells for the latent MoE of Kimi K3 op by op (router, latent down-projection, MXFP4 routed experts, shared
experts, latent tail), the whole MoE, and the dense layer-0 MLP.

Every op gets the inputs the decode step hands it at this rank's shapes (one rank, all-reduces elided: the latent
and shared partials are what `latent_tail` reduces on one GPU), and is judged against an FP64 composition of the
oracles in k3_decode.reference.moe that rounds nothing. The router's two kinds of cell:

- "synthetic": the layer's own router weights and random hidden states, redrawn per token until the top-k choice
  is decided by more than an implementation within the logits tolerance could move (`key_margin`). A choice that
  close is a near-tie either side may win, not an error; exact ties are the other kind's business.
- "ties": router rows and hidden states built so every logit is exact in any summation order, with groups of
  experts whose keys are bit-equal and that straddle the k-th slot, scattered over the expert ids: the lower id
  must win (vLLM 0.33.0's specialized routing rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import Tensor

from harness.numerics.cells import Judged, OpCall, OpSpec
from harness.numerics.compare import Tolerance, ToleranceTable
from k3_decode.config import ModelDims
from k3_decode.reference import moe as ref
from k3_decode.reference.mxfp import MxTensor
from k3_decode.reference.norms import rms_norm
from suites.k3 import weights

ROUTE = OpSpec(
    "moe_route",
    "float32",
    outputs=("logits", "ids", "weights"),
    judged=(
        Judged("logits", tolerance="moe_route.logits"),
        Judged("ids", dtype="int32", tolerance="moe_route.ids"),
        Judged("weights", tolerance="moe_route.weights"),
    ),
)
LATENT_DOWN = OpSpec("moe_latent_down", "bfloat16", outputs=("latent",))
EXPERTS = OpSpec("moe_experts", "bfloat16", outputs=("routed",))
SHARED = OpSpec("moe_shared", "bfloat16", outputs=("shared",))
LATENT_TAIL = OpSpec("moe_latent_tail", "bfloat16", outputs=("out",))
MOE = OpSpec(
    "moe", "bfloat16", outputs=("out", "ids"), judged=(Judged("ids", dtype="int32", tolerance="moe_route.ids"),)
)
DENSE = OpSpec("dense_mlp", "bfloat16", outputs=("out",))

ROUTERS = ("synthetic", "ties")
EXPERT_TENSORS = ("w13_data", "w13_scales", "w2_data", "w2_scales")
MAX_REDRAWS = 64


def _hidden(batch: int, dims: ModelDims, g: torch.Generator, scale: float) -> Tensor:
    """Unit-RMS BF16 rows (times `scale`), as the post-attention RMSNorm hands them to the MLP."""
    return (torch.randn(batch, dims.hidden_size, generator=g) * scale).to(torch.bfloat16)


def _axes_id(op: str, tp: int | None, batch: int, scale: float, extra: str = "") -> str:
    parts = [op, *([f"tp{tp}"] if tp is not None else []), f"b{batch}", *([extra] if extra else [])]
    if scale != 1.0:
        parts.append(f"x{scale:g}")
    return "/".join(parts)


# --- routing -------------------------------------------------------------------------------------------------


@cache
def _logits_tolerance() -> Tolerance:
    return ToleranceTable.load().get("moe_route.logits", "float32")


def key_margin(logits: Tensor, tol: Tolerance | None = None) -> float:
    """The smallest gap between selection keys that any implementation within the logits tolerance must resolve
    the same way: a logit may move by atol + rtol * |logit|, the sigmoid's slope is at most 1/4, and the FP32
    sigmoid and bias add cost a few ulps of a key (keys stay below 4, ulp 2^-22 there); twice that, for two keys."""
    tol = tol or _logits_tolerance()
    shift = tol.atol + tol.rtol * float(logits.abs().max())
    return 2 * (0.25 * shift + 4 * 2.0**-22)


def undecided(logits: Tensor, bias: Tensor, top_k: int, margin: float) -> Tensor:
    """Tokens [B] whose top-k choice or order hinges on a key gap at or below `margin` (exact ties included)."""
    keys = torch.sigmoid(logits.double()).float() + bias
    top = keys.double().topk(min(top_k + 1, keys.shape[-1]), dim=-1).values
    return ((top[:, :-1] - top[:, 1:]) <= margin).any(dim=-1)


def decided_hidden(
    dims: ModelDims, router: Tensor, bias: Tensor, batch: int, g: torch.Generator, scale: float
) -> Tensor:
    """Hidden rows whose routing is decided beyond the key margin: undecided rows are drawn again."""
    x = _hidden(batch, dims, g, scale)
    for _ in range(MAX_REDRAWS):
        logits = ref.router_logits(x.to(router.device), router)
        redo = undecided(logits, bias, dims.moe.top_k, key_margin(logits)).cpu()
        if not bool(redo.any()):
            return x
        x[redo] = _hidden(int(redo.sum()), dims, g, scale)
    raise RuntimeError(f"no decided routing after {MAX_REDRAWS} draws at scale {scale}; the router saturates")


def tie_inputs(
    dims: ModelDims, batch: int, g: torch.Generator, magnitude: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """(hidden, router, bias) whose logits are exact in any summation order and whose keys tie in groups.

    Router rows are level_e * b with b = +-magnitude/4 on 8 columns and 0 elsewhere, level_e in {0, 1/4, 1/2, 3/4};
    the hidden rows are +-1 on those columns (anything elsewhere, where b is 0), so a logit is level_e * s with
    s in magnitude * [-2, 2] on a grid of magnitude/2: every product and partial sum is exact in FP32, and unequal
    logits sit magnitude/8 or more apart. Biases 2 (k/2 + 1 experts, all chosen), 1 (half the experts) and 0 order
    the groups; inside the bias-1 group the k-th slot falls among experts of one level, whose keys are bit-equal.
    A magnitude of 64 drives the top logits to 96, where the sigmoid is exactly 1.0 in FP32: saturated experts tie.
    """
    if magnitude <= 0 or magnitude != 2.0 ** round(math.log2(magnitude)):
        raise ValueError(f"tie magnitude {magnitude} must be a power of two (it keeps every logit exact)")
    moe, h = dims.moe, dims.hidden_size
    e, k = moe.num_experts, moe.top_k
    cols = torch.randperm(h, generator=g)[:8]
    base = torch.zeros(h)
    base[cols] = torch.where(torch.rand(8, generator=g) < 0.5, -0.25, 0.25) * magnitude
    levels = torch.randint(0, 4, (e,), generator=g).float() / 4
    router = (levels[:, None] * base[None, :]).to(torch.bfloat16)
    order = torch.randperm(e, generator=g)  # groups scattered over the ids, so the id rule decides
    bias = torch.zeros(e)
    bias[order[: k // 2 + 1]] = 2.0
    bias[order[k // 2 + 1 : k // 2 + 1 + e // 2]] = 1.0
    hidden = torch.randn(batch, h, generator=g)
    signs = torch.where(torch.rand(batch, 8, generator=g) < 0.5, -1.0, 1.0)
    if float(signs[0] @ base[cols]) == 0:
        signs[0, 0] = -signs[0, 0]  # token 0 has non-zero logits (an all-zero reference proves nothing); others may tie
    hidden[:, cols] = signs
    return hidden.to(torch.bfloat16), router, bias.float()


@dataclass
class RouteCell:
    dims: ModelDims
    batch: int
    router: str = "synthetic"
    scale: float = 1.0  # "synthetic": multiplies the hidden state; "ties": the logits' magnitude (a power of two)
    spec: OpSpec = field(default=ROUTE)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router kind {self.router!r}; use one of {', '.join(ROUTERS)}")
        self.id = _axes_id("moe_route", None, self.batch, self.scale, self.router)
        self.axes = {"batch": self.batch, "router": self.router, "scale": self.scale}

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        tp = weights.replicated_tp(self.dims)
        if self.router == "ties":
            hidden, router, bias = tie_inputs(self.dims, self.batch, g, self.scale)
            router, bias = router.to(device), bias.to(device)
        else:
            w = weights.moe_dense_part(self.dims, tp, str(device))
            router, bias = w.router.clone(), w.router_bias.clone()
            hidden = decided_hidden(self.dims, router, bias, self.batch, g, self.scale)
        return OpCall({"hidden": hidden.to(device), "router": router, "router_bias": bias}, {"tp": tp})

    def reference(self, call: OpCall) -> dict[str, Tensor]:
        t = call.tensors
        r = ref.route_tokens(t["hidden"], t["router"], t["router_bias"], self.dims.moe)
        return {"logits": r.logits, "ids": r.ids, "weights": r.weights}

    def allowed_writes(self, call: OpCall) -> dict[str, Tensor]:
        return {}


# --- experts -------------------------------------------------------------------------------------------------


def expert_tensors(w13: MxTensor, w2: MxTensor) -> dict[str, Tensor]:
    return {"w13_data": w13.data, "w13_scales": w13.scales, "w2_data": w2.data, "w2_scales": w2.scales}


def reference_experts(latent: Tensor, ids: Tensor, wts: Tensor, t: dict[str, Tensor], dims: ModelDims) -> Tensor:
    """The oracle's weighted expert sum in FP64, dequantizing only the experts the batch uses (exactly: every
    MXFP4 value is a BF16 value), so all 896 experts of a K3 rank never sit in memory at once."""
    used, local = torch.unique(ids.long(), return_inverse=True)
    sel = used.to(t["w13_data"].device)
    gate_up = MxTensor("mxfp4", t["w13_data"][sel], t["w13_scales"][sel]).dequantize(torch.bfloat16)
    down = MxTensor("mxfp4", t["w2_data"][sel], t["w2_scales"][sel]).dequantize(torch.bfloat16)
    moe = dims.moe
    return ref.routed_experts(
        latent.double(),
        local,
        wts.double(),
        ref.GatedFfn(gate_up, down),
        beta=moe.situ_beta,
        beta_lin=moe.situ_linear_beta,
    )


@dataclass
class ExpertsCell:
    """This rank's routed partial from a BF16 latent and a given routing: the first half of the tokens share one
    expert set (a hot expert group), the rest choose at random."""

    dims: ModelDims
    tp: int
    batch: int
    scale: float = 1.0
    distinct_experts: int | None = None  # see weights.experts: for the sanitizer only, never for numerics
    spec: OpSpec = field(default=EXPERTS)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = _axes_id("moe_experts", self.tp, self.batch, self.scale)
        self.axes = {"tp": self.tp, "batch": self.batch, "scale": self.scale}

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        moe = self.dims.moe
        w13, w2 = weights.experts(self.dims, self.tp, str(device), self.distinct_experts)
        hot = torch.randperm(moe.num_experts, generator=g)[: moe.top_k]
        ids = torch.stack([torch.randperm(moe.num_experts, generator=g)[: moe.top_k] for _ in range(self.batch)])
        ids[: self.batch // 2] = hot
        wts = torch.rand(self.batch, moe.top_k, generator=g) + 0.1
        wts = wts / wts.sum(dim=-1, keepdim=True)
        latent = (torch.randn(self.batch, moe.latent_size, generator=g) * self.scale).to(torch.bfloat16)
        tensors = {"latent": latent, "ids": ids.to(torch.int32), "weights": wts}
        tensors = {k: v.to(device) for k, v in tensors.items()}
        tensors |= {k: v.clone() for k, v in expert_tensors(w13, w2).items()}
        return OpCall(tensors, {"tp": self.tp})

    def reference(self, call: OpCall) -> dict[str, Tensor]:
        t = call.tensors
        return {"routed": reference_experts(t["latent"], t["ids"], t["weights"], t, self.dims)}

    def allowed_writes(self, call: OpCall) -> dict[str, Tensor]:
        return {}


# --- the dense projections and gated MLPs ----------------------------------------------------------------------


@dataclass
class GatedCell:
    """The shared experts (`moe_shared`) or the dense layer-0 MLP (`dense_mlp`): gate_up, SiTU, down."""

    dims: ModelDims
    tp: int
    batch: int
    which: str = "shared"
    scale: float = 1.0
    spec: OpSpec = field(default=SHARED)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.which not in ("shared", "dense"):
            raise ValueError(f"gated MLP cell {self.which!r}: use 'shared' or 'dense'")
        self.spec = SHARED if self.which == "shared" else DENSE
        self.id = _axes_id(self.spec.op, self.tp, self.batch, self.scale)
        self.axes = {"tp": self.tp, "batch": self.batch, "scale": self.scale}

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        dev = str(device)
        w = (
            weights.moe_dense_part(self.dims, self.tp, dev).shared
            if self.which == "shared"
            else weights.dense(self.dims, self.tp, dev)
        )
        hidden = _hidden(self.batch, self.dims, g, self.scale).to(device)
        return OpCall({"hidden": hidden, "gate_up": w.gate_up.clone(), "down": w.down.clone()}, {"tp": self.tp})

    def reference(self, call: OpCall) -> dict[str, Tensor]:
        t, moe = call.tensors, self.dims.moe
        ffn = ref.GatedFfn(t["gate_up"], t["down"])
        out = ref.gated_ffn(t["hidden"].double(), ffn, beta=moe.situ_beta, beta_lin=moe.situ_linear_beta)
        return {self.spec.outputs[0]: out}

    def allowed_writes(self, call: OpCall) -> dict[str, Tensor]:
        return {}


@dataclass
class LatentDownCell:
    dims: ModelDims
    batch: int
    scale: float = 1.0
    spec: OpSpec = field(default=LATENT_DOWN)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = _axes_id("moe_latent_down", None, self.batch, self.scale)
        self.axes = {"batch": self.batch, "scale": self.scale}

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        tp = weights.replicated_tp(self.dims)
        w = weights.moe_dense_part(self.dims, tp, str(device))
        hidden = _hidden(self.batch, self.dims, g, self.scale).to(device)
        return OpCall({"hidden": hidden, "latent_down": w.latent_down.clone()}, {"tp": tp})

    def reference(self, call: OpCall) -> dict[str, Tensor]:
        t = call.tensors
        return {"latent": t["hidden"].double() @ t["latent_down"].double().T}

    def allowed_writes(self, call: OpCall) -> dict[str, Tensor]:
        return {}


@dataclass
class LatentTailCell:
    """RMSNorm of the (all-reduced) routed latent, the up-projection and the shared add."""

    dims: ModelDims
    batch: int
    scale: float = 1.0
    spec: OpSpec = field(default=LATENT_TAIL)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = _axes_id("moe_latent_tail", None, self.batch, self.scale)
        self.axes = {"batch": self.batch, "scale": self.scale}

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        tp = weights.replicated_tp(self.dims)
        w = weights.moe_dense_part(self.dims, tp, str(device))
        # The routed sum of one token has RMS 0.1..0.3 (k3_decode/weights.py magnitudes), the shared partial ~0.5.
        routed = (torch.randn(self.batch, self.dims.moe.latent_size, generator=g) * 0.3 * self.scale).bfloat16()
        shared = (torch.randn(self.batch, self.dims.hidden_size, generator=g) * 0.5).bfloat16()
        tensors = {"routed": routed.to(device), "shared": shared.to(device), "latent_up": w.latent_up.clone()}
        if self.dims.moe.latent_norm:
            tensors["latent_norm"] = w.latent_norm.clone()
        return OpCall(tensors, {"tp": tp})

    def reference(self, call: OpCall) -> dict[str, Tensor]:
        t = call.tensors
        routed = t["routed"].double()
        if "latent_norm" in t:
            routed = rms_norm(routed, t["latent_norm"], self.dims.rms_norm_eps, torch.float64)
        return {"out": routed @ t["latent_up"].double().T + t["shared"].double()}

    def allowed_writes(self, call: OpCall) -> dict[str, Tensor]:
        return {}


# --- the whole MoE -----------------------------------------------------------------------------------------------

MOE_WEIGHT_NAMES = ("router", "router_bias", "latent_down", "latent_norm", "latent_up")


@dataclass
class MoeCell:
    """The whole latent MoE of one rank (routing decided beyond the key margin, as the route cells draw it)."""

    dims: ModelDims
    tp: int
    batch: int
    scale: float = 1.0
    spec: OpSpec = field(default=MOE)
    id: str = ""
    axes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = _axes_id("moe", self.tp, self.batch, self.scale)
        self.axes = {"tp": self.tp, "batch": self.batch, "scale": self.scale}

    def make(self, seed: int, device: torch.device) -> OpCall:
        g = torch.Generator().manual_seed(seed)
        w = weights.moe(self.dims, self.tp, str(device))
        hidden = decided_hidden(self.dims, w.router, w.router_bias, self.batch, g, self.scale)
        tensors = {"hidden": hidden.to(device), **{k: getattr(w, k).clone() for k in MOE_WEIGHT_NAMES}}
        tensors |= {k: v.clone() for k, v in expert_tensors(w.w13, w.w2).items()}
        tensors |= {"shared_gate_up": w.shared.gate_up.clone(), "shared_down": w.shared.down.clone()}
        return OpCall(tensors, {"tp": self.tp})

    def reference(self, call: OpCall) -> dict[str, Tensor]:
        t, dims = call.tensors, self.dims
        moe = dims.moe
        hidden = t["hidden"].double()
        routing = ref.route_tokens(t["hidden"], t["router"], t["router_bias"], moe)
        latent = hidden @ t["latent_down"].double().T
        routed = reference_experts(latent, routing.ids, routing.weights, t, dims)
        shared_ffn = ref.GatedFfn(t["shared_gate_up"], t["shared_down"])
        shared = ref.gated_ffn(hidden, shared_ffn, beta=moe.situ_beta, beta_lin=moe.situ_linear_beta)
        layer = ref.LatentMoeWeights(
            router=t["router"],
            e_score_correction_bias=t["router_bias"],
            latent_down=t["latent_down"],
            latent_up=t["latent_up"],
            latent_norm=t["latent_norm"],
            experts=shared_ffn,  # not read by the combine; any valid FFN
            shared=shared_ffn,
        )
        partial = ref.MoePartial(routing=routing, latent=latent, routed=routed, shared=shared)
        trace = ref.latent_moe_combine([partial], layer, dims)
        return {"out": trace.out, "ids": routing.ids}

    def allowed_writes(self, call: OpCall) -> dict[str, Tensor]:
        return {}


ORACLE_ENTRY_POINTS = (
    ref.route,
    ref.route_tokens,
    ref.router_logits,
    ref.routed_experts,
    ref.routed_experts_batched,
    ref.gated_ffn,
    ref.latent_moe_partial,
    ref.latent_moe_combine,
    ref.latent_moe,
    ref.dense_mlp,
)
