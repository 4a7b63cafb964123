"""The small MLA kernels around the GEMMs and the attention: fused q/kv RMSNorm, FP8 query build with the FP8
cache insert, and the sigmoid output gate.

Stand-ins for vLLM 0.33.0's `fused_q_kv_rmsnorm`, the CUDA `fused_mla_decode_q_concat_kv_cache_insert`
(vllm/models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py) and the torch.compile'd `_gate_sigmoid_mul`
(vllm/models/kimi_k3/nvidia/mla.py): one launch each, as there.

- `qkv_norm_kernel`, grid (B, 2): program 0 normalizes q_a (the first q_lora columns of the projection),
  program 1 normalizes kv_c (the next kv_lora columns); FP32 math, BF16 out.
- `query_insert_kernel`, grid (B, H + 1): program h < H writes the FP8 E4M3 query row h = [ql_nope | q_pe] /
  q_scale; program H writes the cache row [kv_c_normed | k_pe] / k_scale at slot_mapping[b] (skipped when < 0).
  The division is IEEE (div_rn) and values are clamped to +-448 before the round-to-nearest-even conversion,
  so the bytes equal the oracle's quantize_e4m3 of the same BF16 inputs.
- `sigmoid_gate_kernel`, grid (B, H): out[b, h*V + j] = v[h, b, j] * sigmoid(gate[b, h*V + j]), BF16.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

E4M3_MAX = tl.constexpr(448.0)  # jit code may only read constexpr globals


@triton.jit
def _rms_norm_row(x_ptr, w_ptr, out_ptr, width, eps, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=0) / width + eps) * w
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def qkv_norm_kernel(
    proj_ptr,
    stride_proj,
    q_norm_ptr,
    kv_norm_ptr,
    q_out_ptr,
    stride_q_out,
    kv_out_ptr,
    stride_kv_out,
    q_width,
    kv_width,
    eps,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = proj_ptr + b * stride_proj
    if tl.program_id(1) == 0:
        _rms_norm_row(row, q_norm_ptr, q_out_ptr + b * stride_q_out, q_width, eps, BLOCK)
    else:
        _rms_norm_row(row + q_width, kv_norm_ptr, kv_out_ptr + b * stride_kv_out, kv_width, eps, BLOCK)


@triton.jit
def _e4m3_bits(x, scale):
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def query_insert_kernel(
    ql_ptr,
    stride_ql_h,
    stride_ql_b,
    q_ptr,
    stride_q_b,
    kv_ptr,
    stride_kv_b,
    proj_ptr,
    stride_proj,
    slot_mapping_ptr,
    query_ptr,
    cache_ptr,
    heads,
    k_pe_offset,
    q_scale,
    k_scale,
    L: tl.constexpr,
    NOPE: tl.constexpr,
    R: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    lat = tl.arange(0, L)
    rope = tl.arange(0, R)
    if h < heads:
        ql = tl.load(ql_ptr + h * stride_ql_h + b * stride_ql_b + lat)
        q_pe = tl.load(q_ptr + b * stride_q_b + h * (NOPE + R) + NOPE + rope)
        dst = query_ptr + (b * heads + h) * (L + R)
        tl.store(dst + lat, _e4m3_bits(ql, q_scale))
        tl.store(dst + L + rope, _e4m3_bits(q_pe, q_scale))
    else:
        slot = tl.load(slot_mapping_ptr + b).to(tl.int64)
        if slot >= 0:
            kv_c = tl.load(kv_ptr + b * stride_kv_b + lat)
            k_pe = tl.load(proj_ptr + b * stride_proj + k_pe_offset + rope)
            dst = cache_ptr + slot * (L + R)
            tl.store(dst + lat, _e4m3_bits(kv_c, k_scale))
            tl.store(dst + L + rope, _e4m3_bits(k_pe, k_scale))


@triton.jit
def sigmoid_gate_kernel(
    v_ptr,
    stride_v_h,
    stride_v_b,
    gate_ptr,
    stride_gate,
    out_ptr,
    stride_out,
    V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.arange(0, V)
    v = tl.load(v_ptr + h * stride_v_h + b * stride_v_b + j).to(tl.float32)
    g = tl.load(gate_ptr + b * stride_gate + h * V + j).to(tl.float32)
    tl.store(out_ptr + b * stride_out + h * V + j, (v * tl.sigmoid(g)).to(out_ptr.dtype.element_ty))


def launch_qkv_norm(
    projected: Tensor,
    q_a_norm: Tensor,
    kv_a_norm: Tensor,
    q_out: Tensor,
    kv_out: Tensor,
    *,
    eps: float,
) -> None:
    q_width, kv_width = q_out.shape[1], kv_out.shape[1]
    qkv_norm_kernel[(projected.shape[0], 2)](
        projected,
        projected.stride(0),
        q_a_norm,
        kv_a_norm,
        q_out,
        q_out.stride(0),
        kv_out,
        kv_out.stride(0),
        q_width,
        kv_width,
        eps,
        BLOCK=triton.next_power_of_2(max(q_width, kv_width)),
        num_warps=8,
    )


def launch_query_insert(
    ql_nope: Tensor,
    q: Tensor,
    kv_c: Tensor,
    projected: Tensor,
    slot_mapping: Tensor,
    query: Tensor,
    cache: Tensor,
    *,
    nope: int,
    k_pe_offset: int,
    q_scale: float,
    k_scale: float,
) -> None:
    """ql_nope [H, B, L] (any strides, unit last), q [B, H*(nope+R)], kv_c [B, L], query [B, H, L+R] uint8,
    cache [pages, page_size, L+R] (1-byte, contiguous)."""
    heads, batch, latent = ql_nope.shape
    rope = query.shape[2] - latent
    query_insert_kernel[(batch, heads + 1)](
        ql_nope,
        ql_nope.stride(0),
        ql_nope.stride(1),
        q,
        q.stride(0),
        kv_c,
        kv_c.stride(0),
        projected,
        projected.stride(0),
        slot_mapping,
        query,
        cache,
        heads,
        k_pe_offset,
        q_scale,
        k_scale,
        L=latent,
        NOPE=nope,
        R=rope,
        num_warps=4,
    )


def launch_sigmoid_gate(v: Tensor, gate: Tensor, out: Tensor) -> None:
    """v [H, B, V] (unit last stride), gate [B, H*V] (a column slice is fine), out [B, H*V]."""
    heads, batch, width = v.shape
    sigmoid_gate_kernel[(batch, heads)](
        v,
        v.stride(0),
        v.stride(1),
        gate,
        gate.stride(0),
        out,
        out.stride(0),
        V=width,
        num_warps=4,
    )
