"""Two-shot BF16 all-reduce over peer memory, with optional epilogues, as Triton kernels (one program per row).

The rule is the oracle's (k3_decode.reference.allreduce, after vLLM 0.33.0's specialized decode): rank o owns the
columns [o*C, (o+1)*C) with C = width / world. One launch per call, on every rank:

1. push: the program of row t stores its BF16 partial of each owner's chunk (-0.0 made +0.0) into that owner's
   slot for this rank, in the owner's memory (peer stores over NVLink);
2. barrier A for row t;
3. reduce: the owner widens its `world` slots to FP32, adds them in rank order 0, 1, ..., rounds once to BF16 and
   stores the chunk into every rank's gather row (peer stores again);
4. barrier B for row t;
5. epilogue on the full gathered row, local reads only: a copy, the latent RMSNorm (the same row body as the stock
   norm, k3_decode.stock.triton_moe.elementwise.rms_norm_row), or the whole AttnRes application after attention
   with the reduced o_proj output as its delta (k3_decode.stock.triton_kernels.attn_res.attn_res_row).

No multicast is used: every remote access is an ordinary store or atomic through a peer pointer of the symmetric
buffer. A barrier is per row: the program of row t signals the same row's pad slot on every peer (a CAS 0 -> 1
with release semantics at system scope, retried while the previous signal is still unconsumed) and then consumes
its own slots (CAS 1 -> 0 with acquire semantics). Triton performs a scalar atomic once per program and broadcasts
its result, and a CTA barrier before the signal orders every thread's stores before it. Two consecutive calls
cannot overlap on a buffer: a rank leaves barrier B only once every peer has reduced, and enters the next call's
reduce only once every peer has finished the previous epilogue (barrier A of the next call).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3_decode.stock.triton_kernels.attn_res import attn_res_row
from k3_decode.stock.triton_moe.common import bf16_rne
from k3_decode.stock.triton_moe.elementwise import rms_norm_row

EPILOGUE_COPY = 0
EPILOGUE_RMS_NORM = 1


@triton.jit
def _peer(table, rank, ELEM: tl.constexpr):
    """The peer pointer `table[rank]` (an int64 device address) as a pointer to ELEM."""
    return tl.load(table + rank).to(tl.pointer_type(ELEM))


@triton.jit
def _row_barrier(pad_table, row, max_rows, PHASE: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr):
    tl.debug_barrier()  # every thread's stores of this phase precede the release below
    base = (PHASE * max_rows + row) * WORLD
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            pad = _peer(pad_table, peer, tl.int32)
            while tl.atomic_cas(pad + base + RANK, 0, 1, sem="release", scope="sys") != 0:
                pass
    own = _peer(pad_table, RANK, tl.int32)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_cas(own + base + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # no thread reads peer data before the acquire above


@triton.jit
def _push_reduce_gather(
    x_row,
    slot_table,
    gather_table,
    pad_table,
    row,
    width,
    max_rows,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Phases 1-4 for one row; afterwards this rank's gather row `row` holds the reduced row."""
    cols = tl.arange(0, BLOCK_C)
    ok = cols < CHUNK
    for owner in tl.static_range(WORLD):
        v = tl.load(x_row + owner * CHUNK + cols, mask=ok, other=0.0)
        v = tl.where(v == 0, 0.0, v.to(tl.float32)).to(tl.bfloat16)  # -0.0 -> +0.0, every other value exact
        slots = _peer(slot_table, owner, tl.bfloat16)
        tl.store(slots + (RANK * max_rows + row) * CHUNK + cols, v, mask=ok)
    _row_barrier(pad_table, row, max_rows, 0, RANK, WORLD)
    own = _peer(slot_table, RANK, tl.bfloat16)
    acc = tl.load(own + row * CHUNK + cols, mask=ok, other=0.0).to(tl.float32)
    for src in tl.static_range(1, WORLD):
        acc += tl.load(own + (src * max_rows + row) * CHUNK + cols, mask=ok, other=0.0).to(tl.float32)
    reduced = bf16_rne(acc)
    reduced = tl.where(reduced == 0, 0.0, reduced.to(tl.float32)).to(tl.bfloat16)  # a sum rounding to -0.0 too
    for dst in tl.static_range(WORLD):
        gather = _peer(gather_table, dst, tl.bfloat16)
        tl.store(gather + row * width + RANK * CHUNK + cols, reduced, mask=ok)
    _row_barrier(pad_table, row, max_rows, 1, RANK, WORLD)


@triton.jit
def two_shot_kernel(
    x_ptr,
    stride_x,
    out_ptr,
    stride_out,
    norm_ptr,
    slot_table,
    gather_table,
    pad_table,
    width,
    max_rows,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    EPILOGUE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    _push_reduce_gather(
        x_ptr + row * stride_x, slot_table, gather_table, pad_table, row, width, max_rows, RANK, WORLD, CHUNK, BLOCK_C
    )
    gathered = _peer(gather_table, RANK, tl.bfloat16) + row * width
    if EPILOGUE == 1:
        rms_norm_row(gathered, norm_ptr, out_ptr + row * stride_out, width, eps, BLOCK_W)
    else:
        cols = tl.arange(0, BLOCK_W)
        ok = cols < width
        tl.store(out_ptr + row * stride_out + cols, tl.load(gathered + cols, mask=ok), mask=ok)


@triton.jit
def two_shot_attn_res_kernel(
    x_ptr,
    stride_x,
    slot_table,
    gather_table,
    pad_table,
    width,
    max_rows,
    prefix_ptr,
    blocks_ptr,
    out_ptr,
    scratch_ptr,
    res_norm_ptr,
    res_proj_ptr,
    out_norm_ptr,
    num_blocks,
    stride_prefix,
    stride_blocks_t,
    stride_blocks_s,
    stride_out,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    RESTART: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    """The o_proj all-reduce and the AttnRes application after attention that consumes it, in one launch."""
    row = tl.program_id(0).to(tl.int64)
    _push_reduce_gather(
        x_ptr + row * stride_x, slot_table, gather_table, pad_table, row, width, max_rows, RANK, WORLD, CHUNK, BLOCK_C
    )
    attn_res_row(
        row,
        prefix_ptr,
        _peer(gather_table, RANK, tl.bfloat16) + row * width,
        blocks_ptr,
        out_ptr,
        scratch_ptr,
        res_norm_ptr,
        res_proj_ptr,
        out_norm_ptr,
        width,
        num_blocks,
        -1,
        stride_prefix,
        stride_blocks_t,
        stride_blocks_s,
        stride_out,
        eps,
        True,
        RESTART,
        False,
        HAS_OUT_NORM,
        BLOCK_S,
        BLOCK_H,
        BLOCK_O,
    )


def block_c(chunk: int) -> int:
    return triton.next_power_of_2(chunk)


def block_w(width: int) -> int:
    return triton.next_power_of_2(width)
