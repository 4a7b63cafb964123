"""The KDA input projection on tensor cores for Hopper (sm_90a) in CuTe DSL: out[B, R] = x[B, K] @ W[R, K]^T.

The CUDA-core build (kda_in_proj.py) streams W at 90-99% of the copy bandwidth for B <= 4 but is bound by its FMAs
from B = 8 on (rows x batch x 8 FMAs per 16 bytes of weight). This build does the products with `mma.sync`
m16n8k16 (BF16 x BF16 -> FP32), so an MMA instruction takes 256 weights x 8 batch rows and the inner product costs
a few instructions per 16-byte load at any batch up to 16 (more rows take 32-row passes over W). Semantics are the
CUDA-core build's: every output is an FP32 sum of the K products, rounded once to BF16 (round to nearest even).

Why this design (the plan's numbers: kda_in_proj_mma_plan.py):
- W is the A operand, straight from HBM into the MMA's registers, no shared memory. The dot product may take K in
  any order as long as x and W use the same one, so each lane's A fragment is made of whole 16-byte vectors: for
  a k step of 64 columns, lane (g, t) (g = lane / 4, t = lane % 4) loads columns 8t..8t+7 and 32+8t..32+8t+7 of
  its two rows (g and g + 8 of the tile), and MMA j of the step takes four consecutive of those 16 columns as its
  logical k = 2t, 2t+1, 2t+8, 2t+9. A warp's load instruction then reads 64 contiguous bytes of 8 rows: whole
  32-byte sectors. x (the B operand, 8 batch rows a tile) is loaded the same way, from L2 (and L1: the CTA's
  m-tiles read the same x columns), so the column permutation is the same on both sides.
- One wave, rows spread evenly. CTA c owns ceil(R / SMs) consecutive rows (48 at TP8: 131 CTAs; 25 at TP16: 129),
  so no SM streams more than one row above the average. Its warps are m_tiles x k_splits: warp (m, s) holds the
  rows m, m + m_tiles, ... of the CTA (interleaved, so a CTA whose rows are not a multiple of 16 gives every
  m-tile nearly the same number of real rows) over slice s of K. A lane whose row lies past the CTA's rows loads
  the CTA's last row instead (an L1 hit) and its sums are never stored.
- Loads in flight. Each lane keeps `depth` k steps of W in registers (16 loads of 16 bytes), refilled right after
  a step's MMAs, in a rolled loop over groups of `depth` steps: 12 warps x 32 lanes x 256 bytes = 96 KB per SM at
  TP8, 3x the ~30 KB that the HBM's bandwidth x latency needs. x is held `x_depth` steps ahead (it is nearer).
- Fixed-order sums. The k_splits partials of each output go through shared memory and warp (m, 0) adds them in
  slice order, so results are deterministic and do not depend on scheduling or on the batch (each output column
  of an MMA is summed the same way whatever the other columns hold).
- Programmatic dependent launch. The first `depth` steps of W are issued before `griddepcontrol.wait` (they do not
  depend on the previous kernel); x is read after it, with plain loads (an invariant load could be hoisted above
  the wait). `griddepcontrol.launch_dependents` follows the first x loads.
- Batches above 16 take passes of 32 rows over W (four batch tiles of accumulators and x fragments), with fewer W
  loads in flight to make room (8 per lane at 12 warps, 4 at 14): the K split stays that of 16 rows, and so do a
  row's bits. Each pass after the first reads W again (from HBM: W is larger than the L2).
- x staged in shared memory (plan.x_stages, TP16's one 32-row pass). There the x loads of one step ahead waited
  on L2 (Nsight Compute: L2 and HBM well below their peaks, benchmarks/results/l2-traffic-h200.json), and four
  tiles of x fragments held in registers left room for one step of W. So x goes by cp.async into a ring of 4 k
  steps per K slice, 3 steps ahead without holding registers, and W keeps 2 steps in flight. The slice's warps
  share its ring (each copies its own batch tiles) and meet at a named barrier per step
  (stream_pass_staged). The MMAs and their order are those of the register path: the same bits.
- W staged whole in shared memory (plan.w_smem: o_proj's w_smem_batches and benchmarks/mma_stream_shapes.py; not
  served). Before the wait warp 0's lanes issue one `cp.async.bulk` per row of the CTA into rows padded by 16 bytes
  (so the 8 rows a load instruction reads sit in 8 bank groups), all completing one transaction barrier; after it
  every thread waits on the barrier and the slots are filled from shared memory by the same loads in the same
  order: the same bits, with all of W in flight at once instead of `depth` steps a lane.
- W through a ring in shared memory (plan.w_ring: benchmarks/mma_stream_shapes.py only; not served, not yet timed).
  Every register tiling held one k step of W in flight a lane and streamed at 1.85 TB/s against cuBLAS's 2.67
  (benchmarks/results/mma-stream-shapes-h200.json). Each warp keeps `w_ring` k steps of its 16 rows and K slice in
  flight as bulk copies (lanes 0-15 a row each, 128 bytes), one transaction barrier a stage (start_ring, before the
  wait); a slot is filled from its stage once the stage's barrier has flipped, and right after the warp's MMAs of a
  step its stage takes the step `w_ring` ahead (refill_stage: a proxy fence, the warp meets, lane 0 re-arms), across
  passes too (a stage's place and barrier phase follow the step's index over all passes). The
  warp is its own producer and consumer, so no CTA barrier; the same loads into the same slots, so the same bits.

Measured on one H200 at 28f8360 (tests/k3_decode/kernels/test_kda_in_proj_gpu.py, CUDA-graph replays, W from HBM):
83-87% of the copy bandwidth at TP8 B1-B8 (24.3-25.6 us; cuBLAS 25.1-26.5, the CUDA-core build 35.4 at B8) and
80-86% at TP16 B1-B8 (12.7-13.8 us; cuBLAS 16.0-16.3), within one BF16 rounding of the exact product everywhere.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from k3_decode.kernels.kda_in_proj import compile_args as compile_args  # the same arguments: x, W, out, counter
from k3_decode.kernels.kda_in_proj_mma_plan import STEP, TILE_M, TILE_N, VECTOR, WARP, InProjMmaPlan, MmaStream
from k3_decode.kernels.primitives import bulk_copy, launch_resident, load8, trace_stamp


class KdaInProjKernelMma:
    """out = x @ W^T on tensor cores for one fixed shape (the plan); the arguments of KdaInProjKernel. The name
    extends KdaInProjKernel's so the provider's kernel name (a substring of the CUDA name) covers both builds."""

    def __init__(self, plan: InProjMmaPlan, trace: bool = False) -> None:
        self.plan = plan
        self.trace = trace  # phase stamps (phase_trace.py), as in KdaInProjKernel

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, launches: cute.Tensor, stream: Any):
        plan = self.plan
        launch_resident(
            self.kernel(x, w, out, launches),
            grid=[plan.ctas, 1, 1],
            threads=plan.threads,
            ctas_per_sm=plan.ctas_per_sm,
            stream=stream,
            smem=plan.smem_bytes,
        )

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, launches: cute.Tensor):
        plan = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lanes = lane_rows(plan, cta * plan.rows_per_cta, warp)
        trace_stamp(self.trace, launches, cta, 0, tidx)
        smem = cutlass.memory.SmemAllocator()
        partials = allocate_partials(plan, smem)
        ring = allocate_x_ring(plan, smem)
        slots, xslots = stream_slots(plan)

        # Before the wait: W does not depend on the previous kernel.
        if const_expr(plan.w_smem):
            w_rows, w_bar = stage_w(plan, w, smem, cta * plan.rows_per_cta, tidx, warp)
        elif const_expr(plan.w_ring > 0):
            w_ring = start_ring(plan, w, smem, cta * plan.rows_per_cta, lanes, warp)
        else:
            load_w(plan, w, slots, lanes, Int32(0))
        cute.arch.griddepcontrol_wait()
        trace_stamp(self.trace, launches, cta, 1, tidx)
        if tidx + cta == 0:  # thread 0 of CTA 0 (both non-negative)
            cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")

        if const_expr(plan.w_smem):
            cute.arch.mbarrier_wait(w_bar, 0)  # the CTA's rows of W have landed
            load_w(plan, w_rows, slots, lanes, Int32(0))
            stream_passes(plan, x, w_rows, out, partials, slots, xslots, lanes, warp, ring)
        elif const_expr(plan.w_ring > 0):
            load_w(plan, w_ring, slots, lanes, Int32(0))  # waits for each step's stage
            stream_passes(plan, x, w_ring, out, partials, slots, xslots, lanes, warp, ring)
        else:
            stream_passes(plan, x, w, out, partials, slots, xslots, lanes, warp, ring)
        if const_expr(self.trace):
            cute.arch.sync_threads()  # the end stamp after every warp's last store
            trace_stamp(True, launches, cta, 2, tidx)


class LaneRows(NamedTuple):
    """Where a lane's work lies: its two W rows (g and g + 8 of its m-tile), their CTA-local indices (a row at or
    past `here` reads row `here - 1` instead and its sums are dropped), its first 16-byte vector of its K slice,
    g = lane / 4, t = lane % 4, and its warp's slice."""

    rows: list
    local: list
    here: Int32
    vec0: Int32
    g: Int32
    t: Int32
    lane: Int32
    split: Int32
    m: Int32


@cute.jit
def lane_rows(plan: MmaStream, first: Int32, warp: Int32) -> LaneRows:
    """The lane's rows of the CTA whose rows start at `first`: m-tile m holds rows m, m + m_tiles, ... (interleaved,
    so rows that are not a multiple of 16 leave every m-tile nearly the same number of real rows)."""
    lane = cute.arch.lane_idx()
    m = warp // plan.k_splits
    split = warp % plan.k_splits
    g, t = lane // 4, lane % 4
    here = cutlass.min(Int32(plan.rows_per_cta), Int32(plan.rows) - first)
    local = [(g + 8 * h) * plan.m_tiles + m for h in range(2)]
    rows = [first + cutlass.min(local[h], here - 1) for h in range(2)]
    vec0 = split * (plan.split_steps * STEP // VECTOR) + t
    return LaneRows(rows, local, here, vec0, g, t, lane, split, m)


def allocate_partials(plan: MmaStream, smem: Any) -> cute.Tensor:
    """Shared memory for the K slices' FP32 tiles: [warp x accumulator, lane]."""
    layout = cute.make_layout((plan.warps * plan.partial_floats, WARP), stride=(WARP, 1))
    return smem.allocate_tensor(Float32, layout, byte_alignment=16)


@cute.jit
def stage_w(plan: MmaStream, w: cute.Tensor, smem: Any, first: Int32, tidx: Int32, warp: Int32) -> tuple:
    """(the CTA's rows of W in shared memory, their transaction barrier) for a w_smem plan (stage_rows), in rows
    padded by 16 bytes: a load instruction reads 8 rows at one column, which then fall in 8 bank groups."""
    return stage_rows(w, smem, first, plan.rows_per_cta, plan.rows, plan.w_row_stride, tidx, warp)


@cute.jit
def stage_rows(
    w: cute.Tensor,
    smem: Any,
    first: Int32,
    count: cutlass.Constexpr[int],
    rows: cutlass.Constexpr[int],
    stride: cutlass.Constexpr[int],
    tidx: Int32,
    warp: Int32,
) -> tuple:
    """(rows first .. first + count - 1 of W (of `rows`) in shared memory, `stride` elements apart, their
    transaction barrier): one `cp.async.bulk` per row, issued by warp 0's lanes (lane l copies rows l, l + 32, ...),
    all completing the one barrier, which thread 0 arms with the bytes of the rows that exist (fewer in a last,
    partial CTA). The caller waits on phase 0 of it. Used before griddepcontrol.wait: W does not depend on the
    previous kernel."""
    k = w.shape[1]
    bar = smem.allocate_array(Int64, 1, byte_alignment=8)
    staged = smem.allocate_tensor(BFloat16, cute.make_layout((count, k), stride=(stride, 1)), byte_alignment=128)
    here = cutlass.min(Int32(count), Int32(rows) - first)
    if tidx == 0:
        cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.fence_proxy("async.shared", space="cta")  # the bulk copies complete this barrier
    cute.arch.sync_threads()  # every thread sees the barrier initialized before it waits on it
    if warp == 0:
        lane = cute.arch.lane_idx()
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, here * (k * 2))
        for r in cutlass.range_constexpr(-(-count // WARP)):
            row = lane + r * WARP
            if row < here:
                bulk_copy(staged.iterator + row * stride, w.iterator + (first + row) * k, k * 2, bar)
    return staged, bar


class WRing(NamedTuple):
    """A w_ring plan's W: every warp's `w_ring` stages of 16 rows x one k step in shared memory, [(warp * w_ring +
    stage) * 16 + row, column] with rows padded by 16 bytes, a transaction barrier per stage, and where they are
    filled from: W in global memory and the CTA's first row."""

    stages: cute.Tensor
    bars: Any
    src: cute.Tensor
    first: Int32
    warp: Int32


@cute.jit
def start_ring(plan: MmaStream, w: cute.Tensor, smem: Any, first: Int32, lanes: LaneRows, warp: Int32) -> WRing:
    """Allocate the ring, initialize the warp's barriers and issue its first `w_ring` steps (before
    griddepcontrol.wait: W does not depend on the previous kernel). Warp-local: no CTA barrier."""
    bars = smem.allocate_array(Int64, plan.warps * plan.w_ring, byte_alignment=8)
    layout = cute.make_layout((plan.warps * plan.w_ring * TILE_M, STEP + VECTOR), stride=(STEP + VECTOR, 1))
    stages = smem.allocate_tensor(BFloat16, layout, byte_alignment=128)
    if lanes.lane == 0:
        for i in cutlass.range_constexpr(plan.w_ring):
            cute.arch.mbarrier_init(bars + (warp * plan.w_ring + i), 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.fence_proxy("async.shared", space="cta")  # the bulk copies complete these barriers
    cute.arch.sync_warp()  # the warp's lanes see its barriers initialized before they wait on them
    w_ring = WRing(stages, bars, w, first, warp)
    for i in cutlass.range_constexpr(plan.w_ring):
        fill_stage(plan, w_ring, lanes, Int32(i))
    return w_ring


@cute.jit
def fill_stage(plan: MmaStream, w_ring: WRing, lanes: LaneRows, seq: Int32):
    """The warp's `seq`-th k step over all passes (step seq % split_steps of its K slice, every pass streaming the
    slice again) into its stage seq % w_ring: lane r < 16 copies row r of the m-tile (the CTA's last row where r
    lies past them, so every stage takes 16 x 128 bytes), lane 0 arming the stage's barrier with those bytes."""
    stage = w_ring.warp * plan.w_ring + seq % plan.w_ring
    bar = w_ring.bars + stage
    if lanes.lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(bar, TILE_M * STEP * 2)
    if lanes.lane < TILE_M:
        local = lanes.lane * plan.m_tiles + lanes.m
        row = w_ring.first + cutlass.min(local, lanes.here - 1)
        step = seq
        if const_expr(len(plan.passes) > 1):  # one pass needs no modulo (it spilled 8 bytes at TP8 B64)
            step = seq % plan.split_steps
        col = lanes.split * (plan.split_steps * STEP) + step * STEP
        dst = w_ring.stages.iterator + (stage * TILE_M + lanes.lane) * (STEP + VECTOR)
        bulk_copy(dst, w_ring.src.iterator + row * plan.k + col, STEP * 2, bar)


@cute.jit
def refill_stage(plan: MmaStream, w_ring: WRing, lanes: LaneRows, seq: Int32):
    """After the warp's MMAs of its `seq`-th k step: its stage takes the step w_ring ahead, where the passes have
    one (the next pass's first steps stream while this one ends). Every lane's reads of the stage are done (its MMAs
    consumed them); the proxy fence orders them before the copy engine's writes, and the warp meets before lane 0
    re-arms the barrier."""
    if seq + plan.w_ring < len(plan.passes) * plan.split_steps:
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        fill_stage(plan, w_ring, lanes, seq + plan.w_ring)


def allocate_x_ring(plan: MmaStream, smem: Any) -> cute.Tensor | None:
    """Where x is staged by cp.async ahead of the MMAs (plan.x_stages > 0), else None: per warp, stage, batch tile
    and vector, each lane's own 16 bytes, [((slice * stages + stage) * tiles + tile) * 2 + v) * 32 + lane, 8]: the
    warps of one K slice share it (stream_pass_staged says how they take turns)."""
    if const_expr(plan.x_stages == 0):
        return None
    layout = cute.make_layout((plan.x_ring_vectors, VECTOR), stride=(VECTOR, 1))
    return smem.allocate_tensor(BFloat16, layout, byte_alignment=16)


def stream_slots(plan: MmaStream) -> tuple[list, list]:
    """The register slots: W slot j holds k step group * depth + j as [row h][vector v] of 8 BF16; x slot j one
    step of every batch tile (one slot when x is staged in shared memory: the step being multiplied). Constant
    indices only touch them, so they live in registers."""
    slots = [
        [[cute.make_rmem_tensor((VECTOR,), BFloat16) for _ in range(2)] for _ in range(2)] for _ in range(plan.depth)
    ]
    xslots = [
        [[cute.make_rmem_tensor((VECTOR,), BFloat16) for _ in range(2)] for _ in range(plan.n_tiles)]
        for _ in range(plan.x_depth if plan.x_stages == 0 else 1)
    ]
    return slots, xslots


@cute.jit
def stream_passes(
    plan: MmaStream,
    x: cute.Tensor,
    w: cute.Tensor,
    out: cute.Tensor,
    partials: cute.Tensor,
    slots: list,
    xslots: list,
    lanes: LaneRows,
    warp: Int32,
    ring: cute.Tensor | None = None,
):
    """out = x @ W^T for every batch row, a pass per `plan.passes` entry, with group 0 of W already in the slots.
    Each later pass reads the CTA's rows of W again, from L2 by then. `ring`: allocate_x_ring's, where x is staged
    in shared memory."""
    start = 0
    for p, count in enumerate(plan.passes):
        if const_expr(p > 0):
            cute.arch.sync_threads()  # the previous pass's partials are read
            load_w(plan, w, slots, lanes, Int32(0), p * plan.split_steps)
        if const_expr(plan.x_stages > 0):
            stream_pass_staged(plan, x, w, out, partials, slots, xslots[0], ring, lanes, warp, start, count, p == 0)
        else:
            stream_pass(plan, x, w, out, partials, slots, xslots, lanes, warp, start, count, p == 0, p)
        start += count


def pass_setup(plan: MmaStream, lanes: LaneRows, start: int, count: int) -> tuple[Any, int, list]:
    """(the MMA atom, the pass's batch tiles, the lane's batch row in each: row g of the tile, clamped to the
    batch's last row so a ragged tile reads a real row and its sums are never stored)."""
    mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
    tiles = -(-count // TILE_N)
    xrows = [cutlass.min(Int32(start + TILE_N * i) + lanes.g, Int32(plan.batch - 1)) for i in range(tiles)]
    return mma, tiles, xrows


def zeroed_accumulators(tiles: int) -> list:
    """One m16n8 FP32 accumulator tile (4 per lane) per batch tile, zeroed."""
    acc = [cute.make_rmem_tensor((4, 1, 1), Float32) for _ in range(tiles)]
    for i in range(tiles):
        acc[i].fill(0.0)
    return acc


@cute.jit
def mma_step(mma: Any, acc: list, slot: list, xs: list, first: cutlass.Constexpr[int], end: cutlass.Constexpr[int]):
    """MMAs first..end-1 of a k step (of 4: 16 columns each) of the lane's W slot against every batch tile's x."""
    for q in cutlass.range_constexpr(first, end):
        a = _a_fragment(slot, q)
        for i in cutlass.range_constexpr(len(acc)):
            cute.gemm(mma, acc[i], a, _b_fragment(xs[i], q), acc[i])


@cute.jit
def stream_pass(
    plan: MmaStream,
    x: cute.Tensor,
    w: cute.Tensor,
    out: cute.Tensor,
    partials: cute.Tensor,
    slots: list,
    xslots: list,
    lanes: LaneRows,
    warp: Int32,
    start: cutlass.Constexpr[int],
    count: cutlass.Constexpr[int],
    is_first: cutlass.Constexpr[bool],
    pass_index: cutlass.Constexpr[int] = 0,
):
    """out[start .. start + count - 1, the CTA's rows] = x @ W^T, with group 0 of W already in the slots. After
    the griddepcontrol.wait: x is the previous kernel's output."""
    mma, tiles, xrows = pass_setup(plan, lanes, start, count)
    for j in cutlass.range_constexpr(plan.x_depth):
        load_x(plan, x, xslots[j], xrows, lanes.vec0, Int32(j))
    if const_expr(is_first):
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel's wait still covers all of this grid

    acc = zeroed_accumulators(tiles)
    for grp in cutlass.range(plan.groups, unroll=1):
        for j in cutlass.range_constexpr(plan.depth):
            step = grp * plan.depth + j
            xs = xslots[j % plan.x_depth]
            mma_step(mma, acc, slots[j], xs, 0, 4)
            if const_expr(plan.w_ring > 0):
                # w is the WRing: the stage just consumed streams on
                refill_stage(plan, w, lanes, pass_index * plan.split_steps + step)
            if grp + 1 < plan.groups:  # refill the slot just used: W runs `depth` steps ahead
                load_w(plan, w, [slots[j]], lanes, step + plan.depth, pass_index * plan.split_steps)
            if step + plan.x_depth < plan.split_steps:
                load_x(plan, x, xs, xrows, lanes.vec0, step + plan.x_depth)

    sum_slices(plan, out, partials, acc, lanes, warp, start, count)


@cute.jit
def sum_slices(
    plan: MmaStream,
    out: cute.Tensor,
    partials: cute.Tensor,
    acc: list,
    lanes: LaneRows,
    warp: Int32,
    start: cutlass.Constexpr[int],
    count: cutlass.Constexpr[int],
):
    """The pass's outputs from every warp's accumulators: each parks its tile in shared memory, warp (m, 0) adds the
    slices 0, 1, ... in order (deterministic, the same for every batch) and stores the BF16 sums."""
    tiles = len(acc)
    t, lane = lanes.t, lanes.lane
    base = warp * plan.partial_floats
    for i in cutlass.range_constexpr(tiles):
        for c in cutlass.range_constexpr(4):
            partials[base + 4 * i + c, lane] = acc[i][c, 0, 0]
    cute.arch.sync_threads()
    if lanes.split == 0:
        for i in cutlass.range_constexpr(tiles):
            for c in cutlass.range_constexpr(4):
                total = partials[base + 4 * i + c, lane]
                for s in cutlass.range_constexpr(1, plan.k_splits):
                    total = total + partials[(warp + s) * plan.partial_floats + 4 * i + c, lane]
                # c0, c1: row g, batch columns 2t and 2t + 1; c2, c3: row g + 8, the same columns.
                b = TILE_N * i + 2 * t + c % 2
                h = c // 2
                if b < count and lanes.local[h] < lanes.here:
                    out[start + b, lanes.rows[h]] = total.to(BFloat16)


@cute.jit
def stream_pass_staged(
    plan: MmaStream,
    x: cute.Tensor,
    w: cute.Tensor,
    out: cute.Tensor,
    partials: cute.Tensor,
    slots: list,
    xs: list,
    ring: cute.Tensor,
    lanes: LaneRows,
    warp: Int32,
    start: cutlass.Constexpr[int],
    count: cutlass.Constexpr[int],
    is_first: cutlass.Constexpr[bool],
):
    """stream_pass with x staged in shared memory by cp.async, `x_stages - 1` k steps ahead of the MMAs, in flight
    without holding registers. The m_tiles warps of one K slice share their slice's ring: warp (m, s) copies the
    batch tiles i with i % m_tiles == m, and all of them read every tile. Stage t % x_stages holds step t. At step
    t a lane waits for its own copies of step t, the slice's warps meet at their named barrier (their copies of
    step t are then visible to each other, and every read of step t - 1 is done), step t + x_stages - 1 is copied
    into the stage step t - 1 used and committed as one group (empty past the slice, so the count stays uniform),
    and step t is read back one 16-byte vector of every tile at a time (each feeds two of the step's four MMAs)."""
    mma, tiles, xrows = pass_setup(plan, lanes, start, count)
    for s in cutlass.range_constexpr(plan.x_stages - 1):
        if const_expr(s < plan.split_steps):
            copy_x(plan, x, ring, xrows, lanes, Int32(s), Int32(s))
        cute.arch.cp_async_commit_group()
    if const_expr(is_first):
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel's wait still covers all of this grid

    acc = zeroed_accumulators(tiles)
    for grp in cutlass.range(plan.groups, unroll=1):
        for j in cutlass.range_constexpr(plan.depth):
            step = grp * plan.depth + j
            cute.arch.cp_async_wait_group(plan.x_stages - 2)  # this lane's copies of `step` have landed
            slice_barrier(plan, lanes)
            ahead = step + (plan.x_stages - 1)
            if ahead < plan.split_steps:
                copy_x(plan, x, ring, xrows, lanes, ahead, ahead % plan.x_stages)
            cute.arch.cp_async_commit_group()
            stage = step % plan.x_stages
            for v in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(tiles):
                    load8(ring[_ring_vector(plan, lanes, stage, i, v), None], Int32(0), xs[i][v])
                mma_step(mma, acc, slots[j], xs, 2 * v, 2 * v + 2)
            if grp + 1 < plan.groups:  # refill the slot just used: W runs `depth` steps ahead
                load_w(plan, w, [slots[j]], lanes, step + plan.depth)
    cute.arch.cp_async_wait_group(0)  # nothing of this pass is in flight into the ring when the next one starts
    slice_barrier(plan, lanes)  # nor does any warp of the slice still read it
    sum_slices(plan, out, partials, acc, lanes, warp, start, count)


@cute.jit
def slice_barrier(plan: MmaStream, lanes: LaneRows):
    """The named barrier of the lane's K slice (id 1 + slice: 0 is the CTA's), over its m_tiles warps."""
    if const_expr(plan.m_tiles > 1):
        cute.arch.barrier(barrier_id=lanes.split + 1, number_of_threads=plan.m_tiles * WARP)


@cute.jit
def copy_x(plan: MmaStream, x: cute.Tensor, ring: cute.Tensor, xrows: list, lanes: LaneRows, step: Int32,
           stage: Int32):  # fmt: skip
    """cp.async of k step `step` of the lane's batch row of this warp's tiles into `stage` of its slice's ring."""
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=128)
    for i in cutlass.range_constexpr(len(xrows)):
        if lanes.m == i % plan.m_tiles:  # warp-uniform: this warp copies tile i
            for v in cutlass.range_constexpr(2):
                col = lanes.vec0 + step * (STEP // VECTOR) + 4 * v
                src = cute.local_tile(x[xrows[i], None], (VECTOR,), (col,))
                cute.copy(atom, src, ring[_ring_vector(plan, lanes, stage, i, v), None])


@cute.jit
def _ring_vector(plan: MmaStream, lanes: LaneRows, stage: Int32, tile: int, v: int) -> Int32:
    return (((lanes.split * plan.x_stages + stage) * plan.n_tiles + tile) * 2 + v) * WARP + lanes.lane


@cute.jit
def load_w(
    plan: MmaStream, w: cute.Tensor, slots: list, lanes: LaneRows, step: Int32, seq0: cutlass.Constexpr[int] = 0
):
    """k steps step, step + 1, ... of the lane's two rows into the given slots (one step each). For a w_smem plan `w`
    is the CTA's rows in shared memory (stage_w), indexed by the rows' place in the CTA; for a w_ring plan the
    WRing, `seq0` the pass's first k step over all passes (its stages and barrier phases run on across passes)."""
    if const_expr(plan.w_ring > 0):  # w is the WRing: each step from its stage, once its copies have landed
        for j in cutlass.range_constexpr(len(slots)):
            s = seq0 + step + j
            stage = w.warp * plan.w_ring + s % plan.w_ring
            cute.arch.mbarrier_wait(w.bars + stage, (s // plan.w_ring) % 2)
            for h in cutlass.range_constexpr(2):
                for v in cutlass.range_constexpr(2):
                    load8(w.stages[stage * TILE_M + lanes.g + 8 * h, None], lanes.t + 4 * v, slots[j][h][v])
    else:
        for j in cutlass.range_constexpr(len(slots)):
            for h in cutlass.range_constexpr(2):
                row = lanes.rows[h]
                if const_expr(plan.w_smem):
                    row = cutlass.min(lanes.local[h], lanes.here - 1)
                for v in cutlass.range_constexpr(2):
                    load8(w[row, None], lanes.vec0 + (step + j) * (STEP // VECTOR) + 4 * v, slots[j][h][v])


@cute.jit
def load_x(plan: MmaStream, x: cute.Tensor, xs: list, xrows: list, vec0: Int32, step: Int32):
    """k step `step` of the lane's batch row of every batch tile."""
    for i in cutlass.range_constexpr(len(xrows)):
        for v in cutlass.range_constexpr(2):
            load8(x[xrows[i], None], vec0 + step * (STEP // VECTOR) + 4 * v, xs[i][v])


@cute.jit
def _a_fragment(slot: list, q: cutlass.Constexpr[int]) -> cute.Tensor:
    """MMA q's A registers (a0..a7 of m16n8k16): columns 4q'..4q'+3 of vector q // 2 (q' = q % 2) of rows g and
    g + 8, as logical k = 2t, 2t + 1 (a0, a1 / a2, a3) and 2t + 8, 2t + 9 (a4, a5 / a6, a7)."""
    frag = cute.make_rmem_tensor((8, 1, 1), BFloat16)
    v, e = q // 2, 4 * (q % 2)
    for half in cutlass.range_constexpr(2):
        for h in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(2):
                frag[4 * half + 2 * h + i, 0, 0] = slot[h][v][e + 2 * half + i]
    return frag


@cute.jit
def _b_fragment(xs: list, q: cutlass.Constexpr[int]) -> cute.Tensor:
    """MMA q's B registers (b0..b3): the same four columns of the lane's batch row, as k = 2t, 2t + 1, 2t + 8,
    2t + 9."""
    frag = cute.make_rmem_tensor((4, 1, 1), BFloat16)
    v, e = q // 2, 4 * (q % 2)
    for i in cutlass.range_constexpr(4):
        frag[i, 0, 0] = xs[v][e + i]
    return frag
