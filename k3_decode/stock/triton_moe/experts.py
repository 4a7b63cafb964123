"""MXFP4 routed experts as W4A16 grouped GEMMs: FC1 (w13) with SiTU-and-mul, FC2 (w2) with the routing weight,
then the sum over the top-k slots.

Stand-in for vLLM 0.33.0's H200 path (vllm/model_executor/layers/fused_moe/oracle/mxfp4.py falls through to the
Marlin/Humming MXFP4 MoE on SM90): 16-bit activations, MXFP4 weights dequantized on the fly in registers, FP32
accumulation, tokens grouped by expert so each selected expert's weights are read once. Same launch structure as
vLLM's fused Marlin MoE (align, FC1, activation, FC2, sum) less the activation launch, which rides in FC1's epilogue.

How a weight is decoded: an E2M1 code s|e1 e0|m placed as FP16 bits s|0 0 0 e1 e0|m 0...0 is exactly its value
times 2^-14 (code 1, 0.5, lands on the FP16 subnormal 2^-15, which is right), so a code costs a few integer ops
and a free bitcast. The 32-element scale 2^(b - 127) is split: 2^(b - r + 14), with r the largest scale byte of the
weight's row, is one FP16 multiply per weight (exact while a block sits within 2^23 of its row's largest block),
and 2^(r - 127) multiplies the FP32 result once per output column.

Activations enter the dot as FP16. FC1's input, the latent (a down-projection of a normalized hidden state, O(1)),
is exact between 2^-14 and 65504 and keeps 2^-24 absolute steps below; a token with an element at or above 65520,
which FP16 cannot hold, gets NaN outputs (loud, never a silently clipped value). FC2's input, the SiTU output, is
pre-scaled per row by a power of two into FP16's normal range (a short pass: K is one intermediate shard), because a
small latent makes it tiny (~latent^2) and the latent RMSNorm after the all-reduce would amplify any lost bits.

Decode is latency-bound at small batch: each program streams its weight rows in K steps of 32 * S elements and
issues the next step's weight loads before it computes on the current one, so two steps are in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3_decode.reference.mxfp import BLOCK, MxTensor
from k3_decode.stock.triton_moe.common import bf16_rne, exponent_of, pow2_f32, situ_f32
from k3_decode.stock.triton_moe.limits import MAX_PAIRS
from k3_decode.stock.triton_moe.routing import align
from k3_decode.stock.triton_moe.tiles import ExpertTiles


@triton.jit
def _row_shift(x_ptr, x_rows, x_ok, K, BM: tl.constexpr, BK: tl.constexpr):
    """Per row, the power of two that moves its largest |x| into [2^14, 2^15) (0 for an all-zero row)."""
    amax = tl.zeros([BM], dtype=tl.float32)
    cols = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        k = k0 + cols
        v = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=x_ok[:, None] & (k < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=1))
    shift = tl.where(amax > 0, exponent_of(amax) - 14, 0)
    # 2^-shift (on x) and 2^shift (on the result) must both be normal FP32 powers of two.
    return tl.minimum(tl.maximum(shift, -126), 126)


@triton.jit
def _load_weights(w_ptr, s_ptr, w_rows, w_ok, b0, n_blocks, stride_wn, stride_sn, S: tl.constexpr):
    """Packed codes [S, 16, N] and scale bytes [S, N] of the S scale blocks starting at block b0 (masked past K)."""
    j = tl.arange(0, 16)
    blk = b0 + tl.arange(0, S)
    blk_ok = blk < n_blocks
    w_off = w_rows[None, None, :] * stride_wn + (blk * 16)[:, None, None] + j[None, :, None]
    packed = tl.load(w_ptr + w_off, mask=blk_ok[:, None, None] & w_ok[None, None, :], other=0)
    s_off = w_rows[None, :] * stride_sn + blk[:, None]
    scale = tl.load(s_ptr + s_off, mask=blk_ok[:, None] & w_ok[None, :], other=0)
    return packed, scale


@triton.jit
def _row_scale_max(s_ptr, w_rows, w_ok, n_blocks, stride_sn, N: tl.constexpr, KB: tl.constexpr):
    """Largest scale byte of each weight row (0 for rows that are all padding)."""
    b = tl.arange(0, KB)
    top = tl.zeros([N], dtype=tl.int32)
    for b0 in range(0, n_blocks, KB):
        blk = b0 + b
        sc = tl.load(s_ptr + w_rows[:, None] * stride_sn + blk[None, :], mask=w_ok[:, None] & (blk < n_blocks)[None, :])
        top = tl.maximum(top, tl.max(sc.to(tl.int32), axis=1))
    return top


@triton.jit
def _pow2_f16(e):
    """2^e as FP16 for int32 e <= 15; 0 below 2^-14 (a block that far under its row's largest adds nothing)."""
    bits = tl.where(e >= -14, (e + 15) << 10, 0)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _mx_gemm(
    x_ptr,
    x_rows,
    x_ok,
    x_mul,
    w_ptr,
    s_ptr,
    w_rows,
    w_ok,
    K,
    stride_wn,
    stride_sn,
    BM: tl.constexpr,
    N: tl.constexpr,
    S: tl.constexpr,
):
    """(acc [BM, N] FP32, amax [BM]): acc[m, n] = sum_k x_mul[m] * x[row m, k] * W[w_rows n, k] for MXFP4 W (codes
    [N, K/2] bytes, scales [N, K/32]); amax is each row's largest |x_mul * x|, to flag what FP16 could not hold.

    Each weight becomes v * 2^(b - r) in FP16, with r its row's largest scale byte (exact while a block's scale is
    within 2^23 of its row's largest); 2^(r - 127) is applied to the FP32 result once per column.
    """
    kk = tl.arange(0, S * 32)
    n_blocks = K // 32
    top = _row_scale_max(s_ptr, w_rows, w_ok, n_blocks, stride_sn, N, 128)
    acc = tl.zeros([BM, N], dtype=tl.float32)
    amax = tl.zeros([BM], dtype=tl.float32)
    packed, scale = _load_weights(w_ptr, s_ptr, w_rows, w_ok, 0, n_blocks, stride_wn, stride_sn, S)
    for b0 in range(0, n_blocks, S):
        # The next step's weights are requested before this step's math, so two steps' bytes are in flight.
        next_packed, next_scale = _load_weights(w_ptr, s_ptr, w_rows, w_ok, b0 + S, n_blocks, stride_wn, stride_sn, S)
        # One contiguous load of this step's 32 * S activations per row, split into even and odd elements: column
        # 16 s + j of either half is element 32 s + 2 j (+ 1) of the step, the order of the weight tile's rows.
        k = b0 * 32 + kk
        x = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=x_ok[:, None] & (k < K)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x.to(tl.float32) * x_mul[:, None], (BM, S * 16, 2)))
        amax = tl.maximum(amax, tl.max(tl.maximum(tl.abs(x_even), tl.abs(x_odd)), axis=1))
        codes = packed.to(tl.int32)
        factor = _pow2_f16(scale.to(tl.int32) - top[None, :] + 14)[:, None, :]  # [S, 1, N]; 2^14 undoes the code's
        w_even = (((codes & 0x8) << 12) | ((codes & 0x7) << 9)).to(tl.int16).to(tl.float16, bitcast=True) * factor
        w_odd = (((codes & 0x80) << 8) | ((codes & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True) * factor
        acc = tl.dot(x_even.to(tl.float16), tl.reshape(w_even, (S * 16, N)), acc)
        acc = tl.dot(x_odd.to(tl.float16), tl.reshape(w_odd, (S * 16, N)), acc)
        packed, scale = next_packed, next_scale
    # 2^(r - 127) as 2^(r - 126) / 2 keeps the factor a normal FP32 number for r = 0 (all-padding rows).
    return acc * (pow2_f32(top - 126) * 0.5)[None, :], amax


@triton.jit
def k3_moe_fc1_situ(
    x_ptr,
    w_ptr,
    s_ptr,
    sorted_ptr,
    block_expert_ptr,
    out_ptr,
    num_pairs,
    inter,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    beta,
    beta_lin,
    TOP_K: tl.constexpr,
    CLAMP_UP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    S: tl.constexpr,
):
    """out[pair, n] = bf16(SiTU(x[token] . gate_e[n], x[token] . up_e[n])) for one expert block and BN columns."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= 0:
        pair = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        ok = pair < num_pairs
        x_rows = (pair // TOP_K) * stride_x  # int32 offsets: B * L and 2I * L / 2 are far below 2^31
        # Rows 2c and 2c + 1 of the tile are the gate and up rows of intermediate column c: one dot serves both.
        r = tl.arange(0, 2 * BN)
        col = pid_n * BN + r // 2
        w_rows = col + (r % 2) * inter
        acc, amax = _mx_gemm(
            x_ptr,
            x_rows,
            ok,
            tl.full([BM], 1.0, dtype=tl.float32),  # the latent is O(1): no pre-scaling pass over its 3584 columns
            w_ptr + e * stride_we,
            s_ptr + e * stride_se,
            w_rows,
            col < inter,
            K,
            stride_wn,
            stride_sn,
            BM,
            2 * BN,
            S,
        )
        # 65520 is the smallest magnitude FP16 rounds to inf: such a token's products are lost, so say so with NaN.
        acc = tl.where((amax < 65520.0)[:, None], acc, float("nan"))
        gate, up = tl.split(tl.reshape(acc, (BM, BN, 2)))
        act = situ_f32(gate, up, beta, beta_lin, CLAMP_UP)
        cols = pid_n * BN + tl.arange(0, BN)
        mask = ok[:, None] & (cols < inter)[None, :]
        tl.store(out_ptr + pair[:, None] * stride_out + cols[None, :], bf16_rne(act), mask=mask)


@triton.jit
def k3_moe_fc2(
    a_ptr,
    w_ptr,
    s_ptr,
    sorted_ptr,
    block_expert_ptr,
    route_w_ptr,
    out_ptr,
    num_pairs,
    latent,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    BM: tl.constexpr,
    BN: tl.constexpr,
    S: tl.constexpr,
):
    """out[pair, n] = routing_weight[pair] * (a[pair] . w2_e[n]) in FP32, for one expert block and BN columns."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= 0:
        pair = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        ok = pair < num_pairs
        a_rows = pair * stride_a
        # The SiTU output can be tiny (a small latent gives ~latent^2): pre-scale each row into FP16's normal range.
        # K is one intermediate shard (384 at TP8), one or two K steps, so the extra pass is short.
        shift = _row_shift(a_ptr, a_rows, ok, K, BM, 32 * S)
        rows = pid_n * BN + tl.arange(0, BN)
        acc, amax = _mx_gemm(
            a_ptr,
            a_rows,
            ok,
            pow2_f32(-shift),
            w_ptr + e * stride_we,
            s_ptr + e * stride_se,
            rows,
            rows < latent,
            K,
            stride_wn,
            stride_sn,
            BM,
            BN,
            S,
        )
        route_w = tl.load(route_w_ptr + pair, mask=ok, other=0.0)
        acc = tl.where((amax < 65520.0)[:, None], acc * (pow2_f32(shift) * route_w)[:, None], float("nan"))
        mask = ok[:, None] & (rows < latent)[None, :]
        tl.store(out_ptr + pair[:, None] * stride_out + rows[None, :], acc, mask=mask)


@triton.jit
def k3_moe_sum(pairs_ptr, out_ptr, latent, stride_pairs, stride_out, TOP_K: tl.constexpr, BN: tl.constexpr):
    """out[b, n] = bf16(sum over slots 0..k-1, in slot order, of the weighted FP32 expert outputs)."""
    b = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = n < latent
    acc = tl.zeros([BN], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (b * TOP_K + slot) * stride_pairs + n, mask=ok, other=0.0)
    tl.store(out_ptr + b * stride_out + n, bf16_rne(acc), mask=ok)


def experts(
    latent: Tensor,
    ids: Tensor,
    weights: Tensor,
    w13: MxTensor,
    w2: MxTensor,
    *,
    beta: float,
    beta_lin: float | None,
    tiles: ExpertTiles,
) -> Tensor:
    """This rank's routed sum [B, L] BF16: sum_k weights[b, k] * expert_{ids[b, k]}(latent[b]).

    latent [B, L] BF16; ids [B, k] int32 and weights [B, k] FP32 as `routing.route` makes them. Four launches
    (align, FC1 + SiTU, FC2, slot sum) per chunk of at most MAX_PAIRS pairs.
    """
    batch, lat = latent.shape
    top_k = ids.shape[1]
    num_experts, two_inter = w13.data.shape[0], w13.data.shape[1]
    inter = two_inter // 2
    if latent.dtype != torch.bfloat16 or ids.dtype != torch.int32 or weights.dtype != torch.float32:
        raise TypeError(
            f"experts need BF16 latent, int32 ids, FP32 weights; got {latent.dtype}, {ids.dtype}, {weights.dtype}"
        )
    if lat % BLOCK or inter % BLOCK or tuple(w2.data.shape) != (num_experts, lat, inter // 2):
        raise ValueError(
            f"latent {tuple(latent.shape)} does not fit experts w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}"
        )
    latent = latent.contiguous()
    out = torch.empty(batch, lat, dtype=torch.bfloat16, device=latent.device)
    chunk = max(1, MAX_PAIRS // top_k)
    for t0 in range(0, batch, chunk):
        t1 = min(batch, t0 + chunk)
        _experts_chunk(latent[t0:t1], ids[t0:t1], weights[t0:t1], w13, w2, out[t0:t1], beta, beta_lin, tiles)
    return out


def _experts_chunk(
    latent: Tensor,
    ids: Tensor,
    weights: Tensor,
    w13: MxTensor,
    w2: MxTensor,
    out: Tensor,
    beta: float,
    beta_lin: float | None,
    tiles: ExpertTiles,
) -> None:
    batch, lat = latent.shape
    top_k = ids.shape[1]
    num_experts, inter = w13.data.shape[0], w13.data.shape[1] // 2
    pairs = batch * top_k
    group = align(ids.contiguous(), num_experts, tiles.block_m)
    dev = latent.device
    act = torch.empty(pairs, inter, dtype=torch.bfloat16, device=dev)
    k3_moe_fc1_situ[(group.max_blocks, triton.cdiv(inter, tiles.fc1_block_n))](
        latent,
        w13.data,
        w13.scales,
        group.sorted_pairs,
        group.block_expert,
        act,
        pairs,
        inter,
        lat,
        latent.stride(0),
        w13.data.stride(0),
        w13.data.stride(1),
        w13.scales.stride(0),
        w13.scales.stride(1),
        act.stride(0),
        beta,
        beta_lin if beta_lin is not None and beta_lin > 0 else 1.0,
        TOP_K=top_k,
        CLAMP_UP=beta_lin is not None and beta_lin > 0,
        BM=tiles.block_m,
        BN=tiles.fc1_block_n,
        S=tiles.fc1_k_blocks,
        num_warps=tiles.fc1_warps,
        num_stages=tiles.fc1_stages,
    )
    per_pair = torch.empty(pairs, lat, dtype=torch.float32, device=dev)
    k3_moe_fc2[(group.max_blocks, triton.cdiv(lat, tiles.fc2_block_n))](
        act,
        w2.data,
        w2.scales,
        group.sorted_pairs,
        group.block_expert,
        weights.contiguous(),
        per_pair,
        pairs,
        lat,
        inter,
        act.stride(0),
        w2.data.stride(0),
        w2.data.stride(1),
        w2.scales.stride(0),
        w2.scales.stride(1),
        per_pair.stride(0),
        BM=tiles.block_m,
        BN=tiles.fc2_block_n,
        S=tiles.fc2_k_blocks,
        num_warps=tiles.fc2_warps,
        num_stages=tiles.fc2_stages,
    )
    k3_moe_sum[(batch, triton.cdiv(lat, tiles.sum_block_n))](
        per_pair, out, lat, per_pair.stride(0), out.stride(0), TOP_K=top_k, BN=tiles.sum_block_n
    )
