"""A Hopper weight stream for skinny GEMMs: out[B, R] = x[B, K] @ W[R, K]^T with TMA tiles and warpgroup MMA.

BF16 in and out, FP32 accumulation, all three tensors row-major and contiguous, B <= 64.

Why. Our tensor-core stream (kda_in_proj_mma.py: mma.sync m16n8k16, W loaded by each lane into registers with
16-byte global loads, K split over 4 warps) moves W at ~1.8 TB/s at most on an H100, where cuBLAS reaches
2.2-2.67 TB/s on the same shapes; rings of per-row 128-byte bulk copies did not close the gap. This kernel tests
the standard Hopper design instead: whole swizzled tiles by TMA into a multistage shared-memory ring, consumed in
place by wgmma, so no thread ever touches a byte of W and the copy engine keeps `stages` tiles in flight per CTA.

Design ("swap-AB": W's rows are the MMA's M, the small batch its N):
- One CTA per (tile of `m_rows` W rows, K slice). Its producer warp issues, per k tile, one TMA copy of the W tile
  [m_rows, k_tile] and one of the x tile [N, k_tile] (N = B rounded up to 8), both K-major with the 128-byte swizzle
  wgmma reads without bank conflicts, into a `stages`-deep ring guarded by full/empty mbarriers (CuTe DSL's
  PipelineTmaAsync). TMA fills rows past R (the last M tile) and past B with zeros, so no load is masked.
- One consumer warpgroup per 64 W rows issues wgmma m64nNk16 with both operands in shared memory, keeps one group
  of MMAs in flight and releases a stage as soon as the MMAs that read it are done.
- K split over `k_splits` CTAs (for shapes with few M tiles, 3216 rows -> 51 tiles on 132 SMs): those CTAs form a
  thread-block cluster along K; every CTA but rank 0 stores its FP32 partial tile into rank 0's shared memory
  (distributed shared memory), one cluster barrier (release/acquire) orders the stores before rank 0 reads them,
  and rank 0 adds them in rank order, so the result does not depend on timing.
- Programmatic dependent launch: W does not depend on the previous kernel, so the producer issues the ring's first
  stages of W before `griddepcontrol.wait` and their x after it; every thread lets the next kernel launch right after
  its wait (its own wait still covers this whole grid), so that kernel's prologue overlaps this stream. One thread of
  the grid adds one to the launch counter (counters.py) after its wait.
- The epilogue writes the accumulator transposed (acc[r, b] -> out[b, r]) as BF16, element by element, masked to
  b < B and r < R. The output is ~4% of the bytes moved at B = 64, so it is not staged for wide stores.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.utils import hopper_helpers as sm90

from k3_decode.kernels.kda_in_proj import compile_args as compile_args  # the same: x, W, out, counter
from k3_decode.kernels.primitives import trace_stamp
from k3_decode.kernels.wgmma_stream_plan import (
    MMA_K,
    MMA_M,
    WARP,
    WARPGROUP,
    WgmmaStreamPlan,
)


def make_ring(p: WgmmaStreamPlan, storage: Any) -> pipeline.PipelineTmaAsync:
    """The CTA's ring of `stages` full/empty barrier pairs: one producer thread arms a stage for both copies' bytes,
    every consumer warp releases it. Each CTA's ring is its own (no multicast), so it is built for a cluster of one
    even in a cluster launch: its barriers are only ever signalled locally. Its inits still need publishing
    (pipeline_init_arrive / _wait) before first use."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.barriers.data_ptr(),
        num_stages=p.stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, p.consumer_threads // WARP),
        tx_count=p.stage_bytes,
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        defer_sync=True,
    )


def tile_views(
    p: WgmmaStreamPlan,
    tma_w: cute.CopyAtom,
    w_tiles: cute.Tensor,
    tma_x: cute.CopyAtom,
    x_tiles: cute.Tensor,
    sw: cute.Tensor,
    sx: cute.Tensor,
    m_tile: Any,
) -> tuple:
    """(W's ring slots, W tile `m_tile`'s k tiles, x's ring slots, x's k tiles) as TMA copies take them: indexed
    [(None, stage)] and [(None, k tile)]."""
    gw = cute.local_tile(w_tiles, (p.m_rows, p.k_tile), (m_tile, None))  # (m_rows, k_tile, K / k_tile)
    gx = cute.local_tile(x_tiles, (p.n, p.k_tile), (0, None))
    tws, twg = cpasync.tma_partition(
        tma_w, 0, cute.make_layout(1), cute.group_modes(sw, 0, 2), cute.group_modes(gw, 0, 2)
    )
    txs, txg = cpasync.tma_partition(
        tma_x, 0, cute.make_layout(1), cute.group_modes(sx, 0, 2), cute.group_modes(gx, 0, 2)
    )
    return tws, twg, txs, txg


def ring_storage(p: WgmmaStreamPlan, w_elements: int, x_elements: int) -> Any:
    """The CTA's shared memory: ring barriers, the W and x rings (1024-byte aligned for the 128-byte swizzle) and, in a
    K-split cluster, rank 0's buffer for the other ranks' partials."""

    fields: dict[str, Any] = {
        "barriers": cute.struct.MemRange[cutlass.Int64, p.stages * 2],
        "w": cute.struct.Align[cute.struct.MemRange[BFloat16, w_elements], 1024],
        "x": cute.struct.Align[cute.struct.MemRange[BFloat16, x_elements], 1024],
    }
    if p.k_splits > 1:
        fields["partials"] = cute.struct.Align[cute.struct.MemRange[Float32, p.partial_bytes // 4], 16]
    # Built from a dict: this module's annotations are strings (postponed evaluation), which cute.struct cannot read.
    return cute.struct(type("WgmmaStreamStorage", (), {"__annotations__": fields}))


def operands(p: WgmmaStreamPlan, w: cute.Tensor, x: cute.Tensor) -> tuple:
    """(the tiled wgmma, the W and x rings' swizzled layouts, the TMA atom and tiled view of W, those of x) of one
    plan, built on the host side of a launch."""
    tiled_mma = sm90.make_trivial_tiled_mma(
        BFloat16,
        BFloat16,
        OperandMajorMode.K,
        OperandMajorMode.K,
        Float32,
        (p.consumer_groups, 1, 1),
        tiler_mn=(MMA_M, p.n),
    )
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    w_ring = cute.tile_to_shape(atom, (p.m_rows, p.k_tile, p.stages), order=(0, 1, 2))
    x_ring = cute.tile_to_shape(atom, (p.n, p.k_tile, p.stages), order=(0, 1, 2))
    copy = cpasync.CopyBulkTensorTileG2SOp()
    tma_w, w_tiles = cpasync.make_tiled_tma_atom(copy, w, cute.slice_(w_ring, (None, None, 0)), (p.m_rows, p.k_tile))
    tma_x, x_tiles = cpasync.make_tiled_tma_atom(copy, x, cute.slice_(x_ring, (None, None, 0)), (p.n, p.k_tile))
    return tiled_mma, w_ring, x_ring, tma_w, w_tiles, tma_x, x_tiles


class WgmmaStream:
    """out = x @ W^T for one plan. Arguments of the compiled function: x [B, K], W [R, K], out [B, R] (BF16, row-major,
    contiguous, 16-byte aligned, on one device) and the CUDA stream."""

    def __init__(self, plan: WgmmaStreamPlan, trace: bool = False) -> None:
        why = plan.problem()
        if why is not None:
            raise ValueError(f"WgmmaStreamPlan{dataclasses.astuple(plan)}: {why}")
        self.plan = plan
        self.trace = trace  # phase stamps (phase_trace.py) as the projection's other builds stamp them

    @cute.jit
    def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, launches: cute.Tensor, stream: Any):
        p = self.plan
        tiled_mma, w_ring, x_ring, tma_w, w_tiles, tma_x, x_tiles = operands(p, w, x)
        self.storage = ring_storage(p, cute.cosize(w_ring), cute.cosize(x_ring))
        assert self.storage.size_in_bytes() == p.smem_bytes, (self.storage.size_in_bytes(), p.smem_bytes)
        cluster = [p.k_splits, 1, 1] if const_expr(p.k_splits > 1) else None
        self.kernel(tma_w, w_tiles, tma_x, x_tiles, out, launches, tiled_mma, w_ring, x_ring).launch(
            grid=[p.k_splits, p.m_tiles, 1],
            block=[p.threads, 1, 1],
            cluster=cluster,
            smem=p.smem_bytes,
            min_blocks_per_mp=1,
            preferred_smem_carveout=100,  # also keeps CuTe DSL from asking a driver for the SM's shared memory
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom,
        w_tiles: cute.Tensor,
        tma_x: cute.CopyAtom,
        x_tiles: cute.Tensor,
        out: cute.Tensor,
        launches: cute.Tensor,
        tiled_mma: cute.TiledMma,
        w_ring: cute.ComposedLayout,
        x_ring: cute.ComposedLayout,
    ):
        p = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        split, m_tile, _ = cute.arch.block_idx()
        cta = m_tile * p.k_splits + split  # the CTA's index in the trace
        trace_stamp(self.trace, launches, cta, 0, tidx)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        producer = warp == p.consumer_threads // WARP  # the warp after the consumer warpgroups: wgmma needs whole ones

        if producer:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)

        storage = SmemAllocator().allocate(self.storage)
        ring = make_ring(p, storage)  # the CTA's own even in a K-split cluster
        # Barrier inits must be visible to the async proxy (TMA) and to every thread before first use; in a cluster
        # also every peer must have started before one writes its shared memory at the end.
        if const_expr(p.k_splits > 1):
            pipeline.pipeline_init_arrive(cluster_shape_mn=(p.k_splits, 1), is_relaxed=True)
            pipeline.pipeline_init_wait(cluster_shape_mn=(p.k_splits, 1))
        else:
            pipeline.pipeline_init_arrive()
            pipeline.pipeline_init_wait()

        sw = storage.w.get_tensor(w_ring.outer, swizzle=w_ring.inner)
        sx = storage.x.get_tensor(x_ring.outer, swizzle=x_ring.inner)
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((p.m_rows, p.n)), Float32)
        assert cute.size(acc) == p.acc_values, "the partials' layout assumes wgmma's m64nN accumulator fragment"

        if producer:
            tws, twg, txs, txg = tile_views(p, tma_w, w_tiles, tma_x, x_tiles, sw, sx, m_tile)
            first = split * p.k_tiles
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, p.stages)
            # W does not depend on the previous kernel: the ring's first stages of it go out before the dependency
            # wait, each stage armed for both copies' bytes; x, that kernel's output, only after it.
            for kt in cutlass.range_constexpr(p.ahead):
                ring.producer_acquire(state)
                bar = ring.producer_get_barrier(state)
                cute.copy(tma_w, twg[(None, first + kt)], tws[(None, state.index)], tma_bar_ptr=bar)
                state.advance()
            cute.arch.griddepcontrol_wait()
            # The next kernel may launch now (its own wait still covers all of this grid), so its prologue, such as
            # its weight copies, overlaps this stream instead of starting after it.
            cute.arch.griddepcontrol_launch_dependents()
            early = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, p.stages)
            for kt in cutlass.range_constexpr(p.ahead):
                bar = ring.producer_get_barrier(early)
                cute.copy(tma_x, txg[(None, first + kt)], txs[(None, early.index)], tma_bar_ptr=bar)
                early.advance()
            for kt in cutlass.range(p.ahead, p.k_tiles, unroll=1):
                ring.producer_acquire(state)  # waits for the slot to be empty, then arms it for stage_bytes
                bar = ring.producer_get_barrier(state)
                cute.copy(tma_w, twg[(None, first + kt)], tws[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(tma_x, txg[(None, first + kt)], txs[(None, state.index)], tma_bar_ptr=bar)
                ring.producer_commit(state)
                state.advance()
        else:
            cute.arch.griddepcontrol_wait()  # out may still be read by a kernel before the previous one
            cute.arch.griddepcontrol_launch_dependents()
            trace_stamp(self.trace, launches, cta, 1, tidx)  # thread 0 is a consumer's
            group = cute.arch.make_warp_uniform(tidx // WARPGROUP)
            thr = tiled_mma.get_slice(group * WARPGROUP)  # wgmma operands are per warpgroup
            tsw = tiled_mma.make_fragment_A(thr.partition_A(sw))
            tsx = tiled_mma.make_fragment_B(thr.partition_B(sx))
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, p.stages)
            done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, p.stages)
            for kt in cutlass.range(p.k_tiles, unroll=1):
                ring.consumer_wait(read)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(p.k_tile // MMA_K):
                    cute.gemm(tiled_mma, acc, tsw[(None, None, kb, read.index)], tsx[(None, None, kb, read.index)], acc)
                warpgroup.commit_group()
                # One group stays in flight; the one before it has finished reading its stage, which goes back.
                warpgroup.wait_group(1)
                if kt > 0:
                    ring.consumer_release(done)
                    done.advance()
                read.advance()
            warpgroup.wait_group(0)

        if tidx + split + m_tile == 0:  # one thread of the whole grid (all three non-negative)
            cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")
        is_consumer = tidx < p.consumer_threads
        if const_expr(p.k_splits > 1):
            rank = cute.arch.block_idx_in_cluster()
            # Partials are kept as each thread holds them (value i of consumer thread t): every rank's threads hold
            # the same (row, batch) elements, so rank 0's thread t adds exactly its own elements. Groups of 4 values
            # are contiguous so each thread moves 16 bytes at a time, and consecutive threads' groups are adjacent.
            groups4 = p.acc_values // 4
            slot_layout = cute.make_layout(
                (4, groups4, p.consumer_threads, p.k_splits - 1),
                stride=(1, 4 * p.consumer_threads, 4, 4 * p.consumer_threads * groups4),
            )
            local = storage.partials.data_ptr()
            if is_consumer and rank != 0:
                remote = cute.make_tensor(cute.arch.map_dsmem_ptr(local, 0), slot_layout)
                for g in cutlass.range_constexpr(groups4):
                    chunk = cute.make_rmem_tensor((4,), Float32)
                    for v in cutlass.range_constexpr(4):
                        chunk[v] = acc[g * 4 + v]
                    cute.autovec_copy(chunk, remote[(None, g, tidx, rank - 1)])
            # Release/acquire at cluster scope: the peers' stores above are visible to rank 0 after the wait.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if is_consumer and rank == 0:
                partials = cute.make_tensor(local, slot_layout)
                for slot in cutlass.range_constexpr(p.k_splits - 1):
                    for g in cutlass.range_constexpr(groups4):
                        chunk = cute.make_rmem_tensor((4,), Float32)
                        cute.autovec_copy(partials[(None, g, tidx, slot)], chunk)
                        for v in cutlass.range_constexpr(4):
                            acc[g * 4 + v] = acc[g * 4 + v] + chunk[v]
                self.store(acc, out, tiled_mma, tidx, m_tile)
        elif is_consumer:
            self.store(acc, out, tiled_mma, tidx, m_tile)
        if const_expr(self.trace):
            cute.arch.sync_threads()  # the end stamp after every thread's last store
            trace_stamp(True, launches, cta, 2, tidx)

    @cute.jit
    def store(self, acc: cute.Tensor, out: cute.Tensor, tiled_mma: cute.TiledMma, tidx: Int32, m_tile: Int32):
        """out[b, r] = acc[r, b] in BF16 for the elements this thread holds, masked to b < B and r < R."""
        p = self.plan
        coords = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((p.m_rows, p.n)))
        row0 = m_tile * p.m_rows
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, b = coords[i]
            row = row0 + r
            if b < p.batch and row < p.rows:
                out[b, row] = acc[i].to(BFloat16)


class KdaInProjKernelWgmma(WgmmaStream):
    """The stream as the KDA input projection's build: its kernel name holds `KdaInProjKernel`, which the projection's
    provider declares, so the profiler gives its kernels to the op `in_proj`."""
