"""The stock decode path: a baseline composed only of public kernels, with vLLM's stock launch structure on an H200.

Attention side (this package's attn_res, kda, mla, gemm and triton_kernels modules; docs/stock-path.md): cuBLAS
GEMMs through torch, Triton kernels where vLLM's stock path has a fused kernel no public package provides
(AttnRes, the fused KDA decode, the MLA query/cache insert and split-KV attention), fla-core's recurrent KDA for
speculative verify. On the CPU the same ops run as torch ops ("torch-cpu") at small dims.
"""

from k3_decode.stock.attention_ops import StockAttentionOps
from k3_decode.stock.attn_res import AttnResBuffers, AttnResSite
from k3_decode.stock.dispatch import Implementation, OpInfo, OpRecord, implementation_for, op_info
from k3_decode.stock.mla import PagedLatentCache, choose_num_splits

__all__ = [
    "AttnResBuffers",
    "AttnResSite",
    "Implementation",
    "OpInfo",
    "OpRecord",
    "PagedLatentCache",
    "StockAttentionOps",
    "choose_num_splits",
    "implementation_for",
    "op_info",
]
