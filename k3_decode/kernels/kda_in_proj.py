"""The KDA input projection for Hopper (sm_90a) in CuTe DSL: out[B, R] = x[B, K] @ W[R, K]^T, BF16 in and out.

Compiled for sm_90a on the CPU with its PTX and SASS checked by `k3gate kernels build`; on an H200 it is within one
BF16 rounding of the exact product at every shape CI builds (tests/k3_decode/kernels/test_kda_in_proj_gpu.py). In
CUDA-graph replays it streams the TP8 weight at 90-97% of the copy bandwidth for B <= 4 (cuBLAS: 82-85%) but falls
behind cuBLAS from B = 8 on, where its CUDA-core FMAs, not the weight stream, bound it; so as the `in_proj` provider
(providers.py) it serves only the rows providers.toml lists. A tensor-core (mma) inner product is the next step.

Semantics: `torch.nn.functional.linear(x, W)` for BF16 x and W: every output is an FP32 sum of the K products,
rounded once to BF16 (round to nearest even). Only the summation order differs from cuBLAS, so the two agree
within one BF16 rounding of the FP32 sum plus the FP32 accumulation error (the GPU test states the bound).

Why this design. At decode, B = 1..8 rows meet K = 7168 and R = 6288 (TP8) or 3216 (TP16) weight rows, so the
kernel moves R * K * 2 bytes of weight (90 MB at TP8, 46 MB at TP16) for at most 2 * 8 * R * K FLOPs: about
8 FLOPs per byte at B = 8, far under an H200's ridge point of roughly 15 (CUDA-core FP32) to 200 (tensor core)
FLOPs per byte. The time is the time to stream W once, 90 MB / ~4.3 TB/s = ~21 us at TP8 B = 1..8, and
everything below serves that stream:
- Wide loads, no staging of W. Each lane loads one 16-byte vector (8 columns) of each of its warp's rows per k step
  of 256 columns, straight into registers (`ld.global.v4`): a warp's load instruction reads 512 contiguous bytes of
  one row, whole 32-byte sectors, and W never touches shared memory (a TMA + mbarrier pipeline would add a shared
  round trip for data each thread uses once; it pays off for tensor-core operands, not here).
- Enough bytes in flight. Keeping HBM busy needs about bandwidth x latency = 4.3 TB/s x ~1 us = ~4 MB in flight,
  ~30 KB per SM. Each thread keeps `depth` k steps of its rows in flight, 12 loads of 16 bytes (the plan's
  LOADS_IN_FLIGHT), so a CTA of 256 threads holds 48 KB: 96 KB per SM at TP8 (two CTAs), 48 KB at TP16, a
  1.5-3x margin for latency under load. The k loop runs in groups of `depth` steps (one rolled loop body, unrolled
  `depth` deep): step s's slot is refilled with step s + depth right after it is converted, before the products of
  step s, so the schedule is in the code, not left to the compiler (fully unrolled, ptxas hoisted every load and
  needed 206 registers at B = 8).
- x once per CTA. A chunk of up to 8 batch rows (at most 112 KiB) is staged in shared memory once per CTA and read
  with `ld.shared.v4` (512 contiguous bytes per warp instruction: no bank conflicts). A staged x vector is reused
  for every row of the warp; a converted W vector for every batch row. x costs B x 14 KB of L2 reads per CTA,
  262 CTAs x 112 KB = 29 MB at TP8 B = 8, from L2, against 90 MB from HBM.
- Every SM busy, no tail. A CTA of 8 warps owns 8 x rows_per_warp consecutive rows; the plan picks the most rows
  per warp (most reuse of each x vector) that leaves no partial CTA and at least one CTA per SM: 3 rows at both TP8
  (262 CTAs, two per SM, all resident in one wave) and TP16 (134 CTAs). With every CTA resident at once there is no
  second wave, and no split-K: each warp sums its rows over all of K itself, so no partial sums go through memory.
- FP32 accumulation on CUDA cores. Per k step a thread does rows x batch x 8 FMAs; at B = 8 that is 8 FLOPs per
  weight byte, below the ~15 the SMs' FP32 units sustain per byte of HBM bandwidth, so the FMAs hide under the
  stream. Each (row, batch) sum is a chain of FMAs per lane, then a butterfly over the warp's 32 lanes, in a fixed
  order: results are deterministic and independent of scheduling.
- Programmatic dependent launch. The first `depth` k steps of weights (12 of a thread's loads) are issued before
  `griddepcontrol.wait`, so under PDL the weight stream starts while the previous kernel (the AttnRes that produces
  x) finishes. x is read only after the wait, with plain loads: an invariant `ld.global.nc` may legally be hoisted
  above the wait and read x half-written (the build forbids it). `griddepcontrol.launch_dependents` follows the
  staging of the first x chunk.
- At most 128 registers per thread for B <= 8 (`.minnctapersm 2`; the build checks the cubin, and that nothing
  spills to local memory): two CTAs of 256 threads per SM. CuTe DSL would ask the driver for the SM's shared memory
  to honour that at compile time unless the shared-memory carveout is named, so the launch names it (100%).

Expected bandwidth at B = 1..8: the stream is the only significant traffic, every SM has at least 48 KB of loads
in flight, and the non-overlapped parts are one load latency at the start (hidden by PDL in a decode step) and
the final warp reductions and stores (~1-2 us). At TP8 (~21 us of streaming) that predicts ~90% of the measured
copy bandwidth; at TP16 (~11 us) the fixed costs weigh twice as much, ~80-85%. Measured: not yet (the GPU test
prints it).

Batches above 8 (16, 32, 64; lower priority): the batch is processed in chunks of 8 and W is streamed once per
chunk (L2 absorbs part of it at TP16, where W is 46 MB of a 50 MB L2), and a CTA may use the whole register file
(one CTA per SM: 238-250 registers, which under a 128 cap spilled), so TP8's 262 CTAs run in two waves. That is
correct but not bandwidth-optimal, and at B = 64 the CUDA-core FMAs alone take ~4x the stream time. Those batches
want tensor cores (`mma.sync` m16n8k16 with W as the A operand: with K permuted consistently in x and W, each
thread's A fragment is two contiguous 16-byte row vectors, so the same wide loads feed the MMA); not done here.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from k3_decode.kernels import cutedsl
from k3_decode.kernels.kda_in_proj_mma_plan import InProjMmaPlan
from k3_decode.kernels.kda_in_proj_plan import InProjPlan, WeightStream
from k3_decode.kernels.phase_trace import words_for
from k3_decode.kernels.primitives import (
    VECTOR,
    WARP,
    copy8,
    launch_resident,
    load8,
    load8_value,
    to_f32,
    trace_stamp,
    warp_sum,
)
from k3_decode.kernels.wgmma_stream_plan import WgmmaStreamPlan


def compile_args(plan: InProjPlan | InProjMmaPlan | WgmmaStreamPlan, trace: bool = False) -> tuple[Any, ...]:
    """Fake arguments of one compile of any of the projection's builds: x [B, K], W [R, K], out [B, R], all BF16,
    row-major, 16-byte aligned, and the Int32 launch counter (with the phase stamps after it in a traced build:
    phase_trace.py)."""
    return (
        cutedsl.fake_tensor(BFloat16, (plan.batch, plan.k)),
        cutedsl.fake_tensor(BFloat16, (plan.rows, plan.k)),
        cutedsl.fake_tensor(BFloat16, (plan.batch, plan.rows)),
        cutedsl.fake_tensor(Int32, (words_for(plan.ctas, trace),)),
        cutedsl.fake_stream(),
    )


class KdaInProjKernel:
    """out = x @ W^T for one fixed shape (the plan). Arguments of the compiled function: x [B, K], W [R, K],
    out [B, R] (BF16, contiguous, 16-byte aligned, on one device), launches [1] Int32 (the device-side execution
    counter: one relaxed atomic add per launch, by thread 0 of CTA 0) and the CUDA stream."""

    def __init__(self, plan: InProjPlan, trace: bool = False) -> None:
        self.plan = plan
        self.trace = trace  # phase stamps (phase_trace.py)

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, launches: cute.Tensor, stream: Any):
        plan = self.plan
        # B <= 8: two CTAs per SM (128 registers, .minnctapersm 2) and the whole shared memory asked for, so that
        # two staged x chunks fit.
        launch_resident(
            self.kernel(x, w, out, launches),
            grid=[plan.ctas, 1, 1],
            threads=plan.threads,
            ctas_per_sm=plan.ctas_per_sm,
            smem=plan.smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, launches: cute.Tensor):
        plan = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        row0 = (cta * (plan.threads // WARP) + warp) * plan.rows_per_warp
        trace_stamp(self.trace, launches, cta, 0, tidx)

        smem = cutlass.memory.SmemAllocator()
        xs = smem.allocate_tensor(
            BFloat16, cute.make_layout((plan.chunk_rows, plan.k), stride=(plan.k, 1)), byte_alignment=16
        )
        slots = weight_slots(plan)

        # Weights first: they do not depend on the previous kernel, so they stream while it finishes.
        load_group(plan, w, slots, row0, lane, Int32(0))
        cute.arch.griddepcontrol_wait()
        trace_stamp(self.trace, launches, cta, 1, tidx)
        if tidx + cta == 0:  # thread 0 of CTA 0 (both non-negative)
            cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")

        chunks = plan.chunks
        self._chunk(x, w, out, xs, slots, row0, lane, tidx, Int32(0), chunks[0], True)
        middle = [c for c in chunks[1:] if c == chunks[0]]
        for c in cutlass.range(len(middle), unroll=1):  # batches above 8: one rolled body for every full chunk
            cute.arch.sync_threads()  # every warp is done reading the previous chunk
            load_group(plan, w, slots, row0, lane, Int32(0))
            self._chunk(x, w, out, xs, slots, row0, lane, tidx, (c + 1) * chunks[0], chunks[0], False)
        if const_expr(len(chunks) > 1 + len(middle)):  # a last, partial chunk
            cute.arch.sync_threads()
            load_group(plan, w, slots, row0, lane, Int32(0))
            self._chunk(x, w, out, xs, slots, row0, lane, tidx, Int32(plan.batch - chunks[-1]), chunks[-1], False)
        if const_expr(self.trace):
            cute.arch.sync_threads()  # the end stamp after every warp's last store
            trace_stamp(True, launches, cta, 2, tidx)

    @cute.jit
    def _chunk(
        self,
        x: cute.Tensor,
        w: cute.Tensor,
        out: cute.Tensor,
        xs: cute.Tensor,
        slots: list,
        row0: Int32,
        lane: Int32,
        tidx: Int32,
        first: Int32,
        chunk: cutlass.Constexpr[int],
        is_first: cutlass.Constexpr[bool],
    ):
        """out[first .. first + chunk - 1, the warp's rows], with group 0 of the weights already in the slots."""
        plan = self.plan
        stage(plan, x, xs, first, chunk, plan.fill_loads(chunk), tidx)
        cute.arch.sync_threads()
        if const_expr(is_first):
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel's wait still covers all of this grid
        multiply(plan, w, out, xs, slots, row0, lane, first, chunk)


# --- the weight stream, shared with the fused o_proj kernel (kda_o_proj.py) -----------------------------------


@cute.jit
def weight_slots(plan: WeightStream) -> list[list[cute.Tensor]]:
    """The weight vectors in flight: slot j holds step g * depth + j of every row of the warp. Only constant
    indices touch them, so they live in registers."""
    return [[cute.make_rmem_tensor((VECTOR,), BFloat16) for _ in range(plan.rows_per_warp)] for _ in range(plan.depth)]


@cute.jit
def load_group(plan: WeightStream, w: cute.Tensor, slots: list, row0: Int32, lane: Int32, group: Int32):
    """Issue the weight loads of k steps group * depth .. + depth - 1 into the slots."""
    for j in cutlass.range_constexpr(plan.depth):
        for r in cutlass.range_constexpr(plan.rows_per_warp):
            load8(w[row0 + r, None], lane + WARP * (group * plan.depth + j), slots[j][r])


@cute.jit
def stage(
    plan: WeightStream,
    src: cute.Tensor,
    staged: cute.Tensor,
    first: Int32 | int,
    batch: cutlass.Constexpr[int],
    loads: cutlass.Constexpr[int],
    tidx: Int32,
):
    """Copy rows first .. first + batch - 1 of `src` into shared memory (`staged`), one 16-byte vector per thread
    and pass, in `loads` passes."""
    per_row = plan.k // VECTOR
    for i in cutlass.range_constexpr(loads):
        v = tidx + plan.threads * i
        if const_expr(plan.threads * (i + 1) <= batch * per_row):
            copy8(src[first + v // per_row, None], staged[v // per_row, None], v % per_row)
        else:
            if v < batch * per_row:  # the last pass, when it does not fill every thread
                copy8(src[first + v // per_row, None], staged[v // per_row, None], v % per_row)


@cute.jit
def multiply(
    plan: WeightStream,
    w: cute.Tensor,
    out: cute.Tensor,
    staged: cute.Tensor,
    slots: list,
    row0: Int32,
    lane: Int32,
    first: Int32 | int,
    batch: cutlass.Constexpr[int],
    w_row0: Int32 | None = None,
):
    """out[first .. first + batch - 1, the warp's rows] = the staged rows @ W[the warp's rows]^T, with group 0 of
    the weights already in the slots. `w_row0`: where the warp's rows start in `w` when that is not W itself but the
    CTA's rows of it in shared memory (the fused o_proj's w_smem plan); row0 is still where they go in `out`."""
    rows = plan.rows_per_warp
    src = row0 if w_row0 is None else w_row0
    acc = cute.make_rmem_tensor((rows * batch,), Float32)
    acc.fill(0.0)
    for g in cutlass.range(plan.groups, unroll=1):
        for j in cutlass.range_constexpr(plan.depth):
            wv = [to_f32(slots[j][r].load()) for r in range(rows)]
            if g + 1 < plan.groups:  # refill the slot just read: the stream runs `depth` steps ahead
                for r in cutlass.range_constexpr(rows):
                    load8(w[src + r, None], lane + WARP * ((g + 1) * plan.depth + j), slots[j][r])
            step = g * plan.depth + j
            for b in cutlass.range_constexpr(batch):
                xv = to_f32(load8_value(staged[b, None], lane + WARP * step))
                for r in cutlass.range_constexpr(rows):
                    a = acc[r * batch + b]
                    for i in cutlass.range_constexpr(VECTOR):
                        a = a + wv[r][i] * xv[i]
                    acc[r * batch + b] = a

    # Lane r * batch + b writes out[first + b, row0 + r]; every lane holds every warp total.
    for r in cutlass.range_constexpr(rows):
        for b in cutlass.range_constexpr(batch):
            total = warp_sum(acc[r * batch + b])
            if lane == r * batch + b:
                out[first + b, row0 + r] = total.to(BFloat16)
