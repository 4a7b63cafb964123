"""CuTe DSL building blocks that several kernels of this package share: 16-byte vector moves, BF16 to FP32
conversion, a pinned FMA, the butterfly sum over lanes, the launch of a kernel whose CTAs must all be resident, and the
phase-trace stamp (phase_trace.py).

Every function here is traced inline into the kernel that calls it (a `cute.jit` function called while a kernel
is being traced adds its operations where it is called), so moving code here leaves the compiled kernels as they
were.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from k3_decode.kernels.phase_trace import CLOCK_BASE as TRACE_CLOCK_BASE
from k3_decode.kernels.phase_trace import SM_WORD as TRACE_SM_WORD
from k3_decode.kernels.phase_trace import WORDS as TRACE_WORDS

VECTOR = 8  # BF16 elements in one 16-byte access
WARP = 32


@cute.jit
def load8(row: cute.Tensor, vec: Int32, frag: cute.Tensor):
    """The 8 BF16 elements of column group `vec` of a row into `frag`, in one 16-byte load."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), row.element_type, num_bits_per_copy=128)
    cute.copy(atom, cute.local_tile(row, (VECTOR,), (vec,)), frag)


@cute.jit
def load8_value(row: cute.Tensor, vec: Int32) -> cute.TensorSSA:
    """The 8 BF16 elements of column group `vec` of a row, in one 16-byte load, as a value."""
    frag = cute.make_rmem_tensor((VECTOR,), row.element_type)
    load8(row, vec, frag)
    return frag.load()


@cute.jit
def copy8(src: cute.Tensor, dst: cute.Tensor, vec: Int32):
    """Column group `vec` (8 BF16 elements) of row `src` to the same place of row `dst`, through registers."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), src.element_type, num_bits_per_copy=128)
    frag = cute.make_rmem_tensor((VECTOR,), src.element_type)
    cute.copy(atom, cute.local_tile(src, (VECTOR,), (vec,)), frag)
    cute.copy(atom, frag, cute.local_tile(dst, (VECTOR,), (vec,)))


@cute.jit
def to_f32(v: cute.TensorSSA) -> cute.Tensor:
    """8 BF16 values as FP32 registers, indexable one by one (exact: BF16 is FP32 with a shorter significand)."""
    frag = cute.make_rmem_tensor((VECTOR,), Float32)
    frag.store(v.to(Float32))
    return frag


@cute.jit
def fma(a: Float32, b: Float32, c: Float32) -> Float32:
    """a * b + c rounded once, with the product the source names fused. Written as `c + a * b` where c is itself
    a product, the sum gives the compiler two products to choose from, and two builds that differ elsewhere fused
    different ones: a lean conv's L2 norm of k then rounded apart from the plain conv's (same bits otherwise)."""
    return cute.math.fma(a, b, c)


@cute.jit
def warp_sum(x: Float32, lanes: cutlass.Constexpr[int] = WARP) -> Float32:
    """Butterfly sum over groups of `lanes` lanes (a power of two, at most 32): every lane of a group ends with the
    same bits (each step adds the same pair, in either order)."""
    for i in cutlass.range_constexpr(lanes.bit_length() - 1):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << i)
    return x


@cute.jit
def warp_sums4(parts: list, lane: Int32) -> list:
    """Four butterfly sums over the warp's 32 lanes at once (`parts[i]`: the lane's part of sum i), each with the bits
    warp_sum gives it, in every lane.

    warp_sum adds across lane bits 0, 1, 2, 3, 4 in that order; so does this, but its first two steps trade halves
    instead of shuffling all four: at bit 0 a lane keeps the two sums whose index has its bit 0 and sends the other
    two, at bit 1 it keeps the one of those whose index has its bit 1, then it finishes that sum alone; lane i holds
    sum i, and four indexed shuffles hand every lane all four. Each step adds the same two partial sums warp_sum's
    does (in either order, which FP32 addition does not see), so the bits are equal; it costs 10 shuffles and 6 adds
    where four warp_sums cost 20 of each."""
    odd = (lane & 1) != 0
    lo = Float32(cutlass.select_(odd, parts[1], parts[0])) + cute.arch.shuffle_sync_bfly(
        Float32(cutlass.select_(odd, parts[0], parts[1])), offset=1
    )  # sum (lane & 1)
    hi = Float32(cutlass.select_(odd, parts[3], parts[2])) + cute.arch.shuffle_sync_bfly(
        Float32(cutlass.select_(odd, parts[2], parts[3])), offset=1
    )  # sum 2 + (lane & 1)
    upper = (lane & 2) != 0
    total = Float32(cutlass.select_(upper, hi, lo)) + cute.arch.shuffle_sync_bfly(
        Float32(cutlass.select_(upper, lo, hi)), offset=2
    )  # sum (lane & 3)
    for i in cutlass.range_constexpr(2, 5):
        total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << i)
    return [cute.arch.shuffle_sync(total, i) for i in range(4)]


def launch_resident(
    kernel: Any,
    *,
    grid: list[Any],
    threads: int,
    ctas_per_sm: int,
    stream: Any,
    cluster: list[int] | None = None,
    smem: int | None = None,
) -> None:
    """Launch `kernel` (a traced kernel call) with programmatic dependent launch, `ctas_per_sm` CTAs of `threads`
    threads resident on every SM at once: ptxas caps the registers to fit them (.minnctapersm). The launch names
    the shared-memory carveout (all of it), which also keeps CuTe DSL from asking the driver for the SM's shared
    memory at compile time, a question a CPU build cannot answer."""
    kernel.launch(
        grid=grid,
        block=[threads, 1, 1],
        cluster=cluster,
        smem=smem,
        min_blocks_per_mp=ctas_per_sm,
        preferred_smem_carveout=100,
        stream=stream,
        use_pdl=True,
    )


@cute.jit
def trace_stamp(
    on: cutlass.Constexpr[bool], counter: cute.Tensor, cta: Int32, phase: cutlass.Constexpr[int], tidx: Int32
):
    """Thread 0 stamps phase `phase` of CTA `cta` into a traced kernel's counter (layout: phase_trace.py): the
    global nanosecond timer's low word and the SM's cycle counter; at phase 0 also the SM's id. Emits nothing in
    an untraced build (`on` is a compile-time flag)."""
    if const_expr(on):  # noqa: SIM102 -- a compile-time branch cannot share a condition with a run-time one
        if tidx == 0:
            base = 1 + cta * TRACE_WORDS
            counter[base + phase] = cute.arch.globaltimer_lo()
            counter[base + TRACE_CLOCK_BASE + phase] = cute.arch.clock()
            if const_expr(phase == 0):
                counter[base + TRACE_SM_WORD] = cute.arch.smid()


@cute.jit
def bulk_prefetch_l2(ptr: Any, size: cutlass.Constexpr[int]):
    """`cp.async.bulk.prefetch.L2` of `size` bytes (a multiple of 16) at a 16-byte aligned global address: the copy
    engine warms L2 and the issuing thread waits for nothing."""
    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};", read_only_args=[ptr.toint(), Int32(size)])


@cute.jit
def bulk_copy(dst: Any, src: Any, size: cutlass.Constexpr[int], bar: Any):
    """`cp.async.bulk` of `size` bytes from global to this CTA's shared memory, completing `size` bytes of the
    transaction barrier `bar` (16-byte aligned addresses, `size` a multiple of 16)."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], {$r2}, [{$r3}];",
        read_only_args=[dst.toint(), src.toint(), Int32(size), bar.toint()],
    )
