"""The executor's row-parallel combines (k3_decode.executor.forward.RowParallel) over a real TP group.

    unfused  an all-reduce (any transport), then the stock op that consumes it: AttnRes after attention, the
             latent norm + latent_up GEMM (+ shared sum), the dense MLP output. What a deployment without fusion
             runs: each all-reduce is its own launch(es) before the stock launch.
    fused    the peer two-shot all-reduce with its consumer as epilogue: o_proj all-reduce + AttnRes in one launch,
             latent all-reduce + RMSNorm in one launch (then latent_up as an addmm on the reduced shared sum).

Both give every rank identical bits; with the `ordered` or `peer` transport those are the rank-order rule's bits, so
unfused-ordered and fused-peer must agree exactly (a test and the TP benchmark check it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3_decode.distributed.allreduce import PeerAllReduce
from k3_decode.reference.attn_res import MixWeights
from k3_decode.stock import AttnResBuffers, StockAttentionOps
from k3_decode.stock.attn_res import after_attention_reduced
from k3_decode.stock.moe import StockMoeOps
from k3_decode.weights import MoeWeights, ResidualWeights


@dataclass
class UnfusedRowParallel:
    all_reduce: Callable[[Tensor], Tensor]
    calls: Counter[str] = field(default_factory=Counter)

    def attention_out(
        self, ops: StockAttentionOps, work: AttnResBuffers, layer: int, partial: Tensor, residual: ResidualWeights
    ) -> Tensor:
        self.calls["attention_out"] += 1
        return ops.attn_res_after(work, layer, self.all_reduce(partial), residual)

    def moe_tail(self, moe: StockMoeOps, routed: Tensor, shared: Tensor, weights: MoeWeights) -> Tensor:
        self.calls["moe_tail"] += 1
        return moe.latent_tail(self.all_reduce(routed), self.all_reduce(shared), weights)

    def reduce(self, partial: Tensor) -> Tensor:
        self.calls["reduce"] += 1
        return self.all_reduce(partial)


@dataclass
class FusedRowParallel:
    peer: PeerAllReduce
    calls: Counter[str] = field(default_factory=Counter)

    def attention_out(
        self, ops: StockAttentionOps, work: AttnResBuffers, layer: int, partial: Tensor, residual: ResidualWeights
    ) -> Tensor:
        self.calls["attention_out"] += 1
        res = residual.mlp_res
        mix = MixWeights(res_norm=res.norm, res_proj=res.proj, out_norm=residual.post_attn_norm)
        return after_attention_reduced(work, layer, partial, mix, ops.dims.attn_res_block_size, ops.eps, self.peer)

    def moe_tail(self, moe: StockMoeOps, routed: Tensor, shared: Tensor, weights: MoeWeights) -> Tensor:
        self.calls["moe_tail"] += 1
        dims = moe.dims
        if dims.moe.latent_norm:
            normed = self.peer(routed, norm=weights.latent_norm, eps=dims.rms_norm_eps)
        else:
            normed = self.peer(routed)
        return torch.addmm(self.peer(shared), normed, weights.latent_up.T)

    def reduce(self, partial: Tensor) -> Tensor:
        self.calls["reduce"] += 1
        return self.peer(partial)
