"""The CuTe DSL fused KDA decode step (k3_decode/kernels/kda_step.py) on an H200, at real K3 per-rank shapes (TP8:
12 heads, TP16: 6), against the FP64 oracle (k3_decode/reference/kda.py) and the stock step (cuBLAS f_b GEMM +
the Triton kernel, k3_decode/stock/kda.py).

Its provider (providers.py, CuteKdaStepProvider) was registered after this passed on an H200.

Tolerances, the two styles the repo uses, both applied and printed:
- suites/tolerances.toml `kda_decode.bfloat16` (output) and `kda_decode.state.bfloat16` (recurrent state): element-wise
  atol + rtol |ref| on a matched fraction, a max_abs cap, a non-trivial reference (harness.numerics.compare);
- tests/k3_decode/stock/attention_tolerances.toml `kda_decode` / `kda_decode_state`: rms_rel and peak_rel, with the
  guard that a zero, constant or wrongly scaled output fails (the stock GPU test's check).
Both were set for the stock path, whose f_b product is rounded to BF16 before the decay gate; the kernel keeps it in
FP32, so it should sit well inside them, and its state must be at least as close to the oracle as stock's.
Exact: the conv state (BF16 copies of BF16 inputs) equals the oracle's bit for bit, NULL rows (slot <= 0) are zero,
and every slot the step does not own (canary slots, slot 0) is bit-identical before and after.

Every test prints what it measured (METRIC lines): run with -s to see them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from functools import cache

import pytest
import torch
from torch import Tensor

from harness.numerics.compare import ToleranceTable, compare
from k3_decode.config import K3
from k3_decode.kernels import kda_step_op
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, KdaStepBuild
from k3_decode.kernels.kda_step_plan import (
    CLUSTERS,
    RESIDENT_CHOICES,
    RESIDENT_THREADS,
    KdaStepPlan,
    knob_alone,
    the_pair,
)
from k3_decode.kernels.providers import not_built_reason
from k3_decode.reference import kda as rk
from k3_decode.stock import kda as sk
from k3_decode.weights import KdaWeights
from tests.k3_decode.kernels.helpers import compiled_cubin, ctas_per_sm
from tests.k3_decode.kernels.test_kda_in_proj_gpu import _graph_seconds_per_call
from tests.k3_decode.stock.attention_helpers import (
    assert_close,
    clone_cache,
    error_metrics,
    load_tolerances,
    projected_rows,
    random_kda_cache,
    reference_kda_weights,
    weights_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not_built_reason() is not None, reason=f"the CuTe DSL kernels cannot run: {not_built_reason()}"),
]

DEV = "cuda"
KDA_LAYER = 13
RMS_TOL = load_tolerances()  # tests/k3_decode/stock/attention_tolerances.toml
SUITE_TOL = ToleranceTable.load()  # suites/tolerances.toml
ALL_BUILDS = [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaStepBuild)]  # what CI compiles


def served(plan: KdaStepPlan) -> bool:
    """Whether the provider runs this plan: the one KdaStepPlan.for_shape picks (kda_step_choice.toml's variant)."""
    return plan == KdaStepPlan.for_shape(plan.heads, plan.rows, plan.batch, plan.sm_count, plan.slot_dtype)


BUILDS = [b for b in ALL_BUILDS if served(b.plan)]  # the plans the provider runs
WIDE = [
    b
    for b in ALL_BUILDS
    if b.plan.resident_threads != RESIDENT_THREADS and not (b.plan.warm_ahead or b.plan.wide_warps)
]
WARM = [b for b in ALL_BUILDS if b.plan.warm_ahead]  # warming the next wave's state in L2
GROUP = [b for b in ALL_BUILDS if b.plan.requests_per_cta > 1]  # clusters serving two requests each
LOCAL = [b for b in ALL_BUILDS if b.plan.local_decays]  # every CTA computes the head's decays: no decay exchange
LEAN = [b for b in ALL_BUILDS if b.plan.lean_start and not b.plan.wide_warps]  # copies before the barrier's wait
LEAN_PAIR = [b for b in ALL_BUILDS if b.plan.lean_start and b.plan.wide_warps and b.plan.lean_conv]  # and the pair
LEAN_CONV = [b for b in ALL_BUILDS if b.plan.lean_conv and not b.plan.wide_warps]  # only the conv warps run the conv
JOINT = [b for b in ALL_BUILDS if b.plan.joint_sums]  # a warp's four rows reduced together
WIDE_WARPS = [b for b in ALL_BUILDS if b.plan.wide_warps]  # eight rows a warp, half the warps a CTA
WIDE_BUDGET = max(RESIDENT_CHOICES)
# Every built shape, and two batches the builds do not list (the provider gets whatever the executor prepares).
CASES = [(b.tp, b.plan.batch) for b in BUILDS] + [(8, 3), (16, 5)]


@cache
def kda_weights(tp: int):
    return weights_for(K3, tp, DEV).attention(KDA_LAYER)


PLAIN_KNOBS = knob_alone()  # the budget and warming builds' step: four-row warps, every warp's conv


def step_plan(tp: int, batch: int, **choice) -> KdaStepPlan:
    """The plan at an H200's 132 SMs (the GPU's own count is what the op plans for)."""
    shard = K3.shard(tp)
    return KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, batch, **choice)


def spec_for(tp: int) -> rk.KdaSpec:
    return rk.KdaSpec.for_rank(K3, tp)


def slot_table(batch: int, gen: torch.Generator, dtype: torch.dtype = torch.int32) -> Tensor:
    """Live requests on distinct odd slots in a shuffled order; NULL rows (0 and -1, CUDA-graph padding) in the middle
    and at the end from two rows on. Even slots (and slot 0) belong to no request: canaries the step must not touch.
    The cache has 2 * batch + 2 slots."""
    slots = (torch.randperm(batch, generator=gen) * 2 + 1).to(dtype)
    if batch >= 2:
        slots[batch // 2] = 0
    if batch >= 4:
        slots[-1] = -1
    return slots.to(DEV)


def check_rms(got: Tensor, ref: Tensor, op: str, what: str) -> tuple[float, float]:
    """The stock GPU test's check (rms_rel, peak_rel, not trivially), printing the measured errors."""
    tol = RMS_TOL[op]
    rms_rel, peak_rel = assert_close(got, ref, tol, what)
    print(f"METRIC {what}: rms_rel {rms_rel:.2e} (tol {tol.rms_rel:g}), peak_rel {peak_rel:.2e} (tol {tol.peak_rel:g})")
    return rms_rel, peak_rel


def check_suite(got: Tensor, ref: Tensor, op: str, what: str) -> None:
    """The numerics stage's element-wise check under suites/tolerances.toml's entry, printing its metrics."""
    tol = SUITE_TOL.get(op, "bfloat16")
    checks, metrics = compare(what, got, ref, tol)
    print(
        f"METRIC {what} [{op}]: matched {metrics['matched_fraction']:.6f} (>= {tol.matched_fraction}), max_abs "
        f"{metrics['max_abs_error']:.3e} (<= {tol.max_abs}), ref peak {metrics['ref_peak']:.3g}"
    )
    failed = [c.describe() for c in checks if not c.passed]
    assert not failed, failed


def untouched(before: Tensor, after: Tensor, owned: Tensor, what: str) -> None:
    """Every slot but `owned` (the live slots) is bit-identical."""
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[owned.long()] = False
    assert torch.equal(before[keep], after[keep]), f"{what}: a slot outside the write set changed"


class Step:
    """One decode step's inputs at (tp, batch): weights, packed rows, a cache, and identical copies for the oracle
    and the stock path."""

    def __init__(self, tp: int, batch: int, seed: int, slot_dtype: torch.dtype = torch.int32, **choice) -> None:
        """`choice`: what this step overrides of the plan's choice (KdaStepPlan.for_shape's keywords)."""
        gen = torch.Generator().manual_seed(seed)
        self.tp, self.batch, self.choice = tp, batch, choice
        self.spec, self.weights = spec_for(tp), kda_weights(tp)
        self.cache = random_kda_cache(self.spec, 2 * batch + 2, 0, gen, DEV)
        self.start = clone_cache(self.cache)
        self.slots = slot_table(batch, gen, slot_dtype)
        self.packed = projected_rows(self.weights.in_proj, (batch,), gen)
        self.live = self.slots > 0

    def kernel(self, cache: rk.KdaCache | None = None, packed: Tensor | None = None) -> Tensor:
        packed = self.packed if packed is None else packed
        cache = self.cache if cache is None else cache
        return kda_step_op.decode_step(
            self.spec,
            self.weights,
            packed,
            cache,
            self.slots,
            None,
            **self.choice,
        )

    def oracle(self, cache: rk.KdaCache, packed: Tensor | None = None) -> Tensor:
        packed = self.packed if packed is None else packed
        return rk.kda_decode_step(self.spec, reference_kda_weights(self.weights), packed, cache, self.slots)

    def stock(self, cache: rk.KdaCache, packed: Tensor | None = None) -> Tensor:
        packed = self.packed if packed is None else packed
        return sk.kda_decode_step(self.spec, self.weights, packed, cache, self.slots)

    @property
    def cluster(self) -> int:
        return self.plan.cluster

    @property
    def plan(self) -> KdaStepPlan:
        return kda_step_op.plan_for(self.spec, self.packed, self.slots, **self.choice)


# --- against the oracle and the stock step -------------------------------------------------------------------------


@pytest.mark.parametrize("tp, batch", CASES, ids=[f"tp{t}-b{b}" for t, b in CASES])
def test_step_matches_the_oracle_and_the_stock_step(tp: int, batch: int):
    check_step(Step(tp, batch, seed=tp * 1000 + batch))


# Every cluster the plan does not choose at a built batch: the timing below compares them, so each must be right.
OTHER_CLUSTERS = [
    (b.tp, b.plan.batch, c)
    for b in BUILDS
    if b.plan.batch in (1, 4, 8, 16, 64)
    for c in CLUSTERS
    if c != b.plan.cluster
]


@pytest.mark.parametrize("tp, batch, cluster", OTHER_CLUSTERS, ids=[f"tp{t}-b{b}-c{c}" for t, b, c in OTHER_CLUSTERS])
def test_every_cluster_matches_the_oracle(tp: int, batch: int, cluster: int):
    step = Step(tp, batch, seed=tp * 1000 + batch, cluster=cluster)
    assert step.cluster == cluster
    check_step(step)


# The larger register budget at every cluster where it changes what an SM holds (the builds' B16-B64 at the
# plan's cluster among them): the timing below runs them all.
WIDE_CASES = [(tp, batch, c) for tp in (8, 16) for batch in (16, 32, 64) for c in CLUSTERS]
assert {(b.tp, b.plan.batch, b.plan.cluster) for b in WIDE} <= set(WIDE_CASES)


@pytest.mark.parametrize("tp, batch, cluster", WIDE_CASES, ids=[f"tp{t}-b{b}-c{c}-t1536" for t, b, c in WIDE_CASES])
def test_the_larger_register_budget_matches_the_oracle(tp: int, batch: int, cluster: int):
    step = Step(tp, batch, seed=tp * 1000 + batch, cluster=cluster, resident_threads=WIDE_BUDGET, **PLAIN_KNOBS)
    plan = step.plan
    assert (plan.cluster, plan.resident_threads, plan.ctas_per_sm) == (
        cluster,
        WIDE_BUDGET,
        WIDE_BUDGET // plan.threads,
    )
    check_step(step)


# Warming the next wave at the plan's cluster, at every budget whose grid at B16-B64 runs in more than one wave
# (the warming builds among them). A prefetch changes no value, so the plan's cluster stands for the others the
# timing below runs; one of those would be checked here before it is served.
WARM_CASES = [
    (tp, batch, r)
    for tp in (8, 16)
    for batch in (16, 32, 64)
    for r in RESIDENT_CHOICES
    if step_plan(tp, batch, resident_threads=r, **PLAIN_KNOBS).wave_requests < batch
]
assert {(b.tp, b.plan.batch, b.plan.resident_threads) for b in WARM} <= set(WARM_CASES)


@pytest.mark.parametrize("tp, batch, threads", WARM_CASES, ids=[f"tp{t}-b{b}-t{r}-warm" for t, b, r in WARM_CASES])
def test_warming_the_next_wave_matches_the_oracle(tp: int, batch: int, threads: int):
    step = Step(tp, batch, seed=tp * 1000 + batch, resident_threads=threads, warm_ahead=True, **PLAIN_KNOBS)
    plan = step.plan
    assert plan.warm_ahead and 0 < plan.ahead < batch and plan.resident_threads == threads
    check_step(step)


# Two requests a cluster at the plan's cluster, 1024 threads per SM, at B16-B64 (the group builds among them).
GROUP_CASES = [(tp, batch) for tp in (8, 16) for batch in (16, 32, 64)]
assert {(b.tp, b.plan.batch) for b in GROUP} <= set(GROUP_CASES)


@pytest.mark.parametrize("tp, batch", GROUP_CASES, ids=[f"tp{t}-b{b}-r2" for t, b in GROUP_CASES])
def test_a_cluster_serving_two_requests_gives_the_one_request_kernels_bits(tp: int, batch: int):
    """kda_step_group.py runs each request's arithmetic as the decode kernel does, so outputs, state and taps must
    be bit-identical to it from the same state, with a group of two NULL rows (0 and -1: the group skips its
    barriers), groups with one NULL row (the table's own) and live ones; then the oracle checks, as for any plan."""
    step = Step(tp, batch, seed=tp * 1000 + batch, resident_threads=RESIDENT_THREADS, requests_per_cta=2)
    step.slots[:2] = torch.tensor([0, -1], dtype=step.slots.dtype)  # request 0's and 1's odd slots become canaries
    step.live = step.slots > 0
    plan = step.plan
    assert (plan.requests_per_cta, plan.groups, plan.resident_threads) == (2, batch // 2, RESIDENT_THREADS)
    grouped_cache, one_cache = clone_cache(step.cache), clone_cache(step.cache)
    grouped = step.kernel(cache=grouped_cache)
    one = kda_step_op.decode_step(
        step.spec,
        step.weights,
        step.packed,
        one_cache,
        step.slots,
        None,
        **dataclasses.replace(plan, requests_per_cta=1).choice,
    )
    torch.cuda.synchronize()
    assert torch.equal(grouped, one), f"TP{tp} B{batch}: the group kernel's outputs differ from the decode kernel's"
    assert torch.equal(grouped_cache.recurrent, one_cache.recurrent), "the recurrent states differ"
    assert torch.equal(grouped_cache.conv, one_cache.conv), "the conv states differ"
    print(f"METRIC KDA step TP{tp} B{batch} c{plan.cluster}/r2: bit-identical to the one-request kernel")
    check_step(step)


# Every CTA computing its head's 128 decays (KdaStepPlan.local_decays) at the plan's cluster and budget, B1-B8 (the
# builds among them: clusters of 8, 4 and 2) and B16-B64 (where the phase traces found the decay exchange the
# step's longest phase; at 1536 threads per SM these plans spill 16 bytes and are not built in CI).
LOCAL_CASES = [(tp, batch) for tp in (8, 16) for batch in (1, 2, 4, 8, 16, 32, 64)]
assert {(b.tp, b.plan.batch) for b in LOCAL} <= set(LOCAL_CASES)


def where_bits_differ(a: Tensor, b: Tensor) -> str:
    """How many elements of two same-shaped tensors differ, by how much at most, and at which indices of each
    dimension (the first few): enough to tell a race on a few rows from an arithmetic change everywhere."""
    differ = a != b
    at = differ.nonzero()
    most = (a.double() - b.double()).abs()[differ].max().item()
    parts = [f"{at.shape[0]} of {a.numel()} elements differ, at most by {most:.3g}"]
    for dim in range(a.dim()):
        seen = at[:, dim].unique()
        parts.append(f"dim {dim} ({a.shape[dim]}): {seen.numel()} indices, first {seen[:8].tolist()}")
    return "; ".join(parts)


def assert_same_bits(step: Step, other: KdaStepPlan) -> None:
    """`step`'s plan and `other` (the same shape with a knob turned off) run from the same cache and inputs: the
    outputs, the recurrent state and the conv state must be equal bit for bit, NULL rows among them."""
    plan = step.plan
    mine, theirs = clone_cache(step.cache), clone_cache(step.cache)
    got = step.kernel(cache=mine)
    want = kda_step_op.decode_step(step.spec, step.weights, step.packed, theirs, step.slots, None, **other.choice)
    torch.cuda.synchronize()
    what = f"TP{step.tp} B{step.batch} {plan.tag} against {other.tag}"
    pairs = (("outputs", got, want), ("recurrent states", mine.recurrent, theirs.recurrent))
    for name, a, b in (*pairs, ("conv states", mine.conv, theirs.conv)):
        assert torch.equal(a, b), f"{what}: the {name} differ ({where_bits_differ(a, b)})"
    print(f"METRIC KDA step {what}: bit-identical")


def assert_the_knob_keeps_the_bits(tp: int, batch: int, seed: int, knob: str) -> None:
    """The plan at (tp, batch) with `knob` on, against the same plan with it off (the choice's plan, which the builds
    list): outputs, state and taps bit for bit (assert_same_bits), then the oracle checks, as for any plan."""
    alone = knob_alone(**{knob: True})  # the knob alone, as the builds have it
    step = Step(tp, batch, seed=tp * 1000 + batch + seed, **alone)
    off = dataclasses.replace(step.plan, **{knob: False})
    assert getattr(step.plan, knob) and off == step_plan(tp, batch, **{**alone, knob: False})
    assert_same_bits(step, off)
    check_step(step)


@pytest.mark.parametrize("tp, batch", LOCAL_CASES, ids=[f"tp{t}-b{b}-local-decays" for t, b in LOCAL_CASES])
def test_local_decays_give_the_exchanged_decays_bits(tp: int, batch: int):
    """Each decay is the same half-warp dot product from the same vectors whichever CTA computes it, so computing
    all 128 in every CTA instead of pushing them must give the exchanging kernel's outputs, state and taps bit for
    bit, NULL rows among them; then the oracle checks, as for any plan."""
    assert_the_knob_keeps_the_bits(tp, batch, 7, "local_decays")


# A lean start (KdaStepPlan.lean_start) at the plan's cluster and register budget: one wave (B1, B2, B8) and several
# (B16 and B64 at both sizes, where only the first wave warms its state in L2), the builds among them.
LEAN_CASES = [(tp, batch) for tp in (8, 16) for batch in (1, 2, 8, 16, 64)]
assert {(b.tp, b.plan.batch) for b in LEAN} <= set(LEAN_CASES)


@pytest.mark.parametrize("tp, batch", LEAN_CASES, ids=[f"tp{t}-b{b}-lean" for t, b in LEAN_CASES])
def test_a_lean_start_gives_the_plain_starts_bits(tp: int, batch: int):
    """A lean start moves only when the CTA reads its slot hint and waits for its peers' barriers, so its outputs,
    state and taps must be the plain start's bit for bit, NULL rows among them; then the oracle checks."""
    assert_the_knob_keeps_the_bits(tp, batch, 11, "lean_start")


# A lean conv (KdaStepPlan.lean_conv) at the plan's cluster and register budget, where a CTA has 4, 16 and 16 warps.
LEAN_CONV_CASES = [(tp, batch) for tp in (8, 16) for batch in (1, 16, 64)]
assert {(b.tp, b.plan.batch) for b in LEAN_CONV} <= set(LEAN_CONV_CASES)


@pytest.mark.parametrize("tp, batch", LEAN_CONV_CASES, ids=[f"tp{t}-b{b}-lean-conv" for t, b in LEAN_CONV_CASES])
def test_a_lean_conv_gives_the_plain_convs_bits(tp: int, batch: int):
    """Warps 2 and up discarded their conv; skipping it must leave the outputs, state and taps bit for bit, NULL rows
    among them; then the oracle checks."""
    assert_the_knob_keeps_the_bits(tp, batch, 13, "lean_conv")


# Joint sums (KdaStepPlan.joint_sums) at the plan's cluster and register budget: 4 and 16 warps a CTA, 64 and 40
# registers, the served lean start at TP8 B64.
JOINT_CASES = [(tp, batch) for tp in (8, 16) for batch in (1, 16, 64)]
assert {(b.tp, b.plan.batch) for b in JOINT} <= set(JOINT_CASES)


@pytest.mark.parametrize("tp, batch", JOINT_CASES, ids=[f"tp{t}-b{b}-joint-sums" for t, b in JOINT_CASES])
def test_joint_sums_give_the_butterflies_bits(tp: int, batch: int):
    """warp_sums4 adds the same partial sums in the same tree as four warp_sums (primitives.py), so reducing a warp's
    four rows together must leave the outputs, state and taps bit for bit, NULL rows among them; then the oracle
    checks."""
    assert_the_knob_keeps_the_bits(tp, batch, 17, "joint_sums")


# Wide warps (KdaStepPlan.wide_warps) at both register budgets: 2 and 8 warps a CTA (B1; B16 and B64), the served
# lean start at TP8 B64 among them.
WIDE_WARP_CASES = [(tp, batch, threads) for tp in (8, 16) for batch in (1, 16, 64) for threads in RESIDENT_CHOICES]
assert {(b.tp, b.plan.batch, b.plan.resident_threads) for b in WIDE_WARPS if not b.plan.lean_conv} <= set(
    WIDE_WARP_CASES
)


@pytest.mark.parametrize(
    "tp, batch, threads", WIDE_WARP_CASES, ids=[f"tp{t}-b{b}-t{n}-wide-warps" for t, b, n in WIDE_WARP_CASES]
)
def test_wide_warps_give_the_four_row_warps_bits(tp: int, batch: int, threads: int):
    """A wide warp runs two four-row warps' rows, its lanes the same arithmetic on the same values, and pushes both
    norm partials into their slots (tests/k3_decode/kernels/test_kda_step_build.py compares the PTX): the outputs,
    state and taps must be the four-row build's bit for bit, NULL rows among them; then the oracle checks."""
    step = Step(tp, batch, seed=tp * 1000 + batch + 19, resident_threads=threads, **knob_alone(wide_warps=True))
    off = dataclasses.replace(step.plan, wide_warps=False)
    assert step.plan.wide_warps and off == step_plan(tp, batch, resident_threads=threads, **PLAIN_KNOBS)
    assert_same_bits(step, off)
    check_step(step)
    for _ in range(2):  # and the same bits again: no value may depend on how the wider warps happen to be timed
        assert_same_bits(step, step.plan)


# Wide warps with the lean conv, at 1024 threads (four CTAs of 256 threads an SM at clusters of 2): the builds, B1, B8
# and B16-B64 (served at TP8 B16 and B64 and TP16 B32), and B2 and B4, which the builds do not list; and TP8 B5-B7,
# between the pair's small-batch rounds (clusters of 4 at B5, of 2 at B6 and B7, as at the served B8).
WIDE_CONV_CASES = [(tp, batch) for tp in (8, 16) for batch in (1, 2, 4, 8, 16, 32, 64)] + [(8, b) for b in (5, 6, 7)]
assert {(b.tp, b.plan.batch) for b in WIDE_WARPS if b.plan.lean_conv} <= set(WIDE_CONV_CASES)


@pytest.mark.parametrize("tp, batch", WIDE_CONV_CASES, ids=[f"tp{t}-b{b}-wide-lean-conv" for t, b in WIDE_CONV_CASES])
def test_wide_warps_with_the_lean_conv_give_the_plain_steps_bits(tp: int, batch: int):
    """Each knob keeps the bits alone (the tests above); together, warps 0 and 1 of a wide CTA (its q and k lanes)
    convolve and the others skip it, so the outputs, state and taps must be the plain four-row step's bit for bit,
    NULL rows among them; then the oracle checks, and the same bits again."""
    step = Step(tp, batch, seed=tp * 1000 + batch + 23, resident_threads=1024, wide_warps=True, lean_conv=True)
    plain = dataclasses.replace(step.plan, **PLAIN_KNOBS)
    assert plain == step_plan(tp, batch, resident_threads=1024, **PLAIN_KNOBS)
    assert_same_bits(step, plain)
    check_step(step)
    assert_same_bits(step, step.plan)


# The lean start beside the pair, where the builds have it (B1, B2 and B8 at both TP sizes for their layer rounds, TP8
# B64 served), uncapped.
LEAN_PAIR_CASES = sorted({(b.tp, b.plan.batch) for b in LEAN_PAIR if not b.plan.max_ctas_per_sm})
assert set(LEAN_PAIR_CASES) >= {(8, 1), (8, 8), (16, 2), (8, 64)}


@pytest.mark.parametrize("tp, batch", LEAN_PAIR_CASES, ids=[f"tp{t}-b{b}-lean-pair" for t, b in LEAN_PAIR_CASES])
def test_a_lean_start_beside_the_pair_gives_the_pairs_bits(tp: int, batch: int):
    """The lean start moves when the CTA reads its slot hint and waits for its peers, whichever warps it has: beside
    wide warps and the lean conv the outputs, state and taps must be the pair's bit for bit, NULL rows among them;
    then the oracle checks."""
    step = Step(tp, batch, seed=tp * 1000 + batch + 29, **the_pair(lean_start=True))
    off = dataclasses.replace(step.plan, lean_start=False)
    assert step.plan.lean_start and off == step_plan(tp, batch, **the_pair(lean_start=False))
    assert_same_bits(step, off)
    check_step(step)


# The pair with the launch holding an SM to three CTAs (KdaStepPlan.max_ctas_per_sm), where the builds have it: the
# grids of 768 and 1536 CTAs, four an SM uncapped.
CAPPED = [b for b in ALL_BUILDS if b.plan.max_ctas_per_sm]
assert {(b.tp, b.plan.batch) for b in CAPPED} == {(8, 32), (8, 64), (16, 64)}


@pytest.mark.parametrize("build", CAPPED, ids=[b.name for b in CAPPED])
def test_a_capped_launch_gives_the_uncapped_plans_bits(build: KdaStepBuild):
    """A cap changes only how many CTAs an SM holds (and so the lean start's first wave), never a value. The
    driver's occupancy calculator must fit exactly the cap at the padded request and the budget's four without it;
    the outputs, state and taps must be the uncapped plan's bit for bit, NULL rows among them; then the oracle
    checks."""
    plan = build.plan
    padded, unpadded = ctas_per_sm(*decode_cubin(plan), plan.threads, [plan.launch_smem_bytes, plan.smem_bytes])
    print(f"METRIC KDA step {build.name}: {padded} CTAs per SM at {plan.launch_smem_bytes} B, {unpadded} unpadded")
    assert (padded, unpadded) == (plan.max_ctas_per_sm, plan.ctas_per_sm)
    step = Step(build.tp, plan.batch, seed=build.tp * 1000 + plan.batch + 29, **plan.choice)
    assert step.plan == plan and plan.spread == plan.max_ctas_per_sm < plan.ctas_per_sm
    assert_same_bits(step, dataclasses.replace(plan, max_ctas_per_sm=0))
    check_step(step)


# The served plans and their lean-conv twins where a CTA has 16 warps (B16, B64) and 4 (B1).
REPEAT_CASES = [(8, 1, False)] + [(tp, b, lean) for tp in (8, 16) for b in (16, 64) for lean in (False, True)]


@pytest.mark.parametrize(
    "tp, batch, lean_conv", REPEAT_CASES, ids=[f"tp{t}-b{b}{'-lean-conv' if c else ''}" for t, b, c in REPEAT_CASES]
)
def test_the_step_gives_the_same_bits_every_time(tp: int, batch: int, lean_conv: bool):
    """From the same cache and inputs, one plan must give the same outputs, state and taps every time: no value a
    step reads may depend on how its warps and CTAs happen to be timed. Three pairs of runs, so a race that shows
    now and then has several chances; broken case: any two plans whose bits differ (the lean conv's test)."""
    step = Step(tp, batch, seed=tp * 1000 + batch + 13, lean_conv=lean_conv)
    for _ in range(3):
        assert_same_bits(step, step.plan)


def check_step(step: Step) -> None:
    """The kernel's step against the oracle (both tolerance styles, the conv state exact, nothing outside the
    write set touched) and the stock step from the same state."""
    tp, batch = step.tp, step.batch
    ref_cache, stock_cache = clone_cache(step.cache), clone_cache(step.cache)
    got = step.kernel()
    ref = step.oracle(ref_cache)
    stock = step.stock(stock_cache)
    torch.cuda.synchronize()
    name = f"KDA step TP{tp} B{batch} (cluster {step.cluster})"
    live, owned = step.live, step.slots[step.live]

    assert got.dtype == torch.bfloat16 and got.shape == (batch, step.spec.proj)
    assert torch.isfinite(got).all(), f"{name}: non-finite output"
    assert not got[~live].any(), f"{name}: a NULL row's output is not zero"
    check_suite(got[live], ref[live], "kda_decode", f"{name} out vs oracle")
    out_rms, _ = check_rms(got[live], ref[live], "kda_decode", f"{name} out vs oracle")
    state, ref_state = step.cache.recurrent[owned.long()], ref_cache.recurrent[owned.long()]
    check_suite(state, ref_state, "kda_decode.state", f"{name} state vs oracle")
    state_rms, _ = check_rms(state, ref_state, "kda_decode_state", f"{name} state vs oracle")
    assert torch.equal(step.cache.conv, ref_cache.conv), f"{name}: the conv state differs from the oracle's"
    untouched(step.start.recurrent, step.cache.recurrent, owned, f"{name} recurrent state")
    untouched(step.start.conv, step.cache.conv, owned, f"{name} conv state")

    # The stock step from the same state: both within the tolerance of the oracle, so within twice it of each other;
    # the kernel keeps the f_b product in FP32 where stock rounds it to BF16, so its state is the closer one.
    stock_out_rms, _ = error_metrics(stock[live], ref[live])
    stock_state_rms, _ = error_metrics(stock_cache.recurrent[owned.long()], ref_state)
    vs_stock_out, vs_stock_out_peak = error_metrics(got[live], stock[live])
    vs_stock_state, _ = error_metrics(state, stock_cache.recurrent[owned.long()])
    print(
        f"METRIC {name}: stock vs oracle out rms_rel {stock_out_rms:.2e} state rms_rel {stock_state_rms:.2e}; "
        f"kernel vs stock out rms_rel {vs_stock_out:.2e} (peak {vs_stock_out_peak:.2e}), state {vs_stock_state:.2e}"
    )
    assert vs_stock_out <= 2 * RMS_TOL["kda_decode"].rms_rel, f"{name}: farther from stock than two tolerances"
    assert torch.equal(step.cache.conv, stock_cache.conv), f"{name}: the conv state differs from stock's"
    assert state_rms <= stock_state_rms + 1e-6, f"{name}: state farther from the oracle than stock's ({state_rms:.2e})"
    assert out_rms <= max(2 * stock_out_rms, 2e-3), f"{name}: output much farther from the oracle than stock's"


def test_a_batch_of_null_rows_writes_zeros_and_touches_nothing():
    step = Step(8, 4, seed=7)
    step.slots.copy_(torch.tensor([0, -1, 0, -3], dtype=torch.int32))
    step.live = step.slots > 0
    out = torch.full((4, step.spec.proj), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = kda_step_op.decode_step(step.spec, step.weights, step.packed, step.cache, step.slots, out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and not got.any(), "NULL rows must be written, with zeros"
    assert torch.equal(step.cache.conv, step.start.conv) and torch.equal(step.cache.recurrent, step.start.recurrent)
    print("METRIC KDA step NULL batch TP8 B4: zero output, caches bit-identical")


def test_int64_slot_tables_give_the_same_bits_as_int32():
    """The numerics suite passes int64 slot tables, the executor int32: one compile each, the same results."""
    a, b = Step(16, 8, seed=11), Step(16, 8, seed=11, slot_dtype=torch.int64)
    assert torch.equal(a.slots.long(), b.slots) and torch.equal(a.packed, b.packed)
    out_a, out_b = a.kernel(), b.kernel()
    torch.cuda.synchronize()
    assert torch.equal(out_a, out_b), "int32 and int64 slot tables give different outputs"
    assert torch.equal(a.cache.recurrent, b.cache.recurrent) and torch.equal(a.cache.conv, b.cache.conv)
    print("METRIC KDA step int64 slots TP16 B8: bit-equal to int32")


@pytest.mark.parametrize("tp, batch", [(8, 4), (16, 2), (8, 64)], ids=["tp8-b4", "tp16-b2", "tp8-b64"])
def test_chained_steps_accumulate_state_like_the_oracle(tp: int, batch: int):
    """Several steps back to back on the same cache (the state accumulates), launched one right after the other:
    with PDL each may start while the previous one runs, so this also checks that nothing of the state is read
    before griddepcontrol.wait."""
    steps = 6
    step = Step(tp, batch, seed=tp + batch)
    gen = torch.Generator().manual_seed(99)
    inputs = [projected_rows(step.weights.in_proj, (batch,), gen) for _ in range(steps)]  # all made before the chain
    ref_cache = clone_cache(step.cache)
    outs = [step.kernel(packed=x) for x in inputs]  # back to back in one stream
    refs = [step.oracle(ref_cache, packed=x) for x in inputs]
    torch.cuda.synchronize()
    name = f"KDA step chain of {steps} TP{tp} B{batch}"
    live, owned = step.live, step.slots[step.live].long()
    for i, (got, ref) in enumerate(zip(outs, refs, strict=True)):
        check_rms(got[live], ref[live], "kda_decode", f"{name} out {i}")
    check_suite(outs[-1][live], refs[-1][live], "kda_decode", f"{name} last out vs oracle")
    check_suite(step.cache.recurrent[owned], ref_cache.recurrent[owned], "kda_decode.state", f"{name} state")
    check_rms(step.cache.recurrent[owned], ref_cache.recurrent[owned], "kda_decode_state", f"{name} state")
    assert torch.equal(step.cache.conv, ref_cache.conv), f"{name}: the conv state differs from the oracle's"
    untouched(step.start.recurrent, step.cache.recurrent, step.slots[live], f"{name} recurrent state")


# --- CUDA graphs, determinism, the device counter -----------------------------------------------------------------


def test_graph_replay_equals_the_eager_step_and_the_counter_counts_every_launch():
    step = Step(8, 2, seed=3)
    out = torch.empty(2, step.spec.proj, dtype=torch.bfloat16, device=DEV)

    def run() -> Tensor:
        return kda_step_op.decode_step(step.spec, step.weights, step.packed, step.cache, step.slots, out)

    def restore() -> None:
        step.cache.conv.copy_(step.start.conv)
        step.cache.recurrent.copy_(step.start.recurrent)

    run()  # compiles
    restore()
    before = kda_step_op.launch_count()
    eager = run().clone()
    eager_state, eager_conv = step.cache.recurrent.clone(), step.cache.conv.clone()
    restore()
    again = run().clone()
    assert torch.equal(eager, again) and torch.equal(step.cache.recurrent, eager_state), "two eager runs differ"
    assert kda_step_op.launch_count() == before + 2, "the device counter missed an eager launch"

    graph = torch.cuda.CUDAGraph()
    restore()
    with torch.cuda.graph(graph):
        run()
    counted = kda_step_op.launch_count()  # capture launches nothing
    for _ in range(2):
        restore()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "the graph replay's output differs from the eager step"
        assert torch.equal(step.cache.recurrent, eager_state) and torch.equal(step.cache.conv, eager_conv)
    assert kda_step_op.launch_count() == counted + 2, "the device counter missed a launch inside a graph replay"
    print(f"METRIC KDA step graph TP8 B2: replays bit-equal to eager; device counter {before} -> {counted + 2}")


SPREAD = [b for b in BUILDS if b.plan.spread < b.plan.ctas_per_sm]  # the launches padded to spread their CTAs


def decode_cubin(plan: KdaStepPlan) -> tuple[bytes, str]:
    """The decode kernel's cubin for `plan` and its entry's name, compiled as the op compiles it."""
    from k3_decode.kernels.kda_step import compile_args
    from k3_decode.kernels.kda_step_group import step_kernel

    return compiled_cubin(step_kernel(plan), compile_args(plan))


@pytest.mark.parametrize("build", SPREAD, ids=[b.name for b in SPREAD])
def test_the_driver_fits_exactly_spread_ctas_of_the_decode_launch_on_an_sm(build: KdaStepBuild):
    """The launch's shared-memory request (KdaStepPlan.launch_smem_bytes) is what spreads a small grid over the
    SMs, and only the driver knows what it charges a CTA beside it: at aa5aabc the plan assumed 2 KiB, and two
    CTAs shared an SM where one was meant to (TP8 B1: 96 CTAs on 54 SMs in the phase trace). The occupancy
    calculator, given the compiled cubin, must fit `spread` CTAs with the padded request and resident_ctas without
    it (the padding, not the registers, is what limits). Unpadded, registers limit most plans (ctas_per_sm) and
    shared memory the smallest CTAs: TP16 B1's wide warps, 64 threads and 18.5 KiB, fit 11 an SM, not 16."""
    plan = build.plan
    padded, unpadded = ctas_per_sm(*decode_cubin(plan), plan.threads, [plan.launch_smem_bytes, plan.smem_bytes])
    print(
        f"METRIC KDA step {build.name}: {padded} CTAs per SM at {plan.launch_smem_bytes} B of shared memory "
        f"(spread {plan.spread}), {unpadded} at {plan.smem_bytes} B"
    )
    assert padded == plan.spread, f"{padded} CTAs fit an SM at the padded request, not {plan.spread}"
    assert unpadded == plan.resident_ctas, f"{unpadded} CTAs fit unpadded, not resident_ctas = {plan.resident_ctas}"


# 256 threads a CTA, 56.7 KB of shared memory; a capped launch's count is the spread test's
WIDE_WAVES = [b for b in WIDE_WARPS if b.plan.cluster == 2 and not b.plan.max_ctas_per_sm]


@pytest.mark.parametrize("build", WIDE_WAVES, ids=[b.name for b in WIDE_WAVES])
def test_the_driver_holds_resident_ctas_of_a_wide_warp_plan(build: KdaStepBuild):
    """KdaStepPlan.resident_ctas, which wave_requests (the lean start's first wave, the warming's distance) rests on:
    four CTAs of wide warps an SM at either budget, shared memory and not the registers limiting at 1536 threads.
    The driver's occupancy calculator, given the compiled cubin and the plan's shared memory, must agree."""
    plan = build.plan
    (fits,) = ctas_per_sm(*decode_cubin(plan), plan.threads, [plan.smem_bytes])
    print(f"METRIC KDA step {build.name}: {fits} CTAs per SM at {plan.smem_bytes} B of shared memory")
    assert fits == plan.resident_ctas == 4, f"{fits} CTAs fit an SM, the plan counts {plan.resident_ctas}"


# --- timing (measured and printed; speed targets belong in benchmarks) ----------------------------------------------


def weight_copy(weights: KdaWeights) -> KdaWeights:
    """The step's own weights in new memory (the projections shared: the step does not read them)."""
    small = {name: getattr(weights, name).clone() for name in ("f_b", "conv", "a_log", "dt_bias", "o_norm")}
    return dataclasses.replace(weights, **small)


# cluster (None: the plan's), resident threads per SM, warm_ahead, requests per CTA; None: the plan's choice
Variant = tuple[int | None, int | None, bool | None, int | None]


def time_batch(
    tp: int, batch: int, variants: tuple[Variant, ...] = ((None, None, None, None),)
) -> tuple[list[float], float, KdaStepPlan, int, float]:
    """([CuTe seconds per call for each of `variants`], stock seconds per call, the served plan, rotating copies,
    bytes per call) at one batch; a variant's None is the plan's choice."""
    spec, weights = spec_for(tp), kda_weights(tp)
    gen = torch.Generator().manual_seed(batch)
    state_bytes = batch * spec.heads * 128 * 128 * 4 * 2  # read and written
    copies = max(2, math.ceil(3 * torch.cuda.get_device_properties(DEV).L2_cache_size / state_bytes))
    caches = [random_kda_cache(spec, batch + 1, 0, gen, DEV) for _ in range(copies)]
    small = [weight_copy(weights) for _ in range(copies)]
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device=DEV)
    packed = projected_rows(weights.in_proj, (batch,), gen)
    out = torch.empty(batch, spec.proj, dtype=torch.bfloat16, device=DEV)

    def cute(cluster: int | None, resident: int | None, warm: bool | None, group: int | None) -> Callable[[int], None]:
        choice = {"cluster": cluster, "resident_threads": resident, "warm_ahead": warm, "requests_per_cta": group}

        def call(i: int) -> None:  # None leaves a choice to the plan (KdaStepPlan.for_shape)
            cache = caches[i % copies]
            kda_step_op.decode_step(spec, small[i % copies], packed, cache, slots, out, **choice)

        return call

    def stock(i: int) -> None:
        sk.kda_decode_step(spec, small[i % copies], packed, caches[i % copies], slots, validate=False)

    calls = 2 * copies
    t_cute = [_graph_seconds_per_call(cute(*variant), calls) for variant in variants]
    t_stock = _graph_seconds_per_call(stock, calls)
    moved = state_bytes + batch * spec.conv_channels * 3 * 2 * 2 + spec.proj * 128 * 2
    return t_cute, t_stock, kda_step_op.plan_for(spec, packed, slots), copies, moved


@pytest.mark.parametrize("tp", [8, 16])
def test_timing_against_the_stock_step(tp: int):
    """Per call in CUDA-graph replays, each call on its own cache and weights copy (rotating over enough of them that
    the state and the weights come from HBM, as in decode, where ~90 other layers run in between), the packed row
    shared (it is in L2 in decode too). Stock is the cuBLAS f_b GEMM plus the Triton kernel on the same inputs."""
    slow = []
    for batch in sorted({b.plan.batch for b in BUILDS}):
        (t_cute,), t_stock, plan, copies, moved = time_batch(tp, batch)
        torch.cuda.empty_cache()
        print(
            f"METRIC KDA step timing TP{tp} B{batch} ({plan.tag}): CuTe {t_cute * 1e6:.2f} us "
            f"({moved / t_cute / 1e12:.2f} TB/s), stock {t_stock * 1e6:.2f} us (f_b GEMM + Triton), "
            f"CuTe / stock {t_cute / t_stock:.2f}, {copies} rotating caches"
        )
        if t_cute > 2 * t_stock:  # loose: a kernel twice as slow as the two launches it replaces is a regression
            slow.append(f"B{batch}: {t_cute * 1e6:.1f} vs {t_stock * 1e6:.1f} us")
    assert not slow, f"TP{tp}: the fused step is more than twice as slow as stock at {', '.join(slow)}"


# K3_STEP_TIMED_BATCHES ("16 32 64") times only those batches: a short GPU session measures where the variants differ.
TIMED_BATCHES = tuple(int(b) for b in os.environ.get("K3_STEP_TIMED_BATCHES", "1 2 4 8 16 32 64").split())
CLUSTER_MARGIN = 1.10  # the plan's cluster may be this much slower than the fastest before the test calls it wrong


@pytest.mark.parametrize("tp", [8, 16])
def test_the_plan_picks_a_cluster_within_ten_percent_of_the_fastest(tp: int):
    """Every cluster at both register budgets (1024 and 1536 threads per SM), each also warming the next wave where
    its grid runs in more than one, at every batch, per call as above (the same graph method, rotating caches), side
    by side in one process. Fails where the served plan (KdaStepPlan.for_shape's cluster, with kda_step_choice.toml's
    budget and warming) is more than CLUSTER_MARGIN slower than the fastest of them, so a choice that measurement
    contradicts cannot stand.
    With K3_STEP_CLUSTER_RESULTS set, appends each batch's figures to that JSON file (a new file per run: one of
    another commit or GPU is refused; benchmarks/kda_step_variants.py prints its tables and the choice rules it
    supports); a variant's label is c<cluster> and the plan's variant_suffix (/t1536, /warm, /r2)."""
    from benchmarks.kda_step_variants import append_rows
    from benchmarks.stock_h200 import environment

    results = os.environ.get("K3_STEP_CLUSTER_RESULTS")
    env = environment() if results else {}
    wrong = []
    for batch in TIMED_BATCHES:
        variants = tuple(
            (c, r, w, 1)
            for r in RESIDENT_CHOICES
            for c in CLUSTERS
            for w in (False, True)
            if not w or step_plan(tp, batch, cluster=c, resident_threads=r).wave_requests < batch
        )
        if batch >= 16:  # two requests a cluster at 1024 threads: from where the grid fills the SMs twice
            variants += tuple((c, RESIDENT_THREADS, False, 2) for c in CLUSTERS)
        named = [
            step_plan(tp, batch, cluster=c, resident_threads=r, warm_ahead=w, requests_per_cta=g)
            for c, r, w, g in variants
        ]
        labels = [f"c{plan.cluster}{plan.variant_suffix}" for plan in named]
        times, _, chosen, copies, moved = time_batch(tp, batch, variants)
        torch.cuda.empty_cache()
        us = dict(zip(labels, (t * 1e6 for t in times), strict=True))
        best, plan = min(us, key=us.__getitem__), f"c{chosen.cluster}{chosen.variant_suffix}"
        shown = ", ".join(f"{k} {v:.2f} us" for k, v in us.items())
        print(f"METRIC KDA step clusters TP{tp} B{batch}: {shown}; plan {plan}, fastest {best}")
        row = {
            "tp": tp,
            "batch": batch,
            "plan": plan,
            "fastest": best,
            "us": {k: round(v, 3) for k, v in us.items()},
            "bytes": moved,
            "rotating_caches": copies,
        }
        if results:  # per batch: a run stopped by its time limit keeps what it measured; another run's file refused
            append_rows(results, [row], env)
        if us[plan] > CLUSTER_MARGIN * us[best]:
            wrong.append(f"B{batch}: {plan} {us[plan]:.1f} vs {best} {us[best]:.1f} us")
    assert not wrong, (
        f"TP{tp}: the plan is more than {CLUSTER_MARGIN - 1:.0%} slower than the fastest at {', '.join(wrong)} — "
        "fix the cluster rule (KdaStepPlan.for_shape) or kda_step_choice.toml"
    )
