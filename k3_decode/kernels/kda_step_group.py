"""The fused KDA decode step with a group of requests per cluster (a KdaStepPlan with requests_per_cta > 1): the
decode kernel of kda_step.py, request by request, but with every request's copies in flight at once.

Why. From B16 the step's grid runs in waves, and at 1024 threads per SM (64 registers) an SM holds two CTAs of 512
threads at C = 2: two chains, each with one request's 32 KB of state in flight before its delta rule. A CTA that
serves n requests of its head (requests b0 .. b0 + n - 1, b0 = n * group) at the same registers issues all n
requests' copies first (n times the state bytes in flight per SM), reads its f_b rows and conv weights once for all
of them, and then runs the n chains in turn, each on its own shared memory (copies, exchanged decays and norm
partials, q, k and v) and its own six barriers. The per-request arithmetic is the decode kernel's, in the same
order with the same lanes, so each request's outputs and state are the decode kernel's bits (the GPU test compares
them).

The order, for n requests:
- before the wait, thread 0: the barriers of every request (the weights copied on request 0's), the L2 prefetches of
  every request's state and taps (slots read as hints);
- after it: every request's packed-row sections, then every live request's state rows and taps, all before any wait;
- phase A, request by request: the conv, the decays pushed over DSMEM, q, k and v into shared memory; one CTA
  barrier and one cluster arrive (the taps are read) for the whole group;
- phase B, request by request: the delta rule on the state rows, the norm exchange, the gated output;
- one cluster wait, then every live request's taps rewritten.
A NULL request (slot <= 0) reads and writes no state and outputs zeros; a group with no live request skips the CTA
and cluster barriers (every CTA of the cluster sees the same slots). The batch must be a whole number of groups
(KdaStepPlan checks it; the plan serves a group only where it is). No phase stamps: traces use the one-request
kernel.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from k3_decode.kernels.kda_step import (
    TAPS,
    KdaStepKernel,
    _conv_silu,
    _copy,
    _part,
    _section_offsets,
    _sigmoid,
    _store_f32,
    _store_normalized,
)
from k3_decode.kernels.kda_step_plan import CONV_WIDTH, GATE_RANK, HEAD_DIM, ROWS_PER_WARP, KdaStepPlan
from k3_decode.kernels.primitives import VECTOR

BARRIERS = 6  # per request, as the decode kernel's: decays, norm, weights (request 0's only), packed, taps, state


def step_kernel(plan: KdaStepPlan, trace: bool = False) -> KdaStepKernel:
    """The kernel class for `plan`: the group kernel when a cluster serves more than one request."""
    if plan.requests_per_cta == 1:
        return KdaStepKernel(plan, trace)
    if trace:
        raise ValueError("phase stamps are built into the one-request step only; trace a plan with requests_per_cta 1")
    return KdaStepGroupKernel(plan)


class KdaStepGroupKernel(KdaStepKernel):
    """KdaStepKernel's decode entry for a plan whose clusters serve `requests_per_cta` requests each (arguments and
    launch as KdaStepKernel's; the grid's third dimension is the plan's groups)."""

    @cute.kernel
    def kernel(
        self,
        packed: cute.Tensor,
        f_b: cute.Tensor,
        conv_w: cute.Tensor,
        a_log: cute.Tensor,
        dt_bias: cute.Tensor,
        o_norm: cute.Tensor,
        conv_state: cute.Tensor,
        state: cute.Tensor,
        slots: cute.Tensor,
        out: cute.Tensor,
        launches: cute.Tensor,
        lower_bound: Float32,
        l2_eps: Float32,
        norm_eps: Float32,
    ):
        plan = self.plan
        n = plan.requests_per_cta
        place = self._place()
        tidx, rank, head, group, lane, _, _, col, fb_rows, is_qk, is_conv, cl, _ = place
        b0 = group * n

        smem = cutlass.memory.SmemAllocator()
        bars, fb_s, cw_s, areas = self._allocate_group(smem)
        fa_at, gate_at = _section_offsets(plan)
        exchange = (HEAD_DIM * 4, plan.slots * 4)
        if tidx == 0:
            for r in cutlass.range_constexpr(1, n):
                for i in cutlass.range_constexpr(BARRIERS):
                    cute.arch.mbarrier_init(bars + BARRIERS * r + i, 1)
            self._start(bars, exchange, f_b, conv_w, fb_s, cw_s, place)  # request 0's barriers, fenced with these
            for r in cutlass.range_constexpr(1, n):
                self._arm(bars + BARRIERS * r, exchange)
            for r in cutlass.range_constexpr(n):
                hint = slots[b0 + r]
                self._prefetch(conv_state, state, hint, hint, TAPS, place)
        cute.arch.griddepcontrol_launch_dependents()  # o_proj may start its weight stream now (kda_step.py)
        cute.arch.cluster_arrive_relaxed()
        dt, decay_rate, w_norm = self._head_constants(a_log, dt_bias, o_norm, place)

        cute.arch.cluster_wait()  # peers' barriers are initialized before anything is pushed to them
        cute.arch.griddepcontrol_wait()
        if tidx == 0:
            for r in cutlass.range_constexpr(n):
                self._copy_sections(packed[b0 + r, None], areas[r]["x"], 0, bars + BARRIERS * r, place)
            if rank + head + group == 0:  # thread 0 of the grid's first CTA (all three are non-negative)
                cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")
        live = [
            Int32(slots[b0 + r]) for r in range(n)
        ]  # read again: the copies before the wait only steered prefetches
        if tidx == 0:  # every live request's state rows and taps, from L2
            for r in cutlass.range_constexpr(n):
                if live[r] > 0:
                    row = Int64(live[r])
                    a = areas[r]
                    self._copy_state(
                        a["state"], a["taps"], state, row, conv_state[row, None], TAPS, bars + BARRIERS * r, place
                    )
        busiest = live[0]
        for r in cutlass.range_constexpr(1, n):
            busiest = cutlass.max(busiest, live[r])

        cute.arch.mbarrier_wait(bars + 2, 0)  # the weights (request 0's barrier)
        inputs = cute.make_rmem_tensor((VECTOR,), BFloat16)
        for r in cutlass.range_constexpr(n):  # phase A: the conv, the decays, q, k and v of each live request
            a, rb = areas[r], bars + BARRIERS * r
            cute.arch.mbarrier_wait(rb + 3, 0)  # its packed row's sections (a NULL request's too: no copy in flight)
            if live[r] > 0:
                cute.arch.mbarrier_wait(rb + 4, 0)  # its taps
                cw = cute.make_rmem_tensor((VECTOR * CONV_WIDTH,), BFloat16)
                for i in cutlass.range_constexpr(CONV_WIDTH):
                    _copy(cw_s, VECTOR, CONV_WIDTH * (cl // VECTOR) + i, _part(cw, VECTOR, i))
                taps = cute.make_rmem_tensor((VECTOR * TAPS,), BFloat16)
                for t in cutlass.range_constexpr(TAPS):
                    _copy(a["taps"], VECTOR, TAPS * (cl // VECTOR) + t, _part(taps, VECTOR, t))
                _copy(a["x"], VECTOR, cl // VECTOR, inputs)
                act = cute.make_rmem_tensor((VECTOR,), Float32)
                _conv_silu(cw, taps, inputs, act)
                fa = cute.make_rmem_tensor((VECTOR,), BFloat16)
                _copy(a["x"], VECTOR, fa_at // VECTOR + col, fa)
                for j in cutlass.range_constexpr(2):
                    fb = cute.make_rmem_tensor((VECTOR,), BFloat16)
                    _copy(fb_s[fb_rows[j], None], VECTOR, col, fb)
                    self._push_decay(fb, fa, j, dt, decay_rate, lower_bound, a["decay"], 0, rb, place)
                if is_qk:
                    _store_normalized(act, lane, l2_eps, a["qk"], VECTOR * lane)
                elif is_conv:
                    _store_f32(act, Float32(1.0), a["v"], VECTOR * lane)

        if busiest > 0:
            cute.arch.sync_threads()  # every live request's q, k and v are in shared memory
            cute.arch.cluster_arrive()  # this CTA's tap reads are complete: peers may rewrite theirs (release)
            for r in cutlass.range_constexpr(n):  # phase B: the delta rule and the gated norm of each live request
                if live[r] > 0:
                    beta = _sigmoid(packed[b0 + r, plan.sections["beta"] + head].to(Float32))
                    self._finish_request(
                        state, out, areas[r], bars + BARRIERS * r, b0 + r, Int64(live[r]), beta, place, w_norm,
                        gate_at, norm_eps, (False, launches, 0, tidx),
                    )  # fmt: skip
                else:
                    self._zeros(out, b0 + r, place)
            cute.arch.cluster_wait()
            for r in cutlass.range_constexpr(n):  # the taps of each live request, once every CTA has read them
                if live[r] > 0:
                    self._rewrite_taps(conv_state[Int64(live[r]), None], areas[r], inputs, place)
        else:
            for r in cutlass.range_constexpr(n):
                self._zeros(out, b0 + r, place)

    @cute.jit
    def _allocate_group(self, smem: Any) -> tuple:
        """Six barriers per request, the weights once, then each request's areas (the decode kernel's, in its
        order): state rows, packed-row sections, taps, exchanged decays, q and k, v, norm partials."""
        plan = self.plan
        rows = plan.rows_per_cta
        bars = smem.allocate_array(Int64, BARRIERS * plan.requests_per_cta, byte_alignment=128)
        fb_s = smem.allocate_tensor(BFloat16, cute.make_layout((rows, GATE_RANK), stride=(GATE_RANK, 1)), 128)
        cw_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.conv_local * CONV_WIDTH), 128)
        areas = []
        for _ in cutlass.range_constexpr(plan.requests_per_cta):
            areas.append(
                {
                    "state": smem.allocate_tensor(
                        Float32, cute.make_layout((rows, HEAD_DIM), stride=(HEAD_DIM, 1)), 128
                    ),
                    "x": smem.allocate_tensor(BFloat16, cute.make_layout(plan.packed_bytes // 2), 128),
                    "taps": smem.allocate_tensor(BFloat16, cute.make_layout(plan.conv_local * TAPS), 128),
                    "decay": smem.allocate_tensor(Float32, cute.make_layout(HEAD_DIM), 128),
                    "qk": smem.allocate_tensor(Float32, cute.make_layout(2 * HEAD_DIM), 128),
                    "v": smem.allocate_tensor(Float32, cute.make_layout(rows), 128),
                    "norm": smem.allocate_tensor(Float32, cute.make_layout(plan.slots), 128),
                }
            )
        return bars, fb_s, cw_s, areas

    @cute.jit
    def _arm(self, bars: Any, exchange_bytes: tuple[int, int]):
        """Thread 0: arm a request's barriers as _start arms request 0's, but for the weights (copied once)."""
        plan = self.plan
        sizes = (*exchange_bytes, 0, plan.packed_bytes, plan.tap_bytes, plan.state_bytes)
        for i in cutlass.range_constexpr(BARRIERS):
            if cutlass.const_expr(i != 2):
                cute.arch.mbarrier_arrive_and_expect_tx(bars + i, sizes[i])

    @cute.jit
    def _zeros(self, out: cute.Tensor, b: Int32, place: Any):
        """A NULL request's output rows of this warp: zeros."""
        y = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
        y.fill(0.0)
        if place.lane == 0:
            _copy(y, ROWS_PER_WARP, place.first // ROWS_PER_WARP + place.warp, out[b, None])
