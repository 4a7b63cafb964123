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
  KB each on 96 SMs, provided the launch spreads them: left alone, the clusters take the first SMs the projection
  frees, eight CTAs to an SM (the phase trace at 2a17303: 96 CTAs on 26 SMs), so the launch asks for enough
  shared memory that no more CTAs than the grid needs share an SM (KdaStepPlan.spread). The plan picks the smallest
  C whose grid still covers every SM (C = 2 from TP8 B8): the state work is 32 warps per head whatever C is, and a
  smaller C repeats less per-CTA work (below).
- Every CTA needs the head's whole q and k (for their L2 norms and the dot products) and the decay of all 128 key
  channels. The conv of q and k is cheap (256 channels, one warp, 8 channels per lane), so every CTA recomputes it
  from the same inputs with the same code: the norms are bit-identical in all CTAs without an exchange. f_b is not:
  the decay of 128 channels is a 128 x 128 BF16 matvec (32 KB of f_b per head), which repeated in 8 CTAs would read
  8 x 32 KB per (request, head) from L2 (200 MB at TP8 B64). Instead CTA r computes the decay of its own R channels
  (R rows of f_b, 2 vectors per thread) and pushes them over DSMEM (`st.async` completing a transaction mbarrier in
  every CTA of the cluster, as attn_res.py does): each decay is computed once, each f_b byte read once per request,
  and the exchange (one 8-byte push per warp, lane and half) overlaps the conv and the state loads. A plan with
  `local_decays` (not served: slower in the KDA layer at B1-B4) copies the head's 128 f_b rows and dt_bias instead
  and computes all 128 decays in every CTA, the same arithmetic per channel, so nothing crosses CTAs before the delta
  rule (`_local_decays`; barrier 0 stays unarmed).
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
  of ~90, so every plan keeps 32 warps per SM (.minnctapersm, 64 registers: 8 CTAs of 128 threads or 2 of 512);
  a plan may hold 48 instead (`resident_threads` 1536, 40 registers: 3 CTAs of 512), which fits without a spill
  when the output gate is read after the norm exchange's wait rather than before it.
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
  `griddepcontrol.launch_dependents` follows those early copies and prefetches, before the wait: the next kernel
  (o_proj) then launches while this one still waits for the projection, and its weight loads overlap this kernel,
  which is latency-bound and leaves HBM nearly idle. Its own griddepcontrol.wait still covers all of this grid,
  whatever it reads. Triggering after the conv instead cost 2.5-3 us per layer at B1 (the KDA layer benchmark's
  timeline: o_proj started only as this kernel ended).
- A lean start (a plan with `lean_start`, served at TP8 B64 from one H100's layer rounds, with wide warps and the
  lean conv since c8d524d). From TP8 B16 and TP16 B32
  the grid runs in waves, and a later wave's CTA does not wait for the projection, so what comes before its state
  copy is its whole start: the plain start reads the slot hint (a global load) before the cluster barrier's
  arrive, waits for the peers, then reads the slot again after griddepcontrol.wait: two load latencies and a
  cluster round trip before the copies (1.9-3.9 us of a CTA's 10-14 in the phase traces at B32 and B64). A lean
  start arrives first, reads the hint and warms L2 only in the grid's first wave (request < `wave_requests`, the
  CTAs that wait for the projection), and waits for the peers' barriers after every copy is issued, which is still
  before its first push. Only the order of the start changes, so the bits are the plain start's (the GPU test
  compares them).
- A lean conv (a plan with `lean_conv`; served with wide warps at TP8 B16 and B64 and TP16 B32). Every warp runs the
  conv code so that it is no divergent block, and warps 2 and up discard what they compute: about 215 of the ~800
  instructions a warp of a live CTA issues. From B16 the grid runs in waves of up to 48 warps an SM and the step is
  bound by instruction issue more than by HBM (docs/kda-layer-h200.md, "Where a KDA step CTA's time goes"), so a
  lean conv has warps 2 and up branch past it (warp-uniform: no divergence) and cuts a CTA's instructions by about a
  fifth; the conv warps do exactly what they did. On one H100 its bits differed from the plain conv's by an ulp in a
  few heads' states at B16 and B64: `_dot` then left the compiler free to fuse either of the first two products, and
  the two builds chose differently in the L2 norm of q and k. primitives.fma pins every such product now, and CI
  checks that a lean-conv build's every thread stores what its plain twin's does (harness/ptx_values.py).
- Joint sums (a plan with `joint_sums`, not served: the same bits on one H100, but the layer got slower). Each
  state row needs two sums over the warp's 32 lanes (S_v . k, then S_v . q), a 5-step butterfly each: 40 shuffles
  and 40 adds a warp for its four rows, the delta rule's largest share of issue. `primitives.warp_sums4` reduces the
  four rows together in the same tree (lane bits 0 to 4, the same pairs added), trading halves in the first two
  steps and broadcasting the four totals: 10 shuffles and 6 adds each time, the same bits. It needs the four
  decayed rows in registers at once (16 more live), which still fits 40 registers without a frame at 1536 threads.
- Wide warps (a plan with `wide_warps`; with the lean conv served at TP8 B16 and B64 and TP16 B32, where the pair saved
  model time in every layer round on one H100). Every warp pays a fixed share of a CTA's work whatever its rows: its
  half-warps' decays, q, k, v and the decays read from shared memory, the barrier waits, the norm's butterfly and rsqrt,
  the output's store. A wide warp owns eight value rows (R / 8 warps a CTA), so it pays that once for eight rows: a live
  CTA runs 72-74 % of a four-row CTA's instructions at every build (harness/ptx_values.py counts them), and at 1024
  threads an SM holds four CTAs of 256 threads instead of two of 512, twice the state copies in flight. The arithmetic
  is the four-row warps': each decay is pushed by another lane but computed the same way, and a wide warp pushes its two
  four-row norm partials as one pair into the slots two four-row warps would fill, so every CTA sums the same 32
  partials in the same order (CI compares the PTX: every lane of all warps together stores what the four-row build's
  do).
- Warming the next wave (a plan with `warm_ahead`, not served until measured): from TP8 B16 and TP16 B32 the grid
  runs in waves of `wave_requests` requests, and each CTA's reads wait for HBM while its SM holds only the resident
  CTAs' chains. Thread 0, after its own copies, issues the same L2 prefetches for the CTA of its rank and head one
  wave later (request b + `ahead`, its slot read after the wait), so HBM streams the next wave's state during this
  one.
- The only plain global loads are A_log, dt_bias, o_norm and the slot hint (before the wait) and the slot and beta
  (after it; with warming, the next wave's slot too), none invariant (`.nc`, which may legally be hoisted above
  the wait; the build checks there are none). The stores are plain 16-byte stores from registers: the state rows,
  the taps, the BF16 outputs (8 bytes a warp).

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

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from k3_decode.kernels import cutedsl
from k3_decode.kernels.kda_step_plan import (
    CONV_WIDTH,
    GATE_RANK,
    HEAD_DIM,
    RESIDENT_THREADS,
    ROWS_PER_WARP,
    KdaStepPlan,
    KdaVerifyPlan,
)
from k3_decode.kernels.phase_trace import words_for
from k3_decode.kernels.primitives import (
    VECTOR,
    bulk_copy,
    bulk_prefetch_l2,
    fma,
    launch_resident,
    trace_stamp,
    warp_sum,
    warp_sums4,
)

TAPS = CONV_WIDTH - 1


def compile_args(plan: KdaStepPlan, trace: bool = False) -> tuple[Any, ...]:
    """Fake arguments of one compile. The slot count of the two caches is dynamic (one compile serves any cache);
    everything else is fixed by the plan. The conv weight is passed flat [3P * 4] and the conv state as
    [slots, 3P * 3], so 8 channels are one contiguous run of 16-byte vectors. A traced build's counter holds the
    phase stamps after the launch count (phase_trace.py)."""
    return (
        cutedsl.fake_tensor(BFloat16, (plan.batch, plan.rows)),  # packed
        *_weight_args(plan),
        *_state_args(plan, TAPS),
        cutedsl.fake_tensor(_index_type(plan.slot_dtype), (plan.batch,)),  # slots
        cutedsl.fake_tensor(BFloat16, (plan.batch, plan.proj)),  # out
        *_scalar_args(words_for(plan.ctas, trace)),
    )


def verify_compile_args(plan: KdaVerifyPlan) -> tuple[Any, ...]:
    """Fake arguments of one verify compile: compile_args' but packed [B, q, rows], the conv state [slots, 3P * T]
    (T = 2 + q columns), slots [B, q], num_accepted [B] after them, out [B, q, P]."""
    batch, q = plan.batch, plan.tokens
    return (
        cutedsl.fake_tensor(BFloat16, (batch, q, plan.rows)),  # packed
        *_weight_args(plan),
        *_state_args(plan, plan.columns),
        cutedsl.fake_tensor(_index_type(plan.slot_dtype), (batch, q)),  # slots
        cutedsl.fake_tensor(_index_type(plan.accepted_dtype), (batch,)),  # num_accepted
        cutedsl.fake_tensor(BFloat16, (batch, q, plan.proj)),  # out
        *_scalar_args(),  # its launch counter is the decode kernel's
    )


def _index_type(dtype: str) -> Any:
    return Int64 if dtype == "int64" else Int32


def _weight_args(plan: KdaStepPlan) -> tuple[Any, ...]:
    p = plan.proj
    return (
        cutedsl.fake_tensor(BFloat16, (p, GATE_RANK)),  # f_b
        cutedsl.fake_tensor(BFloat16, (plan.conv_channels * CONV_WIDTH,)),  # conv weight, flat
        cutedsl.fake_tensor(Float32, (plan.heads,)),  # A_log
        cutedsl.fake_tensor(Float32, (p,)),  # dt_bias
        cutedsl.fake_tensor(BFloat16, (HEAD_DIM,)),  # o_norm
    )


def _state_args(plan: KdaStepPlan, columns: int) -> tuple[Any, ...]:
    """The conv state [slots, 3P * columns] and the recurrent state, each with a dynamic slot count."""
    return (
        cutedsl.fake_tensor(BFloat16, (cute.sym_int(), plan.conv_channels * columns)),  # conv state
        cutedsl.fake_tensor(Float32, (cute.sym_int(), plan.heads, HEAD_DIM, HEAD_DIM)),  # recurrent state
    )


def _scalar_args(counter_words: int = 1) -> tuple[Any, ...]:
    return (
        cutedsl.fake_tensor(Int32, (counter_words,)),  # launches: the device-side execution counter (and stamps)
        Float32(-5.0),  # gate lower bound
        Float32(1e-6),  # L2 eps
        Float32(1e-5),  # norm eps
        cutedsl.fake_stream(),
    )


def _section_offsets(plan: KdaStepPlan) -> tuple[int, int]:
    """Where f_a and the output gates start in a token's part of x_s, after the conv inputs of the local channels."""
    return plan.conv_local, plan.conv_local + GATE_RANK


class _Place(NamedTuple):
    """Where a thread of the decode or the verify kernel works (KdaStepKernel._place)."""

    tidx: Int32
    rank: Int32  # the CTA's rank in its head's cluster
    head: Int32
    b: Int32  # the request
    lane: Int32
    warp: Int32
    first: Int32  # the CTA's first channel (value row, decay channel) within P
    col: Int32  # the f_a / f_b vector this lane multiplies
    fb_rows: list[Int32]  # the CTA-local f_b rows (decay channels) of the lane's half-warp
    is_qk: Any  # the conv lanes and their channels (KdaStepKernel._place)
    is_conv: Any
    cl: Int32
    chan: Int32


class KdaStepKernel:
    """One KDA decode step for a fixed plan (heads, packed row width, batch, cluster, slot dtype).

    Arguments of the compiled function, all on one device, 16-byte aligned, row-major and contiguous: packed [B, rows]
    BF16 (the in_proj output), f_b [P, 128] BF16, conv weight [3P * 4] BF16 (the [3P, 4] weight flattened), A_log [H]
    FP32, dt_bias [P] FP32, o_norm [128] BF16, conv state [slots, 3P * 3] BF16 (the [slots, 3P, 3] state flattened,
    rewritten in place), recurrent state [slots, H, 128, 128] FP32 (in place), slots [B] Int32 or Int64 (<= 0: NULL),
    out [B, P] BF16, launches [1] Int32 (the device-side execution counter: one relaxed atomic add per launch, by
    thread 0 of the grid's first CTA), the gate lower bound, the L2 eps and the norm eps (Float32), the CUDA stream.
    """

    def __init__(self, plan: KdaStepPlan, trace: bool = False) -> None:
        self.plan = plan
        self.trace = trace  # phase stamps in the decode kernel (phase_trace.py); the verify kernel has none

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
        self._launch(
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
            ),
            stream,
        )

    def _launch(self, kernel: Any, stream: Any) -> None:
        """The decode or the verify kernel on a cluster per (request, head), at 1024 threads per SM (ptxas caps
        registers at 64 to fit them): 8 CTAs of 128 threads or 2 of 512; a decode grid smaller than that is spread
        over the SMs by its shared-memory request (KdaStepPlan.launch_smem_bytes)."""
        plan = self.plan
        launch_resident(
            kernel,
            grid=[plan.cluster, plan.heads, plan.groups],  # groups: requests (kda_step_group.py)
            threads=plan.threads,
            cluster=[plan.cluster, 1, 1],
            ctas_per_sm=plan.ctas_per_sm,
            smem=plan.launch_smem_bytes,  # padded to spread a small grid over the SMs (KdaStepPlan.spread)
            stream=stream,
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
        sec = plan.sections
        place = self._place()
        tidx, rank, head, b, lane, warp, first, col, fb_rows, is_qk, is_conv, cl, _ = place
        on, cta = self.trace, rank + plan.cluster * (head + plan.heads * b)  # cta: the grid's linear CTA index
        trace_stamp(on, launches, cta, 0, tidx)

        smem = cutlass.memory.SmemAllocator()
        bars, state_s, fb_s, cw_s, x_s, taps_s, decay_s, qk_s, v_s = self._allocate(smem, 1, TAPS)
        norm_s = smem.allocate_tensor(Float32, cute.make_layout(plan.slots), 128)
        dt_s = None  # the head's dt_bias, copied with the weights where every CTA computes all 128 decays
        if const_expr(plan.local_decays):
            dt_s = smem.allocate_tensor(Float32, cute.make_layout(HEAD_DIM), 128)
        fa_at, gate_at = _section_offsets(plan)
        if tidx == 0:
            self._start(bars, (HEAD_DIM * 4, plan.slots * 4), f_b, conv_w, fb_s, cw_s, place)
            if const_expr(plan.local_decays):
                bulk_copy(dt_s.iterator, dt_bias.iterator + head * HEAD_DIM, HEAD_DIM * 4, bars + 2)
            if const_expr(not plan.lean_start):
                self._warm_own_state(conv_state, state, slots, place)
        cute.arch.griddepcontrol_launch_dependents()  # o_proj may start its weight stream now (see the docstring)
        cute.arch.cluster_arrive_relaxed()
        if const_expr(plan.lean_start):  # noqa: SIM102 -- a compile-time branch cannot share a run-time condition
            if tidx == 0 and b < plan.wave_requests:  # the first wave (every CTA where it is the whole grid)
                self._warm_own_state(conv_state, state, slots, place)
        dt, decay_rate, w_norm = self._head_constants(a_log, dt_bias, o_norm, place)

        if const_expr(not plan.lean_start):  # a lean start waits after its copies are issued (below)
            cute.arch.cluster_wait()  # peers' barriers are initialized before anything is pushed to them
            trace_stamp(on, launches, cta, 1, tidx)
        cute.arch.griddepcontrol_wait()
        trace_stamp(on, launches, cta, 2, tidx)
        x = packed[b, None]
        if tidx == 0:
            self._copy_sections(x, x_s, 0, bars, place)
            if rank + head + b == 0:  # thread 0 of the grid's first CTA (all three are non-negative)
                cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")

        slot = Int32(slots[b])  # read again: the copy before the wait only steered the prefetch
        if const_expr(plan.lean_start):  # every read in flight before the cluster barrier's wait
            if tidx == 0 and slot > 0:
                self._read_state(state_s, taps_s, state, conv_state, slots, Int64(slot), bars, place)
            cute.arch.cluster_wait()  # peers' barriers are initialized before anything is pushed to them
            trace_stamp(on, launches, cta, 1, tidx)
        if slot > 0:
            row0 = Int64(slot)  # 64-bit offsets: a slot of the recurrent state is 786 KB at TP8
            conv_row = conv_state[row0, None]
            if const_expr(not plan.lean_start):  # noqa: SIM102 -- a compile-time branch cannot share a run-time condition
                if tidx == 0:
                    self._read_state(state_s, taps_s, state, conv_state, slots, row0, bars, place)
            trace_stamp(on, launches, cta, 3, tidx)
            beta = _sigmoid(x[sec["beta"] + head].to(Float32))

            # The conv: every lane convolves 8 local channels (cl); see _place for which it keeps.
            cute.arch.mbarrier_wait(bars + 2, 0)  # the weights
            cute.arch.mbarrier_wait(bars + 3, 0)  # the packed row's sections
            cute.arch.mbarrier_wait(bars + 4, 0)  # the taps
            trace_stamp(on, launches, cta, 4, tidx)
            inputs = cute.make_rmem_tensor((VECTOR,), BFloat16)
            act = cute.make_rmem_tensor((VECTOR,), Float32)
            if const_expr(plan.lean_conv):
                if warp < 2:  # warp-uniform: warps 2 and up would only discard it
                    _convolve(cw_s, taps_s, x_s, cl, inputs, act)
            else:
                _convolve(cw_s, taps_s, x_s, cl, inputs, act)

            # The decays of the CTA's channels, pushed to every CTA of the cluster (decay_s[c] = exp(g_c)), or
            # with local_decays all 128 of the head, computed here and stored before the CTA barrier below.
            fa = cute.make_rmem_tensor((VECTOR,), BFloat16)
            _copy(x_s, VECTOR, fa_at // VECTOR + col, fa)
            if const_expr(plan.local_decays):
                self._local_decays(fb_s, fa, dt_s, decay_rate, lower_bound, decay_s, place)
            else:
                for j in cutlass.range_constexpr(len(fb_rows)):
                    fb = cute.make_rmem_tensor((VECTOR,), BFloat16)
                    _copy(fb_s[fb_rows[j], None], VECTOR, col, fb)
                    self._push_decay(fb, fa, j, dt, decay_rate, lower_bound, decay_s, 0, bars, place)

            if is_qk:  # the L2 norms over the head's 128 channels: q at 0 .. 127, k at 128 .. 255
                _store_normalized(act, lane, l2_eps, qk_s, VECTOR * lane)
            elif is_conv:
                _store_f32(act, Float32(1.0), v_s, VECTOR * lane)
            cute.arch.sync_threads()  # q, k and v are in shared memory
            trace_stamp(on, launches, cta, 5, tidx)
            cute.arch.cluster_arrive()  # this CTA's tap reads are complete: peers may rewrite theirs (release)

            area = {"state": state_s, "x": x_s, "taps": taps_s, "decay": decay_s, "qk": qk_s, "v": v_s, "norm": norm_s}
            stamp = (on, launches, cta, tidx)
            self._finish_request(state, out, area, bars, b, row0, beta, place, w_norm, gate_at, norm_eps, stamp)

            # The taps this CTA owns: [tap_1, tap_2, x] per channel, once every CTA has read the old ones.
            cute.arch.cluster_wait()
            self._rewrite_taps(conv_row, area, inputs, place)
            trace_stamp(on, launches, cta, 10, tidx)
        else:  # NULL: zero output, no state touched
            w = plan.rows_per_warp
            y = _null_output(bars, w)
            if lane == 0:
                _copy(y, w, first // w + warp, out[b, None])

    # --- what the decode and the verify kernel share -------------------------------------------------------------

    @cute.jit
    def _place(self) -> _Place:
        """Where this thread works: the CTA's rank in its head's cluster, the head, the request, the lane's f_b rows
        and its conv channels.

        The conv lanes: warp 0 convolves the head's q (lanes 0-15) and k (16-31) channels, 8 per lane; lanes
        0 .. R/8 - 1 of warp 1 the CTA's own v channels. Every other lane convolves the CTA's first v channels too
        (a broadcast read of shared memory) and discards them, so the conv is no divergent block. `cl` is the
        lane's first channel in the CTA's local numbering (kda_step_plan.py), `chan` in the conv state's."""
        plan = self.plan
        rows = plan.rows_per_cta
        sec = plan.sections
        tidx, _, _ = cute.arch.thread_idx()
        rank, head, b = cute.arch.block_idx()  # grid x = the CTA's rank in its head's cluster
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        first = head * HEAD_DIM + rank * rows
        col = lane % 16
        # The f_b rows (decay channels) of half-warp `lane // 16`, local to the CTA: 2 w + half, then every 2 W more
        # (W warps: R/2 at four rows a warp); two per half-warp, four with wide warps.
        fb_rows = [2 * warp + lane // 16 + j * (2 * plan.warps) for j in range(plan.rows_per_warp // 2)]
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
        return _Place(tidx, rank, head, b, lane, warp, first, col, fb_rows, is_qk, is_conv, cl, chan)

    @cute.jit
    def _allocate(self, smem: Any, tokens: cutlass.Constexpr[int], columns: cutlass.Constexpr[int]) -> tuple:
        """The shared memory both kernels start with, in this order (the verify kernel allocates more after it):
        six mbarriers (0 the decay exchange, 1 the norm exchange, both of every token; then one per group of bulk
        copies: 2 the weights, 3 every token's packed-row sections, 4 the conv taps, `columns` per channel, 5 the
        state rows), the copies' destinations, and per token the exchanged decays, q and k (the head's), and v."""
        plan = self.plan
        rows = plan.rows_per_cta
        bars = smem.allocate_array(Int64, 6, byte_alignment=128)
        state_s = smem.allocate_tensor(Float32, cute.make_layout((rows, HEAD_DIM), stride=(HEAD_DIM, 1)), 128)
        fb_rows = plan.decay_rows
        fb_s = smem.allocate_tensor(BFloat16, cute.make_layout((fb_rows, GATE_RANK), stride=(GATE_RANK, 1)), 128)
        cw_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.conv_local * CONV_WIDTH), 128)
        x_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.packed_bytes // 2), 128)
        taps_s = smem.allocate_tensor(BFloat16, cute.make_layout(plan.conv_local * columns), 128)
        decay_s = smem.allocate_tensor(Float32, cute.make_layout(tokens * HEAD_DIM), 128)
        qk_s = smem.allocate_tensor(Float32, cute.make_layout(tokens * 2 * HEAD_DIM), 128)  # per token: q, then k
        v_s = smem.allocate_tensor(Float32, cute.make_layout(tokens * rows), 128)
        return bars, state_s, fb_s, cw_s, x_s, taps_s, decay_s, qk_s, v_s

    @cute.jit
    def _start(
        self,
        bars: Any,
        exchange_bytes: tuple[int, int],
        f_b: cute.Tensor,
        conv_w: cute.Tensor,
        fb_s: cute.Tensor,
        cw_s: cute.Tensor,
        place: _Place,
    ):
        """Thread 0, before the wait: initialize the six barriers, arm each with the bytes that complete it (the
        pushes of the whole cluster, `exchange_bytes` for barriers 0 and 1, or its copies; barrier 0 stays unarmed
        and unused with local_decays), and copy the weights first: they do not depend on the previous kernel (the
        caller adds the head's dt_bias with local_decays)."""
        plan = self.plan
        for i in cutlass.range_constexpr(6):
            cute.arch.mbarrier_init(bars + i, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.fence_proxy("async.shared", space="cta")  # the bulk copies complete these barriers
        sizes = (*exchange_bytes, plan.weight_bytes, plan.packed_bytes, plan.tap_bytes)
        for i in cutlass.range_constexpr(int(plan.local_decays), 5):
            cute.arch.mbarrier_arrive_and_expect_tx(bars + i, sizes[i])
        cute.arch.mbarrier_arrive_and_expect_tx(bars + 5, plan.state_bytes)
        fb_first = place.head * HEAD_DIM if const_expr(plan.local_decays) else place.first
        bulk_copy(fb_s.iterator, f_b[fb_first, None].iterator, plan.decay_rows * GATE_RANK * 2, bars + 2)
        for start, local, count in plan.conv_runs(place.head, place.rank):
            src = conv_w.iterator + CONV_WIDTH * start
            bulk_copy(cw_s.iterator + CONV_WIDTH * local, src, count * CONV_WIDTH * 2, bars + 2)

    @cute.jit
    def _prefetch(
        self,
        conv_state: cute.Tensor,
        state: cute.Tensor,
        conv_hint: Any,
        state_hint: Any,
        columns: cutlass.Constexpr[int],
        place: _Place,
    ):
        """L2 prefetches of what the CTA will read after the wait: its state rows of slot `state_hint` and the
        `columns` of its conv channels (the head's q and k, its own v) in conv row `conv_hint`. The hints are slots
        read before the wait, clamped into each table, so the addresses are valid whatever they held; a stale slot
        only warms other lines."""
        plan = self.plan
        rows = plan.rows_per_cta
        s = cutlass.max(cutlass.min(Int32(state_hint), state.shape[0] - 1), 0)
        bulk_prefetch_l2(state[Int64(s), place.head, place.rank * rows, None].iterator, plan.state_bytes)
        c = cutlass.max(cutlass.min(Int32(conv_hint), conv_state.shape[0] - 1), 0)
        taps = conv_state[c, None]
        for start, _, count in plan.conv_runs(place.head, place.rank):
            run = cute.local_tile(taps, (columns * VECTOR,), (start // VECTOR,))
            bulk_prefetch_l2(run.iterator, count * columns * 2)

    @cute.jit
    def _warm_own_state(self, conv_state: cute.Tensor, state: cute.Tensor, slots: cute.Tensor, place: _Place):
        """Thread 0, before the wait: the L2 prefetches of this CTA's state rows and taps, steered by its slot read
        now (a hint: the slot is read again after the wait)."""
        hint = slots[place.b]
        self._prefetch(conv_state, state, hint, hint, TAPS, place)

    @cute.jit
    def _read_state(
        self,
        state_s: cute.Tensor,
        taps_s: cute.Tensor,
        state: cute.Tensor,
        conv_state: cute.Tensor,
        slots: cute.Tensor,
        slot: Int64,
        bars: Any,
        place: _Place,
    ):
        """Thread 0, after the wait, for live slot `slot`: the state rows, then the taps, both from L2 (prefetched
        before the wait); then, with warming, the next wave's."""
        self._copy_state(state_s, taps_s, state, slot, conv_state[slot, None], TAPS, bars, place)
        if const_expr(self.plan.ahead > 0):
            self._warm_ahead(conv_state, state, slots, place)

    @cute.jit
    def _warm_ahead(self, conv_state: cute.Tensor, state: cute.Tensor, slots: cute.Tensor, place: _Place):
        """Thread 0, after its own copies: the L2 prefetches `_prefetch` issues, for the CTA of the same rank and
        head `plan.ahead` requests later, which runs in the next wave (KdaStepPlan.ahead). After the wait, so the
        slot is the one that CTA will read; a NULL one warms nothing, and neither does a CTA of a NULL request
        (graph padding, whose later rows are padding too)."""
        later = place.b + self.plan.ahead
        if later < self.plan.batch:
            slot = Int32(slots[later])
            if slot > 0:
                self._prefetch(conv_state, state, slot, slot, TAPS, place)

    @cute.jit
    def _head_constants(self, a_log: cute.Tensor, dt_bias: cute.Tensor, o_norm: cute.Tensor, place: _Place):
        """Read into registers before the wait: dt_bias of the lane's decay channels (two, four with wide warps; none
        with local_decays: the head's are copied into shared memory), exp(A_log) of the head, and o_norm of the
        warp's rows."""
        rows, w = self.plan.rows_per_cta, self.plan.rows_per_warp
        dt = [] if const_expr(self.plan.local_decays) else [dt_bias[place.first + row] for row in place.fb_rows]
        decay_rate = cute.math.exp(a_log[place.head])
        w_norm = cute.make_rmem_tensor((w,), BFloat16)
        _copy(o_norm, w, place.rank * (rows // w) + place.warp, w_norm)
        return dt, decay_rate, w_norm

    @cute.jit
    def _copy_sections(self, x: cute.Tensor, x_s: cute.Tensor, at: cutlass.Constexpr[int], bars: Any, place: _Place):
        """Thread 0: the sections of packed row `x` into x_s from element `at` (barrier 3): the conv inputs of the
        CTA's channels, f_a, its output gates."""
        plan = self.plan
        rows, sec = plan.rows_per_cta, plan.sections
        fa_at, gate_at = _section_offsets(plan)
        for start, local, count in plan.conv_runs(place.head, place.rank):
            bulk_copy(x_s.iterator + (at + local), x.iterator + start, count * 2, bars + 3)
        bulk_copy(x_s.iterator + (at + fa_at), x.iterator + sec["f_a"], GATE_RANK * 2, bars + 3)
        bulk_copy(x_s.iterator + (at + gate_at), x.iterator + (sec["g"] + place.first), rows * 2, bars + 3)

    @cute.jit
    def _copy_state(
        self,
        state_s: cute.Tensor,
        taps_s: cute.Tensor,
        state: cute.Tensor,
        slot: Int64,
        conv_row: cute.Tensor,
        columns: cutlass.Constexpr[int],
        bars: Any,
        place: _Place,
    ):
        """Thread 0: the CTA's state rows of `slot` (barrier 5), then the `columns` of its conv channels in
        `conv_row` (barrier 4); both from L2, prefetched before the wait."""
        plan = self.plan
        rows = plan.rows_per_cta
        bulk_copy(
            state_s.iterator, state[slot, place.head, place.rank * rows, None].iterator, plan.state_bytes, bars + 5
        )
        for start, local, count in plan.conv_runs(place.head, place.rank):
            bulk_copy(
                taps_s.iterator + columns * local, conv_row.iterator + columns * start, count * columns * 2, bars + 4
            )

    @cute.jit
    def _push_decay(
        self,
        fb: cute.Tensor,
        fa: cute.Tensor,
        j: cutlass.Constexpr[int],
        dt: list,
        decay_rate: Float32,
        lower_bound: Float32,
        decay_s: cute.Tensor,
        at: cutlass.Constexpr[int],
        bars: Any,
        place: _Place,
    ):
        """The decay of the lane's f_b row `j` (`fb`: its vector of that row), pushed with the next row's (from the
        other half-warp) to decay_s[at + c] of every CTA of the cluster (barrier 0)."""
        plan = self.plan
        rows = plan.rows_per_cta
        decay = _decay(fb, fa, dt[j], decay_rate, lower_bound)
        odd = cute.arch.shuffle_sync_down(decay, offset=16)  # the next row, from the other half-warp
        if place.lane < plan.cluster:
            c = at + place.rank * rows + 2 * place.warp + j * (2 * plan.warps)
            dst = decay_s.iterator + cute.assume(c, divby=2)
            cute.arch.store_async_dsmem(dst, (decay.bitcast(Int32), odd.bitcast(Int32)), bars, place.lane)

    @cute.jit
    def _local_decays(
        self,
        fb_s: cute.Tensor,
        fa: cute.Tensor,
        dt_s: cute.Tensor,
        decay_rate: Float32,
        lower_bound: Float32,
        decay_s: cute.Tensor,
        place: _Place,
    ):
        """local_decays: all 128 decays of the head into this CTA's decay_s, half-warp h taking channels h + R/2 i
        (R/2 half-warps, 256 / R channels each, two a pass as _push_decay's rows), each by _decay's arithmetic
        from the same vectors, so each decay has the bits its owner CTA would push."""
        plan = self.plan
        half = plan.rows_per_cta // 2  # half-warps of the CTA
        hw = 2 * place.warp + place.lane // 16
        for i in cutlass.range(HEAD_DIM // (2 * half), unroll=1):
            for j in cutlass.range_constexpr(2):
                c = hw + half * (2 * i + j)
                fb = cute.make_rmem_tensor((VECTOR,), BFloat16)
                _copy(fb_s[c, None], VECTOR, place.col, fb)
                decay = _decay(fb, fa, dt_s[c], decay_rate, lower_bound)
                if place.col == 0:
                    decay_s[c] = decay

    @cute.jit
    def _push_norm(self, o: list, norm_s: cute.Tensor, at: cutlass.Constexpr[int], bars: Any, place: _Place):
        """The warp's partial of sum(o^2) over each four of its rows, pushed to norm_s[at + (CTA, four rows)] of every
        CTA of the cluster (barrier 1): one partial, or a wide warp's two as one pair, so the partials are those of
        four-row warps."""
        plan = self.plan
        quads = plan.rows_per_warp // ROWS_PER_WARP
        partials = [_dot(o[ROWS_PER_WARP * i :], o[ROWS_PER_WARP * i :], ROWS_PER_WARP) for i in range(quads)]
        if place.lane < plan.cluster:
            c = at + place.rank * (plan.rows_per_cta // ROWS_PER_WARP) + quads * place.warp
            if const_expr(quads == 1):
                cute.arch.store_async_dsmem(norm_s.iterator + c, partials[0].bitcast(Int32), bars + 1, place.lane)
            else:
                dst = norm_s.iterator + cute.assume(c, divby=2)
                words = (partials[0].bitcast(Int32), partials[1].bitcast(Int32))
                cute.arch.store_async_dsmem(dst, words, bars + 1, place.lane)

    @cute.jit
    def _finish_request(
        self,
        state: cute.Tensor,
        out: cute.Tensor,
        area: dict,
        bars: Any,
        b: Int32,
        row0: Int64,
        beta: Float32,
        place: _Place,
        w_norm: cute.Tensor,
        gate_at: cutlass.Constexpr[int],
        norm_eps: Float32,
        stamp: tuple,
    ):
        """Phase B of one live request, once its q, k and v are in shared memory (`area`: its state rows, packed-row
        sections, taps, exchanged decays, q and k, v and norm partials): the delta rule on the CTA's state rows and
        their stores, the norm exchange, the gated output row. `stamp` is trace_stamp's (on, counter, cta, tidx)
        for phases 6-9; the group kernel passes it off."""
        plan = self.plan
        rows, w = plan.rows_per_cta, plan.rows_per_warp
        lane, warp, head, rank, first = place.lane, place.warp, place.head, place.rank, place.first
        on, launches, cta, tidx = stamp
        q = cute.make_rmem_tensor((4,), Float32)
        k = cute.make_rmem_tensor((4,), Float32)
        v = cute.make_rmem_tensor((w,), Float32)
        g = cute.make_rmem_tensor((4,), Float32)
        _copy(area["qk"], 4, lane, q)
        _copy(area["qk"], 4, HEAD_DIM // 4 + lane, k)
        for i in cutlass.range_constexpr(w // 4):  # the warp's values, 16 bytes at a time
            _copy(area["v"], 4, (w // 4) * warp + i, _part(v, 4, i))
        if const_expr(not plan.local_decays):  # computed here, before the CTA barrier, with local_decays
            cute.arch.mbarrier_wait(bars, 0)  # every decay of the head has arrived
        trace_stamp(on, launches, cta, 6, tidx)
        _copy(area["decay"], 4, lane, g)
        cute.arch.mbarrier_wait(bars + 5, 0)  # the state rows have arrived
        trace_stamp(on, launches, cta, 7, tidx)

        o = [Float32(0.0)] * w
        if const_expr(plan.joint_sums):  # the warp's four rows' sums reduced together, same bits (warp_sums4)
            rows_s = [cute.make_rmem_tensor((4,), Float32) for _ in range(ROWS_PER_WARP)]
            for i in cutlass.range_constexpr(ROWS_PER_WARP):
                _copy(area["state"][ROWS_PER_WARP * warp + i, None], 4, lane, rows_s[i])
                _decay_row(rows_s[i], g)
            predicted = warp_sums4([_dot(rows_s[i], k, 4) for i in range(ROWS_PER_WARP)], lane)
            for i in cutlass.range_constexpr(ROWS_PER_WARP):
                _correct_row(rows_s[i], k, v[i], predicted[i], beta)
                _copy(rows_s[i], 4, lane, state[row0, head, rank * rows + ROWS_PER_WARP * warp + i, None])
            o = warp_sums4([_dot(rows_s[i], q, 4) for i in range(ROWS_PER_WARP)], lane)
        else:
            for i in cutlass.range_constexpr(w):
                s = cute.make_rmem_tensor((4,), Float32)
                _copy(area["state"][w * warp + i, None], 4, lane, s)
                _delta_rule(s, g, k, v[i], beta)
                _copy(s, 4, lane, state[row0, head, rank * rows + w * warp + i, None])
                o[i] = warp_sum(_dot(s, q, 4))

        # The gated RMSNorm: sum(o^2) over the head's 128 rows, from every (CTA, warp) of the cluster.
        trace_stamp(on, launches, cta, 8, tidx)
        self._push_norm(o, area["norm"], 0, bars, place)
        gate = cute.make_rmem_tensor((w,), BFloat16)
        if const_expr(plan.resident_threads == RESIDENT_THREADS):  # read while the partials travel
            _copy(area["x"], w, gate_at // w + warp, gate)
        cute.arch.mbarrier_wait(bars + 1, 0)
        trace_stamp(on, launches, cta, 9, tidx)
        if const_expr(plan.resident_threads != RESIDENT_THREADS):  # at 40 registers, held across it spilled
            _copy(area["x"], w, gate_at // w + warp, gate)
        rstd = _rstd(area["norm"][lane], norm_eps)  # plan.slots == 32: one partial per lane
        y = _gated(o, rstd, w_norm, gate, w)
        if lane == 0:
            _copy(y, w, first // w + warp, out[b, None])

    @cute.jit
    def _rewrite_taps(self, conv_row: cute.Tensor, area: dict, inputs: cute.Tensor, place: _Place):
        """The taps this CTA owns of one request, [tap_1, tap_2, x] per channel; the caller has waited on the
        cluster barrier, so every CTA has read the old ones."""
        owner = place.warp == 1 or place.col // self.plan.qk_lanes_per_cta == place.rank
        if place.is_conv and owner:
            old = cute.make_rmem_tensor((VECTOR * TAPS,), BFloat16)
            for t in cutlass.range_constexpr(TAPS):
                _copy(area["taps"], VECTOR, TAPS * (place.cl // VECTOR) + t, _part(old, VECTOR, t))
            _copy(area["x"], VECTOR, place.cl // VECTOR, inputs)
            shifted = cute.make_rmem_tensor((VECTOR * TAPS,), BFloat16)
            for c in cutlass.range_constexpr(VECTOR):
                shifted[TAPS * c] = old[TAPS * c + 1]
                shifted[TAPS * c + 1] = old[TAPS * c + 2]
                shifted[TAPS * c + 2] = inputs[c]
            for t in cutlass.range_constexpr(TAPS):
                _copy(_part(shifted, VECTOR, t), VECTOR, TAPS * (place.chan // VECTOR) + t, conv_row)

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
        self._launch(
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
            ),
            stream,
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
        place = self._place()  # the decode kernel's conv lanes: warp 0 the head's q and k, warp 1 the CTA's v
        tidx, rank, head, b, lane, warp, first, col, fb_rows, is_qk, is_conv, cl, chan = place

        smem = cutlass.memory.SmemAllocator()
        bars, state_s, fb_s, cw_s, x_s, taps_s, decay_s, qk_s, v_s = self._allocate(smem, q, cols)
        o_s = smem.allocate_tensor(Float32, cute.make_layout(q * rows), 128)
        norm_s = smem.allocate_tensor(Float32, cute.make_layout(q * plan.slots), 128)
        beta_s = smem.allocate_tensor(Float32, cute.make_layout(q), 128)
        slot_s = smem.allocate_tensor(Int32, cute.make_layout(q), 128)
        tok = plan.token_bytes // 2  # a token's elements in x_s: conv inputs (local channels), f_a, output gates
        fa_at, gate_at = _section_offsets(plan)
        if tidx == 0:
            self._start(bars, (plan.decay_bytes, plan.norm_bytes), f_b, conv_w, fb_s, cw_s, place)
            hint = _clamp(Int32(num_accepted[b]), 1, q)
            self._prefetch(conv_state, state, slots[b, 0], slots[b, hint - 1], cols, place)
        cute.arch.griddepcontrol_launch_dependents()  # as in the decode step
        cute.arch.cluster_arrive_relaxed()
        dt, decay_rate, w_norm = self._head_constants(a_log, dt_bias, o_norm, place)

        cute.arch.cluster_wait()
        cute.arch.griddepcontrol_wait()
        if tidx == 0:
            for t in cutlass.range_constexpr(q):  # every token's sections, token t at t * tok
                self._copy_sections(packed[b, t, None], x_s, t * tok, bars, place)
            if rank + head + b == 0:
                cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")

        slot0 = Int32(slots[b, 0])  # the request's conv row, and NULL (<= 0) for the whole request
        if slot0 > 0:
            accepted = _clamp(Int32(num_accepted[b]), 1, q)  # stock clamps it too; the oracle refuses outside 1..q
            read = cutlass.max(Int32(slots[b, accepted - 1]), 0)  # the accepted token's state (NULL: slot 0)
            conv_row = conv_state[Int64(slot0), None]
            if tidx == 0:
                self._copy_state(state_s, taps_s, state, Int64(read), conv_row, cols, bars, place)
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
                            y = fma(w[j].to(Float32), seq[t + j].to(Float32), y)
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
                    _store_normalized(act, lane, l2_eps, qk_s, t * 2 * HEAD_DIM + VECTOR * lane)

            # The decays of the CTA's channels for every token, pushed to every CTA (decay_s[t * 128 + c]).
            fb = [cute.make_rmem_tensor((VECTOR,), BFloat16) for _ in range(2)]
            for j in cutlass.range_constexpr(2):
                _copy(fb_s[fb_rows[j], None], VECTOR, col, fb[j])
            for t in cutlass.range_constexpr(q):
                fa = cute.make_rmem_tensor((VECTOR,), BFloat16)
                _copy(x_s, VECTOR, (t * tok + fa_at) // VECTOR + col, fa)
                for j in cutlass.range_constexpr(2):
                    self._push_decay(fb[j], fa, j, dt, decay_rate, lower_bound, decay_s, t * HEAD_DIM, bars, place)
            cute.arch.sync_threads()  # q, k, v, beta and the slots are in shared memory
            cute.arch.cluster_arrive()  # this CTA's tap reads are complete (release)

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
                    _delta_rule(s[i], g, k, v[i], beta)
                    if dst > 0:  # the state after token t goes to slot[b, t] when that slot is real
                        _copy(s[i], 4, lane, state[Int64(dst), head, rank * rows + ROWS_PER_WARP * warp + i, None])
                    o[i] = warp_sum(_dot(s[i], qv, 4))
                self._push_norm(o, norm_s, t * plan.slots, bars, place)
                if lane == 0:
                    readouts = cute.make_rmem_tensor((ROWS_PER_WARP,), Float32)
                    for i in cutlass.range_constexpr(ROWS_PER_WARP):
                        readouts[i] = o[i]
                    _copy(readouts, ROWS_PER_WARP, t * (rows // ROWS_PER_WARP) + warp, o_s)

            # The gated RMSNorm of every token, once every CTA's partials of every token have arrived.
            cute.arch.mbarrier_wait(bars + 1, 0)
            for t in cutlass.range_constexpr(q):
                rstd = _rstd(norm_s[t * plan.slots + lane], norm_eps)
                if lane == 0:  # the lane that wrote the warp's readouts to o_s: it reads back only its own stores
                    readouts = cute.make_rmem_tensor((ROWS_PER_WARP,), Float32)
                    _copy(o_s, ROWS_PER_WARP, t * (rows // ROWS_PER_WARP) + warp, readouts)
                    gate = cute.make_rmem_tensor((ROWS_PER_WARP,), BFloat16)
                    _copy(x_s, ROWS_PER_WARP, (t * tok + gate_at) // ROWS_PER_WARP + warp, gate)
                    y = _gated(readouts, rstd, w_norm, gate, ROWS_PER_WARP)
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
        else:  # NULL request: zero output for every token, no state touched
            y = _null_output(bars, ROWS_PER_WARP)
            if lane == 0:
                for t in cutlass.range_constexpr(q):
                    _copy(y, ROWS_PER_WARP, first // ROWS_PER_WARP + warp, out[b, t, None])


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
def _store_normalized(act: cute.Tensor, lane: Int32, l2_eps: Float32, area: cute.Tensor, start: Any):
    """A lane's 8 channels of q or k L2-normalized over the head's 128 (16 lanes of 8 each: lanes 0-15 hold q, which
    is also scaled by D^-0.5), into area[start .. start + 8]."""
    squares = warp_sum(_dot(act, act, VECTOR), 16)
    scale = cute.math.rsqrt(squares + l2_eps)
    if lane < 16:
        scale = scale * (HEAD_DIM**-0.5)
    _store_f32(act, scale, area, start)


@cute.jit
def _convolve(cw_s: cute.Tensor, taps_s: cute.Tensor, x_s: cute.Tensor, cl: Any, inputs: cute.Tensor, act: cute.Tensor):
    """The decode conv of the lane's 8 local channels from `cl` (_place): their weights, taps and inputs from shared
    memory into registers (`inputs` keeps the inputs), the SiLU of the conv into `act`."""
    cw = cute.make_rmem_tensor((VECTOR * CONV_WIDTH,), BFloat16)  # 8 channels x 4 taps, channel-major
    for i in cutlass.range_constexpr(CONV_WIDTH):
        _copy(cw_s, VECTOR, CONV_WIDTH * (cl // VECTOR) + i, _part(cw, VECTOR, i))
    taps = cute.make_rmem_tensor((VECTOR * TAPS,), BFloat16)  # 8 channels x 3 taps, channel-major
    for t in cutlass.range_constexpr(TAPS):
        _copy(taps_s, VECTOR, TAPS * (cl // VECTOR) + t, _part(taps, VECTOR, t))
    _copy(x_s, VECTOR, cl // VECTOR, inputs)
    _conv_silu(cw, taps, inputs, act)


@cute.jit
def _conv_silu(weights: cute.Tensor, taps: cute.Tensor, inputs: cute.Tensor, act: cute.Tensor):
    """SiLU of the causal conv of 8 channels: weights [8 x 4], taps [8 x 3] (oldest first), inputs [8]."""
    for c in cutlass.range_constexpr(VECTOR):
        y = weights[CONV_WIDTH * c + TAPS].to(Float32) * inputs[c].to(Float32)
        for t in cutlass.range_constexpr(TAPS):
            y = fma(weights[CONV_WIDTH * c + t].to(Float32), taps[TAPS * c + t].to(Float32), y)
        act[c] = y * _sigmoid(y)


@cute.jit
def _delta_rule(s: cute.Tensor, g: cute.Tensor, k: cute.Tensor, v: Float32, beta: Float32):
    """One value row of the state, in place (a lane's 4 keys): S_v <- S_v * exp(g), then S_v += beta (v - S_v . k) k."""
    _decay_row(s, g)
    _correct_row(s, k, v, warp_sum(_dot(s, k, 4)), beta)


@cute.jit
def _decay_row(s: cute.Tensor, g: cute.Tensor):
    """S_v <- S_v * exp(g) on a lane's 4 keys (`g` holds exp(g))."""
    for e in cutlass.range_constexpr(4):
        s[e] = s[e] * g[e]


@cute.jit
def _correct_row(s: cute.Tensor, k: cute.Tensor, v: Float32, predicted: Float32, beta: Float32):
    """S_v += beta (v - S_v . k) k on a lane's 4 keys, given the decayed row's S_v . k (`predicted`)."""
    u = beta * (v - predicted)
    for e in cutlass.range_constexpr(4):
        s[e] = fma(u, k[e], s[e])


@cute.jit
def _decay(fb: cute.Tensor, fa: cute.Tensor, dt: Float32, decay_rate: Float32, lower_bound: Float32) -> Float32:
    """exp(g) of one key channel from its f_b row: `fb` and `fa` are the lane's vectors of it (a half-warp's 16 lanes
    hold the row)."""
    dot = warp_sum(_dot(fb, fa, VECTOR), 16)
    return cute.math.exp(lower_bound * _sigmoid(decay_rate * (dot + dt)))


@cute.jit
def _rstd(partial: Float32, norm_eps: Float32) -> Float32:
    """1 / sqrt(mean(o^2) + eps) over the head's 128 outputs, from one partial of sum(o^2) per lane: every CTA of
    the cluster sums the same 32 partials in the same order, so all scale by the same bits."""
    return cute.math.rsqrt(warp_sum(partial) * (1.0 / HEAD_DIM) + norm_eps)


@cute.jit
def _gated(o: Any, rstd: Float32, w_norm: cute.Tensor, gate: cute.Tensor, rows: cutlass.Constexpr[int]) -> cute.Tensor:
    """The warp's `rows` outputs of the gated RMSNorm, o * rstd * o_norm * sigmoid(g_out), as BF16."""
    y = cute.make_rmem_tensor((rows,), BFloat16)
    for i in cutlass.range_constexpr(rows):
        gated = o[i] * rstd * w_norm[i].to(Float32) * _sigmoid(gate[i].to(Float32))
        y[i] = gated.to(BFloat16)
    return y


@cute.jit
def _null_output(bars: Any, rows: cutlass.Constexpr[int]) -> cute.Tensor:
    """A NULL request's output (zeros for the warp's `rows` rows), once the copies into this CTA's shared memory
    have landed: a CTA must not exit with bulk copies into it in flight."""
    cute.arch.mbarrier_wait(bars + 2, 0)
    cute.arch.mbarrier_wait(bars + 3, 0)
    y = cute.make_rmem_tensor((rows,), BFloat16)
    y.fill(0.0)
    return y


@cute.jit
def _dot(a: cute.Tensor, b: cute.Tensor, n: cutlass.Constexpr[int]) -> Float32:
    """sum_i a_i b_i in FP32: the product of element 0, then n - 1 FMAs in element order (primitives.fma pins
    which product each one fuses, so every build of a kernel gives the same bits)."""
    total = a[0].to(Float32) * b[0].to(Float32)
    for i in cutlass.range_constexpr(1, n):
        total = fma(a[i].to(Float32), b[i].to(Float32), total)
    return total


@cute.jit
def _sigmoid(x: Float32) -> Float32:
    """1 / (1 + e^-x); saturates to 0 (not NaN) for very negative x, as e^-x overflows to inf."""
    return cute.arch.rcp_approx(1.0 + cute.math.exp(-x))
