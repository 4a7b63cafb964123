"""o_proj with the AttnRes after attention, in one launch, with W streamed by TMA into wgmma (sm_90a, CuTe DSL).

The semantics, the arguments, the grid-wide arrival word and the AttnRes epilogue are kda_o_proj.py's (this class
inherits them); the weight stream and the grid are new (kda_o_proj_wgmma_plan.py: why two kinds of cluster).

Stream CTAs (clusters 0..S-1, CTA c the W rows [64c, 64c + 64)): one warpgroup is both the consumer and, in warp 0,
the producer of a `stages`-deep ring of TMA tiles (W [64, k_tile] and o [N, k_tile], 128-byte swizzle), as
CUTLASS's single-warpgroup Hopper mainloop does: warp 0 (one lane it elects) issues the ring's first stages of W before
griddepcontrol.wait (W does not depend on the KDA step) and their o after it; per k tile the warpgroup waits for the
stage, issues wgmma m64nNk16 on it, keeps one group in flight, releases the stage the group before read (every warp
arrives on its empty barrier), and warp 0 refills that stage with the tile `stages` ahead once all four warps have
released it. A dedicated producer warp (wgmma_stream.py) would make the CTA 160 threads, and the AttnRes device code
the epilogue shares (attn_res.py) is written for CTAs of exactly one row slice of 128 threads. The accumulator is
stored transposed into attn_out (BF16), a CTA barrier orders every store before thread 0's release on the arrival
word, and the CTA exits.

Epilogue CTAs (clusters S..S+E-1): publish their exchange barriers to the cluster, wait for the KDA step, arrive at
once (they store no o_proj output), and run kda_o_proj.py's epilogue: the AttnRes weights and their rows' bank
blocks and old prefix are loaded while the stream runs, then they poll the arrival word and apply AttnRes to rows
c - S, c - S + E, ... Every CTA lets the next kernel launch right after its own griddepcontrol.wait.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from k3_decode.kernels.attn_res import AttnResKernel
from k3_decode.kernels.kda_o_proj import KdaOProjKernel
from k3_decode.kernels.kda_o_proj import compile_args as compile_args  # the same signature as the mma.sync build
from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan
from k3_decode.kernels.primitives import bulk_prefetch_l2, launch_resident, trace_stamp
from k3_decode.kernels.wgmma_stream import WgmmaStream, make_ring, operands, ring_storage, tile_views
from k3_decode.kernels.wgmma_stream_plan import MMA_K


class KdaOProjKernelWgmma(KdaOProjKernel):
    """The fused o_proj + AttnRes for one OProjWgmmaPlan; called as KdaOProjKernel is (its kernel name holds
    `KdaOProjKernel`, which the o_proj provider declares, so the profiler and the ledger count it as o_proj)."""

    def __init__(self, plan: OProjWgmmaPlan, trace: bool = False) -> None:
        self.plan = plan  # type: ignore[assignment]  # the epilogue reads the fields both plans share
        self.trace = trace
        self.attn = AttnResKernel(plan.hidden, plan.kind)
        self.weights = WgmmaStream(plan.stream)  # its transposed store of the accumulator

    @cute.jit
    def __call__(
        self,
        o: cute.Tensor,
        w: cute.Tensor,
        attn_out: cute.Tensor,
        prefix: cute.Tensor,
        blocks: cute.Tensor,
        out: cute.Tensor,
        res_norm: cute.Tensor,
        res_proj: cute.Tensor,
        out_norm: cute.Tensor | None,
        arrivals: cute.Tensor,
        launches: cute.Tensor,
        save_index: Int32,
        eps: Float32,
        stream: Any,
    ):
        plan = self.plan
        tiled_mma, w_ring, x_ring, tma_w, w_tiles, tma_x, x_tiles = operands(plan.stream, w, o)
        self.storage = ring_storage(plan.stream, cute.cosize(w_ring), cute.cosize(x_ring))
        operand_args = (tma_w, w_tiles, tma_x, x_tiles, tiled_mma, w_ring, x_ring, w)
        step_args = (attn_out, prefix, blocks, out, res_norm, res_proj, out_norm, arrivals, launches, save_index, eps)
        launch_resident(
            self.kernel(*operand_args, *step_args),
            grid=[plan.cluster, plan.clusters, 1],
            threads=plan.threads,
            cluster=[plan.cluster, 1, 1],
            ctas_per_sm=plan.ctas_per_sm,
            smem=plan.smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_w: cute.CopyAtom,
        w_tiles: cute.Tensor,
        tma_x: cute.CopyAtom,
        x_tiles: cute.Tensor,
        tiled_mma: cute.TiledMma,
        w_ring: cute.ComposedLayout,
        x_ring: cute.ComposedLayout,
        w: cute.Tensor,
        attn_out: cute.Tensor,
        prefix: cute.Tensor,
        blocks: cute.Tensor,
        out: cute.Tensor,
        res_norm: cute.Tensor,
        res_proj: cute.Tensor,
        out_norm: cute.Tensor | None,
        arrivals: cute.Tensor,
        launches: cute.Tensor,
        save_index: Int32,
        eps: Float32,
    ):
        plan = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        rank, cluster, _ = cute.arch.block_idx()  # grid x = the CTA's rank in its cluster
        cta = cluster * plan.cluster + rank
        trace_stamp(self.trace, launches, cta, 0, tidx)
        smem = SmemAllocator()
        storage = smem.allocate(self.storage)
        areas = [self.attn.allocate_exchange(smem, tidx) for _ in range(plan.epilogue_rows)]
        if cluster < plan.stream_clusters:  # the same for every CTA of a cluster
            self._stream(tma_w, w_tiles, tma_x, x_tiles, tiled_mma, w_ring, x_ring, w, storage, attn_out, launches,
                         tidx, cta)  # fmt: skip
            cute.arch.sync_threads()  # every thread's o_proj stores precede thread 0's release below
            trace_stamp(self.trace, launches, cta, 2, tidx)
            self._arrive(arrivals, tidx, cta)
            trace_stamp(self.trace, launches, cta, 3, tidx)
        else:
            cute.arch.cluster_arrive_relaxed()  # publishes the exchange barriers to the cluster, long before use
            cute.arch.griddepcontrol_wait()
            trace_stamp(self.trace, launches, cta, 1, tidx)
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel's wait still covers all of this grid
            cute.arch.cluster_wait()
            trace_stamp(self.trace, launches, cta, 2, tidx)
            seen = self._arrive(arrivals, tidx, cta)
            trace_stamp(self.trace, launches, cta, 3, tidx)
            self._epilogue(
                attn_out, prefix, blocks, out, res_norm, res_proj, out_norm, arrivals, seen, areas,
                save_index, eps, tidx, rank, cluster, launches,
            )  # fmt: skip
            if const_expr(self.trace):
                cute.arch.sync_threads()  # the end stamp after every thread's AttnRes stores
                trace_stamp(True, launches, cta, 5, tidx)

    @cute.jit
    def _w_to_l2(self, w: cute.Tensor, tidx: Int32, cta: Int32):
        """Thread t < 64 sends the columns past the ring's first tiles of the CTA's row t of W to L2: one
        cp.async.bulk.prefetch.L2 a row, by the copy engine, nothing to wait for."""
        if tidx < self.plan.stream.m_rows:
            row = w[cta * self.plan.stream.m_rows + tidx, None]
            bulk_prefetch_l2(row.iterator + self.plan.l2_first, self.plan.l2_columns * 2)

    @cute.jit
    def _stream(
        self,
        tma_w: cute.CopyAtom,
        w_tiles: cute.Tensor,
        tma_x: cute.CopyAtom,
        x_tiles: cute.Tensor,
        tiled_mma: cute.TiledMma,
        w_ring: cute.ComposedLayout,
        x_ring: cute.ComposedLayout,
        w: cute.Tensor,
        storage: Any,
        attn_out: cute.Tensor,
        launches: cute.Tensor,
        tidx: Int32,
        cta: Int32,
    ):
        """attn_out[:, 64 cta : 64 cta + 64] = o @ W[64 cta : 64 cta + 64]^T, stored by every thread (BF16)."""
        s = self.plan.stream
        # Warp 0 as a whole: the copies and the barrier arming elect one lane with elect.sync over the full warp,
        # which one lane alone would never complete.
        producer = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        if producer:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)
        ring = make_ring(s, storage)
        pipeline.pipeline_init_arrive()  # fences the barrier inits; no cluster shape: a CTA barrier follows
        pipeline.pipeline_init_wait()

        sw = storage.w.get_tensor(w_ring.outer, swizzle=w_ring.inner)
        sx = storage.x.get_tensor(x_ring.outer, swizzle=x_ring.inner)
        tws, twg, txs, txg = tile_views(s, tma_w, w_tiles, tma_x, x_tiles, sw, sx, cta)

        # Every thread keeps the producer's state (plain counters), so it advances outside warp 0's branches.
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, s.stages)
        for kt in cutlass.range_constexpr(s.ahead):  # W first: it does not depend on the KDA step
            if producer:
                ring.producer_acquire(state)  # a fresh ring: arms the stage for both copies' bytes
                bar = ring.producer_get_barrier(state)
                cute.copy(tma_w, twg[(None, kt)], tws[(None, state.index)], tma_bar_ptr=bar)
            state.advance()
        if const_expr(self.plan.w_l2):  # the rest of each row of W to L2, beside the KDA step's last CTAs
            self._w_to_l2(w, tidx, cta)
        cute.arch.griddepcontrol_wait()
        trace_stamp(self.trace, launches, cta, 1, tidx)
        if const_expr(self.plan.w_l2_late):  # the same once the step is done: HBM is the stream's alone
            self._w_to_l2(w, tidx, cta)
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel's wait still covers all of this grid
        if tidx + cta == 0:  # thread 0 of CTA 0 (both non-negative)
            cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")
        early = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, s.stages)
        for kt in cutlass.range_constexpr(s.ahead):  # then o, the KDA step's output, into the same stages
            if producer:
                bar = ring.producer_get_barrier(early)
                cute.copy(tma_x, txg[(None, kt)], txs[(None, early.index)], tma_bar_ptr=bar)
            early.advance()

        thr = tiled_mma.get_slice(tidx)
        tsw = tiled_mma.make_fragment_A(thr.partition_A(sw))
        tsx = tiled_mma.make_fragment_B(thr.partition_B(sx))
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((s.m_rows, s.n)), Float32)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, s.stages)
        done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, s.stages)
        for kt in cutlass.range(s.k_tiles, unroll=1):
            ring.consumer_wait(read)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(s.k_tile // MMA_K):
                cute.gemm(tiled_mma, acc, tsw[(None, None, kb, read.index)], tsx[(None, None, kb, read.index)], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # the group before this one has read its stage
            if kt > 0:
                ring.consumer_release(done)
                refill = kt - 1 + s.stages  # the k tile that stage takes next
                if refill < s.k_tiles:
                    if producer:
                        ring.producer_acquire(state)  # every warp has released it
                        bar = ring.producer_get_barrier(state)
                        cute.copy(tma_w, twg[(None, refill)], tws[(None, state.index)], tma_bar_ptr=bar)
                        cute.copy(tma_x, txg[(None, refill)], txs[(None, state.index)], tma_bar_ptr=bar)
                    state.advance()
                done.advance()
            read.advance()
        warpgroup.wait_group(0)
        self.weights.store(acc, attn_out, tiled_mma, tidx, cta)
