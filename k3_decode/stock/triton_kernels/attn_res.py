"""One Triton kernel per AttnRes application: prefix update, block save, source mixing and RMSNorm.

Launch structure as vLLM 0.33.0 runs it on an H200 (vllm/models/kimi_k3/nvidia/ops/attn_res.py: the native
`_C` op is SM100-only, so SM90 takes the Triton kernel with one program per token). The body here is our own.

Per token (one program): p' = bf16(p + delta) (or bf16(delta) at a restart, or p), optionally saved as bank
block `save_index`; sources = bank blocks 0..n-1 then p'; logit_s = (s . (w_norm * w_q)) / sqrt(mean(s^2) + eps);
alpha = softmax(logit); mixed = sum_s alpha_s s; out = bf16(RMSNorm(mixed) * out_norm) (or bf16(mixed)).
All math in FP32.

A program walks the row twice in [BLOCK_S, BLOCK_H] chunks, requesting chunk i+2 before it uses chunk i: pass 1
computes the logits, pass 2 the mix and its norm, writing the mix and p' to an FP32 scratch row. After a barrier,
pass 3 writes the output, the prefix and the saved block from the scratch row. No pass reads memory the kernel
writes, except the scratch row after the barrier, so replicated reads in another warp never see a half-updated
prefix. One program per token is latency-bound: the cross-warp reductions of pass 1 put barriers in its loop, and
a barrier waits for the loads in flight. Accumulating per column instead (no barrier) measured slower on the
H200 (twice the registers, half the chunk), as did a plain three-pass walk without the scratch row.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from k3_decode.stock.triton_kernels import LANE_SYMMETRIC

NUM_WARPS = 16
TILE_ELEMS = 8192  # a [BLOCK_S, BLOCK_H] chunk: 16 FP32 values a thread at 16 warps
BLOCK_H_MAX = 4096  # columns per chunk at most (TILE_ELEMS // BLOCK_S never exceeds it at K3 sizes)
BLOCK_OUT = 8192  # columns per step of the output pass: a K3 row in one step


@triton.jit
def _load_chunk(
    prefix_row, delta_row, blocks_row, stride_block, src, cols, hidden, num_blocks, HAS_DELTA: tl.constexpr
):
    """Raw loads of one chunk: bank rows 0..n-1 (zero elsewhere), the old prefix and delta; masked past the row."""
    cmask = cols < hidden
    bank = tl.load(
        blocks_row + src[:, None] * stride_block + cols[None, :],
        mask=(src[:, None] < num_blocks) & cmask[None, :],
        other=0.0,
    )
    p = tl.load(prefix_row + cols, mask=cmask, other=0.0)
    d = tl.load(delta_row + cols, mask=cmask, other=0.0) if HAS_DELTA else p
    return bank, p, d


@triton.jit
def _sources(bank, p, d, src, num_blocks, HAS_DELTA: tl.constexpr, RESTART: tl.constexpr):
    """FP32 [BLOCK_S, BLOCK_H] sources (bank rows, then p' in row n) and p' (FP32 of its BF16 rounding)."""
    p = p.to(tl.float32)
    if HAS_DELTA:
        d = d.to(tl.float32)
        p = d.to(tl.bfloat16).to(tl.float32) if RESTART else (p + d).to(tl.bfloat16).to(tl.float32)
    return tl.where(src[:, None] == num_blocks, p[None, :], bank.to(tl.float32)), p


@triton.jit
def attn_res_kernel(
    prefix_ptr,
    delta_ptr,
    blocks_ptr,
    out_ptr,
    scratch_ptr,
    res_norm_ptr,
    res_proj_ptr,
    out_norm_ptr,
    hidden,
    num_blocks,
    save_index,
    stride_prefix,
    stride_delta,
    stride_blocks_t,
    stride_blocks_s,
    stride_out,
    eps,
    HAS_DELTA: tl.constexpr,
    RESTART: tl.constexpr,
    SAVE: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    attn_res_row(
        t,
        prefix_ptr,
        delta_ptr + t * stride_delta,
        blocks_ptr,
        out_ptr,
        scratch_ptr,
        res_norm_ptr,
        res_proj_ptr,
        out_norm_ptr,
        hidden,
        num_blocks,
        save_index,
        stride_prefix,
        stride_blocks_t,
        stride_blocks_s,
        stride_out,
        eps,
        HAS_DELTA,
        RESTART,
        SAVE,
        HAS_OUT_NORM,
        BLOCK_S,
        BLOCK_H,
        BLOCK_O,
    )


@triton.jit
def attn_res_row(
    t,
    prefix_ptr,
    delta_row,
    blocks_ptr,
    out_ptr,
    scratch_ptr,
    res_norm_ptr,
    res_proj_ptr,
    out_norm_ptr,
    hidden,
    num_blocks,
    save_index,
    stride_prefix,
    stride_blocks_t,
    stride_blocks_s,
    stride_out,
    eps,
    HAS_DELTA: tl.constexpr,
    RESTART: tl.constexpr,
    SAVE: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    """The whole application for token `t` (int64), its delta read from `delta_row`: the stock kernel's body, also
    the epilogue of the TP all-reduce that produces delta (k3_decode.distributed.triton_twoshot)."""
    prefix_row = prefix_ptr + t * stride_prefix
    blocks_row = blocks_ptr + t * stride_blocks_t
    scratch_row = scratch_ptr + t * 2 * hidden  # [mix | p'], FP32
    src = tl.arange(0, BLOCK_S)
    offs = tl.arange(0, BLOCK_H)

    # Pass 1: per-source dot with w_norm * w_q and sum of squares.
    dots = tl.zeros([BLOCK_S], dtype=tl.float32)
    squares = tl.zeros([BLOCK_S], dtype=tl.float32)
    # Two chunks ahead: chunk i+2 is requested while chunk i is used, three chunks in flight.
    b1, p1, d1 = _load_chunk(
        prefix_row, delta_row, blocks_row, stride_blocks_s, src, offs, hidden, num_blocks, HAS_DELTA
    )
    nxt = BLOCK_H + offs
    b2, p2, d2 = _load_chunk(
        prefix_row, delta_row, blocks_row, stride_blocks_s, src, nxt, hidden, num_blocks, HAS_DELTA
    )
    for start in range(0, hidden, BLOCK_H):
        bank, p_old, d = b1, p1, d1
        b1, p1, d1 = b2, p2, d2
        nxt = start + 2 * BLOCK_H + offs
        b2, p2, d2 = _load_chunk(
            prefix_row, delta_row, blocks_row, stride_blocks_s, src, nxt, hidden, num_blocks, HAS_DELTA
        )
        cols = start + offs
        cmask = cols < hidden
        tile, _ = _sources(bank, p_old, d, src, num_blocks, HAS_DELTA, RESTART)
        w = tl.load(res_norm_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w = w * tl.load(res_proj_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dots += tl.sum(tile * w[None, :], axis=1)
        squares += tl.sum(tile * tile, axis=1)
    logits = dots / tl.sqrt(squares / hidden + eps)
    logits = tl.where(src <= num_blocks, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=0))
    alpha = e / tl.sum(e, axis=0)

    # Pass 2: the mix and its norm; the mix and p' go to the scratch row.
    mixed_sq = tl.zeros([BLOCK_H], dtype=tl.float32)
    b1, p1, d1 = _load_chunk(
        prefix_row, delta_row, blocks_row, stride_blocks_s, src, offs, hidden, num_blocks, HAS_DELTA
    )
    nxt = BLOCK_H + offs
    b2, p2, d2 = _load_chunk(
        prefix_row, delta_row, blocks_row, stride_blocks_s, src, nxt, hidden, num_blocks, HAS_DELTA
    )
    for start in range(0, hidden, BLOCK_H):
        bank, p_old, d = b1, p1, d1
        b1, p1, d1 = b2, p2, d2
        nxt = start + 2 * BLOCK_H + offs
        b2, p2, d2 = _load_chunk(
            prefix_row, delta_row, blocks_row, stride_blocks_s, src, nxt, hidden, num_blocks, HAS_DELTA
        )
        cols = start + offs
        cmask = cols < hidden
        tile, p = _sources(bank, p_old, d, src, num_blocks, HAS_DELTA, RESTART)
        mixed = tl.sum(alpha[:, None] * tile, axis=0)
        mixed_sq += mixed * mixed
        tl.store(scratch_row + cols, mixed, mask=cmask)
        tl.store(scratch_row + hidden + cols, p, mask=cmask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(mixed_sq, axis=0) / hidden + eps)

    # Pass 3: every scratch write of the program lands before any thread reads the row back.
    tl.debug_barrier()
    for start in range(0, hidden, BLOCK_O):
        cols = start + tl.arange(0, BLOCK_O)
        cmask = cols < hidden
        mixed = tl.load(scratch_row + cols, mask=cmask, other=0.0)
        if HAS_OUT_NORM:
            mixed = mixed * inv_rms * tl.load(out_norm_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_out + cols, mixed.to(out_ptr.dtype.element_ty), mask=cmask)
        if HAS_DELTA or SAVE:
            p = tl.load(scratch_row + hidden + cols, mask=cmask, other=0.0)
            if HAS_DELTA:
                tl.store(prefix_row + cols, p.to(prefix_ptr.dtype.element_ty), mask=cmask)
            if SAVE:
                tl.store(
                    blocks_row + save_index * stride_blocks_s + cols, p.to(blocks_ptr.dtype.element_ty), mask=cmask
                )


def launch_attn_res(
    prefix: Tensor,
    delta: Tensor | None,
    blocks: Tensor,
    out: Tensor,
    scratch: Tensor,
    res_norm: Tensor,
    res_proj: Tensor,
    out_norm: Tensor | None,
    *,
    num_blocks: int,
    save_index: int | None,
    restart: bool,
    eps: float,
) -> None:
    """Launch one program per token; all tensors on one device, last dims contiguous, scratch [T, 2, hidden] FP32
    (checked by the op)."""
    tokens, hidden = prefix.shape
    block_s = max(2, triton.next_power_of_2(num_blocks + 1))
    attn_res_kernel[(tokens,)](
        prefix,
        prefix if delta is None else delta,  # unused pointer when HAS_DELTA is off
        blocks,
        out,
        scratch,
        res_norm,
        res_proj,
        res_norm if out_norm is None else out_norm,
        hidden,
        num_blocks,
        -1 if save_index is None else save_index,
        prefix.stride(0),
        0 if delta is None else delta.stride(0),
        blocks.stride(0),
        blocks.stride(1),
        out.stride(0),
        eps,
        HAS_DELTA=delta is not None,
        RESTART=restart,
        SAVE=save_index is not None,
        HAS_OUT_NORM=out_norm is not None,
        BLOCK_S=block_s,
        BLOCK_H=min(BLOCK_H_MAX, TILE_ELEMS // block_s, triton.next_power_of_2(hidden)),
        BLOCK_O=min(BLOCK_OUT, triton.next_power_of_2(hidden)),
        num_warps=NUM_WARPS,
        **LANE_SYMMETRIC,
    )
