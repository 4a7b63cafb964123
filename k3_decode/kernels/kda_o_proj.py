"""o_proj with the AttnRes after attention for Hopper (sm_90a) in CuTe DSL, in one launch.

Compiled for sm_90a on the CPU with its PTX and SASS checked by `k3gate kernels build`; its GPU test
(tests/k3_decode/kernels/test_kda_o_proj_gpu.py) passed on an H200 at a3ad2f6, and its provider is registered
(providers.py, CuteKdaOProjProvider).

Semantics, per decode step of B <= 64 rows: attn_out = o @ W^T with W = o_proj [H = 7168, K] (K = 1536 at TP8, 768
at TP16), every output an FP32 sum of the K products rounded once to BF16, as the input projection's weight stream
(kda_in_proj.py) computes it; attn_out is this rank's o_proj partial, on one rank the attention output. Then, per
row, the AttnRes after attention (attn_res.py; k3_decode/reference/attn_res.py `after_attention`) with delta =
attn_out: p' = bf16(p + attn_out) ("add") or attn_out ("restart"), the softmax mix of the bank blocks and p', and
the post-attention RMSNorm. Written: attn_out, the prefix (and a saved block, for a kind that saves), the MLP input.
Given the same attn_out bits, the prefix is bit-equal to the stock pair's (cuBLAS, then the AttnRes kernel).

Why one launch needs a grid-wide point. The AttnRes after attention needs the whole o_proj row (its logits and its
norm are sums over all 7168 columns), and every 16 columns of that row come from a different CTA of the weight
stream. Three ways were weighed:
- Two launches (the provider before this kernel: the weight stream, then the AttnRes kernel). PDL hides the second
  kernel's weight loads, not its launch and ramp, and the issue allows four launches for the attention side of a
  KDA layer (AttnRes, in_proj, KDA step, o_proj + AttnRes).
- A grid barrier over every CTA (a cooperative grid sync). Every CTA would wait for the slowest for no use, and it
  is safe only if the whole grid is co-resident, which a cooperative launch guarantees and CuTe DSL's launch does
  not offer.
- Chosen: only the CTAs that need the whole row wait. The grid is made of clusters of the AttnRes kernel's size (7
  CTAs of 128 threads, 8 columns per thread: attn_res_plan.ClusterPlan), so the same clusters can run the AttnRes
  device code (attn_res.py's exchange setup, weight loads and mix-and-store, shared as jit methods). Every CTA
  streams its 16 rows of W, stores its 16 columns of every attn_out row, and arrives on a global arrival word; the
  7 CTAs of each epilogue cluster c then wait until every CTA of the grid has arrived and apply AttnRes to their
  rows, while every other cluster exits at once. Up to 32 rows cluster c < B takes row c; above, E = ceil(B / 2)
  clusters take rows c and c + E (B64: clusters 0..31), so that at most half the grid waits at any batch.

Which clusters wait: clusters 0..E-1, fixed, rather than the last E clusters to arrive (by the order of their
arrival tickets). Both are deadlock-free (below). Fixed clusters know their role from the start, so while the rest
of the grid streams they already have in flight everything that does not depend on o_proj (the AttnRes weights,
the bank blocks, the old prefix: up to 12 vectors per thread, kda_o_proj_plan.PRELOADED_VECTORS, so all of both
rows of a light kind and the first row of a heavy one); after the last arrival only the read of the o_proj row
(from L2) stands between the first row and its exchanges, and a second row's own exchanges follow its stores.
Picking by arrival order needs a per-cluster ticket, so a cluster barrier after the stream, a broadcast of the
ticket through the cluster and another barrier, and then every load of the epilogue after the last arrival: one
more cluster round trip and memory latency on the critical path of every launch.

Deadlock freedom. A waiting CTA waits only for arrivals, and a CTA arrives after nothing but the previous kernel
(griddepcontrol.wait), its own loads and a CTA barrier, so every resident CTA reaches its arrival. A CTA not yet
resident needs a free slot; the waiting clusters hold at most E <= 32 cluster slots and every other cluster frees
its slots as soon as it has arrived, so the grid finishes whenever the device can hold more than E clusters at once:
33 of the grid's 64. How many it holds is the driver's count, which kda_o_proj_op checks before every new shape
(cluster_residency.py): a cluster's CTAs share one GPC, so SMs x CTAs an SM / 7 overstates it (at four an SM the
driver holds 69 of this grid's clusters on an H200). By registers an H200 holds at least four CTAs of 128
threads per SM (ptxas caps registers at 128 for that, and the build checks it; builds under 97 registers fit five,
which a capped launch forbids: OProjPlan.launch_smem_bytes), so the whole grid of 448 CTAs at once, but what an
SM's shared-memory carveout allows after the previous kernel is not this launch's to choose. With one cluster per
row, at B = 64 every cluster waited, which needs the whole grid resident: that held alone, yet in the layer graph
(TP8 B64, the n8-add kind) the launch hung on the H200 at e879db8; so above 32 rows a cluster takes two rows, and
the residency the grid needs is that of B = 32, which ran there. PDL does not change the argument:
the next kernel launches only once every CTA of this one has executed griddepcontrol.launch_dependents (so all of
them are resident), and the previous kernel's CTAs were all resident before any of ours.

The arrival word, never reset (also not between CUDA-graph replays). As CUDA's cooperative-groups grid sync does
(cooperative_groups details, `sync_grids`): CTA 0 adds 2^31 - (N - 1) and each other CTA adds 1, N = the grid's
CTAs, so one launch adds exactly 2^31 in all: the low 31 bits end where they began (0) and the top bit flips. With
the low bits at 0, no partial sum carries into the top bit (the 1s reach at most N - 1; with CTA 0's add among
them the sum is 2^31 - j, j >= 1), so the top bit flips exactly when the last CTA arrives. A waiting CTA polls until
the top bit differs from the one its own add returned (`seen`). Every launch leaves the word the same way whatever
its plan, so all launches on a device share one word (kda_o_proj_op.py), provided no two overlap in time: in a
decode step they are stream-ordered, and the next launch arrives only after its own griddepcontrol.wait, which
implies this grid's completion through the kernels in between (each of which waits too).

Memory ordering (PTX memory model, gpu scope):
1. Release: each thread stores its o_proj outputs; a CTA barrier (bar.sync) orders them before thread 0's
   `atom.release.gpu.add` (release is cumulative over what precedes it in causality order, which the barrier
   establishes). The SASS is MEMBAR.GPU, then the atomic. This is CUTLASS's GenericBarrier (cutlass/barrier.h:
   __syncthreads, then one thread's red.release.gpu).
2. The adds are a chain of atomic read-modify-writes of one word; in the PTX model a read that observes the last of
   them is preceded in observation order by every write of the chain, so the acquire that sees the flipped bit
   synchronizes with every CTA's release.
3. Acquire: thread 0 polls with `ld.acquire.gpu` (SASS: LDG.E.STRONG.GPU, then CCTL.IVALL: the SM's L1 is
   invalidated, so later loads of the o_proj row come from L2, where the other SMs' stores are); a CTA barrier then
   orders the other threads' plain loads of the row (never `ld.global.nc`, which may be served from a stale line or
   hoisted) after it. The build checks each of these instructions and that only the row is read after the poll.

Ready for a fused TP all-reduce: attn_out is this rank's partial, and `_attention_row` is the only place the
epilogue reads it. A TP variant would have each CTA also push its columns of attn_out to the peers (a mailbox or a
multicast row, as k3_decode/distributed's peer two-shot does) before it arrives, the epilogue wait for the peers'
columns as well, and `_attention_row` sum the ranks' partials of its 8 columns in rank order before the AttnRes.
One GPU has no all-reduce here, so the provider refuses a stack whose partials are combined across ranks.

Work split (kda_o_proj_plan.py): the weight stream of kda_in_proj.py on CTAs of 4 warps x 4 rows = 16 rows of W:
16-byte weight loads straight into registers, 12 per thread in flight and the first 12 issued before
griddepcontrol.wait; o staged once per CTA in shared memory (B x K x 2 bytes, at most 12 KiB); FP32 FMAs and a
fixed-order butterfly per output, so results do not depend on scheduling. TP8 streams 6 k steps of 256 columns in
two groups of 3; TP16's 3 steps are one group (every weight load of a thread is issued before the wait). B <= 4
rows (rows_per_warp x B accumulators beside the weight slots under 128 registers: 117-128 in the builds, no
spills). From 5 to 16 rows the CUDA-core FMAs would bound the stream and their accumulators would not fit, so the
CTA's stream runs on tensor cores instead (kda_in_proj_mma.py's `stream_passes`: its 16 rows as one m16 tile, K split
over its 4 warps and summed in shared memory in a fixed order, o read from L2 in MMA fragments, 12 weight loads per
lane in flight); the arrival, the wait and the epilogue are the same code. Above 16 rows the stream takes a pass
per 32 batch rows (four batch tiles, 4 W loads per lane in flight); a second pass (B > 32) reads the CTA's 16 rows
of W again, mostly from L2 (W is 22 MB at TP8, 11 at TP16); a plan with one_pass (kda_o_proj_choice.toml) takes up
to 64 rows in one pass of eight tiles instead, where the epilogue's held vectors leave the registers for it. Up to
64 rows, at most half the clusters waiting (two rows each above 32); where the provider serves them is
providers.toml's [o_proj], by measurement. A warm plan (kda_o_proj_choice.toml warm_batches; measured slower on the
H200 and not served) also has the copy engine prefetch into L2, before the wait, the runs of W the stream loads
after it (`_warm`). A w_smem plan (w_smem_batches; measured slower on the H200 and not served) has the copy engine
copy the CTA's rows of W whole into shared memory before the wait instead (kda_in_proj_mma.stage_rows), and either
stream fills its slots from there in the same order. 48 KB a CTA at TP8 leaves three CTAs an SM at B4 and from B32,
so that grid runs in more than one wave, which the argument above allows (OProjPlan.resident_clusters >
epilogue_clusters, which the plan checks). A w_l2 plan (w_l2_batches, B1-B4 only; measured on the H200 and slower, not
served) has the copy engine prefetch the CTA's rows of W whole into L2 before the wait and loads none into registers
until after it: in the layer's phase traces the KDA step's cluster exchanges, running beside o_proj's first weight
loads, took 1.6-1.8 us instead of 0.2-0.5 (docs/kda-layer-h200.md); a prefetch lands nothing in the SM.

Expected time at TP8, B = 1..4: 22 MB of W at ~4.15 TB/s is ~5.3 us of streaming; the tail after it is the last
CTA's stores and release (~1 us), the poll that sees it (~0.5-1 us), the row read from L2 and the two DSMEM
exchanges (~2 us): ~8-9 us per launch, against cuBLAS's 8.7 us plus ~2.5 us of AttnRes for the stock pair.
Measured: not yet (the GPU test prints it against the stock pair and the two-launch path).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from k3_decode.kernels import cutedsl
from k3_decode.kernels.attn_res import AttnResKernel
from k3_decode.kernels.attn_res import _load8 as _row_vector
from k3_decode.kernels.kda_in_proj import load_group, multiply, stage, weight_slots
from k3_decode.kernels.kda_in_proj_mma import (
    allocate_partials,
    lane_rows,
    load_w,
    stage_rows,
    stage_w,
    stream_passes,
    stream_slots,
)
from k3_decode.kernels.kda_o_proj_plan import OProjPlan
from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan
from k3_decode.kernels.phase_trace import words_for
from k3_decode.kernels.primitives import bulk_prefetch_l2, launch_resident, trace_stamp


def compile_args(plan: OProjPlan | OProjWgmmaPlan, capacity: int, trace: bool = False) -> tuple[Any, ...]:
    """Fake arguments of one compile, for either build (the same signature): the shapes and dtypes the compiled kernel
    then accepts, nothing else (a traced build's counter has the phase stamps after the launch count:
    phase_trace.py)."""

    def bf16(*shape: int) -> Any:
        return cutedsl.fake_tensor(BFloat16, shape)

    b, h = plan.batch, plan.hidden
    return (
        bf16(b, plan.k),  # o: the KDA output, o_proj's input
        bf16(h, plan.k),  # W: o_proj's weight
        bf16(b, h),  # attn_out: o_proj's output (this rank's partial)
        bf16(b, h),  # prefix
        bf16(b, capacity, h),  # bank
        bf16(b, h),  # out: the MLP input
        bf16(h),  # res_norm
        bf16(h),  # res_proj
        bf16(h) if plan.kind.out_norm else None,  # out_norm
        cutedsl.fake_tensor(Int32, (1,)),  # arrivals: the grid's arrival word
        cutedsl.fake_tensor(Int32, (words_for(plan.ctas, trace),)),  # launches: the execution counter (and stamps)
        Int32(0),  # save_index
        Float32(1e-5),  # eps
        cutedsl.fake_stream(),
    )


class KdaOProjKernel:
    """o_proj and the AttnRes after attention for one fixed plan (shape, batch, AttnRes kind).

    Arguments of the compiled function, all on one device, 16-byte aligned, last dimension contiguous, BF16 unless
    said: o [B, K], W [H, K], attn_out [B, H] (written: o @ W^T), prefix [B, H] (rewritten), blocks
    [B, capacity, H] (block `save_index` written when the kind saves), out [B, H] (written: the MLP input),
    res_norm [H], res_proj [H], out_norm [H] (None without an output norm), arrivals [1] Int32 (the grid's arrival
    word: zero when first used, and left with its low 31 bits zero by every launch, so it is never reset),
    launches [1] Int32 (the device-side execution counter), save_index Int32, eps Float32, and the CUDA stream.
    """

    def __init__(self, plan: OProjPlan, trace: bool = False) -> None:
        self.plan = plan
        self.trace = trace  # phase stamps (phase_trace.py)
        self.attn = AttnResKernel(plan.hidden, plan.kind)  # the epilogue: one AttnRes application per cluster

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
        launch_resident(
            self.kernel(
                o, w, attn_out, prefix, blocks, out, res_norm, res_proj, out_norm, arrivals, launches, save_index, eps
            ),
            grid=[plan.cluster, plan.clusters, 1],
            threads=plan.threads,
            cluster=[plan.cluster, 1, 1],
            ctas_per_sm=plan.ctas_per_sm,  # all CTAs resident at once: the grid-wide point needs it
            smem=plan.launch_smem_bytes,  # capped: no SM holds more than ctas_per_sm (kda_o_proj_choice.toml)
            stream=stream,
        )

    @cute.kernel
    def kernel(
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
    ):
        plan = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        rank, cluster, _ = cute.arch.block_idx()  # grid x = the CTA's rank in its cluster
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta = cluster * plan.cluster + rank
        row0 = (cta * plan.warps + warp) * plan.rows_per_warp
        trace_stamp(self.trace, launches, cta, 0, tidx)

        smem = cutlass.memory.SmemAllocator()
        # One exchange area per epilogue row: a row's pushes never land in an area a slower peer still reads.
        areas = [self.attn.allocate_exchange(smem, tidx) for _ in range(plan.epilogue_rows)]
        if const_expr(plan.tensor_cores):
            # Above 4 rows: the tensor-core stream (kda_in_proj_mma.py) on the CTA's 16 rows as one m-tile, K split
            # over its warps; o is read straight from L2 in MMA fragments, not staged.
            spec = plan.mma
            lanes = lane_rows(spec, cta * plan.rows_per_cta, warp)
            partials = allocate_partials(spec, smem)
            cute.arch.cluster_arrive_relaxed()  # publishes the epilogue's barriers to the cluster, long before use
            slots, xslots = stream_slots(spec)
            # Weights first, while the previous kernel finishes: the first `depth` k steps into the slots, or
            # (w_smem) all of the CTA's rows into shared memory by the copy engine.
            if const_expr(spec.w_smem):
                w_rows, w_bar = stage_w(spec, w, smem, cta * plan.rows_per_cta, tidx, warp)
            else:
                self._warm(w, cta, warp, lane)  # first: its registers are free before the slots fill
                load_w(spec, w, slots, lanes, Int32(0))
            cute.arch.griddepcontrol_wait()
            trace_stamp(self.trace, launches, cta, 1, tidx)
            if tidx + cta == 0:  # thread 0 of CTA 0 (both non-negative)
                cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")
            if const_expr(spec.w_smem):
                cute.arch.mbarrier_wait(w_bar, 0)  # the CTA's rows of W have landed
                load_w(spec, w_rows, slots, lanes, Int32(0))
                stream_passes(spec, o, w_rows, attn_out, partials, slots, xslots, lanes, warp)
            else:
                stream_passes(spec, o, w, attn_out, partials, slots, xslots, lanes, warp)  # 32 batch rows a pass
        else:
            staged = smem.allocate_tensor(
                BFloat16, cute.make_layout((plan.batch, plan.k), stride=(plan.k, 1)), byte_alignment=16
            )
            cute.arch.cluster_arrive_relaxed()  # publishes the epilogue's barriers to the cluster, long before use
            slots = weight_slots(plan)

            # Weights first: they do not depend on the previous kernel, so they stream while it finishes (w_smem:
            # all of the CTA's rows, into shared memory by the copy engine).
            if const_expr(plan.w_smem):
                first = cta * plan.rows_per_cta
                w_rows, w_bar = stage_rows(w, smem, first, plan.rows_per_cta, plan.hidden, plan.k, tidx, warp)
            elif const_expr(plan.w_l2):  # all of the warp's rows to L2, none to registers (the slots fill after)
                self._warm(w, cta, warp, lane)
            else:
                load_group(plan, w, slots, row0, lane, Int32(0))
                self._warm(w, cta, warp, lane)
            cute.arch.griddepcontrol_wait()
            trace_stamp(self.trace, launches, cta, 1, tidx)
            if tidx + cta == 0:  # thread 0 of CTA 0 (both non-negative)
                cute.arch.atomic_add(launches.iterator, Int32(1), sem="relaxed", scope="gpu")
            if const_expr(plan.w_l2):  # the first group now, from L2, in flight while o is staged
                load_group(plan, w, slots, row0, lane, Int32(0))
            stage(plan, o, staged, 0, plan.batch, plan.fill_loads, tidx)
            cute.arch.sync_threads()
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel's wait still covers all of this grid
            if const_expr(plan.w_smem):
                cute.arch.mbarrier_wait(w_bar, 0)  # the CTA's rows of W have landed
                local = warp * plan.rows_per_warp  # the warp's rows in the staged ones
                load_group(plan, w_rows, slots, local, lane, Int32(0))
                multiply(plan, w_rows, attn_out, staged, slots, row0, lane, 0, plan.batch, w_row0=local)
            else:
                multiply(plan, w, attn_out, staged, slots, row0, lane, 0, plan.batch)  # attn_out[:, the warp's rows]

        # The grid-wide point: this CTA's share of attn_out is stored; it says so on the arrival word.
        cute.arch.cluster_wait()  # the epilogue's barriers are published (the arrive above is long done)
        cute.arch.sync_threads()  # every thread's o_proj stores precede thread 0's release below
        trace_stamp(self.trace, launches, cta, 2, tidx)
        seen = self._arrive(arrivals, tidx, cta)
        trace_stamp(self.trace, launches, cta, 3, tidx)
        if cluster < plan.epilogue_clusters:  # the same for every CTA of a cluster: AttnRes of rows c, c + E, ...
            self._epilogue(
                attn_out, prefix, blocks, out, res_norm, res_proj, out_norm, arrivals, seen, areas,
                save_index, eps, tidx, rank, cluster, launches,
            )  # fmt: skip
            if const_expr(self.trace):
                cute.arch.sync_threads()  # the end stamp after every thread's AttnRes stores
                trace_stamp(True, launches, cta, 5, tidx)

    @cute.jit
    def _warm(self, w: cute.Tensor, cta: Int32, warp: Int32, lane: Int32):
        """A warm plan (kda_o_proj_choice.toml warm_batches) or a w_l2 one: the copy engine prefetches into L2 the
        runs of W this CTA loads only after its wait (OProjPlan.late_runs: all of K for w_l2), while the previous
        kernel runs and HBM has room. One `cp.async.bulk.prefetch.L2` per row and run, issued by a lane of the warp
        that reads it: no register, no shared memory, and nothing the issuing lane waits for."""
        plan = self.plan
        if const_expr(plan.l2_prefetched):
            if const_expr(plan.tensor_cores):  # run s is warp s's K slice, for every row of the CTA's m-tile
                if lane < plan.rows_per_cta:
                    row = w[cta * plan.rows_per_cta + lane, None]
                    for s, (first, columns) in enumerate(plan.late_runs):
                        if warp == s:
                            bulk_prefetch_l2(row.iterator + first, columns * 2)
            else:  # the rest of K of each of the warp's rows
                if lane < plan.rows_per_warp:
                    row = w[(cta * plan.warps + warp) * plan.rows_per_warp + lane, None]
                    for first, columns in plan.late_runs:
                        bulk_prefetch_l2(row.iterator + first, columns * 2)

    @cute.jit
    def _arrive(self, arrivals: cute.Tensor, tidx: Int32, cta: Int32) -> Int32:
        """Thread 0 adds this CTA's share to the arrival word with a gpu-scope release and returns the old value
        (0 in the other threads, which do not use it). CTA 0 adds 2^31 - (ctas - 1), every other CTA 1."""
        seen = Int32(0)
        if tidx == 0:
            add = Int32(1)
            if cta == 0:
                add = Int32(self.plan.arrival_master)
            seen = cute.arch.atomic_add(arrivals.iterator, add, sem="release", scope="gpu")
        return seen

    @cute.jit
    def _wait_for_grid(self, arrivals: cute.Tensor, seen: Int32, tidx: Int32):
        """Until every CTA of the grid has arrived: thread 0 polls the arrival word with gpu-scope acquire loads
        until its top bit differs from the one its own arrival saw; the CTA barrier then passes that on."""
        if tidx == 0:
            now = cute.arch.load(arrivals.iterator, Int32, sem="acquire", scope="gpu")
            while (now ^ seen) >= 0:  # the same top bit: the launch's adds have not all landed
                now = cute.arch.load(arrivals.iterator, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_threads()

    @cute.jit
    def _epilogue(
        self,
        attn_out: cute.Tensor,
        prefix: cute.Tensor,
        blocks: cute.Tensor,
        out: cute.Tensor,
        res_norm: cute.Tensor,
        res_proj: cute.Tensor,
        out_norm: cute.Tensor | None,
        arrivals: cute.Tensor,
        seen: Int32,
        areas: list,
        save_index: Int32,
        eps: Float32,
        tidx: Int32,
        rank: Int32,
        cluster: Int32,
        launches: cute.Tensor,
    ):
        """The AttnRes after attention of batch rows c, c + E, ... (c = cluster - plan.first_epilogue_cluster, E =
        plan.epilogue_clusters), once every CTA of the grid has stored its o_proj rows."""
        plan, attn = self.plan, self.attn
        vec = rank * plan.threads + tidx  # this thread's 8 columns of the row
        first = cluster - plan.first_epilogue_cluster  # the cluster's first row
        rows = [first + j * plan.epilogue_clusters for j in range(plan.epilogue_rows)]
        # The last row of a cluster may lie past the batch (an odd batch above 32): it is loaded clamped, not used.
        loaded = [cutlass.min(row, Int32(plan.batch - 1)) for row in rows]
        # What does not depend on o_proj is loaded first, in flight while the rest of the grid finishes: the weights
        # and the rows' bank blocks and old prefix, as many rows as fit in registers beside the weights
        # (plan.preloaded_rows); a later row's are loaded after the row before it is stored.
        w_mix, w_out = attn.load_weights(res_norm, res_proj, out_norm, vec)
        early = [self._row_inputs(prefix, blocks, loaded[j], vec) for j in range(plan.preloaded_rows)]
        self._wait_for_grid(arrivals, seen, tidx)
        trace_stamp(self.trace, launches, rank + cluster * plan.cluster, 4, tidx)  # CTA `rank` of `cluster`
        if const_expr(plan.paired_rows):
            # Both rows' o_proj outputs are read at once and their exchanges overlap (mix_and_store_rows); a second
            # row past the batch is computed from the clamped row's inputs and exchanged like the first, so every
            # CTA of the cluster takes the same path, but not stored.
            inputs = [
                early[j] if j < plan.preloaded_rows else self._row_inputs(prefix, blocks, loaded[j], vec)
                for j in range(plan.epilogue_rows)
            ]
            ps = [self._delta_row(attn_out, inputs[j][1], loaded[j], vec) for j in range(plan.epilogue_rows)]
            stored = [None] + [rows[j] < plan.batch for j in range(1, plan.epilogue_rows)]
            self.attn.mix_and_store_rows([i[0] for i in inputs], ps, w_mix, w_out, areas, out, prefix, blocks, rows,
                                         stored, save_index, vec, tidx, rank, eps)  # fmt: skip
        else:
            for j in cutlass.range_constexpr(plan.epilogue_rows):
                if rows[j] < plan.batch:  # the same in every CTA of the cluster (its exchanges need all of them)
                    bank, old = (
                        early[j] if j < plan.preloaded_rows else self._row_inputs(prefix, blocks, loaded[j], vec)
                    )
                    self._apply(attn_out, prefix, blocks, out, bank, old, w_mix, w_out, areas[j], save_index, eps,
                                tidx, rank, rows[j], vec)  # fmt: skip

    @cute.jit
    def _row_inputs(self, prefix: cute.Tensor, blocks: cute.Tensor, row: Int32, vec: Int32) -> tuple:
        """(the bank blocks, the old prefix in FP32) of this thread's 8 columns of `row`; the old prefix is unused
        (and not loaded) at a restart."""
        bank = [_row_vector(blocks[row, s, None], vec) for s in range(self.plan.kind.num_blocks)]
        return bank, _row_vector(prefix[row, None], vec).to(Float32)

    @cute.jit
    def _apply(
        self,
        attn_out: cute.Tensor,
        prefix: cute.Tensor,
        blocks: cute.Tensor,
        out: cute.Tensor,
        bank: list,
        old: cute.TensorSSA,
        w_mix: cute.TensorSSA,
        w_out: cute.TensorSSA | None,
        areas: tuple,
        save_index: Int32,
        eps: Float32,
        tidx: Int32,
        rank: Int32,
        row: Int32,
        vec: Int32,
    ):
        """One row's AttnRes after attention from its preloaded bank and old prefix and its o_proj row."""
        p = self._delta_row(attn_out, old, row, vec)
        attn = self.attn
        attn.mix_and_store(bank, p, w_mix, w_out, areas, out, prefix, blocks, row, save_index, vec, tidx, rank, eps)

    @cute.jit
    def _delta_row(self, attn_out: cute.Tensor, old: cute.TensorSSA, row: Int32, vec: Int32) -> cute.TensorSSA:
        """The new prefix of this thread's 8 columns of `row` (FP32 holding BF16 values): the o_proj row, added to
        the old prefix where the kind adds."""
        p = self._attention_row(attn_out, row, vec).to(Float32)
        if const_expr(self.plan.kind.delta == "add"):
            p = (old + p).to(BFloat16).to(Float32)
        return p

    @cute.jit
    def _attention_row(self, attn_out: cute.Tensor, row: Int32, vec: Int32) -> cute.TensorSSA:
        """This thread's 8 columns of the attention output of `row`: on one rank, the o_proj output itself. (A
        fused TP all-reduce would sum the ranks' partials here, in rank order, before the AttnRes.)"""
        return _row_vector(attn_out[row, None], vec)
