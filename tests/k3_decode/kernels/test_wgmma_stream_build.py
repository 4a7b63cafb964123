"""The TMA + wgmma weight stream (wgmma_stream.py) built for sm_90a on the CPU: every plan the GPU test runs compiles
with no local memory, within its register budget, with the shared memory its plan states, and its PTX holds the
instructions of the design (wgmma from shared memory, TMA tensor copies, mbarrier waits, and for a K split the
cluster's distributed-shared-memory stores and barriers). The plan's refusals are checked one rule at a time, and
the instruction check is shown to fail on a kernel without them (the old mma.sync stream)."""

from __future__ import annotations

import dataclasses
import re
from functools import cache

import pytest

pytest.importorskip("cutlass", reason="CuTe DSL is not installed: pip install 'k3gate[cutedsl]'")

from k3_decode.kernels.wgmma_stream_plan import MAX_SMEM, WgmmaStreamPlan

REGISTERS_PER_SM = 65536
MAX_REGISTERS = (
    128  # the accumulators are N / 2 FP32 per thread (32 at B = 64); far more would mean a schedule gone wrong
)

# (rows, k, batch, m_rows, k_tile, stages, k_splits): the K3 shapes, a few ring depths, both M tiles and a wide k
# tile, and the 3216 x 7168 shape with K over clusters of 2 and 4.
PLANS = [
    *(WgmmaStreamPlan(7168, 1536, b) for b in (16, 32, 64)),
    *(WgmmaStreamPlan(7168, 768, b) for b in (16, 32, 64)),
    WgmmaStreamPlan(7168, 1536, 64, stages=2),
    WgmmaStreamPlan(7168, 1536, 64, stages=8),
    WgmmaStreamPlan(7168, 1536, 64, m_rows=128, stages=6),
    WgmmaStreamPlan(7168, 768, 32, k_tile=128, stages=3),
    WgmmaStreamPlan(3216, 7168, 64, stages=6),
    WgmmaStreamPlan(3216, 7168, 64, stages=4, k_splits=2),
    WgmmaStreamPlan(3216, 7168, 64, stages=4, k_splits=4),
    WgmmaStreamPlan(3216, 7168, 16, stages=6, k_splits=4),
    # batches whose N rounds up to 32 and 48: an N of 24 or 40 aborted the compile
    WgmmaStreamPlan(3216, 7168, 20, stages=8, k_splits=2),
    WgmmaStreamPlan(3216, 7168, 40, stages=8, k_splits=2),
]


def plan_id(p: WgmmaStreamPlan) -> str:
    return f"r{p.rows}-k{p.k}-b{p.batch}-m{p.m_rows}-kt{p.k_tile}-s{p.stages}-ks{p.k_splits}"


@cache
def build(plan: WgmmaStreamPlan):
    """PTX, cubin and SASS of one plan, compiled once per test session."""
    from k3_decode.kernels import cutedsl
    from k3_decode.kernels.wgmma_stream import WgmmaStream, compile_args

    return cutedsl.compile_artifacts(WgmmaStream(plan), compile_args(plan), "sm_90a")


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text, re.M))


def expected_ptx(plan: WgmmaStreamPlan) -> dict[str, int]:
    """Instruction counts in the code (not executed): the k-tile loops are rolled, the epilogue unrolled."""
    mmas = plan.k_tile // 16  # one k tile per loop body, of 16 columns a wgmma
    groups = plan.live_groups  # rank 0 reads (and stores) only the groups of 8 columns within the batch
    split = plan.k_splits > 1
    columns = (2 + 2 * plan.ahead) * plan.k_tile // 64
    return {
        rf"wgmma\.mma_async\.sync\.aligned\.m64n{plan.n}k16\.f32\.bf16\.bf16": mmas,
        r"wgmma\.fence\.sync\.aligned": 1,
        r"wgmma\.commit_group\.sync\.aligned": 1,
        r"wgmma\.wait_group\.sync\.aligned\s+1;": 1,  # one group in flight in the loop
        r"wgmma\.wait_group\.sync\.aligned\s+0;": 1,  # none after it
        # W and x, one copy per 128-byte swizzle column of the k tile
        # (the ring's first k tiles unrolled: W before the wait, x after it; then both in the loop)
        r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes": columns,
        r"mbarrier\.arrive\.expect_tx\.shared\.b64": 1 + plan.ahead,  # a stage armed for both copies' bytes
        r"mbarrier\.try_wait\.parity\.shared\.b64": 2 + plan.ahead,  # consumers wait full, the producer empty
        r"mbarrier\.arrive\.shared\.b64": 1,  # a consumer warp frees a stage
        r"st\.global\.b16": plan.stored_values,  # the transposed, masked stores: one per accumulator within B
        r"mapa\.shared::cluster": int(split),
        # a peer's partial tile into rank 0, every group (remote stores are never dead code)
        r"st\.shared::cluster\.v4\.b32": plan.acc_values // 4 if split else 0,
        r"ld\.shared\.v4\.b32": (plan.k_splits - 1) * groups,  # rank 0 reading them
        r"barrier\.cluster\.arrive\.relaxed;": int(split),  # after the barrier inits
        r"barrier\.cluster\.arrive;": int(split),  # release: the partials are in place
        r"barrier\.cluster\.wait;": 2 if split else 0,
        r"griddepcontrol\.wait;": 2,  # the producer after its W prologue, the consumers before their first wait
        r"griddepcontrol\.launch_dependents;": 2,  # right after each branch's wait
        r"atom\.global\.add": 1,  # the launch counter, one thread of the grid
        # nothing else touches global memory but TMA
        r"^\s*(?:@!?%p\d+\s+)?(?:atom|red|ld\.global|st\.global\.(?!b16))": 1,
    }


def ahead_problems(ptx: str, plan: WgmmaStreamPlan) -> list[str]:
    """Programmatic dependent launch: before the first dependency wait exactly the W prologue is in flight (one TMA
    copy per swizzle column of each of the ring's first k tiles), and nothing of x: x is the previous kernel's
    output, and a copy of it issued before the wait could read it half-written."""
    head = ptx.split("griddepcontrol.wait;")[0]
    copies = count(r"cp\.async\.bulk\.tensor", head)
    want = plan.ahead * plan.k_tile // 64
    return [] if copies == want else [f"{copies} TMA copies before the wait, want the W prologue's {want}"]


def ptx_problems(ptx: str, plan: WgmmaStreamPlan) -> list[str]:
    """Each expected instruction count the PTX does not meet, as 'pattern: found N, want M'."""
    found = {pattern: count(pattern, ptx) for pattern in expected_ptx(plan)}
    return [
        f"{pattern}: found {found[pattern]}, want {want}"
        for pattern, want in expected_ptx(plan).items()
        if found[pattern] != want
    ]


# --- the plan (no CuTe DSL) -----------------------------------------------------------------------------------


def test_plan_numbers():
    p = WgmmaStreamPlan(3216, 7168, 20, k_splits=4)
    assert (p.n, p.m_tiles, p.ctas, p.threads, p.k_tiles) == (32, 51, 204, 160, 28)
    assert p.stage_bytes == (64 + 32) * 64 * 2 and p.acc_values == 16
    assert p.smem_bytes == 1024 + 4 * p.stage_bytes + 3 * 64 * 32 * 4
    # N: multiples of 16 (an odd multiple of 8 aborts the compile)
    n = [WgmmaStreamPlan(3216, 7168, b).n for b in (9, 16, 17, 33, 48, 49, 64)]
    assert n == [16, 16, 32, 48, 48, 64, 64]
    wide = WgmmaStreamPlan(7168, 1536, 64, m_rows=128)
    assert (wide.consumer_groups, wide.threads, wide.ctas, wide.k_tiles) == (2, 288, 56, 24)


@pytest.mark.parametrize("plan", PLANS, ids=plan_id)
def test_every_built_plan_is_accepted(plan):
    assert plan.problem() is None and plan.smem_bytes <= MAX_SMEM


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"rows": 0}, "rows must be at least 1"),
        ({"batch": 8}, "batch must be 9..64"),
        ({"batch": 65}, "batch must be 9..64"),
        ({"m_rows": 96}, "m_rows must be 64 or 128"),
        ({"k_tile": 32}, "k_tile must be 64, 128"),
        ({"k_tile": 320, "k": 7040}, "k_tile must be 64, 128"),
        ({"k_splits": 0}, "k_splits must be 1..8"),
        ({"k_splits": 16}, "k_splits must be 1..8"),
        ({"stages": 1}, "stages must be at least 2"),
        ({"k": 7168 + 32}, "must be a positive multiple of k_tile \\* k_splits = 64"),
        ({"k_splits": 8, "k": 768}, "must be a positive multiple of k_tile \\* k_splits = 512"),
        ({"stages": 15}, "bytes of shared memory, over the 232448"),
        ({"stages": 12, "k_splits": 4}, "bytes of shared memory"),  # the partials count too (12 stages alone fit)
    ],
)
def test_problem_names_each_rule(changes, reason):
    plan = dataclasses.replace(WgmmaStreamPlan(3216, 7168, 64), **changes)
    why = plan.problem()
    assert why is not None and re.search(reason, why), why
    assert "\n" not in why


def test_the_kernel_refuses_a_plan_with_a_problem():
    from k3_decode.kernels.wgmma_stream import WgmmaStream

    with pytest.raises(ValueError, match=r"batch must be 9\.\.64"):
        WgmmaStream(WgmmaStreamPlan(7168, 1536, 65))


# --- the builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", PLANS, ids=plan_id)
def test_build_has_no_spills_and_fits_its_budget(plan):
    from harness.kernels_cmd import cubin_resources

    art = build(plan)
    assert re.search(r"^\.target sm_90a$", art.ptx, re.M)
    assert re.search(rf"^\.reqntid {plan.threads}, 1, 1$", art.ptx, re.M)
    (res,) = cubin_resources(art.cubin).values()
    assert res.frame_bytes == 0 and res.stack_bytes == 0, res
    assert not re.search(r"\b(LDL|STL)\b", art.sass), "spills to local memory"
    assert res.registers <= MAX_REGISTERS and res.registers * plan.threads <= REGISTERS_PER_SM, res


@pytest.mark.parametrize("plan", PLANS, ids=plan_id)
def test_build_holds_the_designs_instructions(plan):
    art = build(plan)
    assert ptx_problems(art.ptx, plan) == []
    # The SASS agrees: Hopper's tensor-core and TMA instructions, not a fallback.
    assert count(rf"HGMMA\.64x{plan.n}x16\.F32\.BF16", art.sass) == plan.k_tile // 16
    assert count(r"UTMALDG\.2D", art.sass) == (2 + 2 * plan.ahead) * plan.k_tile // 64
    assert ahead_problems(art.ptx, plan) == []
    assert count(r"\bHMMA\b", art.sass) == 0


def test_the_instruction_check_fails_on_the_old_mma_sync_stream():
    """The check applied to kda_in_proj_mma's PTX (mma.sync, W through registers) must name the missing wgmma and TMA
    instructions: the check can fail."""
    from k3_decode.kernels import cutedsl
    from k3_decode.kernels.kda_in_proj_mma import KdaInProjKernelMma, compile_args
    from k3_decode.kernels.kda_in_proj_mma_plan import InProjMmaPlan

    old = InProjMmaPlan.for_shape(7168, 1536, 64)
    ptx = cutedsl.compile_artifacts(KdaInProjKernelMma(old), compile_args(old), "sm_90a").ptx
    assert "mma.sync.aligned.m16n8k16" in ptx
    failed = " | ".join(ptx_problems(ptx, WgmmaStreamPlan(7168, 1536, 64)))
    assert "wgmma\\.mma_async" in failed and "cp\\.async\\.bulk\\.tensor" in failed, failed


def test_the_instruction_check_fails_when_the_cluster_reduction_is_missing():
    """A plain build checked as if it split K: the check names the DSMEM stores and cluster barriers it lacks."""
    plain = WgmmaStreamPlan(3216, 7168, 64, stages=6)
    failed = " | ".join(ptx_problems(build(plain).ptx, WgmmaStreamPlan(3216, 7168, 64, stages=6, k_splits=2)))
    for missing in ("mapa", "st\\.shared::cluster", "barrier\\.cluster\\.wait"):
        assert missing in failed, failed


def test_the_prologue_check_fails_when_x_is_copied_before_the_wait():
    """Broken case: the same code with its first dependency wait gone, as if x's first copies went out before it."""
    plan = PLANS[2]
    ptx = build(plan).ptx.replace("griddepcontrol.wait;", "", 1)
    (problem,) = ahead_problems(ptx, plan)
    assert f"want the W prologue's {plan.ahead}" in problem


def _judged(build, artifacts) -> list[str]:
    """The names of the checks `artifacts` fail against expectations.toml's rules for the wgmma projection."""
    import tempfile
    from pathlib import Path

    from harness.kernels_cmd import judge, parse_expectations
    from k3_decode.kernels.builds import K3_KERNEL_BUILDS

    expect = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    result = judge(build, "sm_90a", artifacts, "", expect["kda_in_proj_wgmma"], Path(tempfile.mkdtemp()))
    return sorted(c.name for c in result.checks if not c.passed)


def test_the_served_tiling_builds_pass_their_expectations():
    from k3_decode.kernels.builds import K3_KERNEL_BUILDS, KdaInProjWgmmaBuild

    builds = [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaInProjWgmmaBuild)]
    assert {(b.tp, b.plan.batch) for b in builds} == {(tp, b) for tp in (8, 16) for b in (16, 17, 32, 33, 64)}
    for b in builds:
        assert _judged(b, b.compile("sm_90a")) == [], b.name


def test_the_expectations_fail_the_mma_sync_stream_in_its_place():
    """Broken case: the tensor-core (mma.sync) projection's code judged as the wgmma build fails the rules on the
    warpgroup MMAs, the tile copies (all and before the wait), the waits, the fallback and the registers."""
    from k3_decode.kernels.builds import K3_KERNEL_BUILDS, KdaInProjMmaBuild, KdaInProjWgmmaBuild

    wgmma = next(b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaInProjWgmmaBuild))
    mma = next(
        b
        for b in K3_KERNEL_BUILDS.builds("sm_90a")
        if isinstance(b, KdaInProjMmaBuild) and (b.tp, b.plan.batch) == (wgmma.tp, wgmma.plan.batch)
    )
    failed = [name.replace("\\", "") for name in _judged(wgmma, mma.compile("sm_90a"))]
    assert failed == [
        "ptx 'cp.async.bulk.tensor.2d.shared::cta.global'",
        "ptx 'cp.async.bulk.tensor.2d.shared::cta.global' before 'griddepcontrol.wait;'",
        "ptx 'griddepcontrol.launch_dependents;'",
        "ptx 'griddepcontrol.wait;'",
        "registers",
        "sass 'bHGMMA.64xd+x16.F32.BF16b'",
        "sass 'bHMMAb|bLDLb|bSTLb'",
    ], failed
