"""The k3-hopper subject's kernel builds for `k3gate kernels build` (protocol in harness/kernels_cmd.py).

Which kernels and shapes: builds.toml. What each build must look like: expectations.toml. Listing the builds
imports neither torch nor CuTe DSL; compiling one imports CuTe DSL in the process that compiles it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from importlib import resources
from typing import Any

from harness.kernels_cmd import KernelArtifacts
from k3_decode.config import ShardError, load_dims
from k3_decode.kernels import cutedsl
from k3_decode.kernels.attn_res_plan import AttnResKind, ClusterPlan, site_kinds
from k3_decode.kernels.kda_head_stream_plan import HeadStreamPlan
from k3_decode.kernels.kda_in_proj_choice import wgmma_plan
from k3_decode.kernels.kda_in_proj_mma_plan import InProjMmaPlan
from k3_decode.kernels.kda_in_proj_plan import InProjPlan
from k3_decode.kernels.kda_o_proj_plan import OProjPlan
from k3_decode.kernels.kda_o_proj_wgmma_plan import CTAS_PER_SM as OPROJ_WGMMA_CTAS_PER_SM
from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan
from k3_decode.kernels.kda_step_plan import (
    RESIDENT_CHOICES,
    RESIDENT_THREADS,
    ROWS_PER_WARP,
    KdaStepPlan,
    KdaVerifyPlan,
    knob_alone,
    the_pair,
)
from k3_decode.kernels.wgmma_stream_plan import WgmmaStreamPlan

PACKAGE = "k3_decode.kernels"


@dataclass(frozen=True)
class AttnResBuild:
    """The AttnRes kernel of one kind at one batch, on K3's rows (hidden) and bank (capacity)."""

    hidden: int
    capacity: int
    batch: int
    kind: AttnResKind
    tps: tuple[int, ...]
    sites: int  # how many applications of the model use this kind
    example_site: str

    kernel = "attn_res"

    @property
    def name(self) -> str:
        return f"attn_res/b{self.batch}/{self.kind.tag}"

    @property
    def tags(self) -> dict[str, Any]:
        """Facts the expectations select on, and the instruction counts this kind's code must show."""
        k, plan = self.kind, ClusterPlan.for_hidden(self.hidden)
        mix = k.num_blocks > 0
        delta_loads = 0 if k.delta == "none" else {"bfloat16": 1, "float32": 2}[k.delta_dtype]
        return {
            "batch": self.batch,
            "tp": ",".join(str(t) for t in self.tps),
            "num_blocks": k.num_blocks,
            "delta": k.delta,
            "delta_dtype": k.delta_dtype,
            "save": k.save,
            "out_norm": k.out_norm,
            "mix": mix,  # more than one source, so the softmax weights need the first exchange
            "cluster": plan.cluster,
            "threads": plan.threads,
            # 16-byte loads before griddepcontrol.wait: res_norm and res_proj when mixing, and the output norm.
            "weight_loads": 2 * mix + k.out_norm,
            # 16-byte loads after it: the bank blocks, the old prefix unless delta replaces it, the delta.
            "row_loads": k.num_blocks + (k.delta != "restart") + delta_loads,
            "row_stores": 1 + (k.delta != "none") + k.save,  # the output, the prefix, the saved block
            "pushes": (k.partials // 4 if mix else 0) + k.out_norm,  # st.async per pushing lane
            "exchanges": mix + k.out_norm,
            "sites": self.sites,
            "example_site": self.example_site,
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.attn_res import AttnResKernel, compile_args  # imports CuTe DSL

        args = compile_args(self.hidden, self.kind, self.batch, self.capacity)
        return cutedsl.compile_artifacts(AttnResKernel(self.hidden, self.kind), args, arch)


@dataclass(frozen=True)
class KdaInProjBuild:
    """The KDA input projection out[B, R] = x[B, K] @ W[R, K]^T at one rank's rows and one batch."""

    tp: int
    plan: InProjPlan
    op: str = "kda_in_proj"
    choice = "cuda_core"  # kda_in_proj_op.KERNELS

    @property
    def kernel(self) -> str:
        # Chunked batches (above 8) have expectations of their own: they may use the whole register file.
        return "kda_in_proj_chunked" if self.plan.chunked else "kda_in_proj"

    @property
    def name(self) -> str:
        return f"{self.op}/tp{self.tp}/b{self.plan.batch}"

    @property
    def tags(self) -> dict[str, Any]:
        """Facts the expectations select on, and the instruction counts the plan implies for the code.

        Counts are of instructions in the code, not executed ones: the k loop is one rolled body per chunk body
        (`code_chunks`), unrolled `depth` steps deep; a chunk body after the first reloads the first weight group.
        """
        p = self.plan
        bodies = p.code_chunks
        group = p.depth * p.rows_per_warp  # 16-byte weight loads per refill of every slot
        return {
            "tp": self.tp,
            "batch": p.batch,
            "rows": p.rows,
            "rows_per_warp": p.rows_per_warp,
            "ctas": p.ctas,
            "ctas_per_sm": p.ctas_per_sm,
            "depth": p.depth,
            "chunked": p.chunked,
            "weight_bytes": p.weight_bytes,
            "weight_loads_ahead": group,  # issued before griddepcontrol.wait
            # ahead + one refill per k-loop body (none when a single group covers K: the compiler drops the refill
            # a one-trip loop never takes) + a first-group reload per later body + the x staging loads
            "global_loads": group
            + (len(bodies) * group if p.groups > 1 else 0)
            + (len(bodies) - 1) * group
            + sum(map(p.fill_loads, bodies)),
            "x_stages": sum(map(p.fill_loads, bodies)),  # shared stores of the staged x
            "x_reads": sum(p.depth * c for c in bodies),  # ld.shared.v4 of x, one per step and batch row
            "fmas": sum(p.depth * p.rows_per_warp * c * 8 for c in bodies),
            "out_stores": sum(p.rows_per_warp * c for c in bodies),
            "shuffles": sum(5 * p.rows_per_warp * c for c in bodies),
            "barriers": 2 * len(bodies) - 1,
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.kda_in_proj import KdaInProjKernel, compile_args  # imports CuTe DSL

        return cutedsl.compile_artifacts(KdaInProjKernel(self.plan), compile_args(self.plan), arch)


@dataclass(frozen=True)
class KdaInProjMmaBuild:
    """The tensor-core KDA input projection (kda_in_proj_mma.py) at one rank's rows and one batch."""

    tp: int
    plan: InProjMmaPlan
    op: str = "kda_in_proj_mma"
    choice = "tensor_core"  # kda_in_proj_op.KERNELS
    kernel = "kda_in_proj_mma"

    @property
    def name(self) -> str:
        return f"{self.op}/tp{self.tp}/b{self.plan.batch}"

    @property
    def tags(self) -> dict[str, Any]:
        """Facts the expectations select on, and the instruction counts the plan implies for the code.

        Counts are of instructions in the code: each pass over W is its own code (unrolled), its k loop one rolled
        body unrolled `depth` steps deep, whose W refill the compiler drops when one group covers the slice."""
        p = self.plan
        counts = p.code_counts()
        return {
            "tp": self.tp,
            "batch": p.batch,
            "rows": p.rows,
            "ctas": p.ctas,
            "threads": p.threads,
            "m_tiles": p.m_tiles,
            "k_splits": p.k_splits,
            "depth": p.depth,
            "passes": counts["passes"],
            "masked": p.masked,
            "partial_ring_pass": p.partial_ring_pass,
            "weight_bytes": p.weight_bytes,
            "weight_loads_ahead": counts["weight_loads_ahead"],
            "global_loads": counts["weight_loads"] + counts["x_loads"],
            "mmas": counts["mmas"],
            "partial_stores": counts["partial_stores"],
            "partial_loads": counts["partial_loads"],
            "out_stores": counts["out_stores"],
            "barriers": 2 * counts["passes"] - 1 + counts["slice_barriers"],
            "x_stages": p.x_stages,
            "x_copies": counts["x_copies"],
            "x_commits": counts["x_commits"],
            "x_waits": counts["x_waits"],
            "x_reads": counts["x_reads"],
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.kda_in_proj_mma import KdaInProjKernelMma, compile_args  # imports CuTe DSL

        return cutedsl.compile_artifacts(KdaInProjKernelMma(self.plan), compile_args(self.plan), arch)


@dataclass(frozen=True)
class KdaInProjWgmmaBuild:
    """The KDA input projection as the TMA + wgmma stream (wgmma_stream.py) at one rank's rows and one batch, tiled as
    kda_in_proj_choice.toml's [wgmma_tiling] says for those rows."""

    tp: int
    plan: WgmmaStreamPlan
    op: str = "kda_in_proj_wgmma"
    choice = "wgmma"  # kda_in_proj_op.KERNELS
    kernel = "kda_in_proj_wgmma"

    @property
    def name(self) -> str:
        return f"{self.op}/tp{self.tp}/b{self.plan.batch}"

    @property
    def tags(self) -> dict[str, Any]:
        """Facts the expectations select on, and the instruction counts the plan implies for the code: the ring's
        first k tiles are unrolled (W before the dependency wait, x after it), then one rolled loop body copies both
        and runs a k tile's wgmmas."""
        p = self.plan
        columns = p.k_tile // 64  # TMA copies of one tile: one per 128-byte swizzle column
        return {
            "tp": self.tp,
            "batch": p.batch,
            "rows": p.rows,
            "ctas": p.ctas,
            "threads": p.threads,
            "k_splits": p.k_splits,
            "stages": p.stages,
            "weight_bytes": p.weight_bytes,
            "w_copies_ahead": p.ahead * columns,
            "tile_copies": (2 + 2 * p.ahead) * columns,
            "wgmmas": p.k_tile // 16,
            "out_stores": p.stored_values,
            "cluster_stores": p.acc_values // 4 if p.k_splits > 1 else 0,
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.wgmma_stream import KdaInProjKernelWgmma, compile_args  # imports CuTe DSL

        return cutedsl.compile_artifacts(KdaInProjKernelWgmma(self.plan), compile_args(self.plan), arch)


@dataclass(frozen=True)
class KdaHeadStreamBuild:
    """The input projection streamed head by head (kda_head_stream.py, not served: the one-kernel plan's probe) at
    one rank's rows, one batch and one K split."""

    tp: int
    plan: HeadStreamPlan
    kernel = "kda_head_stream"

    @property
    def name(self) -> str:
        watch = "/watch" if self.plan.watch else ""
        ring = f"/ring{self.plan.stages}" if self.plan.stages else ""
        return f"{self.kernel}/tp{self.tp}/b{self.plan.batch}/s{self.plan.split}{watch}{ring}"

    @property
    def tags(self) -> dict[str, Any]:
        """Facts the expectations select on, and the instruction counts the plan implies: trip 0's loads before the
        wait, one rolled trip body (the refill of every slot, the products, one slice sum per batch row), x staged
        once."""
        p = self.plan
        copies = p.stages > 0
        ahead = min(p.stages, p.trips)  # trips copied into the ring before the wait
        ring_reads = p.steps_per_unit if copies else 0  # a copy-fed lane reads its W vectors back from the ring
        return {
            "tp": self.tp,
            "batch": p.batch,
            "split": p.split,
            "copies": copies,
            "stages": p.stages,
            "bulk_copies": ahead + 1 if copies else 0,  # the first trips unrolled, one refill in the trip body
            "bulk_copies_ahead": ahead,
            "proxy_fences": 2 if copies else 0,  # after the barriers' set-up, and before each refill
            "rows": p.rows,
            "ctas": p.ctas,
            "ctas_per_sm": p.ctas_per_sm,
            "trips": p.trips,
            "groups": p.groups,
            "weight_bytes": p.weight_bytes,
            "weight_loads_ahead": 0 if copies else p.steps_per_unit,
            "global_loads": p.fill_loads + (0 if copies else 2 * p.steps_per_unit),
            "x_stages": p.fill_loads,
            "x_reads": p.steps_per_unit * p.batch + ring_reads,
            "fmas": p.steps_per_unit * p.batch * 8,
            "shuffles": 5 * p.batch,
            # the slice sums of a warp's batch rows sit in consecutive words, 16-byte aligned where the batch allows,
            # so ptxas moves them in vectors of up to 4
            "slice_vectors": p.batch // p.slice_vector,
            "shared_stores": p.fill_loads + p.batch // p.slice_vector,
            "shared_loads": p.steps_per_unit * p.batch + ring_reads + (p.split - 1) * (p.batch // p.slice_vector),
            "out_stores": p.batch,
            "group_threads": p.split * 32,
            "watch": p.watch,
            "threads": p.threads,
            # the watcher: the epoch, then two acquire loads a group (the first read and the loop's); a stamp a group
            "acquire_loads": (1 + 2 * p.groups) if p.watch else 0,
            "stamps": 2 + (p.groups if p.watch else 0),
            "release_adds": 1 + p.watch,  # each row's publish, and the last CTA's epoch advance
            "cta_barriers": 1 + p.watch,  # after staging x, and before the CTA counts itself done
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.kda_head_stream import KdaHeadStreamKernel, compile_args  # imports CuTe DSL

        return cutedsl.compile_artifacts(KdaHeadStreamKernel(self.plan), compile_args(self.plan), arch)


@dataclass(frozen=True)
class KdaOProjBuild:
    """o_proj with the AttnRes after attention in one launch (kda_o_proj.py) at one rank's shape, batch and kind."""

    tp: int
    plan: OProjPlan
    capacity: int  # bank blocks the buffers hold (K3: 8)

    kernel = "kda_o_proj"

    @property
    def name(self) -> str:
        p = self.plan
        return (
            f"kda_o_proj/tp{self.tp}/b{p.batch}/{p.kind.tag}"
            + "/one-pass" * p.one_pass
            + "/warm" * p.warm_l2
            + "/w-smem" * p.w_smem
            + "/w-l2" * p.w_l2
            + "/paired" * p.paired_rows
        )

    @property
    def tags(self) -> dict[str, Any]:
        """Facts the expectations select on, and the instruction counts the plan implies for the code.

        Counts are of instructions in the code: the k loop is one rolled body unrolled `depth` steps deep, whose
        refill of the weight slots the compiler drops when one group covers K. The stream (everything before the
        arrival) and the epilogue (one AttnRes application per epilogue row, after it) are counted apart.
        """
        p, k = self.plan, self.plan.kind
        group = p.depth * p.rows_per_warp  # 16-byte weight loads per refill of every slot
        mix = k.num_blocks > 0
        weight_loads = 2 * mix + k.out_norm  # the AttnRes weights: res_norm and res_proj when mixing, out_norm
        rows = p.epilogue_rows  # batch rows each epilogue cluster applies AttnRes to, each with its own exchanges
        per_row = k.num_blocks + (k.delta == "add")  # a row's bank blocks and old prefix
        independent = weight_loads + rows * per_row
        w_loads = group + (group if p.groups > 1 else 0)  # the slots' fills: ahead and one refill body
        stream_loads = (0 if p.w_smem else w_loads) + p.fill_loads
        stream = {  # the CUDA-core stream (B <= 4)
            "depth": p.depth,
            "groups": p.groups,
            "weight_loads_ahead": 0 if p.w_smem or p.w_l2 else group,
            "o_stages": p.fill_loads,  # shared stores of the staged o
            "o_reads": p.depth * p.batch,  # ld.shared.v4 of o, one per step and batch row
            "stream_fmas": p.depth * p.rows_per_warp * p.batch * 8,
            "stream_shuffles": 5 * p.rows_per_warp * p.batch,
            "stream_mmas": 0,
            "out_stores": p.rows_per_warp * p.batch,  # BF16 o_proj outputs per lane's warp
            "passes": 1,
            # CTA barriers before the arrival: o's staging, and the one ordering every store before the release
            # (and with W staged in shared memory the one that publishes its barrier's initialization)
            "arrival_barriers": 2 + p.w_smem,
            "w_shared_loads": w_loads if p.w_smem else 0,  # the same fills, from shared memory after the wait
            "w_bulk_copies": 1 if p.w_smem else 0,  # a lane a row: the CTA's 16 rows in one unrolled copy
        }
        if p.tensor_cores:  # the tensor-core stream: o read in MMA fragments, no staging, no FMAs or shuffles
            m = p.mma
            counts = m.code_counts()
            stream_loads = counts["weight_loads"] + counts["x_loads"]
            stream = {
                "depth": m.depth,
                "groups": m.groups,
                "weight_loads_ahead": counts["weight_loads_ahead"],
                "o_stages": 0,
                "o_reads": 0,
                "stream_fmas": 0,
                "stream_shuffles": 0,
                "stream_mmas": counts["mmas"],
                "out_stores": counts["out_stores"],
                "passes": counts["passes"],
                # each pass's fixed-order sum, one between passes (its partials are read), the one before the release,
                # and with W staged in shared memory the one that publishes its barrier's initialization
                "arrival_barriers": 2 * counts["passes"] + m.w_smem,
                "w_shared_loads": counts["w_shared_loads"],
                "w_bulk_copies": counts["w_bulk_copies"],
            }
        return {
            "tp": self.tp,
            "batch": p.batch,
            "k": p.k,
            "num_blocks": k.num_blocks,
            "delta": k.delta,
            "save": k.save,
            "out_norm": k.out_norm,
            "mix": mix,
            "rows_per_warp": p.rows_per_warp,
            "ctas": p.ctas,
            "clusters": p.clusters,
            "ctas_per_sm": p.ctas_per_sm,
            "tensor_cores": p.tensor_cores,
            "weight_bytes": p.weight_bytes,
            "stream_loads": stream_loads,  # W ahead, one refill body, o's staging (or o's MMA fragments)
            "epilogue_rows": rows,
            "epilogue_clusters": p.epilogue_clusters,
            "preloaded_rows": p.preloaded_rows,
            # Loaded by an epilogue CTA before it waits for the grid (the weights and the preloaded rows' inputs);
            # after it, the other rows' inputs and one vector a row: the o_proj row.
            "epilogue_loads_before_wait": weight_loads + p.preloaded_rows * per_row,
            "global_loads": stream_loads + independent + rows,
            **stream,
            "row_stores": rows * (2 + k.save),  # the MLP input, the prefix, the saved block
            "pushes": rows * ((k.partials // 4 if mix else 0) + k.out_norm),  # st.async per pushing lane
            "exchanges": rows * (mix + k.out_norm),
            "warm": p.warm_l2,
            "warm_prefetches": len(p.late_runs) if p.l2_prefetched else 0,  # one per run in the code, before the wait
            "w_smem": p.w_smem,  # as a count: the one wait for the CTA's rows of W, after the dependency wait
            "w_l2": p.w_l2,
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.kda_o_proj import KdaOProjKernel, compile_args  # imports CuTe DSL

        return cutedsl.compile_artifacts(KdaOProjKernel(self.plan), compile_args(self.plan, self.capacity), arch)


def _after_attention_kinds(dims: Any, tags: list[str], where: str) -> list[AttnResKind]:
    """builds.toml's kind tags at `where` as kinds, each one that some after-attention site of the model uses."""
    after = {k for k, sites in site_kinds(dims).items() if any(s.startswith("after attention") for s in sites)}
    kinds = [AttnResKind.from_tag(tag) for tag in tags]
    for tag, kind in zip(tags, kinds, strict=True):
        if kind not in after:
            raise ValueError(f"builds.toml {where}: {tag} is not an after-attention kind of {dims.name}")
    return kinds


@dataclass(frozen=True)
class KdaOProjWgmmaBuild:
    """The fused o_proj + AttnRes's wgmma build (kda_o_proj_wgmma.py) at one rank's shape, batch and kind."""

    tp: int
    plan: OProjWgmmaPlan
    capacity: int  # bank blocks the buffers hold (K3: 8)

    kernel = "kda_o_proj_wgmma"

    @property
    def name(self) -> str:
        p = self.plan
        return (
            f"kda_o_proj_wgmma/tp{self.tp}/b{p.batch}/{p.kind.tag}"
            + f"/{p.ctas_per_sm}-per-sm" * (p.ctas_per_sm != OPROJ_WGMMA_CTAS_PER_SM)
            + "/paired" * p.paired_rows
            + "/w-l2" * p.w_l2
            + "/w-l2-late" * p.w_l2_late
        )

    @property
    def tags(self) -> dict[str, Any]:
        """Facts the expectations select on, and the instruction counts the plan implies for the code: the ring's
        first k tiles unrolled (W before the dependency wait, o after it), then one rolled loop body that runs a k
        tile's wgmmas and refills the stage the tile before read (W and o)."""
        p, s = self.plan, self.plan.stream
        return {
            "tp": self.tp,
            "batch": p.batch,
            "k": p.k,
            "num_blocks": p.kind.num_blocks,
            "ctas": p.ctas,
            "clusters": p.clusters,
            "stream_clusters": p.stream_clusters,
            "epilogue_clusters": p.epilogue_clusters,
            "epilogue_rows": p.epilogue_rows,
            "stages": s.stages,
            "ctas_per_sm": p.ctas_per_sm,
            "weight_bytes": p.weight_bytes,
            "w_copies_ahead": s.ahead,
            "tile_copies": 2 * s.ahead + 2,
            "wgmmas": s.k_tile // 16,
            "out_stores": s.stored_values,
            "l2_prefetches": int(p.w_l2 or p.w_l2_late),
            "l2_prefetches_ahead": int(p.w_l2),
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.kda_o_proj_wgmma import KdaOProjKernelWgmma, compile_args  # imports CuTe DSL

        plan = self.plan
        return cutedsl.compile_artifacts(KdaOProjKernelWgmma(plan), compile_args(plan, self.capacity), arch)


@dataclass(frozen=True)
class KdaStepBuild:
    """The fused KDA decode step (q = 1) at one rank's heads and one batch."""

    tp: int
    plan: KdaStepPlan

    kernel = "kda_step"

    @property
    def name(self) -> str:
        return f"kda_step/tp{self.tp}/b{self.plan.batch}{self.plan.variant_suffix}"

    @property
    def tags(self) -> dict[str, Any]:
        """Facts the expectations select on, and the instruction counts the kernel's code must show. The code is the
        same for every plan but for its constants (the plan sets the grid, the block, the sizes and the offsets), so
        the counts are fixed by its structure (kda_step.py)."""
        p = self.plan
        rows, n, local = p.rows_per_warp, p.requests_per_cta, int(p.local_decays)
        return {
            "tp": self.tp,
            "batch": p.batch,
            "heads": p.heads,
            "cluster": p.cluster,
            "threads": p.threads,
            "ctas": p.ctas,
            "ctas_per_sm": p.ctas_per_sm,
            "resident_threads": p.resident_threads,
            "smem_bytes": p.smem_bytes,
            # Bulk copies into shared memory: before the wait the f_b rows and the conv weights of the three
            # channel runs (the head's q and k, the CTA's v); after it the packed row's sections (the three runs'
            # inputs, f_a, the output gates), the three runs' taps and the state rows.
            # A group kernel (kda_step_group.py) copies and computes all but the weights once per request of its
            # group (n of them).
            # With local decays (one request a CTA) the decay barrier is neither armed nor waited on, nothing is
            # pushed but the norm partial, and the head's dt_bias comes by one more copy instead of two plain loads.
            "requests_per_cta": n,
            "local_decays": p.local_decays,
            "lean_start": p.lean_start,
            "lean_conv": p.lean_conv,
            "joint_sums": p.joint_sums,
            "wide_warps": p.wide_warps,
            "barriers": 6 * n,
            "armed": 6 + 5 * (n - 1) - local,
            "weight_copies": 1 + 3 + local,
            "packed_copies": (3 + 2) * n,
            "tap_copies": 3 * n,
            "state_copies": n,
            "prefetches": (1 + 3) * n,  # before the wait, into L2: the state rows and the three runs' taps
            "warm_ahead": p.warm_ahead,
            "warm_prefetches": 1 + 3 if p.ahead else 0,  # after it, the same for the CTA one wave later
            # Plain loads before the wait: A_log, dt_bias (one per f_b row of the lane: two, four with wide warps),
            # o_norm (the warp's rows, one load), the slot steering the prefetch; after it: the slot again and beta
            # (and the next wave's slot, when warming).
            "early_loads": 1 + rows // 2 * (1 - local) + 1 + n,
            "late_loads": 3 if p.ahead else 2 * n,
            "state_stores": rows * n,
            "tap_stores": 3 * n,
            # the output of a live request and the zeros of a NULL one; a group's NULL requests are zeroed where
            # the group has a live one and where it has none
            "out_stores": 2 if n == 1 else 3 * n,
            # with wide warps both are 16-byte vectors (eight BF16 a warp), the live one before the taps' barrier
            "wide_out_stores": 2 if p.wide_warps else 0,
            "wide_live_out": int(p.wide_warps),
            # the decay pairs of the lane's f_b rows, the norm partial (a wide warp's two as one pair)
            "pushes": (rows // 2 * (1 - local) + 1) * n,
            # mbarrier waits: weights, packed row, taps, decays, state, norm on the live path; weights, packed row on
            # the NULL path. A group waits for the weights once, and for each request's five others.
            "waits": 6 + 2 - local if n == 1 else 1 + 5 * n,
            # The f_b rows (4 steps each over a half-warp), the L2 norms (4), S k and S q per row (2 x 5), the norm
            # (5); with joint sums S k and S q of the warp's rows in two reductions of 2 + 1 + 3 steps each.
            "shuffles": (rows // 2 * 4 + 4 + (2 * 6 if p.joint_sums else rows * 2 * 5) + 5) * n,
            # Indexed shuffles: three at the start (the shared-memory base and the warp index made warp-uniform), and
            # with joint sums the four sums handed to every lane, twice.
            "indexed_shuffles": 3 + (2 * rows if p.joint_sums else 0),
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.kda_step import compile_args  # imports CuTe DSL
        from k3_decode.kernels.kda_step_group import step_kernel

        return cutedsl.compile_artifacts(step_kernel(self.plan), compile_args(self.plan), arch)


@dataclass(frozen=True)
class KdaStepVerifyBuild:
    """The fused KDA verify step (KdaStepKernel.verify) at one rank's heads, a number of requests and q tokens each."""

    tp: int
    plan: KdaVerifyPlan

    kernel = "kda_step_verify"

    @property
    def name(self) -> str:
        return f"kda_step_verify/tp{self.tp}/b{self.plan.batch}/q{self.plan.tokens}"

    @property
    def tags(self) -> dict[str, Any]:
        """What the expectations select on, and the counts the verify kernel's code must show: its loops over the
        q tokens are unrolled, so the decode kernel's per-token instructions appear q times."""
        p, q, rows = self.plan, self.plan.tokens, ROWS_PER_WARP
        return {
            "tp": self.tp,
            "batch": p.batch,
            "tokens": q,
            "heads": p.heads,
            "cluster": p.cluster,
            "threads": p.threads,
            "ctas": p.ctas,
            "ctas_per_sm": p.ctas_per_sm,
            "resident_ctas": p.resident_ctas,
            "smem_bytes": p.smem_bytes,
            "columns": p.columns,
            # Bulk copies: before the wait the weights (f_b rows, the conv weights of the three channel runs);
            # after it every token's packed-row sections (three runs, f_a, the output gates), the conv row's
            # columns of the three runs, the state rows of the accepted token's slot.
            "weight_copies": 1 + 3,
            "packed_copies": 5 * q,
            "tap_copies": 3,
            "state_copies": 1,
            "prefetches": 1 + 3,
            # Plain loads before the wait: A_log, dt_bias (two), o_norm, and the hints num_accepted, slot[b, 0],
            # slot[b, a - 1]; after it: slot[b, 0], num_accepted, slot[b, a - 1], and one lane per token its beta
            # and its slot.
            "early_loads": 1 + 2 + 1 + 3,
            "late_loads": 3 + 2,
            "state_stores": rows * q,  # every token's state rows (each under its slot's test)
            "tap_stores": p.columns,  # the rewritten conv row: T 16-byte vectors per 8 channels
            "out_stores": 2 * q,  # every token's output of a live request and the zeros of a NULL one
            "pushes": 3 * q,  # per token: the decay pairs of both f_b rows, the norm partial
            "waits": 6 + 2,
            "shuffles": q * (2 * 4 + 4 + rows * 2 * 5 + 5),
        }

    def compile(self, arch: str) -> KernelArtifacts:
        from k3_decode.kernels.kda_step import KdaStepKernel, verify_compile_args  # imports CuTe DSL

        return cutedsl.compile_artifacts(KdaStepKernel(self.plan).verify, verify_compile_args(self.plan), arch)


@dataclass(frozen=True)
class K3KernelBuilds:
    """The KernelBuildSet of the k3-hopper subject."""

    table_file: str = "builds.toml"
    expectations_file: str = "expectations.toml"

    @cached_property
    def table(self) -> dict[str, Any]:
        return tomllib.loads(resources.files(PACKAGE).joinpath(self.table_file).read_text())

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(self.table["archs"])

    @property
    def expectations_name(self) -> str:
        return f"k3_decode/kernels/{self.expectations_file}"

    def environment(self, arch: str) -> dict[str, str]:
        return cutedsl.environment(arch)

    def missing(self) -> str | None:
        return cutedsl.missing()

    def expectations_text(self) -> str:
        return resources.files(PACKAGE).joinpath(self.expectations_file).read_text()

    def builds(
        self, arch: str
    ) -> list[
        AttnResBuild
        | KdaInProjBuild
        | KdaInProjMmaBuild
        | KdaInProjWgmmaBuild
        | KdaHeadStreamBuild
        | KdaOProjBuild
        | KdaOProjWgmmaBuild
        | KdaStepBuild
        | KdaStepVerifyBuild
    ]:
        return [
            *self.attn_res_builds(),
            *self.kda_in_proj_builds(),
            *self.kda_in_proj_mma_builds(),
            *self.kda_in_proj_wgmma_builds(),
            *self.kda_head_stream_builds(),
            *self.kda_o_proj_builds(),
            *self.kda_o_proj_wgmma_builds(),
            *self.kda_step_builds(),
            *self.kda_step_verify_builds(),
        ]

    def attn_res_builds(self) -> list[AttnResBuild]:
        dims = load_dims(self.table["model"])
        spec = self.table["attn_res"]
        widths = set()
        for tp in spec["tp"]:
            try:
                widths.add(dims.shard(tp).hidden)
            except ShardError as exc:
                raise ValueError(f"builds.toml attn_res.tp: {exc}") from None
        if len(widths) != 1:  # the rows would differ per rank, and each width needs builds of its own
            raise ValueError(f"builds.toml attn_res.tp gives row widths {sorted(widths)}; list one width at a time")
        kinds = site_kinds(dims)
        for tag in spec["float32_delta"]:
            base = AttnResKind.from_tag(tag)
            if base not in kinds:
                raise ValueError(f"builds.toml attn_res.float32_delta: {tag} is not a kind of {dims.name}'s sites")
            f32 = AttnResKind(base.num_blocks, base.delta, base.save, base.out_norm, "float32")
            kinds[f32] = kinds[base]
        (width,) = widths
        ordered = sorted(kinds.items(), key=lambda item: (item[0].num_blocks, item[0].tag))
        return [
            AttnResBuild(
                hidden=width,
                capacity=dims.num_attn_res_blocks,
                batch=batch,
                kind=kind,
                tps=tuple(spec["tp"]),
                sites=len(sites),
                example_site=sites[0],
            )
            for batch in spec["batches"]
            for kind, sites in ordered
        ]

    def kda_in_proj_builds(self) -> list[KdaInProjBuild]:
        """The packed input projection: x[B, hidden] @ W[rows, hidden]^T per rank."""
        return self._projection_builds("kda_in_proj", lambda shard: (shard.kda_in_proj_rows, shard.hidden))

    def kda_in_proj_mma_builds(self) -> list[KdaInProjMmaBuild]:
        """The tensor-core input projection at the rows and batches of builds.toml's [kda_in_proj_mma]."""
        sms = self.table["kda_in_proj_mma"]["sm_count"]
        return self._rank_projections(
            "kda_in_proj_mma",
            lambda tp, rows, k, batch: KdaInProjMmaBuild(tp, InProjMmaPlan.for_shape(rows, k, batch, sms)),
        )

    def kda_in_proj_wgmma_builds(self) -> list[KdaInProjWgmmaBuild]:
        """The TMA + wgmma input projection at the rows and batches of builds.toml's [kda_in_proj_wgmma], tiled as
        kda_in_proj_choice.toml says."""
        return self._rank_projections(
            "kda_in_proj_wgmma", lambda tp, rows, k, batch: KdaInProjWgmmaBuild(tp, wgmma_plan(rows, k, batch))
        )

    def kda_head_stream_builds(self) -> list[KdaHeadStreamBuild]:
        """The head-ordered input projection at each rank's rows and heads, for the batches and K splits of
        builds.toml's [kda_head_stream], with the watching warp at its watch batches, and copy-fed at its copies."""
        dims = load_dims(self.table["model"])
        spec = self.table["kda_head_stream"]
        builds = []
        for tp in spec["tp"]:
            try:
                shard = dims.shard(tp)
            except ShardError as exc:
                raise ValueError(f"builds.toml kda_head_stream.tp: {exc}") from None
            ring = spec["copies"]
            cells = [(b, s, False, 0) for b in spec["batches"] for s in spec["splits"]]
            cells += [(b, s, True, 0) for b in spec["watch_batches"] for s in spec["splits"]]
            cells += [(b, ring["split"], False, ring["stages"]) for b in ring["batches"]]
            for batch, split, watch, stages in cells:
                plan = HeadStreamPlan.for_shape(
                    shard.kda_in_proj_rows,
                    shard.hidden,
                    batch,
                    shard.kda_heads,
                    dims.kda.head_dim,
                    split,
                    spec["sm_count"],
                    watch,
                    stages,
                )
                builds.append(KdaHeadStreamBuild(tp, plan))
        return builds

    def _rank_projections(self, section: str, make: Callable[[int, int, int, int], Any]) -> list[Any]:
        """make(tp, rows, k, batch) at each rank's projection shape for the TP sizes and batches of `section`."""
        dims = load_dims(self.table["model"])
        spec = self.table[section]
        builds = []
        for tp in spec["tp"]:
            try:
                shard = dims.shard(tp)
            except ShardError as exc:
                raise ValueError(f"builds.toml {section}.tp: {exc}") from None
            builds += [make(tp, shard.kda_in_proj_rows, shard.hidden, batch) for batch in spec["batches"]]
        return builds

    def kda_o_proj_builds(self) -> list[KdaOProjBuild]:
        """o_proj with the AttnRes after attention fused: [B, proj] @ W[hidden, proj]^T per rank, then the AttnRes
        kinds builds.toml lists (each must be one the model's after-attention sites use)."""
        dims = load_dims(self.table["model"])
        spec = self.table["kda_o_proj"]
        kinds = _after_attention_kinds(dims, spec["kinds"], "kda_o_proj.kinds")
        both = spec.get("both_streams", {"batches": [], "kinds": []})
        warm = spec.get("warm", {"batches": [], "kinds": []})
        staged = spec.get("w_smem", {"batches": [], "kinds": []})
        in_l2 = spec.get("w_l2", {"batches": [], "kinds": []})
        paired = spec.get("paired", {"batches": [], "kinds": []})
        variant_kinds = {}
        variants = (("both_streams", both), ("warm", warm), ("w_smem", staged), ("w_l2", in_l2), ("paired", paired))
        for key, table in variants:
            variant_kinds[key] = [AttnResKind.from_tag(tag) for tag in table["kinds"]]
            if any(kind not in kinds for kind in variant_kinds[key]):
                raise ValueError(f"builds.toml kda_o_proj.{key}.kinds must be among kinds, got {table['kinds']}")
        builds: list[KdaOProjBuild] = []

        def add(tp: int, plan: OProjPlan) -> None:  # a variant that is the plain plan at this shape is built once
            if all(b.plan != plan for b in builds):
                builds.append(KdaOProjBuild(tp, plan, dims.num_attn_res_blocks))

        for tp in spec["tp"]:
            try:
                hidden, k = dims.shard(tp).kda_o_proj
            except ShardError as exc:
                raise ValueError(f"builds.toml kda_o_proj.tp: {exc}") from None

            def plan_at(batch: int, kind: AttnResKind, **choices: bool | None) -> OProjPlan:
                # One row at a time in each epilogue cluster unless asked, whatever paired_rows serves: the paired
                # variant is built on its own, so serving it renames and drops no build.
                choices.setdefault("paired_rows", False)
                return OProjPlan.for_shape(hidden, k, batch, kind, spec["sm_count"], **choices)  # noqa: B023

            for batch in spec["batches"]:
                for kind in kinds:
                    builds.append(KdaOProjBuild(tp, plan_at(batch, kind), dims.num_attn_res_blocks))
            # Both streams above 32 rows (one pass and two) where builds.toml asks, whichever kda_o_proj_choice.toml
            # serves, so CI holds the registers and frame of the one a rule may serve next.
            for batch in both["batches"]:
                for kind in variant_kinds["both_streams"]:
                    for one_pass in (False, True):
                        add(tp, plan_at(batch, kind, one_pass=one_pass))
            # Each variant below is built beside the plain stream, whatever else the choice file serves at the batch
            # (two of them in one plan are refused).
            plain = {"w_smem": False, "w_l2": False}
            # L2 warmed with the late weight runs (kda_o_proj_choice.toml warm_batches), where the stream has any.
            for batch in warm["batches"]:
                for kind in variant_kinds["warm"]:
                    if plan_at(batch, kind, warm=False, **plain).warmable:
                        add(tp, plan_at(batch, kind, warm=True, **plain))
            # W staged whole in shared memory (kda_o_proj_choice.toml w_smem_batches), with the served stream.
            for batch in staged["batches"]:
                for kind in variant_kinds["w_smem"]:
                    add(tp, plan_at(batch, kind, capped=False, warm=False, w_smem=True, w_l2=False))
            # W prefetched whole into L2 and none in registers before the wait (w_l2_batches; CUDA cores only).
            for batch in in_l2["batches"]:
                for kind in variant_kinds["w_l2"]:
                    add(tp, plan_at(batch, kind, w_smem=False, w_l2=True))
            # Each epilogue cluster's two rows exchanged together (paired_rows), with the served stream.
            for batch in paired["batches"]:
                for kind in variant_kinds["paired"]:
                    add(tp, plan_at(batch, kind, paired_rows=True))
        return builds

    def kda_o_proj_wgmma_builds(self) -> list[KdaOProjWgmmaBuild]:
        """The fused o_proj's wgmma build at the ranks, batches and after-attention kinds of builds.toml's
        [kda_o_proj_wgmma]."""
        dims = load_dims(self.table["model"])
        spec = self.table["kda_o_proj_wgmma"]
        # The plain build and each variant table (builds.toml key: its choices off the plain plan), every choice
        # explicit, so the builds are the same whatever kda_o_proj_choice.toml serves: serving one renames and drops
        # nothing.
        plain = {"ctas_per_sm": OPROJ_WGMMA_CTAS_PER_SM, "paired_rows": False, "w_l2": False, "w_l2_late": False}
        variants = {
            "two_per_sm": {"ctas_per_sm": 2},
            "two_per_sm_paired": {"ctas_per_sm": 2, "paired_rows": True},
            "paired": {"paired_rows": True},
            "w_l2": {"w_l2": True},
            "w_l2_late": {"w_l2_late": True},
        }
        kinds = _after_attention_kinds(dims, spec["kinds"], "kda_o_proj_wgmma.kinds")
        cells = [(b, kind, plain) for b in spec["batches"] for kind in kinds]
        for key, change in variants.items():
            table = spec.get(key, {"batches": [], "kinds": []})
            for kind in _after_attention_kinds(dims, table["kinds"], f"kda_o_proj_wgmma.{key}.kinds"):
                cells += [(b, kind, {**plain, **change}) for b in table["batches"]]
        builds = []
        for tp in spec["tp"]:
            try:
                hidden, k = dims.shard(tp).kda_o_proj
            except ShardError as exc:
                raise ValueError(f"builds.toml kda_o_proj_wgmma.tp: {exc}") from None
            for batch, kind, choices in cells:
                plan = OProjWgmmaPlan.for_shape(hidden, k, batch, kind, spec["sm_count"], **choices)
                builds.append(KdaOProjWgmmaBuild(tp, plan, dims.num_attn_res_blocks))
        return builds

    def _projection_builds(self, section: str, shape: Callable[[Any], tuple[int, int]]) -> list[KdaInProjBuild]:
        """The weight-stream kernel at `shape(rank shard)` = (rows, K) for every TP and batch of builds.toml's
        [section]."""
        dims = load_dims(self.table["model"])
        spec = self.table[section]
        builds = []
        for tp in spec["tp"]:
            try:
                rows, k = shape(dims.shard(tp))
            except ShardError as exc:
                raise ValueError(f"builds.toml {section}.tp: {exc}") from None
            for batch in spec["batches"]:
                builds.append(KdaInProjBuild(tp, InProjPlan.for_shape(rows, k, batch, spec["sm_count"]), section))
        return builds

    def kda_step_builds(self) -> list[KdaStepBuild]:
        """The fused KDA decode step at every TP and batch of builds.toml's [kda_step], at each rank's heads: the
        served variant (kda_step_choice.toml), and every register budget, the warming, the request groups, the
        local decays, the lean start, the lean conv, the joint sums, the wide warps (at every register budget) and
        the wide warps with the lean conv (uncapped, capped where the cap binds, and with the lean start) where it
        lists them."""
        dims = load_dims(self.table["model"])
        spec = self.table["kda_step"]
        budgets = spec.get("every_budget", {"batches": []})["batches"]
        warm = set(spec.get("warm_ahead", {"batches": []})["batches"])
        groups = spec.get("request_groups", {"requests": 1, "batches": []})
        local = spec.get("local_decays", {"batches": []})["batches"]
        lean = spec.get("lean_start", {"batches": []})["batches"]
        lean_conv = spec.get("lean_conv", {"batches": []})["batches"]
        joint = spec.get("joint_sums", {"batches": []})["batches"]
        wide = spec.get("wide_warps", {"batches": []})["batches"]
        wide_conv = spec.get("wide_lean_conv", {"batches": []})["batches"]
        wide_conv_lean = spec.get("wide_lean_conv_lean", {"batches": []})["batches"]
        capped = spec.get("wide_lean_conv_cap", {"max_ctas_per_sm": 0, "batches": []})
        builds = []
        for tp in spec["tp"]:
            try:
                shard = dims.shard(tp)
            except ShardError as exc:
                raise ValueError(f"builds.toml kda_step.tp: {exc}") from None
            heads, rows, sms = shard.kda_heads, shard.kda_in_proj_rows, spec["sm_count"]
            mine = [KdaStepPlan.for_shape(heads, rows, batch, sms) for batch in spec["batches"]]
            # and its four-row twin where the choice serves the pair there, and the plain step where it serves a
            # lean start: each knob's build is compared with its twin with the knob off (the build tests' value
            # comparisons), whatever the choice serves
            mine += [
                KdaStepPlan.for_shape(heads, rows, batch, sms, **twin)
                for twin in (knob_alone(), knob_alone(lean_start=False))
                for batch in spec["batches"]
            ]
            mine += [  # each budget with the plain step, whatever start, conv and warps the choice serves there
                KdaStepPlan.for_shape(
                    heads, rows, batch, sms, resident_threads=threads, warm_ahead=False, **knob_alone(lean_start=False)
                )
                for batch in budgets
                for threads in RESIDENT_CHOICES
            ]
            mine += [
                replace(plan, warm_ahead=True)
                for plan in list(mine)
                if plan.batch in warm
                and plan.requests_per_cta == 1
                and not plan.lean_start
                and plan.wave_requests < plan.batch
            ]
            mine += [
                KdaStepPlan.for_shape(
                    heads, rows, batch, sms, resident_threads=RESIDENT_THREADS, requests_per_cta=groups["requests"]
                )
                for batch in groups["batches"]
            ]
            # each knob alone beside the served plan (kda_step_plan.knob_alone)
            mine += [KdaStepPlan.for_shape(heads, rows, batch, sms, **knob_alone(local_decays=True)) for batch in local]
            mine += [KdaStepPlan.for_shape(heads, rows, batch, sms, **knob_alone(lean_start=True)) for batch in lean]
            mine += [
                KdaStepPlan.for_shape(heads, rows, batch, sms, **knob_alone(lean_conv=True)) for batch in lean_conv
            ]
            mine += [KdaStepPlan.for_shape(heads, rows, batch, sms, **knob_alone(joint_sums=True)) for batch in joint]
            mine += [
                KdaStepPlan.for_shape(heads, rows, batch, sms, resident_threads=threads, **knob_alone(wide_warps=True))
                for batch in wide
                for threads in RESIDENT_CHOICES
            ]
            mine += [KdaStepPlan.for_shape(heads, rows, batch, sms, **the_pair()) for batch in wide_conv]
            mine += [
                KdaStepPlan.for_shape(heads, rows, batch, sms, **the_pair(lean_start=True)) for batch in wide_conv_lean
            ]
            for batch in capped["batches"]:  # only where the cap binds: elsewhere it is the uncapped build
                plan = KdaStepPlan.for_shape(heads, rows, batch, sms, **the_pair())
                if capped["max_ctas_per_sm"] < plan.spread:
                    mine.append(replace(plan, max_ctas_per_sm=capped["max_ctas_per_sm"]))
            builds += [KdaStepBuild(tp, plan) for plan in mine]
        # a variant kda_step_choice.toml serves is built once, whichever table entry also asks for it
        return list({b.name: b for b in builds}.values())

    def kda_step_verify_builds(self) -> list[KdaStepVerifyBuild]:
        """The fused KDA verify step at every TP, tokens per request and batch of builds.toml's [kda_step_verify]
        whose tokens fit max_tokens."""
        dims = load_dims(self.table["model"])
        spec = self.table["kda_step_verify"]
        builds = []
        for tp in spec["tp"]:
            try:
                shard = dims.shard(tp)
            except ShardError as exc:
                raise ValueError(f"builds.toml kda_step_verify.tp: {exc}") from None
            for q in spec["tokens"]:
                for batch in spec["batches"]:
                    if batch * q > spec["max_tokens"]:
                        continue
                    plan = KdaVerifyPlan.for_shape(
                        shard.kda_heads, shard.kda_in_proj_rows, batch, spec["sm_count"], tokens=q
                    )
                    builds.append(KdaStepVerifyBuild(tp, plan))
        return builds


K3_KERNEL_BUILDS = K3KernelBuilds()
