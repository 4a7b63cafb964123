"""The KDA input projection streamed head by head (sm_90a, CuTe DSL): the first measurement of the one-kernel plan.

What it answers. The plan for one attention-side kernel (docs/kda-layer-h200.md, "What each missed target needs")
starts each head's KDA step as soon as that head's rows of the projection are done, while the projection streams
the next heads. It pays only if W can stream in head order, every row published as it is done, as fast as the
served projection streams it in row order (99 % of copy bandwidth at TP8 B1 and 88 % at TP16 B1 by CTA stamps).
This kernel is that stream and nothing more: out[B, R] = x[B, K] @ W[R, K]^T, BF16 in and out (the semantics and
the error bound of kda_in_proj.py), with W's rows in head order (kda_head_stream_plan.py) and each row group's
release add on its head's counter. It is not served; `benchmarks/head_stream_h200.py` times it beside the served
build and reads its stamps.

Design, and where it differs from the served CUDA-core stream (kda_in_proj.py):
- Split K, not whole rows a warp. Head order needs every SM in every head: at TP8 a head is 512 rows for 2096
  warps. A row's K is split over `split` warps of one CTA (its row group), each summing its slice over the batch;
  the non-leading warps put their sums in shared memory (double-buffered by trip), the group meets at its named
  barrier, and the leading warp's lane 0 adds the slices in slice order, stores the row's B outputs and publishes.
- Publishing: lane 0 stores the outputs, then one `atom.release.gpu` add on its group's counter (the same thread
  stored them, so the release orders them), then stamps the row. Counters are never reset: a group's counter grows
  by its row count each launch, so a waiter compares against (epoch + 1) x (rows), as the plan's epochs do.
- Watching (`watch`): a ninth warp whose lane 0 is that waiter for every group in stream order (acquire polls,
  then a stamp); after a CTA barrier thread 0 counts the CTA done (acq_rel), and the launch's last CTA advances
  the epoch (release) that the next launch's watchers read after their dependency wait. The stream warps are the
  same code as without it.
- The stream crosses trips without a bubble: a lane holds its slice's whole trip (`steps_per_unit` 16-byte vectors
  of one row) and loads the next trip's row into each register slot as it converts it. Trip 0's loads are issued
  before `griddepcontrol.wait` (W does not depend on the previous kernel), x is staged after it.
- Stamps, always on (it is a probe): CTA start times, one per row when it is published and, watched, one per CTA
  and group when its watcher saw the group full: the global timer's low word, after the launch count and the
  counters (HeadStreamPlan's trace words).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from k3_decode.kernels import cutedsl
from k3_decode.kernels.kda_head_stream_plan import WARP, WARPS, HeadStreamPlan
from k3_decode.kernels.kda_in_proj import stage
from k3_decode.kernels.primitives import bulk_copy, launch_resident, load8, load8_value, to_f32, warp_sum


def compile_args(plan: HeadStreamPlan) -> tuple[Any, ...]:
    """Fake arguments of one compile: x [B, K], W [R, K], out [B, R] (BF16, row-major, 16-byte aligned), the Int32
    trace words (launch count, counters, stamps) and the stream."""
    return (
        cutedsl.fake_tensor(BFloat16, (plan.batch, plan.k)),
        cutedsl.fake_tensor(BFloat16, (plan.rows, plan.k)),
        cutedsl.fake_tensor(BFloat16, (plan.batch, plan.rows)),
        cutedsl.fake_tensor(Int32, (plan.trace_words,)),
        cutedsl.fake_stream(),
    )


class KdaHeadStreamKernel:
    """out = x @ W^T with W streamed in head order, for one fixed shape (the plan)."""

    def __init__(self, plan: HeadStreamPlan) -> None:
        self.plan = plan

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, trace: cute.Tensor, stream: Any):
        plan = self.plan
        launch_resident(
            self.kernel(x, w, out, trace),
            grid=[plan.ctas, 1, 1],
            threads=plan.threads,
            ctas_per_sm=plan.ctas_per_sm,
            smem=plan.smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, trace: cute.Tensor):
        plan = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        group = warp // plan.split  # the row group within the CTA
        piece = warp - group * plan.split  # its K slice
        first = cta * plan.groups_per_cta + group  # the stream position of trip 0
        vec0 = piece * plan.slice_vectors + lane
        if tidx == 0:
            trace[plan.start_base + cta] = cute.arch.globaltimer_lo()

        smem = cutlass.memory.SmemAllocator()
        xs = smem.allocate_tensor(
            BFloat16, cute.make_layout((plan.batch, plan.k), stride=(plan.k, 1)), byte_alignment=16
        )
        parts = smem.allocate_tensor(Float32, cute.make_layout((plan.partial_words,)), byte_alignment=16)
        feed = self._feed(smem)

        if const_expr(plan.watch):
            if warp < WARPS:  # the watching warp streams nothing
                self._first_trips(w, feed, first, vec0, warp, lane, piece)
        else:
            self._first_trips(w, feed, first, vec0, warp, lane, piece)
        cute.arch.griddepcontrol_wait()
        if tidx + cta == 0:  # thread 0 of CTA 0: the launch count
            cute.arch.atomic_add(trace.iterator, Int32(1), sem="relaxed", scope="gpu")
        if const_expr(plan.watch):
            if warp < WARPS:
                stage(plan.staging, x, xs, Int32(0), plan.batch, plan.fill_loads, tidx)
        else:
            stage(plan.staging, x, xs, Int32(0), plan.batch, plan.fill_loads, tidx)
        cute.arch.sync_threads()
        cute.arch.griddepcontrol_launch_dependents()

        if const_expr(plan.watch):
            if warp < WARPS:
                self._stream(w, out, trace, xs, parts, feed, warp, lane, group, piece, first, vec0)
            elif lane == 0:
                self._watch(trace, cta)
            cute.arch.sync_threads()  # every row of the CTA published and every group seen
            if tidx == 0:
                self._finish(trace)
        else:
            self._stream(w, out, trace, xs, parts, feed, warp, lane, group, piece, first, vec0)

    def _feed(self, smem: Any) -> Any:
        """Where W's vectors wait to be used: register slots for one trip, or (copy-fed) the ring, each warp's
        `stages` slices of a row in shared memory, and a transaction barrier a stage."""
        plan = self.plan
        if const_expr(plan.stages == 0):
            return [cute.make_rmem_tensor((8,), BFloat16) for _ in range(plan.steps_per_unit)]
        bars = smem.allocate_array(Int64, WARPS * plan.stages, byte_alignment=8)
        width = plan.slice_bytes // 2
        ring = smem.allocate_tensor(
            BFloat16, cute.make_layout((WARPS * plan.stages, width), stride=(width, 1)), byte_alignment=128
        )
        return ring, bars

    @cute.jit
    def _first_trips(self, w: cute.Tensor, feed: Any, first: Int32, vec0: Int32, warp: Int32, lane: Int32,
                     piece: Int32):  # fmt: skip
        """What the warp streams before the dependency wait (W does not depend on the previous kernel): trip 0's
        vectors into its register slots, or, copy-fed, its ring's barriers set up and its first `stages` trips
        copied in."""
        plan = self.plan
        if const_expr(plan.stages == 0):
            lane_w = self._lane_vectors(w, self._row_at(first), vec0)
            for i in cutlass.range_constexpr(plan.steps_per_unit):
                load8(lane_w, WARP * i, feed[i])
        else:
            _, bars = feed
            if lane == 0:
                for i in cutlass.range_constexpr(plan.stages):
                    cute.arch.mbarrier_init(bars + (warp * plan.stages + i), 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.fence_proxy("async.shared", space="cta")  # the bulk copies complete these barriers
            cute.arch.sync_warp()  # the warp's lanes see its barriers set up before they wait on them
            for i in cutlass.range_constexpr(min(plan.stages, plan.trips)):
                self._fill(w, feed, first, Int32(i), warp, lane, piece)

    @cute.jit
    def _fill(self, w: cute.Tensor, feed: Any, first: Int32, trip: Int32, warp: Int32, lane: Int32, piece: Int32):
        """Copy-fed: lane 0 copies the warp's slice of its trip-`trip` row into stage trip % stages, one bulk copy
        completing that stage's barrier, which it arms with the slice's bytes."""
        plan = self.plan
        ring, bars = feed
        stage = warp * plan.stages + trip % plan.stages
        if lane == 0:
            bar = bars + stage
            cute.arch.mbarrier_arrive_and_expect_tx(bar, plan.slice_bytes)
            row = self._row_at(first + plan.row_groups * trip)
            src = w.iterator + cute.assume(row * plan.k + piece * (plan.slice_bytes // 2), divby=8)
            bulk_copy(ring[stage, None].iterator, src, plan.slice_bytes, bar)

    @cute.jit
    def _stream(
        self,
        w: cute.Tensor,
        out: cute.Tensor,
        trace: cute.Tensor,
        xs: cute.Tensor,
        parts: cute.Tensor,
        feed: Any,
        warp: Int32,
        lane: Int32,
        group: Int32,
        piece: Int32,
        first: Int32,
        vec0: Int32,
    ):
        """Every trip of the warp's row group: its slice of the row, the group's sum, the row's stores and publish."""
        plan = self.plan
        for t in cutlass.range(plan.trips, unroll=1):
            position = first + plan.row_groups * t
            row = self._row_at(position)
            acc = cute.make_rmem_tensor((plan.batch,), Float32)
            acc.fill(0.0)
            if const_expr(plan.stages == 0):
                following = self._row_at(position + plan.row_groups)  # next trip's row (unused on the last trip)
                next_w = self._lane_vectors(w, following, vec0)
                for i in cutlass.range_constexpr(plan.steps_per_unit):
                    wv = to_f32(feed[i].load())
                    if t + 1 < plan.trips:  # refill the slot just read with the next trip's vector
                        load8(next_w, WARP * i, feed[i])
                    self._products(acc, wv, xs, vec0 + WARP * i)
            else:
                ring, bars = feed
                stage = warp * plan.stages + t % plan.stages
                cute.arch.mbarrier_wait(bars + stage, (t // plan.stages) % 2)  # this trip's slice has landed
                for i in cutlass.range_constexpr(plan.steps_per_unit):
                    wv = to_f32(load8_value(ring[stage, None], lane + WARP * i))
                    self._products(acc, wv, xs, vec0 + WARP * i)
                if t + plan.stages < plan.trips:  # the stage takes the trip `stages` ahead
                    cute.arch.fence_proxy("async.shared", space="cta")  # our reads before the copy engine's writes
                    cute.arch.sync_warp()
                    self._fill(w, feed, first, t + plan.stages, warp, lane, piece)
            totals = [warp_sum(acc[b]) for b in range(plan.batch)]
            buffer = (t % 2) * (WARPS * plan.batch)
            if piece != 0 and lane == 0:
                for b in cutlass.range_constexpr(plan.batch):
                    parts[buffer + warp * plan.batch + b] = totals[b]
            cute.arch.barrier(barrier_id=group + 1, number_of_threads=plan.split * WARP)
            if piece == 0 and lane == 0:
                for b in cutlass.range_constexpr(plan.batch):
                    total = totals[b]
                    for j in cutlass.range_constexpr(1, plan.split):
                        total = total + parts[buffer + (warp + j) * plan.batch + b]
                    out[b, row] = total.to(BFloat16)
                counter = trace.iterator + (plan.counter_base + self._group_of(position))
                cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")
                trace[plan.row_stamp_base + row] = cute.arch.globaltimer_lo()

    @cute.jit
    def _products(self, acc: cute.Tensor, wv: cute.Tensor, xs: cute.Tensor, vector: Int32):
        """acc[b] += the 8 products of one W vector with batch row b's x vector, in FMA order."""
        for b in cutlass.range_constexpr(self.plan.batch):
            xv = to_f32(load8_value(xs[b, None], vector))
            a = acc[b]
            for e in cutlass.range_constexpr(8):
                a = a + wv[e] * xv[e]
            acc[b] = a

    @cute.jit
    def _watch(self, trace: cute.Tensor, cta: Int32):
        """Lane 0 of the watching warp: each group's counter in stream order, polled with gpu-scope acquire loads
        until it holds (epoch + 1) x the group's rows, then a stamp."""
        plan = self.plan
        epoch = cute.arch.load(trace.iterator + plan.epoch_word, Int32, sem="acquire", scope="gpu")
        for g in cutlass.range_constexpr(plan.groups):
            full = (epoch + 1) * plan.group_rows(g)
            seen = cute.arch.load(trace.iterator + (plan.counter_base + g), Int32, sem="acquire", scope="gpu")
            while seen < full:
                seen = cute.arch.load(trace.iterator + (plan.counter_base + g), Int32, sem="acquire", scope="gpu")
            trace[plan.watch_base + cta * plan.groups + g] = cute.arch.globaltimer_lo()

    @cute.jit
    def _finish(self, trace: cute.Tensor):
        """Thread 0, after its CTA is done: count the CTA, and if it is the launch's last, advance the epoch the
        next launch's watchers read (release: it follows every counter add of this launch in causality order)."""
        plan = self.plan
        done = cute.arch.atomic_add(trace.iterator + plan.done_word, Int32(1), sem="acq_rel", scope="gpu")
        if (done + 1) % plan.ctas == 0:
            cute.arch.atomic_add(trace.iterator + plan.epoch_word, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _lane_vectors(self, w: cute.Tensor, row: Int32, vec0: Int32) -> cute.Tensor:
        """W's row `row` from the lane's first vector on, as a tensor whose vector i * 32 is the lane's step i: one
        64-bit address a trip, the steps at constant offsets from it (indexing the row with the lane's vector
        instead kept a 64-bit offset live per step, and 14 steps spilled)."""
        offset = cute.assume(row * self.plan.k + vec0 * 8, divby=8)
        return cute.make_tensor(w.iterator + offset, cute.make_layout((self.plan.slice_vectors * 8,)))

    @cute.jit
    def _row_at(self, position: Int32) -> Int32:
        """HeadStreamPlan.row_at in the kernel's integers."""
        plan = self.plan
        row = position + 4 * plan.proj
        if position >= plan.shared_rows:
            within = position - plan.shared_rows
            head = within // plan.head_rows
            j = within - head * plan.head_rows
            section = j // plan.head_dim
            row = section * plan.proj + head * plan.head_dim + (j - section * plan.head_dim)
        return row

    @cute.jit
    def _group_of(self, position: Int32) -> Int32:
        """HeadStreamPlan.group_of in the kernel's integers."""
        plan = self.plan
        g = Int32(0)
        if position >= plan.shared_rows:
            g = 1 + (position - plan.shared_rows) // plan.head_rows
        return g
