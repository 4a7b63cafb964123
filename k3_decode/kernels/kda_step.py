"""The fused KDA decode step (q = 1) for Hopper (sm_90a) in CuTe DSL: f_b, conv, norms, gates, delta rule, readout
and gated RMSNorm in one launch.

Compiled for sm_90a on the CPU with its PTX and SASS checked by `k3gate kernels build`. The GPU test
(tests/k3_decode/kernels/test_kda_step_gpu.py) checks it against the FP64 oracle and the stock step on an H200; it
passed at a3ad2f6, and its provider (providers.py, CuteKdaStepProvider) is registered.

Semantics are those of the oracle's `kda_decode_step` (k3_decode/reference/kda.py) and of the stock step
(k3_decode/stock/kda.py: the cuBLAS f_b GEMM, then the Triton `kda_decode_kernel`). Per request b with slot s =
slots[b] and head h, with the packed row x = [q | k | v | g_out | f_a | beta | pad] (kda_step_plan.py), D = 128:
  s <= 0 (NULL, CUDA-graph padding): out[b] = 0, no state read or written;
  conv: y_c = sum_j w[c, j] tap_j + w[c, 3] x_c over the 3 stored taps (oldest first), SiLU; the taps become
        [tap_1, tap_2, x_c] (conv state [slots, 3P, 3] BF16, the KdaCache layout, rewritten in place);
  q <- q / sqrt(|q|^2 + l2_eps) * D^-0.5, k <- k / sqrt(|k|^2 + l2_eps) per head; beta = sigmoid(x_beta);
  g = lower_bound * sigmoid(exp(A_log[h]) * (f_a . f_b[c] + dt_bias[c])) per key channel c;
  S[v, :] <- S[v, :] * exp(g);  u_v = beta (v_v - S[v, :] . k);  S[v, :] += u_v k  (FP32 state [slots, H, 128, 128]);
  o_v = S[v, :] . q;  out = o / sqrt(mean(o^2) + norm_eps) * o_norm * sigmoid(g_out), BF16 [B, P].
All arithmetic is FP32. The f_b product stays FP32 (the stock path rounds it to BF16 between its two launches), so
the decay is closer to the oracle than stock's.

Why this design. At TP8 B = 1 the step moves ~2 MB (12 heads x 64 KB of state in and out, 27 KB of conv state,
the f_b weight) and does almost no arithmetic, so it is bound by latency and by how many SMs share the traffic:
- A cluster of C CTAs per (request, head) splits the head's 128 value rows: CTA r owns rows [rR, (r+1)R),
  R = 128 / C, four per warp, one 16-byte vector of every row per lane. The delta rule is independent per value
  row (u_v = beta (v_v - S_v . k), S_v += u_v k, o_v = S_v . q), so nothing but the output norm crosses CTAs. One
  CTA per head would leave 120 of 132 SMs idle at TP8 B1 and stream 64 KB through one SM; C = 8 puts 96 CTAs of 8
  KB each on 96 SMs. The plan picks the smallest C whose grid still covers every SM (C = 2 from TP8 B8): the
  state work is 32 warps per head whatever C is, and a smaller C repeats less per-CTA work (below).
- Every CTA needs the head's whole q and k (for their L2 norms and the dot products) and the decay of all 128 key
  channels. The conv of q and k is cheap (256 channels, one warp, 8 channels per lane), so every CTA recomputes it
  from the same inputs with the same code: the norms are bit-identical in all CTAs without an exchange. f_b is not:
  the decay of 128 channels is a 128 x 128 BF16 matvec (32 KB of f_b per head), which repeated in 8 CTAs would read
  8 x 32 KB per (request, head) from L2 (200 MB at TP8 B64). Instead CTA r computes the decay of its own R channels
  (R rows of f_b, 2 vectors per thread) and pushes them over DSMEM (`st.async` completing a transaction mbarrier in
  every CTA of the cluster, as attn_res.py does): each decay is computed once, each f_b byte read once per request,
  and the exchange (one 8-byte push per warp, lane and half) overlaps the conv and the state loads.
- The gated RMSNorm needs sum(o^2) over the head's 128 outputs: each warp pushes its partial (its 4 rows) to every
  CTA of the cluster; every CTA receives the same 32 partials and sums them in the same fixed order (a butterfly
  over 32 lanes, lane i holding partial i = (CTA i / warps, warp i % warps)), so all CTAs scale by the same bits.
  Every other reduction is a butterfly within a warp, deterministic, and none is fed by a bare product (the ptx
  lint forbids a butterfly step contracted into an FMA): the first step of every butterfly adds sums that end in
  an FMA, or shared-memory loads.
- Conv taps: every CTA reads the taps of the head's 256 q and k channels, but each channel's taps are rewritten by
  exactly one CTA (CTA r: q and k channels [rR, (r+1)R) and its own v channels). A rewrite must not land before a
  peer's read, so every thread arrives on the cluster barrier (release) once its CTA's taps are in shared memory
  and consumed, and the rewriting lanes wait on it (acquire) at the very end, long after every CTA has arrived.
  The CTA's mbarrier initialization is published by the cluster barrier before (arrive relaxed at the start, wait
  before `griddepcontrol.wait`, where it costs nothing), so two cluster barrier phases in all.
- Every input a CTA reads arrives by `cp.async.bulk` (global to shared memory, completing a transaction mbarrier),
  issued by one thread; the lanes read it from shared memory once its barrier completes. Four groups, one barrier
  each: the weights (the CTA's R f_b rows and the conv weights of its channels), the packed row's sections (the
  conv inputs of its channels, f_a, its output gates), the conv taps, and its state rows (8 KB at C = 8). Why not
  plain loads into registers: ptxas schedules those to save registers, and it sank the state loads (the largest
  read, needed last) below the conv, serializing two memory latencies; a bulk copy has no register result to
  economize on, and its consumers cannot run before it is issued. It also leaves ~24 registers per thread instead
  of ~90, so every plan keeps 32 warps per SM (.minnctapersm, 64 registers: 8 CTAs of 128 threads or 2 of 512).
- Programmatic dependent launch. The weights are copied before `griddepcontrol.wait` (f_b, the conv weights, and
  A_log, dt_bias and o_norm, those three into registers): they do not depend on the previous kernel. The packed
  row (the in_proj output) is copied only after it, first thing. The state (recurrent and conv) is NOT copied
  before the wait: that is correct only if the kernel just before this one in the stream neither writes the
  state nor lets its dependents start before its own wait; in a decode step it is the input projection, but two
  steps back to back (this kernel starts its dependents before its state stores) would read the state before the
  previous step wrote it, and griddepcontrol.wait is the only ordering PDL gives. Instead one thread reads the slot
  (clamped into the tables) and issues `cp.async.bulk.prefetch.L2` of the CTA's state rows and the head's taps
  before the wait: a prefetch puts nothing anywhere but L2, and L2 is the GPU's point of coherence, so a stale
  slot only warms the wrong lines and no value can be stale, with any neighbour; after the wait the slot is read
  again and the copies hit L2. The device-side launch counter is one relaxed atomic by one thread, after the wait.
- The only plain global loads are A_log, dt_bias, o_norm and the slot hint (before the wait) and the slot and beta
  (after it), none invariant (`.nc`, which may legally be hoisted above the wait; the build checks there are none).
  The stores are plain 16-byte stores from registers: the state rows, the taps, the BF16 outputs (8 bytes a warp).

Verify (`KdaStepKernel.verify`, a KdaVerifyPlan): one launch does what the stock verify pipeline does in five (the
f_b GEMM, the conv, fla-core's recurrence, a state scatter, the gated norm), with the semantics of the oracle's
`kda_verify_step` and the stock `kda_verify_step`. Per request b with q tokens, slots [B, q], a = num_accepted[b]:
  slot[b, 0] <= 0 (NULL): out[b, :] = 0, nothing read or written;
  the conv row lives in slot[b, 0], T = 2 + q columns c_0 .. c_T-1 (vLLM's conv state for q - 1 speculative
        tokens); token t's conv runs over s[t .. t + 3] of the sequence s = [c_a-1, c_a, c_a+1, x_0 .. x_q-1], and
        the row becomes s[1 ..] = [c_a, c_a+1, x_0 .. x_q-1];
  the state is read from slot[b, a - 1]; the state after token t is written to slot[b, t] when that slot is > 0
        (token t's output is computed either way); tokens run in order on the FP32 state kept in registers.
a is clamped into 1..q and a NULL accepted slot reads slot 0, as stock's sanitized tables do (the oracle refuses
both). The geometry is the decode kernel's, request by request (the cluster, the value rows per CTA, the conv lanes,
the exchanges), and every per-token computation has its arithmetic in the same order, so a one-token verify that
accepted one token should give the decode kernel's bits, and q tokens those of q chained decode steps (the GPU test
compares both). Differences, all
for registers (the decode kernel's budget of 64 holds, no spills): the conv runs channel by channel into shared
memory and the L2 norms read it back; the tokens' q, k, v, beta, slots and readouts sit in shared memory; the
per-token scalars (beta, the slot) are read by one lane per token; lane 0 of each warp, which stored the warp's
readouts, applies the gated norm. The kernel's CUDA name contains `KdaStepKernel` and it adds to the decode kernel's
device counter: for the ledger and the sanitizer, op kda launches one kernel named KdaStepKernel per call, decode or
verify.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from k3_decode.kernels import cutedsl
from k3_decode.kernels.kda_step_plan import (
    CONV_WIDTH,
    GATE_RANK,
    HEAD_DIM,
    ROWS_PER_WARP,
    KdaStepPlan,
    KdaVerifyPlan,
)

TAPS = CONV_WIDTH - 1
VECTOR = 8  # BF16 elements in one 16-byte access


def compile_args(plan: KdaStepPlan) -> tuple[Any, ...]:
    """Fake arguments of one compile. The slot count of the two caches is dynamic (one compile serves any cache);
    everything else is fixed by the plan. The conv weight is passed flat [3P * 4] and the conv state as
    [slots, 3P * 3], so 8 channels are one contiguous run of 16-byte vectors."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    def dynamic(dtype: Any, shape: tuple[Any, ...]) -> Any:
        order = tuple(range(len(shape)))[::-1]
        return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)

    slot_type = Int64 if plan.slot_dtype == "int64" else Int32
    p = plan.proj
    return (
        cutedsl.fake_tensor(BFloat16, (plan.batch, plan.rows)),  # packed
        cutedsl.fake_tensor(BFloat16, (p, GATE_RANK)),  # f_b
        cutedsl.fake_tensor(BFloat16, (plan.conv_channels * CONV_WIDTH,)),  # conv weight, flat
        cutedsl.fake_tensor(Float32, (plan.heads,)),  # A_log
        cutedsl.fake_tensor(Float32, (p,)),  # dt_bias
        cutedsl.fake_tensor(BFloat16, (HEAD_DIM,)),  # o_norm
        dynamic(BFloat16, (cute.sym_int(), plan.conv_channels * TAPS)),  # conv state
        dynamic(Float32, (cute.sym_int(), plan.heads, HEAD_DIM, HEAD_DIM)),  # recurrent state
        cutedsl.fake_tensor(slot_type, (plan.batch,)),  # slots
        cutedsl.fake_tensor(BFloat16, (plan.batch, p)),  # out
        cutedsl.fake_tensor(Int32, (1,)),  # launches: the device-side execution counter
        Float32(-5.0),  # gate lower bound
        Float32(1e-6),  # L2 eps
        Float32(1e-5),  # norm eps
        cutedsl.fake_stream(),
    )


def verify_compile_args(plan: KdaVerifyPlan) -> tuple[Any, ...]:
    """Fake arguments of one verify compile: compile_args' but packed [B, q, rows], the conv state [slots, 3P * T]
    (T = 2 + q columns), slots [B, q], num_accepted [B] after them, out [B, q, P]."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    def dynamic(dtype: Any, shape: tuple[Any, ...]) -> Any:
        order = tuple(range(len(shape)))[::-1]
        return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)

    index = {"int32": Int32, "int64": Int64}
    p, batch, q = plan.proj, plan.batch, plan.tokens
    return (
        cutedsl.fake_tensor(BFloat16, (batch, q, plan.rows)),  # packed
        cutedsl.fake_tensor(BFloat16, (p, GATE_RANK)),  # f_b
        cutedsl.fake_tensor(BFloat16, (plan.conv_channels * CONV_WIDTH,)),  # conv weight, flat
        cutedsl.fake_tensor(Float32, (plan.heads,)),  # A_log
        cutedsl.fake_tensor(Float32, (p,)),  # dt_bias
        cutedsl.fake_tensor(BFloat16, (HEAD_DIM,)),  # o_norm
        dynamic(BFloat16, (cute.sym_int(), plan.conv_channels * plan.columns)),  # conv state
        dynamic(Float32, (cute.sym_int(), plan.heads, HEAD_DIM, HEAD_DIM)),  # recurrent state
        cutedsl.fake_tensor(index[plan.slot_dtype], (batch, q)),  # slots
        cutedsl.fake_tensor(index[plan.accepted_dtype], (batch,)),  # num_accepted
        cutedsl.fake_tensor(BFloat16, (batch, q, p)),  # out
        cutedsl.fake_tensor(Int32, (1,)),  # launches: the device-side execution counter (the decode kernel's)
        Float32(-5.0),  # gate lower bound
        Float32(1e-6),  # L2 eps
        Float32(1e-5),  # norm eps
        cutedsl.fake_stream(),
    )


class KdaStepKernel:
    """One KDA decode step for a fixed plan (heads, packed row width, batch, cluster, slot dtype).

    Arguments of the compiled function, all on one device, 16-byte aligned, row-major and contiguous: packed [B, rows]
    BF16 (the in_proj output), f_b [P, 128] BF16, conv weight [3P * 4] BF16 (the [3P, 4] weight flattened), A_log [H]
    FP32, dt_bias [P] FP32, o_norm [128] BF16, conv state [slots, 3P * 3] BF16 (the [slots, 3P, 3] state flattened,
    rewritten in place), recurrent state [slots, H, 128, 128] FP32 (in place), slots [B] Int32 or Int64 (<= 0: NULL),
    out [B, P] BF16, launches [1] Int32 (the device-side execution counter: one relaxed atomic add per launch, by
    thread 0 of the grid's first CTA), the gate lower bound, the L2 eps and the norm eps (Float32), the CUDA stream.
    """

    def __init__(self, plan: KdaStepPlan) -> None:
        self.plan = plan

    @cute.jit
    def __call__(
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
        stream: Any,
    ):
        plan = self.plan
        self.kernel(
            packed,
            f_b,
            conv_w,
            a_log,
            dt_bias,
            o_norm,
            conv_state,
            state,
            slots,
            out,
            launches,
            lower_bound,
            l2_eps,
            norm_eps,
        ).launch(
            grid=[plan.cluster, plan.heads, plan.batch],
            block=[plan.threads, 1, 1],
            cluster=[plan.cluster, 1, 1],
            smem=plan.smem_bytes,
            # 1024 threads per SM (ptxas caps registers at 64 to fit them): 8 CTAs of 128 threads or 2 of 512.
            # Naming the carveout keeps CuTe DSL from asking the driver for the SM's shared memory at compile time.
            min_blocks_per_mp=plan.ctas_per_sm,
            preferred_smem_carveout=100,
            stream=stream,
            use_pdl=True,
        )

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
        rows = plan.rows_per_cta
        sec = plan.sections
        tidx, _, _ = cute.arch.thread_idx()
        rank, head, b = cute.arch.block_idx()  # grid x = the CTA's rank in its head's cluster
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        first = head * HEAD_DIM + rank * rows  # the CTA's first channel (value row, decay channel) within P
        col = lane % 16  # the f_a / f_b vector this lane multiplies
        # The f_b rows (decay channels) of half-warp `lane // 16`, local to the CTA: 2 w + half and R/2 more.
        fb_rows = [2 * warp + lane // 16 + j * (rows // 2) for j in range(2)]
        # The conv lanes: warp 0 convolves the head's q (lanes 0-15) and k (16-31) channels, 8 per lane; lanes
        # 0 .. R/8 - 1 of warp 1 the CTA's own v channels. Every other lane convolves the CTA's first v channels
        # too (a broadcast read of shared memory) and discards them, so the conv is no divergent block. `cl` is the
        # lane's first channel in the CTA's local numbering (kda_step_plan.py), `chan` in the conv state's.
        is_qk = warp == 0
        is_conv = is_qk or (warp == 1 and lane < plan.v_lanes)
        cl = VECTOR * lane  # warp 0: q, then k
        chan = (lane // 16) * sec["k"] + head * HEAD_DIM + VECTOR * col
        if warp != 0:
            cl = 2 * HEAD_DIM
            chan = sec["v"] + first
            if is_conv:
                cl = cl + VECTOR * lane
                chan = chan + VECTOR * lane

        smem = cutlass.utils.SmemAllocator()
        # mbarriers: 0 the decay exchange, 1 the norm exchange; then one per group of bulk copies into shared
        # memory: 2 the weights, 3 the packed row's sections, 4 the conv taps, 5 the state rows.
        bars = smem.allocate_array(Int64, 6, byte_alignment=128)
        state_s = smem.allocate_tensor(Float32, cute.make_layout((rows, HEAD_DIM), stride=(HEAD_DIM, 1)), 128)
        fb_s = smem.allocate_tensor(BFloat16, cute.make_layout((rows, GATE_RANK), stride=(GATE_RANK, 1)), 128)
        cw_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.conv_local * CONV_WIDTH), 128)
        x_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.packed_bytes // 2), 128)
        taps_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.conv_local * TAPS), 128)
        decay_s = smem.allocate_tensor(Float32, cute.make_layout(HEAD_DIM), 128)
        qk_s = smem.allocate_tensor(Float32, cute.make_layout(2 * HEAD_DIM), 128)  # q, then k
        v_s = smem.allocate_tensor(Float32, cute.make_layout(rows), 128)
        norm_s = smem.allocate_tensor(Float32, cute.make_layout(plan.slots), 128)
        fa_at = plan.conv_local  # x_s holds the conv inputs (local channels), then f_a, then the output gate
        gate_at = fa_at + GATE_RANK
        if tidx == 0:
            for i in cutlass.range_constexpr(6):
                cute.arch.mbarrier_init(bars + i, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.fence_proxy("async.shared", space="cta")  # the bulk copies complete these barriers
            # Each barrier completes when its bytes have arrived: the pushes of the whole cluster, or its copies.
            sizes = (HEAD_DIM * 4, plan.slots * 4, plan.weight_bytes, plan.packed_bytes, plan.tap_bytes)
            for i in cutlass.range_constexpr(5):
                cute.arch.mbarrier_arrive_and_expect_tx(bars + i, sizes[i])
            cute.arch.mbarrier_arrive_and_expect_tx(bars + 5, plan.state_bytes)
            # Weights first: they do not depend on the previous kernel.
            _bulk_copy(fb_s.iterator, f_b[first, None].iterator, rows * GATE_RANK * 2, bars + 2)
            for start, local, count in plan.conv_runs(head, rank):
                src = conv_w.iterator + CONV_WIDTH * start
                _bulk_copy(cw_s.iterator + CONV_WIDTH * local, src, count * CONV_WIDTH * 2, bars + 2)
            self._prefetch_state(conv_state, state, slots[b], head, rank)
        cute.arch.cluster_arrive_relaxed()
        dt = [dt_bias[first + fb_rows[j]] for j in range(2)]
        decay_rate = cute.math.exp(a_log[head])
        w_norm = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
        _copy(o_norm, ROWS_PER_WARP, rank * (rows // ROWS_PER_WARP) + warp, w_norm)

        cute.arch.cluster_wait()  # peers' barriers are initialized before anything is pushed to them
        cute.arch.griddepcontrol_wait()
        x = packed[b, None]
        if tidx == 0:
            # The packed row's sections, first: the conv inputs of the CTA's channels, f_a, its output gates.
            for start, local, count in plan.conv_runs(head, rank):
                _bulk_copy(x_s.iterator + local, x.iterator + start, count * 2, bars + 3)
            _bulk_copy(x_s.iterator + fa_at, x.iterator + sec["f_a"], GATE_RANK * 2, bars + 3)
            _bulk_copy(x_s.iterator + gate_at, x.iterator + (sec["g"] + first), rows * 2, bars + 3)
            if rank + head + b == 0:  # thread 0 of the grid's first CTA (all three are non-negative)
                cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")

        slot = Int32(slots[b])  # read again: the copy before the wait only steered the prefetch
        if slot > 0:
            row0 = Int64(slot)  # 64-bit offsets: a slot of the recurrent state is 786 KB at TP8
            conv_row = conv_state[row0, None]
            if tidx == 0:  # the state rows, then the taps; both from L2 (prefetched before the wait)
                _bulk_copy(state_s.iterator, state[row0, head, rank * rows, None].iterator, plan.state_bytes, bars + 5)
                for start, local, count in plan.conv_runs(head, rank):
                    _bulk_copy(
                        taps_s.iterator + TAPS * local, conv_row.iterator + TAPS * start, count * TAPS * 2, bars + 4
                    )
            beta = _sigmoid(x[sec["beta"] + head].to(Float32))

            # The conv: every lane convolves 8 local channels (cl); see is_conv above for which it keeps.
            cute.arch.mbarrier_wait(bars + 2, 0)  # the weights
            cute.arch.mbarrier_wait(bars + 3, 0)  # the packed row's sections
            cute.arch.mbarrier_wait(bars + 4, 0)  # the taps
            cw = cute.make_rmem_tensor((VECTOR * CONV_WIDTH,), BFloat16)  # 8 channels x 4 taps, channel-major
            for i in cutlass.range_constexpr(CONV_WIDTH):
                _copy(cw_s, VECTOR, CONV_WIDTH * (cl // VECTOR) + i, _part(cw, VECTOR, i))
            taps = cute.make_rmem_tensor((VECTOR * TAPS,), BFloat16)  # 8 channels x 3 taps, channel-major
            for t in cutlass.range_constexpr(TAPS):
                _copy(taps_s, VECTOR, TAPS * (cl // VECTOR) + t, _part(taps, VECTOR, t))
            inputs = cute.make_rmem_tensor((VECTOR,), BFloat16)
            _copy(x_s, VECTOR, cl // VECTOR, inputs)
            act = cute.make_rmem_tensor((VECTOR,), Float32)
            _conv_silu(cw, taps, inputs, act)

            # The decays of the CTA's channels, pushed to every CTA of the cluster (decay_s[c] = exp(g_c)).
            fa = cute.make_rmem_tensor((VECTOR,), BFloat16)
            _copy(x_s, VECTOR, fa_at // VECTOR + col, fa)
            for j in cutlass.range_constexpr(2):
                fb = cute.make_rmem_tensor((VECTOR,), BFloat16)
                _copy(fb_s[fb_rows[j], None], VECTOR, col, fb)
                dot = _dot(fb, fa, VECTOR)
                for i in cutlass.range_constexpr(4):  # the half-warp's 16 lanes hold one f_b row
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << i)
                decay = cute.math.exp(lower_bound * _sigmoid(decay_rate * (dot + dt[j])))
                odd = cute.arch.shuffle_sync_down(decay, offset=16)  # the next row, from the other half-warp
                if lane < plan.cluster:
                    dst = decay_s.iterator + cute.assume(rank * rows + 2 * warp + j * (rows // 2), divby=2)
                    cute.arch.store_async_dsmem(dst, (decay.bitcast(Int32), odd.bitcast(Int32)), bars, lane)

            if is_qk:  # the L2 norms over the head's 128 channels: 16 lanes of 8 each
                squares = _dot(act, act, VECTOR)
                for i in cutlass.range_constexpr(4):
                    squares = squares + cute.arch.shuffle_sync_bfly(squares, offset=1 << i)
                scale = cute.math.rsqrt(squares + l2_eps)
                if lane < 16:
                    scale = scale * (HEAD_DIM**-0.5)
                _store_f32(act, scale, qk_s, VECTOR * lane)  # q at 0 .. 127, k at 128 .. 255
            elif is_conv:
                _store_f32(act, Float32(1.0), v_s, VECTOR * lane)
            cute.arch.sync_threads()  # q, k and v are in shared memory
            cute.arch.cluster_arrive()  # this CTA's tap reads are complete: peers may rewrite theirs (release)
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel's wait still covers all of this grid

            q = cute.make_rmem_tensor((4,), Float32)
            k = cute.make_rmem_tensor((4,), Float32)
            v = cute.make_rmem_tensor((4,), Float32)
            g = cute.make_rmem_tensor((4,), Float32)
            _copy(qk_s, 4, lane, q)
            _copy(qk_s, 4, HEAD_DIM // 4 + lane, k)
            _copy(v_s, 4, warp, v)
            cute.arch.mbarrier_wait(bars, 0)  # every decay of the head has arrived
            _copy(decay_s, 4, lane, g)
            cute.arch.mbarrier_wait(bars + 5, 0)  # the state rows have arrived

            o = [Float32(0.0)] * ROWS_PER_WARP
            for i in cutlass.range_constexpr(ROWS_PER_WARP):
                s = cute.make_rmem_tensor((4,), Float32)
                _copy(state_s[ROWS_PER_WARP * warp + i, None], 4, lane, s)
                for e in cutlass.range_constexpr(4):
                    s[e] = s[e] * g[e]
                predicted = _dot(s, k, 4)
                for m in cutlass.range_constexpr(5):
                    predicted = predicted + cute.arch.shuffle_sync_bfly(predicted, offset=1 << m)
                u = beta * (v[i] - predicted)
                for e in cutlass.range_constexpr(4):
                    s[e] = s[e] + u * k[e]
                _copy(s, 4, lane, state[row0, head, rank * rows + ROWS_PER_WARP * warp + i, None])
                readout = _dot(s, q, 4)
                for m in cutlass.range_constexpr(5):
                    readout = readout + cute.arch.shuffle_sync_bfly(readout, offset=1 << m)
                o[i] = readout

            # The gated RMSNorm: sum(o^2) over the head's 128 rows, from every (CTA, warp) of the cluster.
            partial = o[0] * o[0]
            for i in cutlass.range_constexpr(1, ROWS_PER_WARP):
                partial = partial + o[i] * o[i]
            if lane < plan.cluster:
                dst = norm_s.iterator + (rank * plan.warps + warp)
                cute.arch.store_async_dsmem(dst, partial.bitcast(Int32), bars + 1, lane)
            gate = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
            _copy(x_s, ROWS_PER_WARP, gate_at // ROWS_PER_WARP + warp, gate)
            cute.arch.mbarrier_wait(bars + 1, 0)
            total = norm_s[lane]  # plan.slots == 32: one partial per lane
            for m in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << m)
            rstd = cute.math.rsqrt(total * (1.0 / HEAD_DIM) + norm_eps)
            y = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
            for i in cutlass.range_constexpr(ROWS_PER_WARP):
                gated = o[i] * rstd * w_norm[i].to(Float32) * _sigmoid(gate[i].to(Float32))
                y[i] = gated.to(BFloat16)
            if lane == 0:
                _copy(y, ROWS_PER_WARP, (head * HEAD_DIM + rank * rows) // ROWS_PER_WARP + warp, out[b, None])

            # The taps this CTA owns: [tap_1, tap_2, x] per channel, once every CTA has read the old ones.
            cute.arch.cluster_wait()
            owner = warp == 1 or col // plan.qk_lanes_per_cta == rank
            if is_conv and owner:
                old = cute.make_rmem_tensor((VECTOR * TAPS,), BFloat16)
                for t in cutlass.range_constexpr(TAPS):
                    _copy(taps_s, VECTOR, TAPS * (cl // VECTOR) + t, _part(old, VECTOR, t))
                _copy(x_s, VECTOR, cl // VECTOR, inputs)
                shifted = cute.make_rmem_tensor((VECTOR * TAPS,), BFloat16)
                for c in cutlass.range_constexpr(VECTOR):
                    shifted[TAPS * c] = old[TAPS * c + 1]
                    shifted[TAPS * c + 1] = old[TAPS * c + 2]
                    shifted[TAPS * c + 2] = inputs[c]
                for t in cutlass.range_constexpr(TAPS):
                    _copy(_part(shifted, VECTOR, t), VECTOR, TAPS * (chan // VECTOR) + t, conv_row)
        else:  # NULL: zero output, no state touched; the copies into this CTA's shared memory land before it exits
            cute.arch.mbarrier_wait(bars + 2, 0)
            cute.arch.mbarrier_wait(bars + 3, 0)
            y = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
            y.fill(0.0)
            if lane == 0:
                _copy(y, ROWS_PER_WARP, (head * HEAD_DIM + rank * rows) // ROWS_PER_WARP + warp, out[b, None])

    @cute.jit
    def _prefetch_state(self, conv_state: cute.Tensor, state: cute.Tensor, hint: Any, head: Int32, rank: Int32):
        """L2 prefetches of what the CTA will read after the wait: its state rows and the head's q, k and its v taps.
        `hint` is the slot read before the wait, clamped into each table, so the addresses are valid whatever it
        held; a stale slot only warms other lines."""
        plan = self.plan
        rows = plan.rows_per_cta
        s = cutlass.max(cutlass.min(Int32(hint), state.shape[0] - 1), 0)
        _bulk_prefetch(state[Int64(s), head, rank * rows, None].iterator, plan.state_bytes)
        c = cutlass.max(cutlass.min(Int32(hint), conv_state.shape[0] - 1), 0)
        taps = conv_state[c, None]
        for start, count in (
            (head * HEAD_DIM, HEAD_DIM),
            (plan.proj + head * HEAD_DIM, HEAD_DIM),
            (2 * plan.proj + head * HEAD_DIM + rank * rows, rows),
        ):
            first = cute.local_tile(taps, (TAPS * VECTOR,), (start // VECTOR,))
            _bulk_prefetch(first.iterator, count * TAPS * 2)

    # --- verify: q tokens per request (KdaVerifyPlan) ------------------------------------------------------------

    @cute.jit
    def verify(
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
        num_accepted: cute.Tensor,
        out: cute.Tensor,
        launches: cute.Tensor,
        lower_bound: Float32,
        l2_eps: Float32,
        norm_eps: Float32,
        stream: Any,
    ):
        """One verify step (module docstring, "Verify"); the plan must be a KdaVerifyPlan. Arguments as `__call__`'s
        but packed [B, q, rows], conv state [slots, 3P * (2 + q)], slots [B, q], num_accepted [B] (Int32 or Int64)
        after slots, out [B, q, P]."""
        plan = self.plan
        self.verify_kernel(
            packed,
            f_b,
            conv_w,
            a_log,
            dt_bias,
            o_norm,
            conv_state,
            state,
            slots,
            num_accepted,
            out,
            launches,
            lower_bound,
            l2_eps,
            norm_eps,
        ).launch(
            grid=[plan.cluster, plan.heads, plan.batch],
            block=[plan.threads, 1, 1],
            cluster=[plan.cluster, 1, 1],
            smem=plan.smem_bytes,
            min_blocks_per_mp=plan.ctas_per_sm,  # the decode kernel's register budget: 64 per thread
            preferred_smem_carveout=100,
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def verify_kernel(
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
        num_accepted: cute.Tensor,
        out: cute.Tensor,
        launches: cute.Tensor,
        lower_bound: Float32,
        l2_eps: Float32,
        norm_eps: Float32,
    ):
        plan = self.plan
        rows, q, cols = plan.rows_per_cta, plan.tokens, plan.columns
        sec = plan.sections
        tidx, _, _ = cute.arch.thread_idx()
        rank, head, b = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        first = head * HEAD_DIM + rank * rows
        col = lane % 16
        fb_rows = [2 * warp + lane // 16 + j * (rows // 2) for j in range(2)]
        # The conv lanes, as the decode kernel's: warp 0 the head's q and k, warp 1 the CTA's v; the rest discard.
        is_qk = warp == 0
        is_conv = is_qk or (warp == 1 and lane < plan.v_lanes)
        cl = VECTOR * lane
        chan = (lane // 16) * sec["k"] + head * HEAD_DIM + VECTOR * col
        if warp != 0:
            cl = 2 * HEAD_DIM
            chan = sec["v"] + first
            if is_conv:
                cl = cl + VECTOR * lane
                chan = chan + VECTOR * lane

        smem = cutlass.utils.SmemAllocator()
        # mbarriers as the decode kernel's: 0 the decays, 1 the norm partials (both: every token's), 2 the weights,
        # 3 every token's packed-row sections, 4 the conv row's columns, 5 the state rows.
        bars = smem.allocate_array(Int64, 6, byte_alignment=128)
        state_s = smem.allocate_tensor(Float32, cute.make_layout((rows, HEAD_DIM), stride=(HEAD_DIM, 1)), 128)
        fb_s = smem.allocate_tensor(BFloat16, cute.make_layout((rows, GATE_RANK), stride=(GATE_RANK, 1)), 128)
        cw_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.conv_local * CONV_WIDTH), 128)
        x_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.packed_bytes // 2), 128)  # token t at t * tok
        taps_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.conv_local * cols), 128)
        decay_s = smem.allocate_tensor(Float32, cute.make_layout(q * HEAD_DIM), 128)
        qk_s = smem.allocate_tensor(Float32, cute.make_layout(q * 2 * HEAD_DIM), 128)  # per token: q, then k
        v_s = smem.allocate_tensor(Float32, cute.make_layout(q * rows), 128)
        o_s = smem.allocate_tensor(Float32, cute.make_layout(q * rows), 128)
        norm_s = smem.allocate_tensor(Float32, cute.make_layout(q * plan.slots), 128)
        beta_s = smem.allocate_tensor(Float32, cute.make_layout(q), 128)
        slot_s = smem.allocate_tensor(Int32, cute.make_layout(q), 128)
        tok = plan.token_bytes // 2  # a token's elements in x_s: conv inputs (local channels), f_a, output gates
        fa_at = plan.conv_local
        gate_at = fa_at + GATE_RANK
        if tidx == 0:
            for i in cutlass.range_constexpr(6):
                cute.arch.mbarrier_init(bars + i, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.fence_proxy("async.shared", space="cta")
            sizes = (plan.decay_bytes, plan.norm_bytes, plan.weight_bytes, plan.packed_bytes, plan.tap_bytes)
            for i in cutlass.range_constexpr(5):
                cute.arch.mbarrier_arrive_and_expect_tx(bars + i, sizes[i])
            cute.arch.mbarrier_arrive_and_expect_tx(bars + 5, plan.state_bytes)
            _bulk_copy(fb_s.iterator, f_b[first, None].iterator, rows * GATE_RANK * 2, bars + 2)
            for start, local, count in plan.conv_runs(head, rank):
                src = conv_w.iterator + CONV_WIDTH * start
                _bulk_copy(cw_s.iterator + CONV_WIDTH * local, src, count * CONV_WIDTH * 2, bars + 2)
            hint = _clamp(Int32(num_accepted[b]), 1, q)
            self._prefetch_verify(conv_state, state, slots[b, 0], slots[b, hint - 1], head, rank)
        cute.arch.cluster_arrive_relaxed()
        dt = [dt_bias[first + fb_rows[j]] for j in range(2)]
        decay_rate = cute.math.exp(a_log[head])
        w_norm = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
        _copy(o_norm, ROWS_PER_WARP, rank * (rows // ROWS_PER_WARP) + warp, w_norm)

        cute.arch.cluster_wait()
        cute.arch.griddepcontrol_wait()
        if tidx == 0:
            for t in cutlass.range_constexpr(q):  # every token's sections, token t at t * tok
                x = packed[b, t, None]
                for start, local, count in plan.conv_runs(head, rank):
                    _bulk_copy(x_s.iterator + (t * tok + local), x.iterator + start, count * 2, bars + 3)
                _bulk_copy(x_s.iterator + (t * tok + fa_at), x.iterator + sec["f_a"], GATE_RANK * 2, bars + 3)
                _bulk_copy(x_s.iterator + (t * tok + gate_at), x.iterator + (sec["g"] + first), rows * 2, bars + 3)
            if rank + head + b == 0:
                cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")

        slot0 = Int32(slots[b, 0])  # the request's conv row, and NULL (<= 0) for the whole request
        if slot0 > 0:
            accepted = _clamp(Int32(num_accepted[b]), 1, q)  # stock clamps it too; the oracle refuses outside 1..q
            read = cutlass.max(Int32(slots[b, accepted - 1]), 0)  # the accepted token's state (NULL: slot 0)
            conv_row = conv_state[Int64(slot0), None]
            if tidx == 0:
                _bulk_copy(
                    state_s.iterator, state[Int64(read), head, rank * rows, None].iterator, plan.state_bytes, bars + 5
                )
                for start, local, count in plan.conv_runs(head, rank):
                    _bulk_copy(
                        taps_s.iterator + cols * local, conv_row.iterator + cols * start, count * cols * 2, bars + 4
                    )
            if warp == 2 and lane < q:  # the per-token scalars (every plan has at least 4 warps)
                beta_s[lane] = _sigmoid(packed[b, lane, sec["beta"] + head].to(Float32))
                slot_s[lane] = Int32(slots[b, lane])

            cute.arch.mbarrier_wait(bars + 2, 0)
            cute.arch.mbarrier_wait(bars + 3, 0)
            cute.arch.mbarrier_wait(bars + 4, 0)
            # The conv, channel by channel (a lane's 8 channels x q tokens of outputs would not fit its registers),
            # each output with the decode kernel's arithmetic (_conv_silu's order), into shared memory; the conv
            # warps are 0 and 1 (warp-uniform), and warp 1's lanes past its v channels repeat its first ones.
            if warp < 2:
                for c in cutlass.range_constexpr(VECTOR):
                    w = cute.make_rmem_tensor((CONV_WIDTH,), BFloat16)
                    _copy(cw_s, CONV_WIDTH, cl + c, w)
                    # The input sequence: columns a - 1 .. a + 1 of the row, then the q new inputs.
                    seq = [taps_s[(cl + c) * cols + (accepted - 1 + j)] for j in range(TAPS)]
                    for t in cutlass.range_constexpr(q):
                        seq.append(x_s[t * tok + cl + c])
                        y = w[TAPS].to(Float32) * seq[t + TAPS].to(Float32)
                        for j in cutlass.range_constexpr(TAPS):
                            y = y + w[j].to(Float32) * seq[t + j].to(Float32)
                        act = y * _sigmoid(y)
                        if is_qk:
                            qk_s[t * 2 * HEAD_DIM + cl + c] = act
                        elif is_conv:
                            v_s[t * rows + cl - 2 * HEAD_DIM + c] = act
            if is_qk:  # the L2 norms of q and k, token by token: 16 lanes of 8 channels each, as in decode
                for t in cutlass.range_constexpr(q):
                    act = cute.make_rmem_tensor((VECTOR,), Float32)
                    for half in cutlass.range_constexpr(2):
                        _copy(qk_s, 4, (t * 2 * HEAD_DIM + cl) // 4 + half, _part(act, 4, half))
                    squares = _dot(act, act, VECTOR)
                    for i in cutlass.range_constexpr(4):
                        squares = squares + cute.arch.shuffle_sync_bfly(squares, offset=1 << i)
                    scale = cute.math.rsqrt(squares + l2_eps)
                    if lane < 16:
                        scale = scale * (HEAD_DIM**-0.5)
                    _store_f32(act, scale, qk_s, t * 2 * HEAD_DIM + VECTOR * lane)

            # The decays of the CTA's channels for every token, pushed to every CTA (decay_s[t * 128 + c]).
            fb = [cute.make_rmem_tensor((VECTOR,), BFloat16) for _ in range(2)]
            for j in cutlass.range_constexpr(2):
                _copy(fb_s[fb_rows[j], None], VECTOR, col, fb[j])
            for t in cutlass.range_constexpr(q):
                fa = cute.make_rmem_tensor((VECTOR,), BFloat16)
                _copy(x_s, VECTOR, (t * tok + fa_at) // VECTOR + col, fa)
                for j in cutlass.range_constexpr(2):
                    dot = _dot(fb[j], fa, VECTOR)
                    for i in cutlass.range_constexpr(4):
                        dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << i)
                    decay = cute.math.exp(lower_bound * _sigmoid(decay_rate * (dot + dt[j])))
                    odd = cute.arch.shuffle_sync_down(decay, offset=16)
                    if lane < plan.cluster:
                        at = t * HEAD_DIM + rank * rows + 2 * warp + j * (rows // 2)
                        dst = decay_s.iterator + cute.assume(at, divby=2)
                        cute.arch.store_async_dsmem(dst, (decay.bitcast(Int32), odd.bitcast(Int32)), bars, lane)
            cute.arch.sync_threads()  # q, k, v, beta and the slots are in shared memory
            cute.arch.cluster_arrive()  # this CTA's tap reads are complete (release)
            cute.arch.griddepcontrol_launch_dependents()

            cute.arch.mbarrier_wait(bars, 0)  # every token's decays
            cute.arch.mbarrier_wait(bars + 5, 0)  # the state rows
            s = [cute.make_rmem_tensor((4,), Float32) for _ in range(ROWS_PER_WARP)]
            for i in cutlass.range_constexpr(ROWS_PER_WARP):
                _copy(state_s[ROWS_PER_WARP * warp + i, None], 4, lane, s[i])
            for t in cutlass.range_constexpr(q):
                qv = cute.make_rmem_tensor((4,), Float32)
                k = cute.make_rmem_tensor((4,), Float32)
                v = cute.make_rmem_tensor((4,), Float32)
                g = cute.make_rmem_tensor((4,), Float32)
                _copy(qk_s, 4, t * (2 * HEAD_DIM // 4) + lane, qv)
                _copy(qk_s, 4, t * (2 * HEAD_DIM // 4) + HEAD_DIM // 4 + lane, k)
                _copy(v_s, 4, t * (rows // 4) + warp, v)
                _copy(decay_s, 4, t * (HEAD_DIM // 4) + lane, g)
                beta = beta_s[t]
                dst = slot_s[t]
                o = [Float32(0.0)] * ROWS_PER_WARP
                for i in cutlass.range_constexpr(ROWS_PER_WARP):
                    for e in cutlass.range_constexpr(4):
                        s[i][e] = s[i][e] * g[e]
                    predicted = _dot(s[i], k, 4)
                    for m in cutlass.range_constexpr(5):
                        predicted = predicted + cute.arch.shuffle_sync_bfly(predicted, offset=1 << m)
                    u = beta * (v[i] - predicted)
                    for e in cutlass.range_constexpr(4):
                        s[i][e] = s[i][e] + u * k[e]
                    if dst > 0:  # the state after token t goes to slot[b, t] when that slot is real
                        _copy(s[i], 4, lane, state[Int64(dst), head, rank * rows + ROWS_PER_WARP * warp + i, None])
                    readout = _dot(s[i], qv, 4)
                    for m in cutlass.range_constexpr(5):
                        readout = readout + cute.arch.shuffle_sync_bfly(readout, offset=1 << m)
                    o[i] = readout
                partial = o[0] * o[0]
                for i in cutlass.range_constexpr(1, ROWS_PER_WARP):
                    partial = partial + o[i] * o[i]
                if lane < plan.cluster:
                    at = norm_s.iterator + (t * plan.slots + rank * plan.warps + warp)
                    cute.arch.store_async_dsmem(at, partial.bitcast(Int32), bars + 1, lane)
                if lane == 0:
                    readouts = cute.make_rmem_tensor((ROWS_PER_WARP,), Float32)
                    for i in cutlass.range_constexpr(ROWS_PER_WARP):
                        readouts[i] = o[i]
                    _copy(readouts, ROWS_PER_WARP, t * (rows // ROWS_PER_WARP) + warp, o_s)

            # The gated RMSNorm of every token, once every CTA's partials of every token have arrived.
            cute.arch.mbarrier_wait(bars + 1, 0)
            for t in cutlass.range_constexpr(q):
                total = norm_s[t * plan.slots + lane]
                for m in cutlass.range_constexpr(5):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << m)
                rstd = cute.math.rsqrt(total * (1.0 / HEAD_DIM) + norm_eps)
                if lane == 0:  # the lane that wrote the warp's readouts to o_s: it reads back only its own stores
                    readouts = cute.make_rmem_tensor((ROWS_PER_WARP,), Float32)
                    _copy(o_s, ROWS_PER_WARP, t * (rows // ROWS_PER_WARP) + warp, readouts)
                    gate = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
                    _copy(x_s, ROWS_PER_WARP, (t * tok + gate_at) // ROWS_PER_WARP + warp, gate)
                    y = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
                    for i in cutlass.range_constexpr(ROWS_PER_WARP):
                        gated = readouts[i] * rstd * w_norm[i].to(Float32) * _sigmoid(gate[i].to(Float32))
                        y[i] = gated.to(BFloat16)
                    _copy(y, ROWS_PER_WARP, first // ROWS_PER_WARP + warp, out[b, t, None])

            # The conv row this CTA owns: [c_a, c_a+1, x_0 .. x_q-1] per channel (the step's input sequence from
            # its second entry), once every CTA has copied the old columns.
            cute.arch.cluster_wait()
            owner = warp == 1 or col // plan.qk_lanes_per_cta == rank
            if is_conv and owner:
                for i in cutlass.range_constexpr(cols):  # 16-byte vector i of the channels' 8 x T columns
                    vec = cute.make_rmem_tensor((VECTOR,), BFloat16)
                    for e in cutlass.range_constexpr(VECTOR):
                        c, column = divmod(VECTOR * i + e, cols)
                        if const_expr(column < 2):  # the old row's columns a and a + 1
                            vec[e] = taps_s[(cl + c) * cols + (accepted + column)]
                        else:  # token column - 2's input
                            vec[e] = x_s[(column - 2) * tok + cl + c]
                    _copy(vec, VECTOR, cols * (chan // VECTOR) + i, conv_row)
        else:  # NULL request: zero output for every token, no state touched; its copies land before it exits
            cute.arch.mbarrier_wait(bars + 2, 0)
            cute.arch.mbarrier_wait(bars + 3, 0)
            y = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
            y.fill(0.0)
            if lane == 0:
                for t in cutlass.range_constexpr(q):
                    _copy(y, ROWS_PER_WARP, first // ROWS_PER_WARP + warp, out[b, t, None])

    @cute.jit
    def _prefetch_verify(
        self, conv_state: cute.Tensor, state: cute.Tensor, conv_hint: Any, state_hint: Any, head: Int32, rank: Int32
    ):
        """L2 prefetches of a verify CTA's reads: its state rows of the accepted token's slot and the conv row's
        columns of its channels, from hints read before the wait and clamped into the tables."""
        plan = self.plan
        rows, cols = plan.rows_per_cta, plan.columns
        s = cutlass.max(cutlass.min(Int32(state_hint), state.shape[0] - 1), 0)
        _bulk_prefetch(state[Int64(s), head, rank * rows, None].iterator, plan.state_bytes)
        c = cutlass.max(cutlass.min(Int32(conv_hint), conv_state.shape[0] - 1), 0)
        taps = conv_state[c, None]
        for start, _, count in plan.conv_runs(head, rank):
            run = cute.local_tile(taps, (cols * VECTOR,), (start // VECTOR,))
            _bulk_prefetch(run.iterator, count * cols * 2)


@cute.jit
def _clamp(x: Int32, low: cutlass.Constexpr[int], high: cutlass.Constexpr[int]) -> Int32:
    """x clamped into [low, high]."""
    return cutlass.max(cutlass.min(x, high), low)


@cute.jit
def _part(frag: cute.Tensor, width: cutlass.Constexpr[int], i: cutlass.Constexpr[int]) -> cute.Tensor:
    """Elements [i * width, (i + 1) * width) of a register fragment."""
    return cute.local_tile(frag, (width,), (i,))


@cute.jit
def _copy(src: cute.Tensor, width: cutlass.Constexpr[int], index: Any, dst: cute.Tensor):
    """Copy `width` contiguous elements in one vector access (16 or 8 bytes). One side is a register fragment of
    `width` elements, the other a 1-D tensor from which tile `index` of `width` elements is taken."""
    dtype = src.element_type
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=width * dtype.width)
    if const_expr(cute.size(src) == width):
        cute.copy(atom, src, cute.local_tile(dst, (width,), (index,)))
    else:
        cute.copy(atom, cute.local_tile(src, (width,), (index,)), dst)


@cute.jit
def _store_f32(values: cute.Tensor, scale: Float32, area: cute.Tensor, start: Any):
    """values * scale into area[start .. start + 8], two 16-byte shared stores."""
    frag = cute.make_rmem_tensor((VECTOR,), Float32)
    for i in cutlass.range_constexpr(VECTOR):
        frag[i] = values[i] * scale
    for half in cutlass.range_constexpr(2):
        _copy(_part(frag, 4, half), 4, start // 4 + half, area)


@cute.jit
def _conv_silu(weights: cute.Tensor, taps: cute.Tensor, inputs: cute.Tensor, act: cute.Tensor):
    """SiLU of the causal conv of 8 channels: weights [8 x 4], taps [8 x 3] (oldest first), inputs [8]."""
    for c in cutlass.range_constexpr(VECTOR):
        y = weights[CONV_WIDTH * c + TAPS].to(Float32) * inputs[c].to(Float32)
        for t in cutlass.range_constexpr(TAPS):
            y = y + weights[CONV_WIDTH * c + t].to(Float32) * taps[TAPS * c + t].to(Float32)
        act[c] = y * _sigmoid(y)


@cute.jit
def _dot(a: cute.Tensor, b: cute.Tensor, n: cutlass.Constexpr[int]) -> Float32:
    """sum_i a_i b_i in FP32, one product then n - 1 FMAs (so a butterfly over it never starts with a bare product)."""
    total = a[0].to(Float32) * b[0].to(Float32)
    for i in cutlass.range_constexpr(1, n):
        total = total + a[i].to(Float32) * b[i].to(Float32)
    return total


@cute.jit
def _sigmoid(x: Float32) -> Float32:
    """1 / (1 + e^-x); saturates to 0 (not NaN) for very negative x, as e^-x overflows to inf."""
    return cute.arch.rcp_approx(1.0 + cute.math.exp(-x))


@cute.jit
def _bulk_copy(dst: Any, src: Any, size: cutlass.Constexpr[int], bar: Any):
    """`cp.async.bulk` of `size` bytes from global to this CTA's shared memory, completing `size` bytes of the
    transaction barrier `bar` (16-byte aligned addresses, `size` a multiple of 16)."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], {$r2}, [{$r3}];",
        read_only_args=[dst.toint(), src.toint(), Int32(size), bar.toint()],
    )


@cute.jit
def _bulk_prefetch(ptr: Any, size: cutlass.Constexpr[int]):
    """`cp.async.bulk.prefetch.L2` of `size` bytes (a multiple of 16) at a 16-byte aligned global address."""
    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};", read_only_args=[ptr.toint(), Int32(size)])
