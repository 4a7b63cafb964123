"""Split-KV MLA decode attention over the paged FP8 E4M3 latent cache, in Triton: one split kernel and one merge.

The stand-in for the backend vLLM 0.33.0 picks for head size 576 on an H200 (FlashInfer trtllm-gen and the
tokenspeed core are SM100-only there; FlashMLA-class kernels stream the cache near HBM bandwidth): a split-KV
decode that writes per-split partial outputs with their log-sum-exp, then a merge launch. Math as the oracle
(k3_decode.reference.mla.attend / merge_partials):

- split j of request b covers tiles [j*c, (j+1)*c) of the cdiv(seq_len[b], BLOCK_N) tiles of its context, with
  c = cdiv(tiles, S) (in positions: cdiv(seq_len, S) rounded up to BLOCK_N, as before); an empty split writes
  out = 0, lse = -inf.
- scores = (q_fp8 . row_fp8) * q_scale * k_scale * softmax_scale over the 576-wide rows (latent | rope), online
  softmax in FP32 base e; values = the latent part of the rows times k_scale. FP8 -> FP16 is exact, so the score
  dots (FP16 operands, FP32 accumulation) are exact products; the probabilities are rounded to FP16 for the value
  dot, as flash-decoding kernels do. (FP16 rather than BF16 operands: the same exact products, a finer rounding of
  the probabilities, and Triton's CPU interpreter, which the CPU tests use, computes BF16 dots wrong.)
- merge: lse = logsumexp_j lse_j, out = sum_j exp(lse_j - lse) out_j, written BF16 as [H, B, L] (the layout the
  W_UV bmm reads); all-empty rows give 0. The sum runs over the splits in a fixed order (chunks of BLOCK_S splits
  in index order, each chunk summed by the same compiled reduction tree), so a step is bit-reproducible; no
  atomics anywhere.

Why the first version read the cache at 14-17 % of the HBM roofline at B8/B64 and cost 35 us at B1 (H200, 4096
tokens of context, measured in docs/stock-h200.md; SASS of that kernel compiled for sm_90 with Triton 3.6):

- Grid and tiles. One program per (request, split) held all 12 (TP8) or 6 (TP16) heads as a 16-row block, so a
  cache row was read once for all heads (MQA-style) -- that part was right. But its tiles were 32 positions
  (18 KB) at 8 warps, 171-175 registers and 88 KB of shared memory: one program per SM, 18 KB in flight per SM
  where Little's law at ~4.15 TB/s and ~1-2 us of loaded latency asks for 40-60 KB. The split policy (two
  programs per SM, >= 128 positions per split) gave B64 5 splits = 320 programs: 3 waves (132, 132, 56) of
  one-per-SM programs, each 26 tiles long.
- Compute per tile. With heads as the MMA's M (16) and 32 positions spread over 8 warps, each warp ran the score
  dot as one chain of 36 dependent mma.sync (K = 576 in steps of 16), some warps duplicating others' columns;
  the softmax reductions crossed warps through shared memory (7 barriers per tile); the value dot needed the FP8
  tile transposed, so Triton converted it twice (two FP8 -> FP16 conversions per byte, two shared-memory round
  trips). About 980 SASS instructions per warp per tile (~2000 issue cycles per SM) in serial chains: the
  measured 275 us for 3 x 26 tiles is ~3.5 us (~6500 cycles) per 18 KB tile, under 3 B/cycle per SM where the
  roofline allows ~16. Latency, not bandwidth, bounded it.
- B1. 4096 positions at >= 128 per split gave 32 programs for 132 SMs, each a serial chain of 4 such tiles
  (~14-28 us), then a merge whose one program per (request, head) walked the splits one 2 KB row at a time.

This version (the design FlashMLA and FlashDecoding use on Hopper: stream the latent once, all heads per CTA,
tensor cores over [tokens x heads], fixed split count, LSE merge):

- 128-position tiles (74 KB of FP8 rows) at 8 warps. The scores are computed swapped, S^T[tokens, heads] =
  rows[tokens, 576] @ q^T[576, heads], and the values as O^T[512, heads] += rows[:, :512]^T @ P^T[tokens, heads],
  so both are wgmma with M = 128 / 512 (two warpgroups of 64 rows, no duplicated work) and N = 16 heads; the
  rows are converted FP8 -> FP16 once, in registers, stored once to a 128-byte-swizzled shared tile, and both
  wgmma read that tile (the value dot through its transposed view), q^T and P^T from shared memory too.
- Explicit prefetch: tile t+1's rows (74 KB, in registers) and tile t+2's page ids are requested while tile t
  is computed; the converted tile is the loop-carried value, which also keeps Triton from re-deriving the
  conversion inside each dot's operand load (it then loads 2-byte operand pairs from an FP8 shared copy and
  converts every byte twice). No Triton software pipelining (num_stages = 1): its cp.async copies would need a
  second 74 KB buffer on top of the 162 KB the FP16 tile, q and P take.
- Per 128 positions per thread (8 warps): 18 16-byte row loads and 18 page-id loads, 144 conversions (two bytes
  each), 36 16-byte shared stores; per warp 68 wgmma and ~1250 SASS instructions in all (Triton 3.6, the H200's:
  ~2500 issue cycles per SM against ~4600 cycles of HBM time for the 74 KB tile); 255 registers, no spills
  (Triton 3.9: 24-32 bytes, 6-7 local accesses per tile); one CTA per SM. test_attention_kernels_compile.py
  checks all of it. The shared-memory traffic per tile (store 147 KB, score wgmma 147 KB + q, value wgmma
  128 KB + P: ~490 KB, ~3800 cycles at 128 B/cycle) is the next limit. The page size is a compile-time
  constant, so row addressing is shifts and masks.
- Split policy (k3_decode.stock.mla.choose_num_splits): one CTA per SM, so S = SMs // (B x head blocks) splits
  of whole tiles, capped by the tiles and by 64: B1 at 4096 tokens 32 CTAs of one tile, B8 16 splits (128
  CTAs of 2 tiles), B64 2 splits (128 CTAs of 16 tiles): one wave each.
- Merge: one program per (request, head, latent chunk), the chunk sized so the grid has ~2 programs per SM;
  each program reads its chunk of up to BLOCK_S splits at once ([BLOCK_S, BLOCK_L] loads), so B1's 32 partials
  are one round of loads, not 32.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 128  # positions per tile: two wgmma warpgroups of 64 rows for the scores
BLOCK_H = 16  # heads per program: the smallest N Triton 3.6 keeps on wgmma; 12 (TP8) and 6 (TP16) heads are masked
NUM_WARPS = 8
H200_SMS = 132
MERGE_ELEMENTS = 4096  # a merge program's [splits, latent] chunk: 32 FP32 registers per thread at 4 warps


@triton.jit
def _fp16(raw):
    """uint8 E4M3 bits -> FP16 values (exact)."""
    return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _pages(block_table_row, tile, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical page of each position of a tile (0 at and past `end`: never dereferenced unmasked)."""
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(block_table_row + pos // PAGE, mask=pos < end, other=0)


@triton.jit
def _rows(cache_ptr, pages, tile, end, PAGE: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """The raw E4M3 bytes of a tile's cache rows, latent [BLOCK_N, L] and rope [BLOCK_N, R]; 0 at and past `end`."""
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (pos < end)[:, None]
    row = cache_ptr + (pages.to(tl.int64) * PAGE + pos % PAGE)[:, None] * (L + R)
    kv = tl.load(row + tl.arange(0, L)[None, :], mask=live, other=0)
    pe = tl.load(row + L + tl.arange(0, R)[None, :], mask=live, other=0)
    return kv, pe


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
    score_scale,
    value_scale,
    PAGE: tl.constexpr,
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

    n = tl.load(seq_lens_ptr + b)
    tiles = tl.cdiv(n, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    t0 = split * per_split
    t1 = tl.minimum(tiles, t0 + per_split)
    end = tl.minimum(n, t1 * BLOCK_N)  # positions of this split: [t0 * BLOCK_N, end)

    # All heads' queries once, transposed: the N operand of both dots, read from shared memory by every wgmma.
    q_row = query_ptr + (b * heads + hs)[:, None] * (L + R)
    q_lat = tl.trans(_fp16(tl.load(q_row + lat[None, :], mask=hmask[:, None], other=0)))
    q_pe = tl.trans(_fp16(tl.load(q_row + L + rope[None, :], mask=hmask[:, None], other=0)))

    bt_row = block_table_ptr + b * stride_bt
    tile = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([L, BLOCK_H], dtype=tl.float32)  # O^T: latent x heads
    kv_raw, pe_raw = _rows(cache_ptr, _pages(bt_row, t0, end, PAGE, BLOCK_N), t0, end, PAGE, L, R, BLOCK_N)
    pages = _pages(bt_row, t0 + 1, end, PAGE, BLOCK_N)
    kv = _fp16(kv_raw)
    pe = _fp16(pe_raw)
    for t in tl.range(t0, t1, num_stages=1):
        kv_t = kv
        pe_t = pe
        scores = tl.dot(kv_t, q_lat)
        scores = tl.dot(pe_t, q_pe, scores)
        # Requested while this tile is computed: the next tile's rows (page ids from the previous iteration) and
        # the page ids of the one after. Both stop at the split's end, so no split reads its neighbour's rows.
        kv_raw, pe_raw = _rows(cache_ptr, pages, t + 1, end, PAGE, L, R, BLOCK_N)
        pages = _pages(bt_row, t + 2, end, PAGE, BLOCK_N)
        scores = tl.where((t * BLOCK_N + tile < end)[:, None], scores * score_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        rescale = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[None, :])
        total = total * rescale + tl.sum(p, axis=0)
        acc = tl.dot(tl.trans(kv_t), p.to(tl.float16), acc * rescale[None, :])
        m = m_new
        kv = _fp16(kv_raw)
        pe = _fp16(pe_raw)

    nonempty = total > 0.0
    inv = tl.where(nonempty, value_scale / tl.where(nonempty, total, 1.0), 0.0)
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
    part = (b * num_splits + split) * heads + hs
    tl.store(part_out_ptr + part[None, :] * L + lat[:, None], acc * inv[None, :], mask=hmask[None, :])
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
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    s = tl.arange(0, BLOCK_S)
    lse_row = part_lse_ptr + b * num_splits * heads + h
    top = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        top = tl.maximum(top, tl.load(lse_row + (s0 + s) * heads, mask=s0 + s < num_splits, other=float("-inf")))
    best = tl.max(top, axis=0)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_L], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        live = s0 + s < num_splits
        lse = tl.load(lse_row + (s0 + s) * heads, mask=live, other=float("-inf"))
        w = tl.exp(tl.where(lse == float("-inf"), float("-inf"), lse - best))  # empty splits weigh 0, no NaN
        rows = part_out_ptr + ((b * num_splits + s0 + s) * heads + h)[:, None] * L + cols[None, :]
        acc += w[:, None] * tl.load(rows, mask=live[:, None], other=0.0)
        total += w
    denom = tl.sum(total, axis=0)
    out = tl.sum(acc, axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + h * stride_out_h + b * stride_out_b + cols, out.to(out_ptr.dtype.element_ty))


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
        score_scale,
        value_scale,
        PAGE=cache.shape[1],
        L=kv_lora_rank,
        R=width - kv_lora_rank,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        num_warps=NUM_WARPS,
        num_stages=1,
    )


def merge_blocks(batch: int, heads: int, num_splits: int, latent: int, num_sms: int = H200_SMS) -> tuple[int, int]:
    """(BLOCK_L, BLOCK_S) of the merge: latent chunks small enough for ~2 programs per SM (at least 64 wide), and
    as many splits per load as fit MERGE_ELEMENTS."""
    block_l = latent
    while block_l > 64 and batch * heads * (latent // block_l) < 2 * num_sms:
        block_l //= 2
    block_s = max(2, min(triton.next_power_of_2(num_splits), max(2, MERGE_ELEMENTS // block_l)))
    return block_l, block_s


def launch_merge(part_out: Tensor, part_lse: Tensor, out: Tensor) -> None:
    """part_out [B, S, H, L] -> out [H, B, L] (unit last stride)."""
    batch, num_splits, heads, latent = part_out.shape
    block_l, block_s = merge_blocks(batch, heads, num_splits, latent)
    merge_kernel[(batch, heads, latent // block_l)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        heads,
        num_splits,
        L=latent,
        BLOCK_L=block_l,
        BLOCK_S=block_s,
        num_warps=4,
    )
