"""Split-KV MLA decode attention over the paged FP8 E4M3 latent cache, in Triton: one split kernel and one merge.

The stand-in for the backend vLLM 0.33.0 picks for head size 576 on an H200 (FlashInfer trtllm-gen and the
tokenspeed core are SM100-only there): a split-KV decode that writes per-split partial outputs with their
log-sum-exp, then a merge launch. Math as the oracle (k3_decode.reference.mla.attend / merge_partials):

- split j of request b covers positions [j*c, (j+1)*c) of [0, seq_len[b]) with c = cdiv(seq_len, S) rounded up
  to BLOCK_N; an empty split writes out = 0, lse = -inf.
- scores = (q_fp8 . row_fp8) * q_scale * k_scale * softmax_scale over the 576-wide rows (latent | rope), online
  softmax in FP32 base e; values = the latent part of the rows times k_scale. FP8 -> FP16 is exact, so the two
  score dots (FP16 operands, FP32 accumulation) are exact products; the probabilities are rounded to FP16 for
  the value dot, as flash-decoding kernels do. (FP16 rather than BF16 operands: the same exact products, a finer
  rounding of the probabilities, and Triton's CPU interpreter, which the CPU tests use, computes BF16 dots wrong.)
- merge: lse = logsumexp_j lse_j, out = sum_j exp(lse_j - lse) out_j, written BF16 as [H, B, L] (the layout the
  W_UV bmm reads); all-empty rows give 0.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 32  # positions per tile
BLOCK_H = 16  # heads per program: the smallest M of a tensor-core dot; 12 (TP8) and 6 (TP16) heads are masked


@triton.jit
def _fp8_tile(ptr, mask):
    """uint8 E4M3 bits -> FP16 values (exact)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _pages(block_table_row, pos, end, page_size):
    """Physical page of each position of a tile (0 past the split: never dereferenced unmasked)."""
    return tl.load(block_table_row + pos // page_size, mask=pos < end, other=0).to(tl.int64)


@triton.jit
def _rows(cache_ptr, page, pos, end, page_size, lat, rope, L: tl.constexpr, R: tl.constexpr):
    """The raw E4M3 bytes of a tile's cache rows: latent [BLOCK_N, L] and rope [BLOCK_N, R]."""
    row = cache_ptr + (page * page_size + pos % page_size)[:, None] * (L + R)
    pmask = (pos < end)[:, None]
    return tl.load(row + lat[None, :], mask=pmask, other=0), tl.load(row + L + rope[None, :], mask=pmask, other=0)


@triton.jit
def split_kv_kernel(
    query_ptr,
    cache_ptr,
    block_table_ptr,
    stride_bt,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    heads,
    num_splits,
    page_size,
    score_scale,
    value_scale,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    hs = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = hs < heads
    lat = tl.arange(0, L)
    rope = tl.arange(0, R)
    row = L + R

    n = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(n, start + per_split)

    q_row = query_ptr + (b * heads + hs)[:, None] * row
    q_lat = _fp8_tile(q_row + lat[None, :], hmask[:, None])
    q_pe = _fp8_tile(q_row + L + rope[None, :], hmask[:, None])

    # Tile i+1's rows and tile i+2's page ids are requested before tile i is used. (The barriers the dots need
    # drain loads in flight, so this hides less than it could; Triton's own pipelining, tl.range with 3 stages
    # of asynchronous copies, measured 8% slower on the H200.)
    bt_row = block_table_ptr + b * stride_bt
    tile = tl.arange(0, BLOCK_N)
    kv_raw, pe_raw = _rows(
        cache_ptr, _pages(bt_row, start + tile, end, page_size), start + tile, end, page_size, lat, rope, L, R
    )
    pages_next = _pages(bt_row, start + BLOCK_N + tile, end, page_size)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
    for pos0 in range(start, end, BLOCK_N):
        pmask = pos0 + tile < end
        kv = kv_raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        pe = pe_raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        kv_raw, pe_raw = _rows(cache_ptr, pages_next, pos0 + BLOCK_N + tile, end, page_size, lat, rope, L, R)
        pages_next = _pages(bt_row, pos0 + 2 * BLOCK_N + tile, end, page_size)
        scores = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_pe, tl.trans(pe))
        scores = tl.where(pmask[None, :], scores * score_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(tl.float16), kv)
        m = m_new

    nonempty = total > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, total, 1.0)[:, None] * value_scale, 0.0)
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
    part = (b * num_splits + split) * heads + hs
    tl.store(part_out_ptr + part[:, None] * L + lat[None, :], out, mask=hmask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=hmask)


@triton.jit
def merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_out_h,
    stride_out_b,
    heads,
    num_splits,
    L: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    lat = tl.arange(0, L)
    lse = tl.load(part_lse_ptr + (b * num_splits + s) * heads + h, mask=s < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weights = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
    total = tl.sum(weights, axis=0)
    # One split row at a time: a [splits, L] tile of partials would spill at 64 splits.
    acc = tl.zeros([L], dtype=tl.float32)
    for j in range(num_splits):
        lse_j = tl.load(part_lse_ptr + (b * num_splits + j) * heads + h)
        w_j = tl.where(lse_j == float("-inf"), 0.0, tl.exp(lse_j - top))
        acc += w_j * tl.load(part_out_ptr + ((b * num_splits + j) * heads + h) * L + lat)
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + h * stride_out_h + b * stride_out_b + lat, out.to(out_ptr.dtype.element_ty))


def launch_split_kv(
    query: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    part_out: Tensor,
    part_lse: Tensor,
    *,
    kv_lora_rank: int,
    score_scale: float,
    value_scale: float,
) -> None:
    """query [B, H, L+R] uint8; cache [pages, page_size, L+R] 1-byte contiguous; part_out [B, S, H, L] and
    part_lse [B, S, H] FP32; block_table [B, max_pages] with unit last stride; seq_lens [B]."""
    batch, heads, width = query.shape
    num_splits = part_out.shape[1]
    split_kv_kernel[(batch, num_splits, triton.cdiv(heads, BLOCK_H))](
        query,
        cache,
        block_table,
        block_table.stride(0),
        seq_lens,
        part_out,
        part_lse,
        heads,
        num_splits,
        cache.shape[1],
        score_scale,
        value_scale,
        L=kv_lora_rank,
        R=width - kv_lora_rank,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        num_warps=8 if kv_lora_rank >= 256 else 4,
    )


def launch_merge(part_out: Tensor, part_lse: Tensor, out: Tensor) -> None:
    """part_out [B, S, H, L] -> out [H, B, L] (unit last stride)."""
    batch, num_splits, heads, latent = part_out.shape
    merge_kernel[(batch, heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        heads,
        num_splits,
        L=latent,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4,
    )
