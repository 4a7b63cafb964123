"""The fused KDA decode step (q = 1) as one Triton kernel: the stand-in for vLLM's native `ops.fused_kda_decode`.

vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/kda.py) runs, on SM90 too, one native `_C` kernel for a pure-decode
KDA step: conv update + SiLU + L2 norms + gate + delta rule + state write + gated RMSNorm; the f_b GEMM before
it stays a separate cuBLAS launch. That kernel is in no public package, so this file writes the same fusion in
Triton. One program per (request, head): it owns the head's D conv channels of q, k and v, its [D, D] FP32
state and its D outputs, so the gated RMSNorm over the head needs no cross-program reduction.

Per program (b, h), with slot = slots[b]:
- slot <= 0 (NULL, CUDA-graph padding): write zeros to the output and touch no state.
- conv: y = sum_j w[c, j] * tap_j + w[c, W-1] * x over the W-1 stored taps (oldest first), SiLU; the row's
  taps become [tap_1 .. tap_{W-2}, x].
- q, k: x / sqrt(sum(x^2) + l2_eps); q times D^-0.5. beta = sigmoid(b). g = lower * sigmoid(exp(A_log[h]) *
  (f_b_out + dt_bias)) along k.
- S[v, k] <- S diag(exp g); u = beta (v - S k); S <- S + u k^T (FP32 state); o = S q, row chunk by row chunk.
- out = o / sqrt(mean(o^2) + norm_eps) * o_norm * sigmoid(g_out), BF16.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from k3_decode.stock.triton_kernels import LANE_SYMMETRIC

STATE_ROWS = 32  # value rows per state chunk: [32, 128] FP32 chunks at 8 warps, two programs per SM


@triton.jit
def _conv_silu(packed_row, conv_row, stride_chan, stride_tap, conv_w_ptr, chan, W: tl.constexpr):
    """SiLU(causal conv) of channels `chan` for the newest input; returns (activation, newest input)."""
    x = tl.load(packed_row + chan).to(tl.float32)
    y = tl.load(conv_w_ptr + chan * W + (W - 1)).to(tl.float32) * x
    for j in tl.static_range(W - 1):
        tap = tl.load(conv_row + chan * stride_chan + j * stride_tap).to(tl.float32)
        y += tl.load(conv_w_ptr + chan * W + j).to(tl.float32) * tap
    return y * tl.sigmoid(y), x


@triton.jit
def _conv_shift(conv_row, stride_chan, stride_tap, chan, x, W: tl.constexpr):
    """Drop the oldest tap and append x; a thread reads tap j+1 of a channel before it rewrites it (a replicated
    channel is stored by one thread only)."""
    for j in tl.static_range(W - 2):
        tap = tl.load(conv_row + chan * stride_chan + (j + 1) * stride_tap)
        tl.store(conv_row + chan * stride_chan + j * stride_tap, tap)
    tl.store(conv_row + chan * stride_chan + (W - 2) * stride_tap, x.to(conv_row.dtype.element_ty))


@triton.jit
def kda_decode_kernel(
    packed_ptr,
    stride_packed,
    fb_ptr,
    stride_fb,
    conv_ptr,
    stride_conv_slot,
    stride_conv_chan,
    stride_conv_tap,
    conv_w_ptr,
    a_log_ptr,
    dt_bias_ptr,
    o_norm_ptr,
    state_ptr,
    stride_state_slot,
    stride_state_head,
    stride_state_v,
    stride_state_k,
    slots_ptr,
    out_ptr,
    stride_out,
    proj,
    beta_offset,
    lower_bound,
    l2_eps,
    norm_eps,
    q_scale,
    D: tl.constexpr,
    W: tl.constexpr,
    BV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot <= 0:
        tl.store(out_ptr + b * stride_out + h * D + d, tl.zeros([D], dtype=out_ptr.dtype.element_ty))
        return

    # The state goes through in chunks of BV value rows (a whole [D, D] tile with its 64-bit addresses spills);
    # the first chunk is requested before the conv so its latency overlaps the conv, and chunk c+1 before chunk c
    # is processed. Each chunk's outputs land in row c of a [NV, BV] register tile for the norm.
    NV: tl.constexpr = D // BV
    rows = tl.arange(0, BV)
    chunk_ids = tl.arange(0, NV)
    head_state = state_ptr + slot * stride_state_slot + h * stride_state_head
    nxt = tl.load(head_state + rows[:, None] * stride_state_v + d[None, :] * stride_state_k)

    packed_row = packed_ptr + b * stride_packed
    conv_row = conv_ptr + slot * stride_conv_slot
    head = h * D + d
    cols = chunk_ids[:, None] * BV + rows[None, :]  # v and the output as [NV, BV], row c = state chunk c
    q, xq = _conv_silu(packed_row, conv_row, stride_conv_chan, stride_conv_tap, conv_w_ptr, head, W)
    k, xk = _conv_silu(packed_row, conv_row, stride_conv_chan, stride_conv_tap, conv_w_ptr, proj + head, W)
    v, xv = _conv_silu(packed_row, conv_row, stride_conv_chan, stride_conv_tap, conv_w_ptr, 2 * proj + h * D + cols, W)
    # A channel's taps may be read by several threads (replicated layouts) and are rewritten by one: every read
    # must land before any rewrite, and warps do not run in step.
    tl.debug_barrier()
    _conv_shift(conv_row, stride_conv_chan, stride_conv_tap, head, xq, W)
    _conv_shift(conv_row, stride_conv_chan, stride_conv_tap, proj + head, xk, W)
    _conv_shift(conv_row, stride_conv_chan, stride_conv_tap, 2 * proj + h * D + cols, xv, W)

    q = q / tl.sqrt(tl.sum(q * q, axis=0) + l2_eps) * q_scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + l2_eps)
    beta = tl.sigmoid(tl.load(packed_row + beta_offset + h).to(tl.float32))
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    logit = tl.load(fb_ptr + b * stride_fb + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    decay = tl.exp(lower_bound * tl.sigmoid(a * logit))

    o = tl.zeros([NV, BV], dtype=tl.float32)
    for c in tl.static_range(NV):
        tile = head_state + (c * BV + rows)[:, None] * stride_state_v + d[None, :] * stride_state_k
        s = nxt.to(tl.float32)
        if c + 1 < NV:
            nxt = tl.load(tile + BV * stride_state_v)
        v_c = tl.sum(tl.where(chunk_ids[:, None] == c, v, 0.0), axis=0)
        s = s * decay[None, :]
        u = beta * (v_c - tl.sum(s * k[None, :], axis=1))
        s = s + u[:, None] * k[None, :]
        tl.store(tile, s.to(state_ptr.dtype.element_ty))
        o_c = tl.sum(s * q[None, :], axis=1)
        o = tl.where(chunk_ids[:, None] == c, o_c[None, :], o)

    gate = tl.load(packed_row + 3 * proj + h * D + cols).to(tl.float32)
    weight = tl.load(o_norm_ptr + cols).to(tl.float32)
    o = o / tl.sqrt(tl.sum(tl.sum(o * o, axis=1), axis=0) / D + norm_eps) * weight * tl.sigmoid(gate)
    tl.store(out_ptr + b * stride_out + h * D + cols, o.to(out_ptr.dtype.element_ty))


def launch_kda_decode(
    packed: Tensor,
    fb_out: Tensor,
    conv_state: Tensor,
    conv_weight: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    o_norm: Tensor,
    recurrent_state: Tensor,
    slots: Tensor,
    out: Tensor,
    *,
    heads: int,
    head_dim: int,
    beta_offset: int,
    lower_bound: float,
    l2_eps: float,
    norm_eps: float,
) -> None:
    """Grid (B, heads); the op checks shapes, dtypes and the unit strides the kernel assumes."""
    batch = packed.shape[0]
    kda_decode_kernel[(batch, heads)](
        packed,
        packed.stride(0),
        fb_out,
        fb_out.stride(0),
        conv_state,
        *conv_state.stride(),
        conv_weight,
        a_log,
        dt_bias,
        o_norm,
        recurrent_state,
        *recurrent_state.stride(),
        slots,
        out,
        out.stride(0),
        heads * head_dim,
        beta_offset,
        lower_bound,
        l2_eps,
        norm_eps,
        head_dim**-0.5,
        D=head_dim,
        W=conv_weight.shape[1],
        BV=min(STATE_ROWS, head_dim),
        num_warps=8 if head_dim >= 128 else 4,
        **LANE_SYMMETRIC,
    )
