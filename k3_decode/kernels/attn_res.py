"""AttnRes for Hopper (sm_90a) in CuTe DSL: prefix update, block save, source mixing and RMSNorm in one kernel.

Compiled for sm_90a on the CPU with its PTX and SASS checked by `k3gate kernels build`; on an H200 it matches the
oracle at every kind CI builds (tests/k3_decode/kernels/test_attn_res_gpu.py), so it serves the `attn_res` op of KDA
layers as a specialized provider (providers.py).

Semantics are those of the oracle (k3_decode/reference/attn_res.py) and of the stock Triton kernel
(k3_decode/stock/triton_kernels/attn_res.py). Per token row, all math in FP32:
  p' = bf16(p + delta) ("add"), bf16(delta) ("restart") or p ("none"), optionally saved as bank block `save_index`;
  sources = bank blocks 0..n-1, then p';  logit_s = (s . (w_norm * w_q)) / sqrt(mean(s^2) + eps);
  alpha = softmax(logit);  mixed = sum_s alpha_s s;  out = bf16(mixed / sqrt(mean(mixed^2) + eps) * w_out),
  or bf16(mixed) without an output norm. BF16 state, weights and output; delta is BF16 or FP32.
The prefix and the saved block are bit-equal to the oracle's: the same FP32 add and one rounding to BF16. (With a
BF16 delta the compiler fuses the two into `add.bf16x2`, which rounds the exact sum once; the bits are the same,
since FP32's 24 significand bits are at least 2 * 8 + 2, so rounding to FP32 first never changes the BF16 result.)

Design. A decode batch is 1..64 rows of 7168, so latency decides, not bandwidth:
- One cluster of C CTAs per row (C = 7 at K3's width: 7 x 128 threads x 8 columns = 7168). A row is read by 7 SMs
  at once, and every thread issues all of its loads up front: one 16-byte vector per source row (n bank blocks,
  the prefix, delta) and per weight. The row then stays in registers: one trip to memory, no second pass over
  the row and no scratch row (the stock kernel walks the row twice and round-trips the mix through FP32 scratch).
  Each element is read and written by the same thread, so the in-place prefix update needs no barrier.
- Weights are loaded before `griddepcontrol.wait`: under programmatic dependent launch they overlap the tail of
  the previous kernel. (The wait covers only the previous kernel in the stream, so every PDL kernel of the decode
  step must itself wait before it reads what earlier kernels wrote; this one does.) Activations (bank, prefix,
  delta) are loaded after it, with plain loads: an invariant (`ld.global.nc`) load may legally be hoisted above
  the wait, the very bug a decode kernel must not have, and the compiler sinks invariant weight loads to their
  last use, past the exchanges below, which would put a full memory latency at the end of the kernel. Plain
  loads keep both where the code puts them (the build checks it).
- Two cross-CTA reductions, each a single push through distributed shared memory: a warp reduces its partials
  with shuffles, then lane r of each warp writes them into CTA r's shared memory with `st.async`, whose bytes
  complete a transaction mbarrier there. A CTA waits on its own barrier only; no cluster-wide barrier sits
  between the loads and the stores. The first push carries the 2(n+1) per-source partials (dot with
  w_norm * w_q, sum of squares), the second the sum of squares of the mix. A site with no bank block skips the
  first (alpha = 1 for the lone source), a site without an output norm skips the second.
- Every CTA sums the same partials in the same fixed order (CTA rank, then warp), so all CTAs of a row compute
  bit-identical softmax weights and norm factors, and results do not depend on scheduling.
- One cluster barrier makes every CTA's mbarrier initialization visible to its peers before anything is pushed.
  It is arrived at first and waited on after the weight loads are issued, ahead of `griddepcontrol.wait` (which
  under PDL waits longer anyway). Waiting later, with the activation loads in flight, made ptxas spill registers
  around the branch it builds for the cluster wait (the build's zero-local-memory check caught it).
- At most 128 registers per thread (checked by the build, see expectations.toml): 4 CTAs of 128 threads per SM,
  so all 448 CTAs of a B = 64 batch are resident at once on 132 SMs. (`.minnctapersm` would enforce it in ptxas,
  but CuTe DSL then asks the driver for the SM's shared memory at compile time, which a CPU build cannot.)
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from k3_decode.kernels import cutedsl
from k3_decode.kernels.attn_res_plan import VECTOR, AttnResKind, ClusterPlan
from k3_decode.kernels.primitives import warp_sum


def compile_args(hidden: int, kind: AttnResKind, batch: int, capacity: int) -> tuple[Any, ...]:
    """Fake arguments of one compile: the shapes and dtypes the compiled kernel then accepts, nothing else."""

    def bf16(*shape: int) -> Any:
        return cutedsl.fake_tensor(BFloat16, shape)

    delta = None
    if kind.delta != "none":
        delta = cutedsl.fake_tensor(Float32 if kind.delta_dtype == "float32" else BFloat16, (batch, hidden))
    out_norm = bf16(hidden) if kind.out_norm else None
    return (
        bf16(batch, hidden),  # prefix
        delta,
        bf16(batch, capacity, hidden),  # bank
        bf16(batch, hidden),  # out
        bf16(hidden),  # res_norm
        bf16(hidden),  # res_proj
        out_norm,
        cutedsl.fake_tensor(Int32, (1,)),  # launches: the device-side execution counter
        Int32(0),  # save_index
        Float32(1e-5),  # eps
        cutedsl.fake_stream(),
    )


class AttnResKernel:
    """One AttnRes application for a fixed (hidden, kind); the rows (the batch) come from the tensors.

    Arguments of the compiled function, all on one device, 16-byte aligned, last dimension contiguous:
    prefix [B, H] BF16 (rewritten when the kind has a delta), delta [B, H] BF16 or FP32 (None without delta),
    blocks [B, capacity, H] BF16 (block `save_index` is written when the kind saves), out [B, H] BF16,
    res_norm [H], res_proj [H], out_norm [H] (None without an output norm) BF16, launches [1] Int32 (the device-side
    execution counter: one relaxed atomic add per launch, by thread 0 of the grid's first CTA), save_index Int32,
    eps Float32, and the CUDA stream.
    """

    def __init__(self, hidden: int, kind: AttnResKind) -> None:
        self.kind = kind
        self.plan = ClusterPlan.for_hidden(hidden)
        self.partials = kind.partials

    @cute.jit
    def __call__(
        self,
        prefix: cute.Tensor,
        delta: cute.Tensor | None,
        blocks: cute.Tensor,
        out: cute.Tensor,
        res_norm: cute.Tensor,
        res_proj: cute.Tensor,
        out_norm: cute.Tensor | None,
        launches: cute.Tensor,
        save_index: Int32,
        eps: Float32,
        stream: Any,
    ):
        plan = self.plan
        self.kernel(prefix, delta, blocks, out, res_norm, res_proj, out_norm, launches, save_index, eps).launch(
            grid=[plan.cluster, prefix.shape[0], 1],
            block=[plan.threads, 1, 1],
            cluster=[plan.cluster, 1, 1],
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        prefix: cute.Tensor,
        delta: cute.Tensor | None,
        blocks: cute.Tensor,
        out: cute.Tensor,
        res_norm: cute.Tensor,
        res_proj: cute.Tensor,
        out_norm: cute.Tensor | None,
        launches: cute.Tensor,
        save_index: Int32,
        eps: Float32,
    ):
        kind, plan = self.kind, self.plan
        tidx, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()  # grid x = the CTA's rank in its row's cluster
        vec = rank * plan.threads + tidx  # this thread's 8 columns

        areas = self.allocate_exchange(cutlass.memory.SmemAllocator(), tidx)
        cute.arch.cluster_arrive_relaxed()

        # Weights first: they do not depend on the previous kernel.
        w_mix, w_out = self.load_weights(res_norm, res_proj, out_norm, vec)

        cute.arch.cluster_wait()  # peers' barriers are initialized before anything is pushed to them (see above)
        cute.arch.griddepcontrol_wait()
        if tidx + rank + row == 0:  # thread 0 of the grid's first CTA (all three are non-negative)
            cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")
        bank = [_load8(blocks[row, s, None], vec) for s in range(kind.num_blocks)]
        p = _load8(prefix[row, None], vec).to(Float32)
        if const_expr(kind.delta == "add"):
            p = (p + _load8(delta[row, None], vec).to(Float32)).to(BFloat16).to(Float32)
        elif const_expr(kind.delta == "restart"):
            p = _load8(delta[row, None], vec).to(Float32).to(BFloat16).to(Float32)
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel's wait still covers all of this grid
        self.mix_and_store(bank, p, w_mix, w_out, areas, out, prefix, blocks, row, save_index, vec, tidx, rank, eps)

    # --- the parts of one application, shared with the fused o_proj kernel (kda_o_proj.py) ----------------------

    @cute.jit
    def allocate_exchange(self, smem: Any, tidx: Int32) -> tuple:
        """(barriers, sources area, norm area) of the two exchanges in shared memory, the transaction barriers
        initialized by thread 0. A cluster barrier must publish them before any peer pushes into them."""
        plan = self.plan
        bars = smem.allocate_array(Int64, 2, byte_alignment=8)
        sources_area = smem.allocate_tensor(Float32, cute.make_layout((self.partials, plan.slots)), byte_alignment=16)
        norm_area = smem.allocate_tensor(Float32, cute.make_layout(plan.slots), byte_alignment=16)
        if tidx == 0:
            cute.arch.mbarrier_init(bars, 1)
            cute.arch.mbarrier_init(bars + 1, 1)
            cute.arch.mbarrier_init_fence()
        return bars, sources_area, norm_area

    @cute.jit
    def load_weights(self, res_norm: cute.Tensor, res_proj: cute.Tensor, out_norm: cute.Tensor | None, vec: Int32):
        """(w_norm * w_q, the output norm's weight or None) of this thread's 8 columns, in FP32."""
        w_mix = _load8(res_norm, vec).to(Float32) * _load8(res_proj, vec).to(Float32)
        w_out = _load8(out_norm, vec).to(Float32) if const_expr(self.kind.out_norm) else None
        return w_mix, w_out

    @cute.jit
    def mix_and_store(
        self,
        bank: list,
        p: cute.TensorSSA,
        w_mix: cute.TensorSSA,
        w_out: cute.TensorSSA | None,
        areas: tuple,
        out: cute.Tensor,
        prefix: cute.Tensor,
        blocks: cute.Tensor,
        row: Int32,
        save_index: Int32,
        vec: Int32,
        tidx: Int32,
        rank: Int32,
        eps: Float32,
    ):
        """Mix this thread's 8 columns of the bank blocks (BF16) and the new prefix p (FP32, BF16 values) over the
        cluster, norm, and store the output, the prefix (when delta changed it) and the saved block of row `row`."""
        self.mix_and_store_rows([bank], [p], w_mix, w_out, [areas], out, prefix, blocks, [row], [None], save_index,
                                vec, tidx, rank, eps)  # fmt: skip

    @cute.jit
    def mix_and_store_rows(
        self,
        banks: list,
        ps: list,
        w_mix: cute.TensorSSA,
        w_out: cute.TensorSSA | None,
        areas: list,
        out: cute.Tensor,
        prefix: cute.Tensor,
        blocks: cute.Tensor,
        rows: list,
        stored: list,
        save_index: Int32,
        vec: Int32,
        tidx: Int32,
        rank: Int32,
        eps: Float32,
    ):
        """mix_and_store of several rows, each with its own exchange areas, phase by phase: every row's logit
        partials are pushed before the first row's wait, and every row's norm partial before the first row's norm
        wait, so the rows' exchanges overlap instead of following one another. stored[j]: None, or a condition (the
        same in every CTA of the cluster) without which row j is exchanged but not stored."""
        kind, plan = self.kind, self.plan
        n = len(rows)
        sources = [[b.to(Float32) for b in banks[j]] + [ps[j]] for j in range(n)]
        if const_expr(kind.num_blocks > 0):
            for j in cutlass.range_constexpr(n):
                self._push_logit_partials(sources[j], w_mix, areas[j][1], areas[j][0], tidx, rank)
        mixed = []
        for j in cutlass.range_constexpr(n):
            alphas = [Float32(1.0)]
            if const_expr(kind.num_blocks > 0):
                alphas = self._alphas(areas[j][1], areas[j][0], eps)
            m = _mix(sources[j], alphas)
            if const_expr(kind.out_norm):
                squares = (m * m).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                self._push_sum(Float32(squares), areas[j][2], areas[j][0] + 1, tidx, rank)
            mixed.append(m)
        for j in cutlass.range_constexpr(n):
            result = mixed[j]
            if const_expr(kind.out_norm):
                total = self._summed(areas[j][2], areas[j][0] + 1)
                result = mixed[j] * cute.math.rsqrt(total * (1.0 / plan.hidden) + eps) * w_out
            if const_expr(stored[j] is None):
                self._store_row(result, ps[j], out, prefix, blocks, rows[j], save_index, vec)
            else:
                if stored[j]:
                    self._store_row(result, ps[j], out, prefix, blocks, rows[j], save_index, vec)

    @cute.jit
    def _store_row(
        self,
        result: cute.TensorSSA,
        p: cute.TensorSSA,
        out: cute.Tensor,
        prefix: cute.Tensor,
        blocks: cute.Tensor,
        row: Int32,
        save_index: Int32,
        vec: Int32,
    ):
        """The output, the prefix (when delta changed it) and the saved block of `row`."""
        kind = self.kind
        _store8(result.to(BFloat16), out[row, None], vec)
        if const_expr(kind.delta != "none"):
            _store8(p.to(BFloat16), prefix[row, None], vec)
        if const_expr(kind.save):
            _store8(p.to(BFloat16), blocks[row, save_index, None], vec)

    @cute.jit
    def _push_logit_partials(
        self, sources: list, w_mix: cute.TensorSSA, area: cute.Tensor, bar: Any, tidx: Int32, rank: Int32
    ):
        """Each warp's partial logits and squares of every source, pushed to every CTA of the cluster (`_alphas`
        waits for them)."""
        plan, k = self.plan, self.kind.sources
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        partial = [warp_sum(Float32((s * w_mix).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))) for s in sources]
        partial += [warp_sum(Float32((s * s).reduce(cute.ReductionOp.ADD, Float32(0.0), 0))) for s in sources]
        partial += [Float32(0.0)] * (self.partials - 2 * k)
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.partials * plan.slots * 4)
        slot = rank * plan.warps + warp
        if lane < plan.cluster:  # lane r pushes this warp's partials to CTA r
            for q in cutlass.range_constexpr(self.partials // 4):
                words = tuple(partial[4 * q + j].bitcast(Int32) for j in range(4))
                dst = area.iterator + cute.assume(slot * self.partials + 4 * q, divby=4)
                cute.arch.store_async_dsmem(dst, words, bar, lane)

    @cute.jit
    def _alphas(self, area: cute.Tensor, bar: Any, eps: Float32) -> list:
        """[alpha_0, ..., alpha_n] from every warp's pushed partials, bit-identical in every thread of the cluster."""
        plan, k = self.plan, self.kind.sources
        lane = cute.arch.lane_idx()
        cute.arch.mbarrier_wait(bar, 0)
        # Lane i totals partial i over every (CTA, warp) in a fixed order; lane s then holds source s's logit.
        total = Float32(0.0)
        if lane < 2 * k:
            for j in cutlass.range_constexpr(plan.slots):
                total = total + area[lane, j]
        squares = cute.arch.shuffle_sync(total, lane + k)
        logit = Float32(float("-inf"))
        if lane < k:
            logit = total * cute.math.rsqrt(squares * (1.0 / plan.hidden) + eps)
        peak = logit
        for i in cutlass.range_constexpr(5):
            peak = cute.arch.fmax(peak, cute.arch.shuffle_sync_bfly(peak, offset=1 << i))
        e = Float32(0.0)
        if lane < k:
            e = cute.math.exp(logit - peak)
        alpha = e * cute.arch.rcp_approx(warp_sum(e))
        return [cute.arch.shuffle_sync(alpha, s) for s in range(k)]

    @cute.jit
    def _push_sum(self, x: Float32, area: cute.Tensor, bar: Any, tidx: Int32, rank: Int32):
        """Each warp's sum of `x`, pushed to every CTA of the cluster (`_summed` waits for them)."""
        plan = self.plan
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        x = warp_sum(x)
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, plan.slots * 4)
        if lane < plan.cluster:
            cute.arch.store_async_dsmem(area.iterator + (rank * plan.warps + warp), x.bitcast(Int32), bar, lane)

    @cute.jit
    def _summed(self, area: cute.Tensor, bar: Any) -> Float32:
        """The sum of what `_push_sum` pushed over every thread of the cluster, bit-identical everywhere."""
        plan = self.plan
        lane = cute.arch.lane_idx()
        cute.arch.mbarrier_wait(bar, 0)
        y = Float32(0.0)
        if lane < plan.slots:
            y = area[lane]
        return warp_sum(y)


@cute.jit
def _load8(row: cute.Tensor, vec: Int32) -> cute.TensorSSA:
    """The 8 elements of column group `vec` of a row, in 16-byte loads (two for FP32)."""
    per_load = 128 // row.element_type.width
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), row.element_type, num_bits_per_copy=128)
    src = cute.local_tile(row, (VECTOR,), (vec,))
    frag = cute.make_rmem_tensor((VECTOR,), row.element_type)
    for i in cutlass.range_constexpr(VECTOR // per_load):
        cute.copy(atom, cute.local_tile(src, (per_load,), (i,)), cute.local_tile(frag, (per_load,), (i,)))
    return frag.load()


@cute.jit
def _store8(values: cute.TensorSSA, row: cute.Tensor, vec: Int32):
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    frag = cute.make_rmem_tensor((VECTOR,), BFloat16)
    frag.store(values)
    cute.copy(atom, frag, cute.local_tile(row, (VECTOR,), (vec,)))


@cute.jit
def _mix(sources: list, alphas: list) -> cute.TensorSSA:
    """sum_s alpha_s source_s, left to right. Which product the first add fuses is the compiler's (pinning it with
    primitives.fma costs the B64 eight-block o_proj epilogue a spill); builds claiming the same bits are checked to
    store the same expressions (test_kda_o_proj_build) or the same outputs on the GPU."""
    m = sources[0] * alphas[0]
    for s in cutlass.range_constexpr(1, len(sources)):
        m = m + sources[s] * alphas[s]
    return m
