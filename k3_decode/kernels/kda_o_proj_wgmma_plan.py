"""How the fused o_proj + AttnRes kernel's wgmma build (kda_o_proj_wgmma.py) splits its work, without CuTe DSL.

The same semantics as kda_o_proj.py (attn_out = o @ W^T, then the AttnRes after attention of every row), another
grid. The mma.sync build gives every CTA 16 rows of W, so its 448 CTAs each read all of o (at B64 TP8, 88 MB from
L2 beside W's 22) and its stream moved W at about half of what cuBLAS reaches from 32 rows on. Here W streams as in
wgmma_stream.py: TMA tiles of 64 rows into a shared-memory ring, wgmma m64nNk16 with W's rows as M, so 112 CTAs read
o (22 MB at B64 TP8). Those 112 CTAs cannot also apply AttnRes to every row: at most half of 16 clusters of 7 may
wait for the grid, which makes 8 rows a cluster at B64, one after another. So the grid has two kinds of cluster,
both of the AttnRes kernel's size (attn_res_plan.ClusterPlan: 7 CTAs of 128 threads, one warpgroup):
- stream clusters 0..S-1 (S = 112 / 7 = 16 at K3's 7168 rows): CTA c streams W's rows [64c, 64c + 64), stores
  attn_out's columns of them, and arrives on the grid's arrival word;
- epilogue clusters S..S+E-1 (E = B up to `max_epilogue_clusters` rows, then as few as take the rows, each
  the same count: at most 32 clusters with three CTAs an SM, 24 with two; B64: 32 of 2 or 22 of 3): each
  arrives at once, loads what does not depend on o_proj (the AttnRes weights, its rows' bank blocks and old
  prefix), waits for every arrival and applies AttnRes
  to rows c - S, c - S + E, ... as kda_o_proj.py's epilogue does.
The launch has one shared-memory size for both kinds (the stream's ring), sized so `ctas_per_sm` fit an SM (three by
default, 47 clusters at once by the driver on an H100/H200, nearly the 48 of B64; two give the ring more stages).
Only the E epilogue clusters ever wait, so the grid finishes whenever more than E clusters fit (the argument of
kda_o_proj.py). How many fit is the driver's count (cluster_residency.py, which kda_o_proj_op checks before
launching, with `resident_margin` to spare): the SM count `resident_clusters` here is only an upper bound, since a
cluster's CTAs share one GPC (two a SM: 37 by the count, 32 by the driver, and the launch hung with 32 waiting).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k3_decode.kernels.attn_res_plan import AttnResKind, ClusterPlan
from k3_decode.kernels.kda_o_proj_plan import (
    DRIVER_SMEM_BYTES,
    H200_SMS,
    MAX_BATCH,
    SMEM_PER_SM,
    WGMMA_CTAS_PER_SM_CHOICES,
    AttnResEpilogue,
    wgmma_ctas_per_sm_at,
    wgmma_w_l2_at,
    wgmma_w_l2_late_at,
)
from k3_decode.kernels.wgmma_stream_plan import (
    BARRIER_BYTES,
    MIN_BATCH,  # the stream's least batch: wgmma N 8 raised an illegal instruction here
    MMA_M,
    WARPGROUP,
    WgmmaStreamPlan,
    wgmma_n,
)

# Rows of AttnRes run by at most this many waiting clusters; above 32 rows each takes two (B64: 32 clusters of 2).
MAX_EPILOGUE_CLUSTERS = 32
# With the ring sized for two CTAs an SM the driver holds 32 clusters of the grid at once on an H100/H200
# (cluster_residency; test_kda_o_proj_wgmma_gpu.py), and half the 16 stream clusters must fit beside the waiting ones
# (resident_margin): at most 24 wait, so from 25 rows each takes two and from 49 three (B64: 22 clusters of 3). Below
# 25 and at 33-48 rows this is the same grid as with 32.
TWO_PER_SM_EPILOGUE_CLUSTERS = 24
# CTAs an SM holds at once by default (kda_o_proj_choice.toml wgmma_ctas_per_sm): ptxas caps registers at 168 for
# three warpgroups, and the ring is sized to three a SM: 3 x 132 CTA slots by the SM count, 47 clusters at once by the
# driver (a cluster's CTAs share a GPC), against B64's 48 (16 stream and 32 epilogue clusters).
CTAS_PER_SM = 3
MAX_STAGES = 8  # k tiles in flight a CTA: 8 x 8 KB of W is more than an SM needs to cover HBM latency


@dataclass(frozen=True)
class OProjWgmmaPlan(AttnResEpilogue):
    hidden: int  # H: o_proj's output features (W's rows), the AttnRes row width
    k: int  # K: o_proj's input features on this rank
    batch: int
    kind: AttnResKind  # the AttnRes after attention this launch applies
    sm_count: int = H200_SMS
    k_tile: int = 64
    ctas_per_sm: int = CTAS_PER_SM  # CTAs an SM the shared memory is sized for (and ptxas's register cap)
    paired_rows: bool = False  # each epilogue cluster exchanges its two rows together (AttnResEpilogue.pairing)
    w_l2: bool = False  # stream CTAs prefetch into L2, before the wait, the columns of W past the ring's first tiles
    w_l2_late: bool = False  # the same prefetch right after the wait, once the KDA step no longer shares HBM
    max_epilogue_clusters: int = MAX_EPILOGUE_CLUSTERS  # epilogue clusters at most: each then takes more rows

    @classmethod
    def for_shape(
        cls,
        hidden: int,
        k: int,
        batch: int,
        kind: AttnResKind,
        sm_count: int = H200_SMS,
        ctas_per_sm: int | None = None,
        paired_rows: bool | None = None,
        w_l2: bool | None = None,
        w_l2_late: bool | None = None,
        max_epilogue_clusters: int | None = None,
    ) -> OProjWgmmaPlan:
        """The plan for one shape; raises, naming the problem, for one this build cannot take. `ctas_per_sm`,
        `paired_rows`, `w_l2`, `w_l2_late`: None takes kda_o_proj_choice.toml's (wgmma_two_per_sm_batches, else
        wgmma_ctas_per_sm), paired_rows, wgmma_w_l2_batches and wgmma_w_l2_late_batches; `max_epilogue_clusters`
        None: what the CTAs an SM hold (epilogue_cap_for)."""
        attn = ClusterPlan.for_hidden(hidden)  # raises for a width AttnRes cannot split
        if attn.threads != WARPGROUP:  # then the rows are whole clusters of 64-row tiles too: 1024 a CTA of 8 columns
            raise ValueError(
                f"the wgmma o_proj needs the AttnRes cluster's CTAs to be one warpgroup ({WARPGROUP} threads); "
                f"hidden {hidden} gives {attn.threads}: use the mma.sync build"
            )
        if not MIN_BATCH <= batch <= MAX_BATCH:
            raise ValueError(
                f"the wgmma o_proj serves {MIN_BATCH}..{MAX_BATCH} rows, got {batch}; use the mma.sync build"
            )
        if kind.delta not in ("add", "restart") or kind.delta_dtype != "bfloat16":
            raise ValueError(
                f"the AttnRes after attention takes the BF16 o_proj output as delta (add or restart), not {kind.tag}"
            )
        if sm_count < 1:
            raise ValueError(f"sm_count must be at least 1, got {sm_count}")
        if ctas_per_sm is None:
            ctas_per_sm = wgmma_ctas_per_sm_at(batch, k)
        if ctas_per_sm not in WGMMA_CTAS_PER_SM_CHOICES:
            raise ValueError(f"the wgmma o_proj is sized for {WGMMA_CTAS_PER_SM_CHOICES} CTAs an SM, got {ctas_per_sm}")
        cap = epilogue_cap_for(ctas_per_sm) if max_epilogue_clusters is None else max_epilogue_clusters
        if not 1 <= cap <= MAX_EPILOGUE_CLUSTERS:
            raise ValueError(f"max_epilogue_clusters is 1..{MAX_EPILOGUE_CLUSTERS}, got {cap}")
        plan = cls(hidden, k, batch, kind, sm_count, ctas_per_sm=ctas_per_sm, max_epilogue_clusters=cap)
        plan = replace(plan, paired_rows=plan.pairing(paired_rows))
        if plan.stages < 2:
            raise ValueError(f"{plan.tag}: fewer than two ring stages fit {ctas_per_sm} CTAs an SM")
        plan = replace(
            plan,
            w_l2=wgmma_w_l2_at(batch) if w_l2 is None else w_l2,
            w_l2_late=wgmma_w_l2_late_at(batch) if w_l2_late is None else w_l2_late,
        )
        if plan.w_l2 and plan.w_l2_late:
            raise ValueError(f"{plan.tag}: W goes to L2 before the wait (w_l2) or after it (w_l2_late), not both")
        if (plan.w_l2 or plan.w_l2_late) and plan.l2_columns == 0:
            raise ValueError(f"{plan.tag}: the ring's first tiles hold all of K; there is no W left to send to L2")
        why = plan.stream.problem()
        if why is not None:
            raise ValueError(f"{plan.tag}: {why}")
        if plan.resident_clusters <= plan.epilogue_clusters:
            raise ValueError(
                f"{plan.tag}: {sm_count} SMs hold {plan.resident_clusters} clusters at once, not more than the "
                f"{plan.epilogue_clusters} that wait for the grid: the rest could never run"
            )
        return plan

    @property
    def stage_bytes(self) -> int:
        """Bytes of one ring stage: a W tile of 64 rows and an o tile of wgmma's N rows, k_tile wide."""
        return (MMA_M + wgmma_n(self.batch)) * self.k_tile * 2

    @property
    def stages(self) -> int:
        """Ring stages: as many k tiles as fit beside the exchange areas with ctas_per_sm CTAs an SM, at most
        MAX_STAGES and the k tiles there are."""
        room = SMEM_PER_SM // self.ctas_per_sm - DRIVER_SMEM_BYTES - BARRIER_BYTES - self.exchange_bytes - 128
        return min(MAX_STAGES, self.k // self.k_tile, room // self.stage_bytes)

    @property
    def l2_first(self) -> int:
        """The first column of W a stream CTA's ring does not take before the wait (w_l2 sends the rest to L2)."""
        return self.stream.ahead * self.k_tile

    @property
    def l2_columns(self) -> int:
        """Columns of each of a stream CTA's rows of W that w_l2 prefetches into L2: all after l2_first."""
        return self.k - self.l2_first

    @property
    def stream(self) -> WgmmaStreamPlan:
        """The weight stream of one stream CTA (wgmma_stream_plan's cut: 64 rows, no K split)."""
        return WgmmaStreamPlan(self.hidden, self.k, self.batch, MMA_M, self.k_tile, self.stages, 1)

    @property
    def stream_clusters(self) -> int:
        return self.hidden // (MMA_M * self.cluster)

    @property
    def first_epilogue_cluster(self) -> int:
        """Clusters from here on apply AttnRes (kda_o_proj.py's epilogue numbers rows from it)."""
        return self.stream_clusters

    @property
    def epilogue_clusters(self) -> int:
        return -(-self.batch // self.epilogue_rows)

    @property
    def epilogue_rows(self) -> int:
        """Batch rows each epilogue cluster applies AttnRes to."""
        return -(-self.batch // self.max_epilogue_clusters)

    @property
    def clusters(self) -> int:
        return self.stream_clusters + self.epilogue_clusters

    @property
    def ctas(self) -> int:
        return self.clusters * self.cluster

    @property
    def smem_bytes(self) -> int:
        """The dynamic shared memory every CTA asks for: the ring (and its barriers), then the exchange areas."""
        return self.stream.smem_bytes + self.exchange_bytes + 128

    @property
    def resident_clusters(self) -> int:
        per_sm = min(self.ctas_per_sm, SMEM_PER_SM // (self.smem_bytes + DRIVER_SMEM_BYTES))
        return self.sm_count * per_sm // self.cluster

    @property
    def residency(self) -> tuple[int, int, int]:
        """(threads, CTAs an SM, dynamic shared memory a CTA) for cluster_residency.max_active_clusters: registers
        are capped for ctas_per_sm (ptxas's minnctapersm) and the ring is sized for it."""
        return WARPGROUP, self.ctas_per_sm, self.smem_bytes

    @property
    def resident_margin(self) -> int:
        """Clusters the driver must hold beside the waiting epilogue ones: half the stream clusters. One more would
        let the grid finish, but the stream would then run a cluster at a time; and beside a running kernel (under
        programmatic dependent launch) fewer fit than the driver counts for an idle GPU. Three CTAs an SM: 47 held
        at once, 32 + 8 needed at B64. Two: 32 held, so 32 epilogue clusters are refused at B25-B32 and B49-B64 (B32
        and B64 hung on an H100 with them), and two-an-SM plans wait on at most 24 (TWO_PER_SM_EPILOGUE_CLUSTERS)."""
        return -(-self.stream_clusters // 2)

    @property
    def residency_fix(self) -> str:
        if self.ctas_per_sm < CTAS_PER_SM:
            return (
                f"size its ring for {CTAS_PER_SM} CTAs an SM at these rows (kda_o_proj_choice.toml wgmma_ctas_per_sm, "
                "wgmma_two_per_sm_batches)"
            )
        return "serve the mma.sync build at these rows (kda_o_proj_choice.toml wgmma_batches)"

    @property
    def tag(self) -> str:
        return (
            f"o-proj-wgmma/h{self.hidden}/k{self.k}/b{self.batch}/{self.kind.tag}/s{self.stages}/c{self.ctas_per_sm}"
            + "/paired" * self.paired_rows
            + "/w-l2" * self.w_l2
            + "/w-l2-late" * self.w_l2_late
            + f"/e{self.max_epilogue_clusters}" * (self.max_epilogue_clusters != epilogue_cap_for(self.ctas_per_sm))
        )


def epilogue_cap_for(ctas_per_sm: int) -> int:
    """The most epilogue clusters a plan sized for `ctas_per_sm` CTAs an SM gives its batch rows."""
    return TWO_PER_SM_EPILOGUE_CLUSTERS if ctas_per_sm == 2 else MAX_EPILOGUE_CLUSTERS
