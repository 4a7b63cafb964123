"""Row RMSNorm and SiTU-and-mul, one launch each, BF16 in and out with FP32 math inside.

Stand-ins for vLLM 0.33.0's `rms_norm` (the latent norm of tail tier 1, which fuses it with the latent all-reduce
when TP > 1) and `situ_and_mul` CUDA kernels (vllm/model_executor/layers/activation.py, csrc/).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3_decode.stock.triton_moe.common import bf16_rne, situ_f32


@triton.jit
def k3_rms_norm(x_ptr, w_ptr, out_ptr, n, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    """out[row] = bf16(x / sqrt(mean(x^2) + eps) * w), one program per row, the row held in registers."""
    row = tl.program_id(0)
    rms_norm_row(x_ptr + row * stride_x, w_ptr, out_ptr + row * stride_out, n, eps, BLOCK)


@triton.jit
def rms_norm_row(x_row, w_ptr, out_row, n, eps, BLOCK: tl.constexpr):
    """One row of k3_rms_norm; also the epilogue of the TP all-reduce of the latent (k3_decode.distributed)."""
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_row + cols, bf16_rne(x * inv * w), mask=ok)


@triton.jit
def k3_situ_and_mul(
    x_ptr, out_ptr, inter, stride_x, stride_out, beta, beta_lin, CLAMP_UP: tl.constexpr, BLOCK: tl.constexpr
):
    """out[row, c] = bf16(SiTU(x[row, c], x[row, inter + c])) for a [B, 2I] BF16 input laid out [gate | up]."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    act = situ_f32(gate, up, beta, beta_lin, CLAMP_UP)
    tl.store(out_ptr + row * stride_out + cols, bf16_rne(act), mask=ok)


MAX_NORM_WIDTH = 16384
"""The norm keeps a whole row in registers; K3's latent (3584) and hidden (7168) rows fit with 8 warps."""


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    rows, n = x.shape
    if x.dtype != torch.bfloat16 or weight.shape != (n,):
        raise ValueError(
            f"rms_norm needs BF16 x [rows, n] and weight [n]; got {x.dtype} {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"rms_norm holds a row in registers: width {n} is above {MAX_NORM_WIDTH}")
    x = x.contiguous()
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    k3_rms_norm[(rows,)](
        x, weight, out, n, x.stride(0), out.stride(0), eps, BLOCK=block, num_warps=8 if block >= 4096 else 4
    )
    return out


def situ_and_mul(x: Tensor, beta: float, beta_lin: float | None, block: int = 1024) -> Tensor:
    rows, two_inter = x.shape
    if x.dtype != torch.bfloat16 or two_inter % 2:
        raise ValueError(
            f"situ_and_mul needs BF16 [rows, 2I] input laid out [gate | up], got {x.dtype} {tuple(x.shape)}"
        )
    x = x.contiguous()
    inter = two_inter // 2
    out = torch.empty(rows, inter, dtype=torch.bfloat16, device=x.device)
    clamp = beta_lin is not None and beta_lin > 0
    k3_situ_and_mul[(rows, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), beta, beta_lin if clamp else 1.0, CLAMP_UP=clamp, BLOCK=block
    )
    return out
