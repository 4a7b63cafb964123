"""The stock path's dense GEMMs: cuBLAS through torch, as vLLM's stock decode runs them on an H200.

vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/low_latency_gemm.py) has an SM90 projection table, but the FlashInfer
CuTe-DSL QKVG kernels it would pick are SM100/103-only, so on an H200 the KDA in_proj, f_b, o_proj and the MLA
projections are `torch.mm` / `F.linear` calls, i.e. cuBLAS (cuBLASLt heuristics choose the kernel, a split-K
reduction may add a launch at small M). The absorbed MLA W_UK / W_UV products are `torch.bmm`
(vllm/models/kimi_k3/nvidia/mla.py). On the CPU the same torch calls run on the CPU.

All operands stay in the weights' dtype (BF16 in the model); cuBLAS accumulates in FP32 and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor, out: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N]: one cuBLAS GEMM on CUDA.

    `x` may be a column slice of a wider activation (last dim contiguous): cuBLAS takes the row stride as the
    leading dimension, so no copy is made.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain; need [M, K] x [N, K]"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype} but the weight is {weight.dtype}; cast the activation first")
    if out is None:
        return F.linear(x, weight)
    return torch.mm(x, weight.t(), out=out)


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """Batched a [G, M, K] @ b [G, K, N] -> [G, M, N]: one cuBLAS strided-batched GEMM on CUDA."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm: {tuple(a.shape)} x {tuple(b.shape)} do not chain; need [G, M, K] x [G, K, N]")
    if a.dtype != b.dtype:
        raise ValueError(f"bmm: operands are {a.dtype} and {b.dtype}; cast the activation to the weight dtype")
    return torch.bmm(a, b)
