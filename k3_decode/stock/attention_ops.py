"""`StockAttentionOps`: the attention side of the stock decode path behind one object, so the executor and the
numerics suites call every op the same way and the ledger learns which implementation ran.

One instance serves one rank (dims, TP) on one device. Every call appends an OpRecord (op, implementation,
launches, batch, tokens per request) to `records` and passes it to `listener` when one is set; the per-op facts
come from attention_ops.toml through k3_decode.stock.dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from k3_decode.config import ModelDims
from k3_decode.reference.attn_res import MixWeights
from k3_decode.reference.kda import KdaCache, KdaSpec
from k3_decode.stock import attn_res, gemm, kda, mla
from k3_decode.stock.dispatch import Implementation, OpRecord, check_implementation, implementation_for, op_info
from k3_decode.weights import AttnResWeights, KdaWeights, MlaWeights, ResidualWeights

MLA_DECODE_OPS = ("mla_qkv_norm", "mla_q_b", "mla_w_uk", "mla_query_insert", "mla_attention", "mla_w_uv", "mla_gate")


@dataclass
class StockAttentionOps:
    dims: ModelDims
    tp: int
    device: torch.device | str = "cpu"
    implementation: Implementation | None = None  # None: "triton" on CUDA, "torch-cpu" elsewhere
    validate: bool = True  # check slot-table contents (a device sync) outside CUDA-graph capture
    listener: Callable[[OpRecord], None] | None = None
    records: list[OpRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.dims.shard(self.tp)  # raises ShardError for an unsupported TP size
        self.implementation = check_implementation(self.implementation or implementation_for(self.device), self.device)

    @cached_property
    def kda_spec(self) -> KdaSpec:
        return KdaSpec.for_rank(self.dims, self.tp)

    @property
    def eps(self) -> float:
        return self.dims.rms_norm_eps

    def _record(self, op: str, batch: int, tokens_per_request: int = 1) -> None:
        info = op_info(op, self.device)
        impl = "torch-cpu" if self.implementation == "torch-cpu" else info.implementation
        rec = OpRecord(op, impl, info.launches if impl != "torch-cpu" else 0, batch, tokens_per_request)
        self.records.append(rec)
        if self.listener is not None:
            self.listener(rec)

    def expected_launches(self, ops: tuple[str, ...]) -> int:
        """Kernel launches the named ops issue on CUDA, from the op table."""
        return sum(op_info(op, "cuda").launches for op in ops)

    # -- AttnRes ---------------------------------------------------------------------------------------------

    @staticmethod
    def _mix(weights: AttnResWeights, out_norm: Tensor | None) -> MixWeights:
        return MixWeights(res_norm=weights.norm, res_proj=weights.proj, out_norm=out_norm)

    def attn_res_before(
        self, buffers: attn_res.AttnResBuffers, layer: int, delta: Tensor | None, residual: ResidualWeights
    ) -> Tensor:
        """AttnRes before the attention of `layer`: returns the attention input (BF16 [T, hidden])."""
        out = attn_res.before_attention(
            buffers,
            layer,
            delta,
            self._mix(residual.attn_res, residual.input_norm),
            self.dims.attn_res_block_size,
            self.eps,
            self.implementation,
        )
        self._record("attn_res", buffers.prefix.shape[0])
        return out

    def attn_res_after(
        self, buffers: attn_res.AttnResBuffers, layer: int, attn_out: Tensor, residual: ResidualWeights
    ) -> Tensor:
        """AttnRes after the attention of `layer`: returns the MLP input (BF16 [T, hidden])."""
        out = attn_res.after_attention(
            buffers,
            layer,
            attn_out,
            self._mix(residual.mlp_res, residual.post_attn_norm),
            self.dims.attn_res_block_size,
            self.eps,
            self.implementation,
        )
        self._record("attn_res", buffers.prefix.shape[0])
        return out

    def attn_res_final(
        self, buffers: attn_res.AttnResBuffers, delta: Tensor, final_res: AttnResWeights, final_norm: Tensor | None
    ) -> Tensor:
        """The final AttnRes; pass final_norm=None for stock's pre-norm hidden state."""
        out = attn_res.final(
            buffers,
            delta,
            self.dims.num_layers,
            self._mix(final_res, final_norm),
            self.dims.attn_res_block_size,
            self.eps,
            self.implementation,
        )
        self._record("attn_res", buffers.prefix.shape[0])
        return out

    # -- KDA -------------------------------------------------------------------------------------------------

    def kda_in_proj(self, x: Tensor, weights: KdaWeights) -> Tensor:
        """[B, hidden] -> packed [B, rows] (BF16, cuBLAS)."""
        out = gemm.linear(x, weights.in_proj)
        self._record("kda_in_proj", x.shape[0])
        return out

    def kda_decode(self, packed: Tensor, weights: KdaWeights, cache: KdaCache, slots: Tensor) -> Tensor:
        """f_b GEMM + the fused decode step: packed [B, rows] -> BF16 [B, P]; updates `cache` at live slots."""
        out = kda.kda_decode_step(
            self.kda_spec,
            weights,
            packed,
            cache,
            slots,
            implementation=self.implementation,
            validate=self.validate,
        )
        self._record("kda_f_b", packed.shape[0])
        self._record("kda_decode", packed.shape[0])
        return out

    def kda_verify(
        self, packed: Tensor, weights: KdaWeights, cache: KdaCache, slots: Tensor, num_accepted: Tensor
    ) -> Tensor:
        """f_b GEMM + the verify pipeline: packed [B, q, rows] -> BF16 [B, q, P]."""
        out = kda.kda_verify_step(
            self.kda_spec,
            weights,
            packed,
            cache,
            slots,
            num_accepted,
            implementation=self.implementation,
            validate=self.validate,
        )
        batch, q = slots.shape
        self._record("kda_f_b", batch, q)
        self._record("kda_verify", batch, q)
        return out

    def kda_o_proj(self, o: Tensor, weights: KdaWeights) -> Tensor:
        """[B, P] -> [B, hidden], this rank's partial (cuBLAS)."""
        out = gemm.linear(o, weights.o_proj)
        self._record("kda_o_proj", o.shape[0])
        return out

    def kda_attention(self, x: Tensor, weights: KdaWeights, cache: KdaCache, slots: Tensor) -> Tensor:
        """The KDA attention of one decode step between the two AttnRes: in_proj, f_b, fused KDA, o_proj."""
        packed = self.kda_in_proj(x, weights)
        return self.kda_o_proj(self.kda_decode(packed, weights, cache, slots), weights)

    # -- MLA -------------------------------------------------------------------------------------------------

    def mla_num_splits(self, batch: int, max_context: int) -> int:
        return mla.choose_num_splits(batch, self.dims.shard(self.tp).mla_heads, max_context)

    def mla_decode(
        self, projected: Tensor, weights: MlaWeights, paged: mla.PagedLatentCache, num_splits: int
    ) -> Tensor:
        """From the qkv_a_g output to the o_proj input (BF16 [B, H*v]); inserts the new cache rows."""
        out = mla.mla_decode(
            projected,
            weights,
            self.dims.mla,
            paged,
            self.eps,
            num_splits=num_splits,
            implementation=self.implementation,
        )
        for op in MLA_DECODE_OPS:
            self._record(op, projected.shape[0])
        return out

    def mla_attention(self, x: Tensor, weights: MlaWeights, paged: mla.PagedLatentCache, num_splits: int) -> Tensor:
        """The MLA attention of one decode step between the two AttnRes: qkv_a_g, mla_decode, o_proj."""
        projected = gemm.linear(x, weights.qkv_a_g)
        self._record("mla_qkv_a_g", x.shape[0])
        o = self.mla_decode(projected, weights, paged, num_splits)
        out = gemm.linear(o, weights.o_proj)
        self._record("mla_o_proj", x.shape[0])
        return out
