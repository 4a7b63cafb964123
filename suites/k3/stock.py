"""The stock path under test: each op of the K3 suite called through the op providers the executor uses
(k3_decode.stock.StockAttentionOps and StockMoeOps), on the cell's tensors.

An adapter only unpacks a call into the provider's arguments; every number comes from the stock op. Weight fields a
provider method does not read are filled from the cached layer (they must not matter: the cell's copies are the
ones under the hygiene probes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from harness.numerics.cells import Impl, OpCall
from k3_decode.config import ModelDims
from k3_decode.reference.mxfp import MxTensor
from k3_decode.stock import AttnResBuffers, PagedLatentCache, StockAttentionOps
from k3_decode.stock.moe import StockMoeOps, StockRouting
from k3_decode.weights import AttnResWeights, DenseMlpWeights, MoeWeights, ResidualWeights
from suites.k3 import mla, weights


@cache
def attention_ops(dims: ModelDims, tp: int, device: str) -> StockAttentionOps:
    return StockAttentionOps(dims, tp, device)


@cache
def moe_ops(dims: ModelDims, tp: int, device: str) -> StockMoeOps:
    return StockMoeOps(dims, tp, device)


def _experts(t: dict[str, Tensor]) -> dict[str, MxTensor]:
    return {
        "w13": MxTensor("mxfp4", t["w13_data"], t["w13_scales"]),
        "w2": MxTensor("mxfp4", t["w2_data"], t["w2_scales"]),
    }


@dataclass(frozen=True)
class StockAdapters:
    dims: ModelDims
    device: str

    def ops(self) -> dict[str, Impl]:
        return {
            "attn_res": self.attn_res,
            "kda_in_proj": self.kda_in_proj,
            "kda_o_proj": self.kda_o_proj,
            "mla_decode": self.mla_decode,
            "moe_route": self.moe_route,
            "moe_latent_down": self.moe_latent_down,
            "moe_experts": self.moe_experts,
            "moe_shared": self.moe_shared,
            "moe_latent_tail": self.moe_latent_tail,
            "moe": self.moe,
            "dense_mlp": self.dense_mlp,
        }

    def _moe_weights(self, tp: int, **fields: object) -> MoeWeights:
        """The provider's weights container with the call's tensors; fields the called op does not read hold
        empty tensors, so an op that read one would fail loudly instead of using weights the cell never gave."""
        empty = torch.empty(0, device=self.device)
        none = MxTensor("mxfp4", empty.to(torch.uint8), empty.to(torch.uint8))
        base = MoeWeights(
            router=empty,
            router_bias=empty,
            latent_down=empty,
            latent_norm=empty,
            latent_up=empty,
            w13=none,
            w2=none,
            shared=DenseMlpWeights(empty, empty),
            expert_ids=tuple(range(self.dims.moe.num_experts)),
        )
        return dataclasses.replace(base, **fields)

    def attn_res(self, call: OpCall) -> dict[str, Tensor]:
        t, a = call.tensors, call.args
        ops = attention_ops(self.dims, weights.replicated_tp(self.dims), self.device)
        buffers = AttnResBuffers(t["prefix"], t["blocks"], num_blocks=a["bank_blocks"])
        mix = AttnResWeights(norm=t["res_norm"], proj=t["res_proj"])
        site: str = a["site"]
        if site.startswith("final"):
            return {"out": ops.attn_res_final(buffers, t["delta"], mix, t.get("out_norm"))}
        norm = t["out_norm"]
        residual = ResidualWeights(attn_res=mix, mlp_res=mix, input_norm=norm, post_attn_norm=norm)
        if site.startswith("before"):
            return {"out": ops.attn_res_before(buffers, a["layer"], t.get("delta"), residual)}
        return {"out": ops.attn_res_after(buffers, a["layer"], t["delta"], residual)}

    def kda_in_proj(self, call: OpCall) -> dict[str, Tensor]:
        t, tp = call.tensors, call.args["tp"]
        layer = dataclasses.replace(weights.kda(self.dims, tp, self.device), in_proj=t["in_proj"])
        return {"packed": attention_ops(self.dims, tp, self.device).kda_in_proj(t["x"], layer)}

    def kda_o_proj(self, call: OpCall) -> dict[str, Tensor]:
        """cuBLAS o_proj, then the AttnRes after attention on its output, as the stock layer runs them."""
        t, a = call.tensors, call.args
        ops = attention_ops(self.dims, a["tp"], self.device)
        layer = dataclasses.replace(weights.kda(self.dims, a["tp"], self.device), o_proj=t["o_proj"])
        attn_out = ops.kda_o_proj(t["o"], layer)
        buffers = AttnResBuffers(t["prefix"], t["blocks"], num_blocks=a["bank_blocks"])
        mix = AttnResWeights(norm=t["res_norm"], proj=t["res_proj"])
        norm = t["out_norm"]
        residual = ResidualWeights(attn_res=mix, mlp_res=mix, input_norm=norm, post_attn_norm=norm)
        return {"attn_out": attn_out, "out": ops.attn_res_after(buffers, a["layer"], attn_out, residual)}

    def mla_decode(self, call: OpCall) -> dict[str, Tensor]:
        t, a = call.tensors, call.args
        ops = attention_ops(self.dims, a["tp"], self.device)
        layer = dataclasses.replace(weights.mla(self.dims, a["tp"], self.device), **{k: t[k] for k in mla.WEIGHT_NAMES})
        paged = PagedLatentCache(
            t["cache"], t["block_table"], t["seq_lens"], t["slot_mapping"], k_scale=a["k_scale"], q_scale=a["q_scale"]
        )
        return {"out": ops.mla_decode(t["projected"], layer, paged, a["num_splits"])}

    def moe_route(self, call: OpCall) -> dict[str, Tensor]:
        t, tp = call.tensors, call.args["tp"]
        layer = self._moe_weights(tp, router=t["router"], router_bias=t["router_bias"])
        r = moe_ops(self.dims, tp, self.device).route(t["hidden"], layer)
        return {"logits": r.logits, "ids": r.ids, "weights": r.weights}

    def moe_latent_down(self, call: OpCall) -> dict[str, Tensor]:
        t, tp = call.tensors, call.args["tp"]
        layer = self._moe_weights(tp, latent_down=t["latent_down"])
        return {"latent": moe_ops(self.dims, tp, self.device).latent_down(t["hidden"], layer)}

    def moe_experts(self, call: OpCall) -> dict[str, Tensor]:
        t, tp = call.tensors, call.args["tp"]
        routing = StockRouting(logits=torch.empty(0, device=t["ids"].device), ids=t["ids"], weights=t["weights"])
        layer = self._moe_weights(tp, **_experts(t))
        return {"routed": moe_ops(self.dims, tp, self.device).experts(t["latent"], routing, layer)}

    def moe_shared(self, call: OpCall) -> dict[str, Tensor]:
        t, tp = call.tensors, call.args["tp"]
        layer = self._moe_weights(tp, shared=DenseMlpWeights(t["gate_up"], t["down"]))
        return {"shared": moe_ops(self.dims, tp, self.device).shared(t["hidden"], layer)}

    def moe_latent_tail(self, call: OpCall) -> dict[str, Tensor]:
        t, tp = call.tensors, call.args["tp"]
        layer = self._moe_weights(tp, latent_up=t["latent_up"], latent_norm=t.get("latent_norm", torch.empty(0)))
        return {"out": moe_ops(self.dims, tp, self.device).latent_tail(t["routed"], t["shared"], layer)}

    def moe(self, call: OpCall) -> dict[str, Tensor]:
        t, tp = call.tensors, call.args["tp"]
        layer = self._moe_weights(
            tp,
            router=t["router"],
            router_bias=t["router_bias"],
            latent_down=t["latent_down"],
            latent_norm=t["latent_norm"],
            latent_up=t["latent_up"],
            shared=DenseMlpWeights(t["shared_gate_up"], t["shared_down"]),
            **_experts(t),
        )
        out = moe_ops(self.dims, tp, self.device).moe(t["hidden"], layer)
        return {"out": out.out, "ids": out.routing.ids}

    def dense_mlp(self, call: OpCall) -> dict[str, Tensor]:
        t, tp = call.tensors, call.args["tp"]
        return {"out": moe_ops(self.dims, tp, self.device).dense(t["hidden"], DenseMlpWeights(t["gate_up"], t["down"]))}
