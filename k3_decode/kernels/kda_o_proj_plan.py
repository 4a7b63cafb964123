"""How the fused o_proj + AttnRes kernel (k3_decode/kernels/kda_o_proj.py) splits its work, without CuTe DSL.

The kernel computes attn_out[B, H] = o[B, K] @ W[H, K]^T (o_proj: H = 7168 output features, K = the rank's KDA
value width, 1536 at TP8 and 768 at TP16), then the AttnRes after attention on every row of attn_out. The grid is
made of clusters of the AttnRes kernel's size (attn_res_plan.ClusterPlan: 7 CTAs of 128 threads at K3's width), so
the same clusters that stream W can run the AttnRes epilogue: CTA c (cluster c // 7, rank c % 7) owns
`warps * rows_per_warp` consecutive rows of W, each warp `rows_per_warp` of them over the whole of K, a lane one
16-byte vector (8 columns) of each row per k step of 256 columns; o is staged whole in shared memory. Above 4 rows
the CTA's 16 rows run on tensor cores instead (kda_in_proj_mma_plan.MmaStream), 16 batch rows per pass over its
slice of W to 16 rows, 32 a pass above (or, with one_pass, every row in one pass: kda_o_proj_choice.toml). Then
at most half the grid's clusters apply AttnRes: to 32 rows, cluster b to row b; above, each of
`epilogue_clusters` clusters to `epilogue_rows` rows (b, b + E, ...). Every number
here is fixed at compile time, so listing builds needs neither CuTe DSL nor torch, and the build expectations can
count instructions from these numbers.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from k3_decode.kernels.attn_res_plan import AttnResKind, ClusterPlan
from k3_decode.kernels.kda_in_proj_mma_plan import STEP as MMA_STEP
from k3_decode.kernels.kda_in_proj_mma_plan import TILE_M, TILE_N, WIDE_N_TILES, MmaStream, n_tiles
from k3_decode.kernels.kda_in_proj_plan import STEP, VECTOR, WeightStream
from k3_decode.kernels.wgmma_stream_plan import MIN_BATCH as WGMMA_STREAM_MIN_BATCH

# The CUDA-core stream's accumulators (rows_per_warp x batch per lane) fit beside 12 weight vectors in flight under
# 128 registers up to 4 rows; above, the stream runs on tensor cores (kda_in_proj_mma.py's), whose accumulators
# are 4 per batch tile of 8. 16 rows: two tiles, one pass over W; above, one pass of 32 rows (four tiles).
CUDA_CORE_MAX_BATCH = 4
# The epilogue's clusters wait for every CTA's arrival, so they must be resident beside room for the rest to run. With
# one cluster per row, at 64 rows every cluster of the grid's 64 waited, which needs all 448 CTAs resident at four per
# SM: that held alone, but in the layer graph (benchmarks/kda_layer_h200.py, stack k3-kda-mla-late, TP8 B64, the
# n8-add kind) the launch hung on the H200 at e879db8, while B32 (half the grid waiting) ran. So at most half the
# clusters wait at any batch (WAITING_SHARE), and above 32 rows each takes two rows.
MAX_BATCH = 64
WAITING_SHARE = 2  # at most 1 / WAITING_SHARE of the grid's clusters wait for the grid
# 16-byte vectors an epilogue thread holds across the wait for the grid (AttnRes weights, bank blocks, old prefixes):
# one row of the heaviest kind (n8-add: 3 weights + 9) fits under 128 registers; two rows of n8 spilled 112-192 bytes
# at TP8 B64, two of n1 took 95 registers.
PRELOADED_VECTORS = 12
# 16-byte W loads per lane in flight and x steps ahead, by batch tiles: one tile as the CUDA-core stream (12), two
# with fewer (128 registers also hold the x fragments and the epilogue's loads; TP8 B16 spilled at 12 and 1), and
# fewer again with three and four (up to WIDE_N_TILES: every batch is one pass). Two 16-row passes spilled a 64-bit
# address at TP8 B32 with 8 loads and 1 step; at 4 loads four tiles fit (91-128 registers, no frame), and the one
# 32-row pass took TP8 B32 12.6 us against 16.2 in two of 16 rows (the H200 at 1c73f22).
MMA_STREAM = {1: (12, 2), 2: (8, 1), 3: (4, 1), 4: (4, 1), 5: (4, 1), 6: (4, 1), 7: (4, 1), 8: (4, 1)}
# Above 32 rows the stream may take one pass of up to eight batch tiles instead of two of four (OProjPlan.one_pass,
# kda_o_proj_choice.toml): W is read once instead of twice. Its 32 accumulators a lane fit 128 registers with no frame
# beside the one-block kinds' epilogue loads (n1, TP8 and TP16 B64); the eight-block kinds spilled 48 bytes.
ONE_PASS_N_TILES = MAX_BATCH // TILE_N
# The wgmma build's least batch (kda_o_proj_wgmma_plan.py), the wgmma stream's: its first GPU run (an H100, at 812a7fd)
# raised an illegal instruction at TP8 B1 (wgmma N = 8, one epilogue cluster), not diagnosed, while B9-B64 ran; below
# 9 rows the mma.sync build (CUDA cores to 4 rows) serves.
WGMMA_MIN_BATCH = WGMMA_STREAM_MIN_BATCH
# CTAs an SM the wgmma build's shared memory is sized for (kda_o_proj_choice.toml wgmma_ctas_per_sm): three (168
# registers, 4-7 ring stages; the driver holds 47 of its clusters at once on an H100/H200, against 48 at B64) or two
# (6-8 stages, but the driver holds only 32, so the op refuses it at B25-B32 and B49-B64: resident_margin,
# cluster_residency.py). One SM holds at most three warpgroups of the eight-block kinds' 156 registers.
WGMMA_CTAS_PER_SM = 3
# The bank blocks up to which an epilogue cluster's two rows may be exchanged together (kda_o_proj_choice.toml
# paired_rows): the one-block kinds fit both rows' sources in registers (71-128, no frame); the eight-block kinds
# spilled 32-360 bytes in both builds, and CI builds none between.
PAIRED_MAX_BLOCKS = 1
WGMMA_CTAS_PER_SM_CHOICES = (2, 3)
ROWS_PER_WARP = (4, 3, 2, 1)  # tried in this order
MAX_CTAS_PER_SM = 4  # 4 x 128 threads x 128 registers = an SM's 64K registers
H200_SMS = 132
SMEM_PER_SM = 228 * 1024  # an H100/H200 SM's shared memory
DRIVER_SMEM_BYTES = 1024  # the driver's shared memory beside each CTA
ARRIVAL_TOP = 1 << 31  # the arrival word's top bit flips once per launch (see kda_o_proj.py)
CHOICE = Path(__file__).with_name("kda_o_proj_choice.toml")


@dataclass(frozen=True)
class BlocksRule:
    """Batches first..last (inclusive, above 32 rows) where the AttnRes after attention mixes at most max_blocks bank
    blocks: where kda_o_proj_choice.toml's one_pass runs the tensor-core stream in one pass of up to
    ONE_PASS_N_TILES batch tiles, or its paired_rows has each epilogue cluster exchange its two rows together."""

    first: int
    last: int
    max_blocks: int

    def matches(self, batch: int, num_blocks: int) -> bool:
        return self.first <= batch <= self.last and num_blocks <= self.max_blocks


@dataclass(frozen=True)
class WidthRule:
    """Batches first..last (inclusive) at one rank width `k` (o_proj's K, the rank's KDA projection: 1536 at TP8,
    768 at TP16): where kda_o_proj_choice.toml's wgmma_two_per_sm_rules size the wgmma build's ring for two CTAs an
    SM at that width only."""

    first: int
    last: int
    k: int

    def matches(self, batch: int, k: int) -> bool:
        return self.first <= batch <= self.last and k == self.k


@dataclass(frozen=True)
class OProjChoice:
    """kda_o_proj_choice.toml: how the launch and the stream are chosen where a choice waits for measurement."""

    cap_batches: tuple[tuple[int, int], ...]
    one_pass: tuple[BlocksRule, ...]
    warm_batches: tuple[tuple[int, int], ...] = ()
    w_smem_batches: tuple[tuple[int, int], ...] = ()
    w_l2_batches: tuple[tuple[int, int], ...] = ()
    wgmma_batches: tuple[tuple[int, int], ...] = ()
    wgmma_ctas_per_sm: int = WGMMA_CTAS_PER_SM
    paired_rows: tuple[BlocksRule, ...] = ()
    wgmma_w_l2_batches: tuple[tuple[int, int], ...] = ()
    wgmma_w_l2_late_batches: tuple[tuple[int, int], ...] = ()
    wgmma_two_per_sm_batches: tuple[tuple[int, int], ...] = ()
    wgmma_two_per_sm_rules: tuple[WidthRule, ...] = ()


def choice(path: Path | None = None) -> OProjChoice:
    """kda_o_proj_choice.toml (or `path`), checked; a malformed file is an error naming it."""
    return _choice(path or CHOICE)


def capped_batches(path: Path | None = None) -> tuple[tuple[int, int], ...]:
    """The batch ranges (inclusive) whose launch caps the CTAs an SM holds."""
    return choice(path).cap_batches


def capped_at(batch: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) caps the launch at `batch`."""
    return _within(batch, capped_batches(path))


def one_pass_at(batch: int, num_blocks: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) runs the stream in one pass at `batch` where the AttnRes after
    attention mixes `num_blocks` bank blocks."""
    return any(rule.matches(batch, num_blocks) for rule in choice(path).one_pass)


def paired_at(batch: int, num_blocks: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) has each epilogue cluster exchange its two rows together at
    `batch` where the AttnRes after attention mixes `num_blocks` bank blocks (either build)."""
    return any(rule.matches(batch, num_blocks) for rule in choice(path).paired_rows)


def warm_at(batch: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) warms L2 with the CTA's late weight runs at `batch`."""
    return _within(batch, choice(path).warm_batches)


def w_smem_at(batch: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) stages the CTA's rows of W whole in shared memory at `batch`."""
    return _within(batch, choice(path).w_smem_batches)


def w_l2_at(batch: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) has the CTA's rows of W prefetched whole into L2 before the wait,
    and none loaded into registers before it, at `batch`."""
    return _within(batch, choice(path).w_l2_batches)


def wgmma_at(batch: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) runs the wgmma build (kda_o_proj_wgmma.py) at `batch`."""
    return _within(batch, choice(path).wgmma_batches)


def wgmma_w_l2_at(batch: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) has the wgmma build's stream CTAs prefetch into L2, before the
    wait, the part of their rows of W the ring does not take then, at `batch`."""
    return _within(batch, choice(path).wgmma_w_l2_batches)


def wgmma_w_l2_late_at(batch: int, path: Path | None = None) -> bool:
    """Whether kda_o_proj_choice.toml (or `path`) has the wgmma build's stream CTAs prefetch into L2, right after
    the wait, the part of their rows of W the ring does not take then, at `batch`."""
    return _within(batch, choice(path).wgmma_w_l2_late_batches)


def wgmma_ctas_per_sm(path: Path | None = None) -> int:
    """CTAs of one SM the wgmma build's launch is sized for, as kda_o_proj_choice.toml (or `path`) says."""
    return choice(path).wgmma_ctas_per_sm


def wgmma_ctas_per_sm_at(batch: int, k: int, path: Path | None = None) -> int:
    """CTAs of one SM the wgmma build's launch is sized for at `batch` and rank width `k` (o_proj's K): two within
    kda_o_proj_choice.toml's (or `path`'s) wgmma_two_per_sm_batches or a wgmma_two_per_sm_rules entry of that width,
    else its wgmma_ctas_per_sm."""
    table = choice(path)
    rules = table.wgmma_two_per_sm_rules
    two = _within(batch, table.wgmma_two_per_sm_batches) or any(r.matches(batch, k) for r in rules)
    return 2 if two else table.wgmma_ctas_per_sm


def _within(batch: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(first <= batch <= last for first, last in ranges)


def _span(span: object, low: int, where: str) -> tuple[int, int]:
    if isinstance(span, list) and len(span) == 2 and all(isinstance(b, int) for b in span):
        first, last = span
        if low <= first <= last <= MAX_BATCH:
            return first, last
    raise ValueError(f"{where} is a [first, last] range within {low}..{MAX_BATCH}, got {span!r}")


# The batch-range lists of kda_o_proj_choice.toml and the least batch each may name (the wgmma build's from 9 rows).
_RANGE_KEYS = {
    "cap_batches": 1,
    "warm_batches": 1,
    "w_smem_batches": 1,
    "w_l2_batches": 1,
    "wgmma_batches": WGMMA_MIN_BATCH,
    "wgmma_w_l2_batches": WGMMA_MIN_BATCH,
    "wgmma_w_l2_late_batches": WGMMA_MIN_BATCH,
    "wgmma_two_per_sm_batches": WGMMA_MIN_BATCH,
}
_RULE_KEYS = ("one_pass", "paired_rows", "wgmma_two_per_sm_rules")


@cache
def _choice(path: Path) -> OProjChoice:
    table = tomllib.loads(path.read_text())
    known = {*_RANGE_KEYS, *_RULE_KEYS, "wgmma_ctas_per_sm"}
    lists = [table.get(key, []) for key in (*_RANGE_KEYS, *_RULE_KEYS)]
    if not {"cap_batches", "one_pass"} <= set(table) <= known or not all(isinstance(v, list) for v in lists):
        raise ValueError(
            f"{path.name} holds the lists cap_batches and one_pass (and warm_batches, w_smem_batches, w_l2_batches, "
            f"wgmma_batches, paired_rows, wgmma_w_l2_batches, wgmma_w_l2_late_batches, wgmma_two_per_sm_batches, "
            f"wgmma_two_per_sm_rules and wgmma_ctas_per_sm) and nothing else, got {sorted(table)}"
        )
    per_sm = table.get("wgmma_ctas_per_sm", WGMMA_CTAS_PER_SM)
    if per_sm not in WGMMA_CTAS_PER_SM_CHOICES or isinstance(per_sm, bool):
        raise ValueError(
            f"{path.name}: wgmma_ctas_per_sm is one of {WGMMA_CTAS_PER_SM_CHOICES} (CTAs an SM the wgmma build's "
            f"shared memory is sized for), got {per_sm!r}"
        )
    ranges = {
        key: tuple(_span(span, low, f"{path.name}: {key}[{i}]") for i, span in enumerate(table.get(key, [])))
        for key, low in _RANGE_KEYS.items()
    }
    one_pass = _blocks_rules(table["one_pass"], f"{path.name}: one_pass")
    paired_rows = _blocks_rules(table.get("paired_rows", []), f"{path.name}: paired_rows")
    for i, rule in enumerate(paired_rows):
        if rule.max_blocks > PAIRED_MAX_BLOCKS:
            raise ValueError(
                f"{path.name}: paired_rows[{i}] max_blocks is at most {PAIRED_MAX_BLOCKS}: paired rows of more bank "
                f"blocks spill (builds.toml builds none), got {rule.max_blocks}"
            )
    for i, (_, last) in enumerate(ranges["w_l2_batches"]):
        if last > CUDA_CORE_MAX_BATCH:
            raise ValueError(
                f"{path.name}: w_l2_batches[{i}] reaches {last} rows; W goes to L2 alone only on the CUDA-core "
                f"stream, 1..{CUDA_CORE_MAX_BATCH} rows"
            )
    before, after = ranges["wgmma_w_l2_batches"], ranges["wgmma_w_l2_late_batches"]
    if any(_within(b, before) and _within(b, after) for b in range(WGMMA_MIN_BATCH, MAX_BATCH + 1)):
        raise ValueError(
            f"{path.name}: wgmma_w_l2_batches and wgmma_w_l2_late_batches overlap; W goes to L2 before the wait or "
            "after it, not both"
        )
    two_per_sm = _width_rules(table.get("wgmma_two_per_sm_rules", []), f"{path.name}: wgmma_two_per_sm_rules")
    return OProjChoice(
        one_pass=one_pass,
        paired_rows=paired_rows,
        wgmma_ctas_per_sm=per_sm,
        wgmma_two_per_sm_rules=two_per_sm,
        **ranges,
    )


def _width_rules(rules: list, where: str) -> tuple[WidthRule, ...]:
    """{ batches = [first, last], k = N } rules within the wgmma build's batches."""
    return tuple(
        WidthRule(first, last, k)
        for first, last, k in _counted_rules(
            rules, where, "k", WGMMA_MIN_BATCH, 1, "o_proj's K at one TP size (1536 at TP8, 768 at TP16)"
        )
    )


def _blocks_rules(rules: list, where: str) -> tuple[BlocksRule, ...]:
    """{ batches = [first, last], max_blocks = N } rules above 32 rows (where an epilogue cluster takes two)."""
    return tuple(
        BlocksRule(first, last, blocks)
        for first, last, blocks in _counted_rules(
            rules, where, "max_blocks", WIDE_N_TILES * TILE_N + 1, 0, "a count of bank blocks"
        )
    )


def _counted_rules(rules: list, where: str, key: str, low: int, least: int, means: str) -> list[tuple[int, int, int]]:
    """(first, last, N) of each { batches = [first, last], `key` = N } entry, batches within low..MAX_BATCH and N an
    integer of at least `least`; a malformed entry is a one-line error naming it."""
    out = []
    for i, rule in enumerate(rules):
        at = f"{where}[{i}]"
        if not isinstance(rule, dict) or set(rule) != {"batches", key}:
            raise ValueError(f"{at} is {{ batches = [first, last], {key} = N }} (N: {means}), got {rule!r}")
        first, last = _span(rule["batches"], low, f"{at} batches")
        n = rule[key]
        if not isinstance(n, int) or isinstance(n, bool) or n < least:
            raise ValueError(f"{at} {key} is {means}, got {n!r}")
        out.append((first, last, n))
    return out


class AttnResEpilogue:
    """What both builds of the fused o_proj (OProjPlan, kda_o_proj_wgmma_plan.OProjWgmmaPlan) derive alike from their
    `hidden`, `k`, `kind`, `epilogue_rows` and `ctas`: the AttnRes clusters their epilogue runs on, what it holds
    across the wait for the grid, its exchange areas, the arrival word's arithmetic and o_proj's weight bytes."""

    @property
    def attn(self) -> ClusterPlan:
        return ClusterPlan.for_hidden(self.hidden)

    @property
    def cluster(self) -> int:
        return self.attn.cluster

    @property
    def threads(self) -> int:
        return self.attn.threads

    @property
    def warps(self) -> int:
        return self.attn.warps

    @property
    def preloaded_rows(self) -> int:
        """Epilogue rows whose bank blocks and old prefix are loaded before the wait for the grid: as many as keep
        the vectors held across it within PRELOADED_VECTORS beside the AttnRes weights, at least one."""
        kind = self.kind
        weights = 2 * (kind.num_blocks > 0) + kind.out_norm
        per_row = kind.num_blocks + (kind.delta == "add")
        fit = (PRELOADED_VECTORS - weights) // per_row if per_row else self.epilogue_rows
        return max(1, min(self.epilogue_rows, fit))

    @property
    def exchange_bytes(self) -> int:
        """Shared memory of the AttnRes exchanges, one set per epilogue row (attn_res.py allocate_exchange: two
        barriers, the sources area of up to 20 partials per slot, the norm area), with alignment."""
        return (2 * 8 + (self.attn.slots * 20 + self.attn.slots) * 4 + 64) * self.epilogue_rows

    def pairing(self, paired: bool | None) -> bool:
        """Whether this plan's epilogue clusters exchange their rows together: `paired`, or where None what
        kda_o_proj_choice.toml's paired_rows says; only where a cluster takes two rows or more (above 32, or above
        24 for the wgmma build at two CTAs an SM, whose clusters take three from 49)."""
        if paired is None:
            return self.epilogue_rows >= 2 and paired_at(self.batch, self.kind.num_blocks)
        if paired and self.epilogue_rows < 2:
            raise ValueError(
                f"{self.tag}: paired rows are an epilogue cluster's rows exchanged together, and this plan gives "
                f"each {self.epilogue_rows}; pair from 33 rows"
            )
        return paired

    def check_resident(self, at_once: int) -> None:
        """Raises, naming the fix, unless `at_once` (the clusters of this grid the GPU holds at once: the driver's
        count, cluster_residency.max_active_clusters of `residency`) holds the epilogue clusters that wait for the
        grid and `resident_margin` more; with none more every resident cluster could be one that waits, for a
        cluster that never starts."""
        if at_once < self.epilogue_clusters + self.resident_margin:
            raise ValueError(
                f"{self.tag}: this GPU holds {at_once} of its clusters of {self.cluster} CTAs at once (the driver's "
                f"occupancy calculator), fewer than the {self.epilogue_clusters} that wait for the grid and "
                f"{self.resident_margin} more, so the launch could hang or crawl; {self.residency_fix}"
            )

    @property
    def arrival_master(self) -> int:
        """What CTA 0 adds to the arrival word; every other CTA adds 1. All of a launch's adds total 2^31."""
        return ARRIVAL_TOP - (self.ctas - 1)

    @property
    def weight_bytes(self) -> int:
        return self.hidden * self.k * 2


@dataclass(frozen=True)
class OProjPlan(AttnResEpilogue, WeightStream):
    hidden: int  # H: o_proj's output features, the AttnRes row width
    k: int  # K: o_proj's input features on this rank
    batch: int
    kind: AttnResKind  # the AttnRes after attention this launch applies
    sm_count: int
    rows_per_warp: int
    capped: bool = False  # the launch caps the CTAs an SM holds at ctas_per_sm (launch_smem_bytes)
    one_pass: bool = False  # above 32 rows, one pass of up to ONE_PASS_N_TILES batch tiles (mma)
    warm_l2: bool = False  # the CTA warms L2 with its late_runs before griddepcontrol.wait
    w_smem: bool = False  # the CTA bulk-copies its rows of W into shared memory before the wait
    w_l2: bool = False  # the CTA's rows of W go to L2 by the copy engine before the wait, none to registers
    paired_rows: bool = False  # each epilogue cluster exchanges its two rows together (AttnResEpilogue.pairing)

    @classmethod
    def for_shape(
        cls,
        hidden: int,
        k: int,
        batch: int,
        kind: AttnResKind,
        sm_count: int = H200_SMS,
        capped: bool | None = None,
        one_pass: bool | None = None,
        warm: bool | None = None,
        w_smem: bool | None = None,
        w_l2: bool | None = None,
        paired_rows: bool | None = None,
    ) -> OProjPlan:
        """The plan for one shape: the most rows per warp (the most reuse of each staged o vector) whose grid is
        whole clusters and fits on the SMs at once (one wave, MAX_CTAS_PER_SM per SM). `capped` and `one_pass`: None
        takes what kda_o_proj_choice.toml says for the batch (and kind); so does `warm`, which the choice file's
        warm_batches give only where the stream loads part of W after its wait (late_runs), and `w_smem` (a staged
        stream has no late runs, so it is never warmed), and `w_l2` (whose late runs are all of W, already
        prefetched, so it is never warmed either)."""
        cluster = ClusterPlan.for_hidden(hidden)  # raises for a width AttnRes cannot split
        if k <= 0 or k % STEP:
            raise ValueError(f"the fused o_proj kernel needs K to be a positive multiple of {STEP}, got {k}")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(
                f"the fused o_proj kernel serves 1..{MAX_BATCH} rows, got {batch}; "
                "run o_proj and the AttnRes after attention stock above"
            )
        if kind.delta not in ("add", "restart") or kind.delta_dtype != "bfloat16":
            raise ValueError(
                f"the AttnRes after attention takes the BF16 o_proj output as delta (add or restart), not {kind.tag}"
            )
        if sm_count < 1:
            raise ValueError(f"sm_count must be at least 1, got {sm_count}")
        per_cluster = cluster.cluster * cluster.warps
        whole = [r for r in ROWS_PER_WARP if hidden % (per_cluster * r) == 0]
        fitting = [r for r in whole if hidden // (cluster.warps * r) <= MAX_CTAS_PER_SM * sm_count]
        if not fitting:
            raise ValueError(
                f"the fused o_proj kernel cannot split {hidden} rows into whole clusters that fit on {sm_count} SMs"
            )
        if capped is None:
            capped = capped_at(batch)
        if one_pass is None:
            one_pass = one_pass_at(batch, kind.num_blocks)
        if one_pass and batch <= WIDE_N_TILES * TILE_N:
            raise ValueError(
                f"one pass is the fused o_proj's plan up to {WIDE_N_TILES * TILE_N} rows; got one_pass at {batch}"
            )
        if w_smem is None:
            w_smem = w_smem_at(batch)
        if w_smem and capped:
            raise ValueError(
                f"the fused o_proj's capped launch asks for less shared memory than W staged in it takes at {batch} "
                "rows: serve cap_batches or w_smem_batches there, not both"
            )
        if w_l2 is None:
            w_l2 = w_l2_at(batch)
        if w_l2 and batch > CUDA_CORE_MAX_BATCH:
            raise ValueError(
                f"W goes to L2 alone (w_l2) only on the fused o_proj's CUDA-core stream, 1..{CUDA_CORE_MAX_BATCH} "
                f"rows; got {batch}"
            )
        if w_l2 and w_smem:
            raise ValueError(f"W is either staged in shared memory or prefetched into L2 before the wait at {batch}")
        if w_l2 and warm:
            raise ValueError(f"a w_l2 plan prefetches all of W into L2 already at {batch}: it is not also warmed")
        plan = cls(hidden, k, batch, kind, sm_count, fitting[0], capped, one_pass, w_smem=w_smem, w_l2=w_l2)
        if w_l2:
            warm = False
        elif warm is None:
            warm = warm_at(batch) and plan.warmable
        elif warm and not plan.late_runs:
            raise ValueError(f"the fused o_proj's stream holds all of W before its wait at {plan.tag}: nothing to warm")
        elif warm and not plan.warmable:
            raise ValueError(f"the fused o_proj's two-pass stream is not warmed ({plan.tag}): see OProjPlan.warmable")
        plan = replace(plan, warm_l2=warm, paired_rows=plan.pairing(paired_rows))
        if plan.tensor_cores and plan.rows_per_cta != TILE_M:
            raise ValueError(
                f"the fused o_proj kernel's tensor-core stream needs {TILE_M} rows per CTA, the plan gives "
                f"{plan.rows_per_cta} for {hidden} rows"
            )
        if plan.resident_clusters <= plan.epilogue_clusters:
            raise ValueError(
                f"{plan.tag}: {plan.resident_ctas_per_sm} CTAs of {plan.cta_smem_bytes} bytes of shared memory an SM "
                f"hold {plan.resident_clusters} clusters at once, not more than the {plan.epilogue_clusters} that wait "
                "for the grid: the rest could never run"
            )
        if plan.epilogue_clusters * WAITING_SHARE > plan.clusters:
            raise ValueError(
                f"{plan.clusters} clusters cannot apply AttnRes to {batch} rows with at most "
                f"1/{WAITING_SHARE} of them waiting for the grid"
            )
        return plan

    @property
    def tensor_cores(self) -> bool:
        """Whether the stream runs on tensor cores (above CUDA_CORE_MAX_BATCH rows) instead of CUDA-core FMAs."""
        return self.batch > CUDA_CORE_MAX_BATCH

    @property
    def mma(self) -> MmaStream:
        """The tensor-core stream of one CTA: its 16 rows as one m-tile, K split over its warps, every batch row in
        one pass (up to WIDE_N_TILES tiles of 8; ONE_PASS_N_TILES with one_pass)."""
        tiles = n_tiles(self.batch, ONE_PASS_N_TILES if self.one_pass else WIDE_N_TILES)
        loads, x_ahead = MMA_STREAM[tiles]
        return MmaStream(
            self.hidden, self.k, self.batch, self.rows_per_cta, 1, self.warps, loads, x_ahead, tiles, w_smem=self.w_smem
        )

    @property
    def late_runs(self) -> tuple[tuple[int, int], ...]:
        """(first column, columns) of the runs of each of the CTA's rows of W that its stream loads only after
        griddepcontrol.wait: what the registers do not hold before it. One run over K on CUDA cores (past the first
        `depth` steps of 256 columns); on tensor cores one per K slice, slice s being warp s's (past its first
        `depth` steps of 64; none when W is staged whole in shared memory; all of K when W goes to L2 alone). A warm
        plan, and a w_l2 one, has these prefetched into L2 before the wait."""
        if self.w_smem:
            return ()
        if self.w_l2:
            return ((0, self.k),)
        if self.tensor_cores:
            spec = self.mma
            width, held = spec.split_steps * MMA_STEP, spec.depth * MMA_STEP
            return tuple((s * width + held, width - held) for s in range(spec.k_splits) if held < width)
        held = self.depth * STEP
        return ((held, self.k - held),) if held < self.k else ()

    @property
    def l2_prefetched(self) -> bool:
        """Whether the CTA has the copy engine prefetch its late runs of W into L2 before the wait: a warm plan, or
        a w_l2 one (whose late runs are all of W)."""
        return self.warm_l2 or self.w_l2

    @property
    def warmable(self) -> bool:
        """Whether a warm plan exists here: some of W is loaded after the wait, in one pass over it. A second pass
        reads W again after the first, mostly from L2 already, and the eight-block kinds' two-pass builds spilled 8
        bytes with the prefetches (TP8 and TP16 B64)."""
        return bool(self.late_runs) and (not self.tensor_cores or len(self.mma.passes) == 1)

    @property
    def epilogue_rows(self) -> int:
        """Batch rows each epilogue cluster applies AttnRes to: one while that keeps the waiting clusters to
        1 / WAITING_SHARE of the grid, more above (the grid's arrival is awaited once for all of them)."""
        return -(-self.batch * WAITING_SHARE // self.clusters)

    @property
    def epilogue_clusters(self) -> int:
        """Clusters 0..E-1 apply AttnRes, cluster c to rows c, c + E, ... below the batch; the rest exit after
        their arrival. E = B to 32 rows; above, as few as take `epilogue_rows` rows each (B40: 20 of 2)."""
        return -(-self.batch // self.epilogue_rows)

    @property
    def first_epilogue_cluster(self) -> int:
        """Clusters from here on apply AttnRes: the first E of the grid (kda_o_proj.py numbers rows from it)."""
        return 0

    @property
    def rows_per_cta(self) -> int:
        return self.warps * self.rows_per_warp

    @property
    def ctas(self) -> int:
        return self.hidden // self.rows_per_cta

    @property
    def clusters(self) -> int:
        return self.ctas // self.cluster

    @property
    def ctas_per_sm(self) -> int:
        """CTAs each SM must hold at once so that the whole grid is resident in one wave (ptxas caps registers)."""
        return -(-self.ctas // self.sm_count)

    @property
    def cta_smem_bytes(self) -> int:
        """The shared memory of one CTA, the driver's 1 KiB included: staged o (the CUDA-core stream) or the K slices'
        partials and, with w_smem, the CTA's rows of W (tensor cores); the AttnRes exchange's two barriers and areas
        per epilogue row; alignment."""
        exchange = self.exchange_bytes
        if self.tensor_cores:
            stream = self.mma.smem_bytes
        else:  # W's rows unpadded: a load instruction reads 512 contiguous bytes of one row
            stream = self.stage_bytes + (self.rows_per_cta * self.k * 2 + 128) * self.w_smem
        return stream + exchange + DRIVER_SMEM_BYTES

    @property
    def resident_ctas_per_sm(self) -> int:
        """CTAs of this grid an SM can hold at once by registers (ctas_per_sm, the cap ptxas meets) and shared
        memory. Below ctas_per_sm (W staged in shared memory at TP8) the grid runs in more than one wave, which the
        grid-wide point allows while more clusters than wait for it fit at once (resident_clusters)."""
        return min(self.ctas_per_sm, SMEM_PER_SM // self.cta_smem_bytes)

    @property
    def resident_clusters(self) -> int:
        return self.sm_count * self.resident_ctas_per_sm // self.cluster

    @property
    def residency(self) -> tuple[int, int, int]:
        """(threads, CTAs an SM, dynamic shared memory a CTA) for cluster_residency.max_active_clusters: the
        registers are capped for ctas_per_sm (ptxas's minnctapersm) and the shared memory fits resident_ctas_per_sm."""
        return self.threads, self.resident_ctas_per_sm, self.cta_smem_bytes - DRIVER_SMEM_BYTES

    @property
    def residency_fix(self) -> str:
        return "serve fewer rows with the fused o_proj at this TP size (providers.toml [o_proj])"

    @property
    def resident_margin(self) -> int:
        """Clusters the driver must hold beside the waiting ones: one, so that the grid can finish; every cluster
        streams W here, and at most 1 / WAITING_SHARE of them wait."""
        return 1

    @property
    def launch_smem_bytes(self) -> int | None:
        """The dynamic shared memory the launch asks for: None (what the kernel allocates, a few KiB) uncapped;
        capped, a request that alone exceeds an SM's share for ctas_per_sm + 1 CTAs, so that no SM holds more than
        ctas_per_sm of this grid whatever its registers allow. It is far above what the kernel allocates
        (tests/k3_decode/kernels/test_kda_o_proj_build.py checks every build), and ctas_per_sm of them fit an SM
        beside the driver's 1 KiB per CTA."""
        if not self.capped:
            return None
        share = SMEM_PER_SM // (self.ctas_per_sm + 1) + 1
        return -(-share // 128) * 128

    @property
    def fill_loads(self) -> int:
        """16-byte loads of o (and shared stores) per thread that stage the batch."""
        return -(-self.batch * (self.k // VECTOR) // self.threads)

    @property
    def stage_bytes(self) -> int:
        return self.batch * self.k * 2

    @property
    def tag(self) -> str:
        return (
            f"k{self.k}/b{self.batch}/{self.kind.tag}"
            + "/one-pass" * self.one_pass
            + "/cap" * self.capped
            + "/warm" * self.warm_l2
            + "/w-smem" * self.w_smem
            + "/w-l2" * self.w_l2
            + "/paired" * self.paired_rows
        )
