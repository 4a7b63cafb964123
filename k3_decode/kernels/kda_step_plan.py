"""How the fused KDA decode step (k3_decode/kernels/kda_step.py) splits its work, without CuTe DSL or torch.

One cluster of `cluster` CTAs serves one (request, head): CTA r of the cluster owns the head's value rows
[r * R, (r + 1) * R) of the recurrent state S[v, k] (R = 128 / cluster), four rows per warp, one 16-byte vector of
every row per lane (lane l holds keys 4l .. 4l + 3). It also owns the same R channels of the head's decay (the f_b
rows it multiplies) and rewrites the conv taps of the head's q, k and v channels in that range. Every number here
is fixed at compile time, so listing builds needs neither CuTe DSL nor torch, and the build expectations can count
instructions from these numbers.

The packed row is the in_proj output [q | k | v | g_out | f_a | beta | pad] (k3_decode.config.RankShapes
.in_proj_sections); the plan recomputes the section offsets from (proj, gate_rank, heads) and the op checks them
against the spec's, so the kernel and the model cannot disagree silently.

A verify step (`KdaVerifyPlan`, q = `tokens` per request) splits the work the same way, request by request: each
CTA copies the q packed rows' sections of its channels, the conv row's 2 + q columns (the row vLLM keeps for q
tokens) and its state rows once, and exchanges q times the decays and the norm partials.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

WARP = 32
HEAD_DIM = 128  # D: 32 lanes x 4 keys; the layout below is built for it
GATE_RANK = 128  # f_a width: one f_b row is 16 vectors of 8 BF16, one half-warp
CONV_WIDTH = 4  # 3 stored taps per channel: 8 channels are 48 contiguous bytes, three 16-byte vectors
ROWS_PER_WARP = 4  # value rows of S per warp: 4 independent butterflies in flight per lane
RESIDENT_THREADS = 1024  # per SM: 32 warps, a 64-register budget per thread
# The budgets a plan may hold per SM: 1536 threads is 40 registers, three CTAs of 512 threads (C = 2) where 1024 holds
# two, so more of the per-CTA chains (state copy, conv, exchanges, delta rule, stores) are in flight on an SM. It
# builds without a spill since the output gate is read after the norm exchange's wait, not before it (8 bytes of
# frame before); 2048 (32 registers) still spills 8 bytes.
RESIDENT_CHOICES = (1024, 1536)
# Requests one cluster may serve: a group of 2 copies both requests' state at once (twice the bytes in flight per
# CTA at the same registers), reads its f_b rows and conv weights once for both, and runs the two chains in turn.
REQUEST_GROUPS = (1, 2)
CLUSTERS = (8, 4, 2)  # CTAs per head, most first; 8 is the portable cluster size on Hopper
H200_SMS = 132
MAX_TOKENS = 8  # a verify step's tokens per request: 1 + up to 7 speculative ones (vLLM's KdaSplit takes 1..8)
SMEM_PER_SM = 228 * 1024  # an H100/H200 SM's shared memory
# Per CTA beside its dynamic bytes: the driver's 1 KiB, which the cubin records as its static shared memory (not more
# beside it: the H200's occupancy calculator at fce2860, launch_smem_bytes)
SMEM_PER_CTA_RESERVED = 1024

CHOICE = Path(__file__).with_name("kda_step_choice.toml")
# Knobs kda_step_choice.toml serves together (the lean conv with wide warps, at TP8 B16 and B64 and TP16 B32). A
# build or test of another knob alone, or of the plain step, turns them off, so each variant keeps its plain twin.
PAIRED_KNOBS = ("lean_conv", "wide_warps")


def knob_alone(**knob: bool | int) -> dict[str, bool | int]:
    """for_shape's overrides for `knob` as given, the paired knobs off and no cap on the CTAs an SM holds, whatever
    the choice serves."""
    return {**dict.fromkeys(PAIRED_KNOBS, False), "max_ctas_per_sm": 0, **knob}


def the_pair(**knob: bool | int) -> dict[str, bool | int]:
    """for_shape's overrides for the paired knobs on at 1024 threads an SM, uncapped (as the layer rounds time and CI
    builds them), with `knob` as given, whatever the choice serves."""
    return {"resident_threads": RESIDENT_THREADS, **dict.fromkeys(PAIRED_KNOBS, True), "max_ctas_per_sm": 0, **knob}


SlotDtype = Literal["int32", "int64"]


@dataclass(frozen=True)
class StepVariant:
    """What the plan takes beside its cluster: the register budget, the next wave's warming, requests per CTA."""

    resident_threads: int
    warm_ahead: bool
    requests_per_cta: int = 1
    local_decays: bool = False
    lean_start: bool = False
    lean_conv: bool = False
    joint_sums: bool = False
    wide_warps: bool = False
    max_ctas_per_sm: int = 0  # 0: as many as the register budget holds


@dataclass(frozen=True)
class VariantRule:
    heads: int | None  # None: any
    first: int
    last: int
    variant: StepVariant

    def matches(self, heads: int, batch: int) -> bool:
        return (self.heads is None or self.heads == heads) and self.first <= batch <= self.last


def _variant(entry: Any, where: str, rule: bool) -> StepVariant:
    keys = {"resident_threads", "warm_ahead"}
    named = set(entry) - {"heads", "batches"} if rule and isinstance(entry, dict) else set(entry or ())
    # Every field of StepVariant with a default is an optional key, so a new knob cannot be left out of the file's
    # grammar.
    optional = [f.name for f in fields(StepVariant) if f.name not in keys]
    if not isinstance(entry, dict) or named - set(optional) != keys:
        scope = "; a rule also batches and optionally heads" if rule else ", nothing else"
        raise ValueError(
            f"{where} must name resident_threads and warm_ahead ({', '.join(optional[:-1])} and {optional[-1]} "
            f"optional){scope}, got {entry!r}"
        )
    threads, warm, group = entry["resident_threads"], entry["warm_ahead"], entry.get("requests_per_cta", 1)
    local, lean, conv = entry.get("local_decays", False), entry.get("lean_start", False), entry.get("lean_conv", False)
    joint, wide = entry.get("joint_sums", False), entry.get("wide_warps", False)
    cap = entry.get("max_ctas_per_sm", 0)
    if threads not in RESIDENT_CHOICES or not isinstance(warm, bool) or group not in REQUEST_GROUPS:
        raise ValueError(
            f"{where}: resident_threads is one of {RESIDENT_CHOICES}, warm_ahead true or false, requests_per_cta "
            f"one of {REQUEST_GROUPS}"
        )
    if not isinstance(local, bool):
        raise ValueError(f"{where}: local_decays is true or false, got {local!r}")
    if not isinstance(lean, bool):
        raise ValueError(f"{where}: lean_start is true or false, got {lean!r}")
    if not isinstance(conv, bool):
        raise ValueError(f"{where}: lean_conv is true or false, got {conv!r}")
    if not isinstance(joint, bool):
        raise ValueError(f"{where}: joint_sums is true or false, got {joint!r}")
    if not isinstance(wide, bool):
        raise ValueError(f"{where}: wide_warps is true or false, got {wide!r}")
    if "max_ctas_per_sm" in entry and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"{where}: max_ctas_per_sm is a positive count of CTAs (leave it out for none), got {cap!r}")
    if warm and group > 1:
        raise ValueError(f"{where}: warm_ahead and requests_per_cta > 1 are not built together")
    if local and group > 1:
        raise ValueError(f"{where}: local_decays and requests_per_cta > 1 are not built together")
    for name, on in (("lean_start", lean), ("lean_conv", conv), ("joint_sums", joint), ("wide_warps", wide)):
        if on and group > 1:
            raise ValueError(f"{where}: {name} and requests_per_cta > 1 are not built together")
    if wide and joint:
        raise ValueError(f"{where}: wide_warps and joint_sums are not built together (joint sums reduce four rows)")
    return StepVariant(threads, warm, group, local, lean, conv, joint, wide, cap)


def variant_rules(path: Path | None = None) -> tuple[StepVariant, tuple[VariantRule, ...]]:
    """kda_step_choice.toml (or `path`): the default variant and the rules, checked; a malformed file is an error
    naming it."""
    return _variant_rules(path or CHOICE)


@cache
def _variant_rules(path: Path) -> tuple[StepVariant, tuple[VariantRule, ...]]:
    table = tomllib.loads(path.read_text())
    if set(table) != {"default", "rules"}:
        raise ValueError(f"{path.name} holds `default` and `rules`, got {sorted(table)}")
    default = _variant(table["default"], f"{path.name} default", rule=False)
    rules = []
    for i, entry in enumerate(table["rules"]):
        where = f"{path.name} rules[{i}]"
        variant = _variant(entry, where, rule=True)
        span = entry.get("batches")
        if not (isinstance(span, list) and len(span) == 2 and all(isinstance(b, int) for b in span)):
            raise ValueError(f"{where}: batches is [first, last], got {span!r}")
        if not 1 <= span[0] <= span[1]:
            raise ValueError(f"{where}: batches [{span[0]}, {span[1]}] is not a range of batches")
        heads = entry.get("heads")
        if heads is not None and (not isinstance(heads, int) or heads < 1):
            raise ValueError(f"{where}: heads is a positive count, got {heads!r}")
        rules.append(VariantRule(heads, span[0], span[1], variant))
    return default, tuple(rules)


def chosen_variant(heads: int, batch: int, path: Path | None = None) -> StepVariant:
    """The variant kda_step_choice.toml (or `path`) serves at (heads, batch): the first matching rule's, else the
    default."""
    default, rules = variant_rules(path)
    return next((r.variant for r in rules if r.matches(heads, batch)), default)


@dataclass(frozen=True)
class KdaStepPlan:
    """One compile of the kernel: a rank's KDA shape, the batch, the CTAs per head and the slot table's dtype."""

    heads: int  # H, this rank's heads
    rows: int  # the packed row's width (the in_proj output, padded)
    batch: int
    cluster: int
    slot_dtype: SlotDtype = "int32"
    sm_count: int = H200_SMS  # the SMs the grid is spread over (launch_smem_bytes)
    resident_threads: int = RESIDENT_THREADS  # per SM, which sets the register budget (RESIDENT_CHOICES)
    warm_ahead: bool = False  # each CTA warms in L2 the state of the CTA that runs a wave after it (`ahead`)
    requests_per_cta: int = 1  # REQUEST_GROUPS: a cluster serves this many requests of its head, their copies at once
    local_decays: bool = False  # every CTA computes the head's 128 decays itself: no decay exchange (decay_rows)
    lean_start: bool = False  # the copies before the cluster barrier's wait; the slot hint only in the first wave
    lean_conv: bool = False  # only warps 0 and 1 (the conv lanes') run the conv; the others skip it, not discard it
    joint_sums: bool = False  # a warp's four rows' butterfly sums reduced together (primitives.warp_sums4): same bits
    wide_warps: bool = False  # eight value rows a warp, half the warps a CTA (rows_per_warp): same bits
    max_ctas_per_sm: int = 0  # 0, else the launch holds an SM to fewer CTAs than the budget fits (`spread`): same code

    def __post_init__(self) -> None:
        if self.resident_threads not in RESIDENT_CHOICES:
            raise ValueError(f"the KDA step holds {RESIDENT_CHOICES} threads per SM, not {self.resident_threads}")
        if self.sm_count < 1:
            raise ValueError(f"sm_count must be at least 1, got {self.sm_count}")
        if self.heads < 1:
            raise ValueError(f"the KDA step needs at least one head, got {self.heads}")
        if self.batch < 1:
            raise ValueError(f"batch must be at least 1, got {self.batch}")
        if self.cluster not in CLUSTERS:
            raise ValueError(f"the KDA step runs a head on a cluster of {CLUSTERS} CTAs, not {self.cluster}")
        if self.slot_dtype not in ("int32", "int64"):
            raise ValueError(f"slot tables are int32 or int64, not {self.slot_dtype!r}")
        if self.rows < self.unpadded_rows:
            raise ValueError(
                f"the packed row has {self.rows} columns; {self.heads} heads need at least {self.unpadded_rows}"
            )
        if self.rows % 8:
            raise ValueError(f"the packed row must be a whole number of 16-byte vectors, got {self.rows} columns")
        if self.requests_per_cta not in REQUEST_GROUPS:
            raise ValueError(f"a KDA step cluster serves {REQUEST_GROUPS} requests, not {self.requests_per_cta}")
        if self.batch % self.requests_per_cta:
            raise ValueError(
                f"batch {self.batch} is not a whole number of groups of {self.requests_per_cta} requests: "
                "serve it one request a cluster"
            )
        if self.requests_per_cta > 1 and self.warm_ahead:
            raise ValueError("warm_ahead and requests_per_cta > 1 are not built together: choose one")
        if self.requests_per_cta > 1 and self.local_decays:
            raise ValueError("local_decays and requests_per_cta > 1 are not built together: choose one")
        for name, on in (
            ("lean_start", self.lean_start),
            ("lean_conv", self.lean_conv),
            ("joint_sums", self.joint_sums),
            ("wide_warps", self.wide_warps),
        ):
            if on and self.requests_per_cta > 1:
                raise ValueError(f"{name} and requests_per_cta > 1 are not built together: choose one")
        if self.wide_warps and self.joint_sums:
            raise ValueError(
                "wide_warps and joint_sums are not built together (joint sums reduce four rows): choose one"
            )
        if self.max_ctas_per_sm and not 1 <= self.max_ctas_per_sm < self.ctas_per_sm:
            raise ValueError(
                f"max_ctas_per_sm caps the CTAs an SM holds below the {self.ctas_per_sm} of {self.threads} threads "
                f"that {self.resident_threads} threads per SM fit, got {self.max_ctas_per_sm}: leave it out or lower it"
            )
        if self.max_ctas_per_sm and self.max_ctas_per_sm >= self.fewest_ctas_per_sm:
            raise ValueError(
                f"max_ctas_per_sm {self.max_ctas_per_sm} changes nothing: the grid's {self.ctas} CTAs put at most "
                f"{self.fewest_ctas_per_sm} on each of {self.sm_count} SMs; leave it out"
            )
        if self.warm_ahead and self.wave_requests >= self.batch:
            raise ValueError(
                f"warm_ahead warms the requests of the next wave, and at batch {self.batch} the grid is one wave "
                f"({self.wave_requests} requests fit the {self.sm_count} SMs at once): leave it off"
            )

    @classmethod
    def for_shape(
        cls,
        heads: int,
        rows: int,
        batch: int,
        sm_count: int = H200_SMS,
        slot_dtype: SlotDtype = "int32",
        cluster: int | None = None,
        resident_threads: int | None = None,
        warm_ahead: bool | None = None,
        requests_per_cta: int | None = None,
        local_decays: bool | None = None,
        lean_start: bool | None = None,
        lean_conv: bool | None = None,
        joint_sums: bool | None = None,
        wide_warps: bool | None = None,
        max_ctas_per_sm: int | None = None,
    ) -> KdaStepPlan:
        """The smallest cluster whose grid still gives every SM a CTA, else the largest (8), and the register budget,
        the warming, the requests per CTA, the local decays, the lean start, the lean conv, the joint sums and the
        wide warps and the cap on the CTAs an SM holds kda_step_choice.toml serves at this batch (`chosen_variant`).
        `cluster`, `resident_threads`, `warm_ahead`, `requests_per_cta`, `local_decays`, `lean_start`, `lean_conv`,
        `joint_sums`, `wide_warps` and `max_ctas_per_sm` (0: none) override each choice (the GPU test times and checks
        every cluster at every batch, and the other variants at every cluster where they apply). A served cap applies
        only where it binds: below both the CTAs the budget fits and those the grid would put on an SM.

        Every head costs 32 warps of state work whatever the cluster (128 rows, 4 per warp); the cluster only
        groups them. Small clusters repeat less per-CTA work (every CTA convolves the head's whole q and k, and
        exchanges once per cluster), large ones spread a small batch over more SMs: at TP8 B1 the 12 heads fill
        only 12 SMs with one CTA per head, 96 with eight.
        """
        if cluster is None:
            filling = [c for c in sorted(CLUSTERS) if heads * batch * c >= sm_count]
            cluster = filling[0] if filling else max(CLUSTERS)
        served = chosen_variant(heads, batch)
        threads = served.resident_threads if resident_threads is None else resident_threads
        plan = cls(heads, rows, batch, cluster, slot_dtype, sm_count, threads)
        # A served rule applies where it can: warming where the grid has a next wave, groups where the batch divides
        # into them. Asked for explicitly, either is refused where it cannot apply.
        warm = served.warm_ahead and plan.wave_requests < batch if warm_ahead is None else warm_ahead
        group = requests_per_cta
        if group is None:
            group = served.requests_per_cta if batch % served.requests_per_cta == 0 else 1
        local = served.local_decays and group == 1 if local_decays is None else local_decays
        lean = served.lean_start and group == 1 if lean_start is None else lean_start
        conv = served.lean_conv and group == 1 if lean_conv is None else lean_conv
        joint = served.joint_sums and group == 1 if joint_sums is None else joint_sums
        wide = served.wide_warps and group == 1 if wide_warps is None else wide_warps
        plan = replace(
            plan,
            warm_ahead=warm,
            requests_per_cta=group,
            local_decays=local,
            lean_start=lean,
            lean_conv=conv,
            joint_sums=joint,
            wide_warps=wide,
        )
        cap = max_ctas_per_sm
        if cap is None:
            cap = served.max_ctas_per_sm if served.max_ctas_per_sm < plan.spread else 0
        return replace(plan, max_ctas_per_sm=cap)

    @property
    def choice(self) -> dict[str, Any]:
        """for_shape's overrides that give this plan back at its shape, whatever kda_step_choice.toml serves: its
        cluster and every knob a choice file's variant names (StepVariant's fields)."""
        return {"cluster": self.cluster} | {f.name: getattr(self, f.name) for f in fields(StepVariant)}

    # --- the packed row ---------------------------------------------------------------------------------------

    @property
    def proj(self) -> int:
        """P = H * D: the width of each of the q, k, v and g_out sections."""
        return self.heads * HEAD_DIM

    @property
    def sections(self) -> dict[str, int]:
        """Start column of each section of the packed row (RankShapes.in_proj_sections' order)."""
        p = self.proj
        return {"q": 0, "k": p, "v": 2 * p, "g": 3 * p, "f_a": 4 * p, "beta": 4 * p + GATE_RANK}

    @property
    def unpadded_rows(self) -> int:
        return 4 * self.proj + GATE_RANK + self.heads

    @property
    def conv_channels(self) -> int:
        return 3 * self.proj

    # --- the launch ---------------------------------------------------------------------------------------------

    @property
    def rows_per_cta(self) -> int:
        """R: value rows of S (and decay channels, and conv channels of q, k and v) each CTA owns."""
        return HEAD_DIM // self.cluster

    @property
    def rows_per_warp(self) -> int:
        """Value rows of S one warp owns: ROWS_PER_WARP, or twice that with wide_warps. Why wide: every warp pays a
        fixed share (q, k, v and the decays read from shared memory, the barrier waits, the norm's butterfly and
        rsqrt, the output's store) whatever its rows, and from B16 the step is bound by issue (docs/kda-layer-h200.md);
        eight rows a warp pay it once for eight, so a live CTA runs 72-74 % of the instructions (the PTX run per
        thread, test_kda_step_build.py), and at 1024 threads an SM holds four CTAs of 256 threads instead of two of
        512."""
        return 2 * ROWS_PER_WARP if self.wide_warps else ROWS_PER_WARP

    @property
    def warps(self) -> int:
        return self.rows_per_cta // self.rows_per_warp

    @property
    def threads(self) -> int:
        return self.warps * WARP

    @property
    def ctas_per_sm(self) -> int:
        """CTAs the compiled kernel must fit on one SM at once: `resident_threads` threads, so at most 64 registers
        per thread at 1024 and 40 at 1536 (ptxas is told, .minnctapersm). Every plan of a budget holds the same warps
        per SM: 32 at 1024, 48 at 1536."""
        return self.resident_threads // self.threads

    @property
    def groups(self) -> int:
        """The grid's slowest dimension: groups of requests_per_cta requests, each on its own cluster per head."""
        return self.batch // self.requests_per_cta

    @property
    def ctas(self) -> int:
        return self.cluster * self.heads * self.groups

    @property
    def held_ctas(self) -> int:
        """The most CTAs of this plan an SM may hold: ctas_per_sm (the register budget), or the cap below it."""
        return self.max_ctas_per_sm or self.ctas_per_sm

    @property
    def resident_ctas(self) -> int:
        """CTAs of this plan one SM holds at once when the grid fills it: held_ctas unless shared memory is short
        for that many (wide warps at 1536 threads: four of 56.7 KB, not six)."""
        return min(self.held_ctas, SMEM_PER_SM // (self.smem_bytes + SMEM_PER_CTA_RESERVED))

    @property
    def wave_requests(self) -> int:
        """Requests whose clusters are all resident at once when the grid fills every SM (resident_ctas each): the
        grid's CTAs are scheduled request after request (the request is its slowest index), so the CTA of request
        b + wave_requests takes the place of request b's, about when it ends."""
        return self.sm_count * self.resident_ctas // (self.cluster * self.heads) * self.requests_per_cta

    @property
    def ahead(self) -> int:
        """How many requests ahead a CTA warms the state of (0: none). Why: from TP8 B16 and TP16 B32 the grid runs
        in waves, and a
        CTA's chain (copies, conv, exchanges, delta rule, stores) holds its SM's slot while HBM serves only the
        resident CTAs' reads; an L2 prefetch of the next wave's state rows and taps, issued by thread 0 after its
        own copies, lets HBM stream them during this wave, so the next wave's copies hit L2. A prefetch returns no
        data and the lines it warms are written by no one before their own CTA runs, so it changes no value."""
        return self.wave_requests if self.warm_ahead else 0

    @property
    def spread(self) -> int:
        """The most CTAs of this grid one SM should hold: as few as the grid allows (ceil(CTAs / SMs)), at most
        held_ctas (a cap holds a grid of several waves to fewer CTAs an SM: more waves, each with more of an SM's
        issue slots and load pipe per CTA). Why it is enforced at all: the step launches as the projection's CTAs
        retire, and the first SMs freed would otherwise take whole clusters (the phase trace at 2a17303: at TP8 B1
        the 96 CTAs ran on 26 SMs, at TP16 B1 48 on 8), eight latency-bound CTAs sharing one SM's issue slots and
        load pipe."""
        return min(self.held_ctas, self.fewest_ctas_per_sm)

    @property
    def fewest_ctas_per_sm(self) -> int:
        """ceil(CTAs / SMs): the fewest CTAs an SM must hold for the whole grid to be resident at once."""
        return -(-self.ctas // self.sm_count)

    @property
    def launch_smem_bytes(self) -> int:
        """The dynamic shared memory the launch asks for: smem_bytes, padded where `spread` is below ctas_per_sm so
        that no more than `spread` CTAs fit on an SM (the only residency limit a launch can set; registers are
        capped for ctas_per_sm). The padding leaves an SM's other shared memory to the kernels beside the step
        (o_proj's CTAs, which start during it).

        The request alone exceeds an SM's share for spread + 1 CTAs, whatever the per-CTA reserve. At aa5aabc it
        subtracted 2 KiB for the driver's reserve and the cubin's 1 KiB of static shared memory, and on the H200
        two CTAs still fit (TP8 B1: 96 CTAs on 54 SMs, all resident at once): the cubin's 1 KiB is that reserve,
        not more beside it. The GPU test asks the driver's occupancy calculator for the count."""
        if self.spread >= self.ctas_per_sm:
            return self.smem_bytes
        share = SMEM_PER_SM // (self.spread + 1) + 1  # spread + 1 requests of this size exceed the SM alone
        return max(self.smem_bytes, -(-share // 128) * 128)

    @property
    def slots(self) -> int:
        """Partials each CTA receives in the output-norm exchange: one per (CTA, four rows) of the cluster, 32 in
        all (a wide warp pushes two, so the sum adds the same partials in the same order as four-row warps')."""
        return self.cluster * self.rows_per_cta // ROWS_PER_WARP

    @property
    def v_lanes(self) -> int:
        """Lanes of warp 1 that convolve the CTA's v channels, 8 each."""
        return self.rows_per_cta // 8

    @property
    def qk_lanes_per_cta(self) -> int:
        """Lanes (of the 16 per section in warp 0) whose q or k channels the CTA rewrites in the conv state."""
        return 16 // self.cluster

    # --- what one CTA copies into shared memory (bulk copies, one mbarrier each) -----------------------------
    # The CTA's conv channels, "local" numbering: the head's q (0 .. 127), k (128 .. 255), then its own R v channels.

    @property
    def conv_local(self) -> int:
        return 2 * HEAD_DIM + self.rows_per_cta

    def conv_runs(self, head: Any, rank: Any) -> tuple[tuple[Any, int, int], ...]:
        """(first conv-state channel, first local channel, channels) of CTA `rank` of head `head`'s three runs of
        conv channels: the head's q and k channels and the CTA's own v channels. Plain arithmetic, so the kernel
        calls it on its run-time head and rank, and every copy size below is a sum over these runs."""
        rows = self.rows_per_cta
        return (
            (head * HEAD_DIM, 0, HEAD_DIM),
            (self.proj + head * HEAD_DIM, HEAD_DIM, HEAD_DIM),
            (2 * self.proj + head * HEAD_DIM + rank * rows, 2 * HEAD_DIM, rows),
        )

    @property
    def decay_rows(self) -> int:
        """The f_b rows (decay channels) one CTA multiplies: its own R, pushed to its peers, or with local_decays all
        128 of the head. Why local: in the layer's phase traces (docs/kda-layer-h200.md) the decay exchange took
        1.6-1.8 us instead of 0.3-0.5 when it began while o_proj's CTAs received their first weight loads (TP8 B1,
        TP16 B1-B2); computed locally it is 128 / R times the f_b reads (from L2: 3 MB at TP8 B1, 200 MB at B64) and
        256 / R f_b rows per half-warp instead of two, and no exchange to wait for. The same arithmetic per channel
        (a half-warp's dot product, lane l holding columns 8 (l % 16) ..), so the same bits."""
        return HEAD_DIM if self.local_decays else self.rows_per_cta

    @property
    def weight_bytes(self) -> int:
        """Before the wait: the CTA's f_b rows (decay_rows, 128 BF16 each), the conv weights (4 BF16) of its channels,
        and with local_decays the head's 128 dt_bias values (FP32), which plain loads would hold in registers."""
        dt = HEAD_DIM * 4 if self.local_decays else 0
        return self.decay_rows * GATE_RANK * 2 + self.conv_local * CONV_WIDTH * 2 + dt

    @property
    def packed_bytes(self) -> int:
        """After it, from the packed row: the conv inputs of its channels, f_a, and the output gate of its rows."""
        return self.conv_local * 2 + GATE_RANK * 2 + self.rows_per_cta * 2

    @property
    def tap_bytes(self) -> int:
        """The stored taps (3 BF16) of its conv channels."""
        return self.conv_local * (CONV_WIDTH - 1) * 2

    @property
    def state_bytes(self) -> int:
        """Recurrent-state bytes one CTA reads (and writes): its R rows of 128 FP32."""
        return self.rows_per_cta * HEAD_DIM * 4

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA: the copies above, the exchanged decays and norm partials, q, k and v as FP32,
        six mbarriers, each buffer 128-byte aligned; all but the weights once per request of the CTA's group."""
        r = self.rows_per_cta
        dt = HEAD_DIM * 4 if self.local_decays else 0  # its own buffer, beside the f_b rows and conv weights
        parts = [6 * 8 * self.requests_per_cta, self.weight_bytes - dt, dt]
        each = [self.state_bytes, self.packed_bytes, self.tap_bytes, HEAD_DIM * 4, 2 * HEAD_DIM * 4, r * 4]
        parts += [*each, self.slots * 4] * self.requests_per_cta
        return sum(-(-n // 128) * 128 for n in parts)

    @property
    def variant_suffix(self) -> str:
        """ "" at 1024 threads per SM without warming, one request a cluster, decays exchanged, the plain start, else
        "/t<threads per SM>", "/warm", "/r<requests per CTA>", "/local-decays", "/lean", "/lean-conv" and
        "/joint-sums", "/wide-warps" and "/cap<CTAs an SM>": builds and compiles of the variants are named apart."""
        budget = "" if self.resident_threads == RESIDENT_THREADS else f"/t{self.resident_threads}"
        group = "" if self.requests_per_cta == 1 else f"/r{self.requests_per_cta}"
        leaner = ("/lean" if self.lean_start else "") + ("/lean-conv" if self.lean_conv else "")
        leaner += ("/joint-sums" if self.joint_sums else "") + ("/wide-warps" if self.wide_warps else "")
        return (
            budget
            + ("/warm" if self.warm_ahead else "")
            + group
            + ("/local-decays" if self.local_decays else "")
            + leaner
            + (f"/cap{self.max_ctas_per_sm}" if self.max_ctas_per_sm else "")
        )

    @property
    def tag(self) -> str:
        return f"h{self.heads}/b{self.batch}/c{self.cluster}{self.variant_suffix}"


@dataclass(frozen=True)
class KdaVerifyPlan(KdaStepPlan):
    """One compile of the verify kernel (KdaStepKernel.verify): a decode plan's geometry (heads, packed width,
    requests as `batch`, cluster, slot dtype) for `tokens` tokens per request, with the dtype of num_accepted.

    The geometry is the decode plan's, request by request: the same cluster per (request, head), rows per CTA and
    warps, so every per-token computation is the decode kernel's. What grows with q: the packed-row copies (one set
    per token), the conv row (2 + q columns: vLLM's conv state for q - 1 speculative tokens), the exchanges (one
    per token), the per-token q, k, v and outputs kept in shared memory."""

    tokens: int = field(kw_only=True)
    accepted_dtype: SlotDtype = field(default="int32", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise ValueError(f"a verify step takes 1..{MAX_TOKENS} tokens per request, got {self.tokens}")
        if self.accepted_dtype not in ("int32", "int64"):
            raise ValueError(f"num_accepted is int32 or int64, not {self.accepted_dtype!r}")

    @classmethod
    def for_shape(  # type: ignore[override]
        cls,
        heads: int,
        rows: int,
        batch: int,
        sm_count: int = H200_SMS,
        slot_dtype: SlotDtype = "int32",
        *,
        tokens: int,
        accepted_dtype: SlotDtype = "int32",
    ) -> KdaVerifyPlan:
        """The decode plan's cluster for `batch` requests (KdaStepPlan.for_shape: every SM gets a CTA, else 8)."""
        step = KdaStepPlan.for_shape(heads, rows, batch, sm_count, slot_dtype)
        return cls(heads, rows, batch, step.cluster, slot_dtype, sm_count, tokens=tokens, accepted_dtype=accepted_dtype)

    @property
    def columns(self) -> int:
        """T: the conv state's columns per channel, 2 + q (CONV_WIDTH - 1 taps + q - 1 speculative columns)."""
        return CONV_WIDTH - 2 + self.tokens

    @property
    def token_bytes(self) -> int:
        """What one token's packed row gives the CTA: the conv inputs of its channels, f_a, its output gates."""
        return self.conv_local * 2 + GATE_RANK * 2 + self.rows_per_cta * 2

    @property
    def packed_bytes(self) -> int:
        """The packed-row barrier's bytes: every token's sections."""
        return self.tokens * self.token_bytes

    @property
    def tap_bytes(self) -> int:
        """The conv row's T columns of the CTA's conv channels."""
        return self.conv_local * self.columns * 2

    @property
    def decay_bytes(self) -> int:
        """The decay exchange's bytes per CTA: the head's 128 decays of every token."""
        return self.tokens * HEAD_DIM * 4

    @property
    def norm_bytes(self) -> int:
        """The norm exchange's bytes per CTA: 32 partials per token."""
        return self.tokens * self.slots * 4

    @property
    def smem_bytes(self) -> int:
        """The copies above, the exchanges, and per token q and k (FP32, the head's), v and o (the CTA's rows),
        beta and the token's state slot; six mbarriers; each buffer 128-byte aligned. Only clusters of 8 from q = 4
        are short of shared memory for ctas_per_sm CTAs an SM (resident_ctas: 7 at q = 4, 5 at q = 8)."""
        r, q = self.rows_per_cta, self.tokens
        parts = [6 * 8, self.state_bytes, self.weight_bytes, self.packed_bytes, self.tap_bytes]
        parts += [self.decay_bytes, q * 2 * HEAD_DIM * 4, q * r * 4, q * r * 4, self.norm_bytes, q * 4, q * 4]
        return sum(-(-n // 128) * 128 for n in parts)

    @property
    def launch_smem_bytes(self) -> int:
        """The verify kernel asks for its own shared memory only: its launch is not spread (not yet measured)."""
        return self.smem_bytes

    @property
    def tag(self) -> str:
        return f"h{self.heads}/b{self.batch}/q{self.tokens}/c{self.cluster}"
