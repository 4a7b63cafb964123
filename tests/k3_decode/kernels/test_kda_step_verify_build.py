"""The fused KDA verify step (KdaStepKernel.verify, q <= 8 tokens per request): its plan, builds, launcher checks and
provider binding (fast, no CuTe DSL), and real sm_90a builds of one shape per cluster size with their PTX, SASS and
cubin checked, two kernels without a synchronization that must fail, and the launcher binding every argument (slow;
needs CuTe DSL). `k3gate kernels build --arch sm_90a --match 'kda_step_verify/*'` compiles all 22."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from harness.kernels_cmd import cubin_resources, parse_expectations, select_builds
from k3_decode.config import K3
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, K3KernelBuilds, KdaStepVerifyBuild
from k3_decode.kernels.kda_step_plan import (
    CLUSTERS,
    CONV_WIDTH,
    GATE_RANK,
    HEAD_DIM,
    MAX_TOKENS,
    RESIDENT_THREADS,
    KdaStepPlan,
    KdaVerifyPlan,
    knob_alone,
)
from k3_decode.reference.kda import KdaSpec
from tests.k3_decode.kernels.helpers import assert_launch_reaches_the_driver, build_command, needs_cutedsl
from tests.k3_decode.kernels.test_kda_step_build import STATIC_SMEM

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
SMEM_PER_SM = 228 * 1024  # an H100/H200 SM's shared memory; the driver reserves 1 KiB per CTA
BUILT = {  # (tokens per request, requests) built per TP: requests x q <= 64 tokens
    (2, 1), (2, 4), (2, 8), (2, 16), (4, 1), (4, 4), (4, 8), (4, 16), (8, 1), (8, 4), (8, 8),
}  # fmt: skip


def verify_builds() -> list[KdaStepVerifyBuild]:
    return [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaStepVerifyBuild)]


# --- the plan -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("batch", [1, 3, 4, 8, 16])
def test_a_verify_plan_is_the_decode_plan_of_its_requests(tp, batch):
    """The same geometry as the plain decode step for that many requests (four rows a warp, every warp's conv: the
    served wide warps and lean conv give its bits), so every per-token computation is the decode kernel's."""
    shard = K3.shard(tp)
    step = KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, batch, **knob_alone())
    for q in (1, 2, 5, 8):
        plan = KdaVerifyPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, batch, tokens=q)
        assert (plan.cluster, plan.rows_per_cta, plan.threads, plan.ctas, plan.sections) == (
            step.cluster,
            step.rows_per_cta,
            step.threads,
            step.ctas,
            step.sections,
        )
        assert plan.conv_runs(1, 0) == step.conv_runs(1, 0) and plan.weight_bytes == step.weight_bytes
        assert plan.token_bytes == step.packed_bytes and plan.packed_bytes == q * step.packed_bytes
        assert plan.columns == KdaSpec.for_rank(K3, tp).conv_taps(q) == 2 + q  # vLLM's row for q - 1 spec tokens
        assert plan != step and plan.tag == f"h{shard.kda_heads}/b{batch}/q{q}/c{step.cluster}"


def test_the_verify_plan_refuses_what_the_kernel_cannot_take():
    for q in (0, MAX_TOKENS + 1):
        with pytest.raises(ValueError, match=r"1\.\.8 tokens"):
            KdaVerifyPlan(12, 6288, 1, 8, tokens=q)
    with pytest.raises(ValueError, match="num_accepted is int32 or int64"):
        KdaVerifyPlan(12, 6288, 1, 8, tokens=2, accepted_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KdaVerifyPlan(12, 6288, 1, 8)  # type: ignore[call-arg]  # tokens has no default
    with pytest.raises(ValueError, match="cluster of"):
        KdaVerifyPlan(12, 6288, 1, 3, tokens=2)  # the decode plan's checks hold too


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("q", [1, 2, 4, 8])
def test_a_verify_cta_fits_and_its_copies_fill_exactly_its_barriers(cluster, q):
    """Each transaction barrier completes only on its armed bytes (a drift hangs the kernel): every token's sections,
    the conv row's T columns of the three channel runs, q decays and q x 32 partials; everything 16-byte sized."""
    plan = KdaVerifyPlan(12, 6288, 4, cluster, tokens=q)
    rows = plan.rows_per_cta
    channels = sum(n for _, _, n in plan.conv_runs(0, cluster - 1))
    assert channels == plan.conv_local and all(n % 8 == 0 for _, _, n in plan.conv_runs(0, cluster - 1))
    assert plan.packed_bytes == q * (channels * 2 + GATE_RANK * 2 + rows * 2)
    assert plan.tap_bytes == channels * (2 + q) * 2 and plan.state_bytes == rows * HEAD_DIM * 4
    assert plan.decay_bytes == q * HEAD_DIM * 4 == q * cluster * plan.warps * 2 * 8  # 8-byte pairs per warp
    assert plan.norm_bytes == q * plan.slots * 4 and plan.slots == 32
    sizes = [plan.token_bytes, plan.tap_bytes, plan.state_bytes, rows * GATE_RANK * 2, channels * CONV_WIDTH * 2]
    sizes += [8 * plan.columns * 2, rows * 2, GATE_RANK * 2]  # a lane's conv row, the gate and f_a copies
    assert all(size % 16 == 0 for size in sizes), sizes
    assert plan.token_bytes % 16 == 0  # token t's sections start 16-byte aligned in shared memory
    # Registers: the decode kernel's budget (64 per thread at 32 warps per SM); shared memory may hold fewer CTAs.
    assert plan.threads * plan.ctas_per_sm == RESIDENT_THREADS
    assert 1 <= plan.resident_ctas <= plan.ctas_per_sm
    assert plan.resident_ctas * (plan.smem_bytes + STATIC_SMEM + 1024) <= SMEM_PER_SM
    assert (
        plan.resident_ctas == plan.ctas_per_sm
        or (plan.resident_ctas + 1) * (plan.smem_bytes + STATIC_SMEM + 1024) > SMEM_PER_SM
    )
    if cluster < 8 or q <= 2:
        assert plan.resident_ctas == plan.ctas_per_sm  # only clusters of 8 at q >= 4 run short of shared memory


# --- what is built ----------------------------------------------------------------------------------------------


def test_builds_are_every_tp_tokens_and_batch_up_to_64_tokens():
    builds = verify_builds()
    assert len(builds) == 22 == 2 * len(BUILT)
    assert {(b.tp, b.plan.tokens, b.plan.batch) for b in builds} == {(tp, q, n) for tp in (8, 16) for q, n in BUILT}
    assert all(b.plan.batch * b.plan.tokens <= 64 for b in builds)
    assert {b.name for b in builds} == {f"kda_step_verify/tp{b.tp}/b{b.plan.batch}/q{b.plan.tokens}" for b in builds}
    assert {b.kernel for b in builds} == {"kda_step_verify"}
    assert {b.tp: (b.plan.heads, b.plan.rows) for b in builds} == {8: (12, 6288), 16: (6, 3216)}
    assert {b.plan.cluster for b in builds} == set(CLUSTERS)  # every cluster size is built
    assert {(b.plan.slot_dtype, b.plan.accepted_dtype) for b in builds} == {("int32", "int32")}
    assert K3_KERNEL_BUILDS.kda_step_verify_builds() == builds


def test_verify_build_tags_count_what_the_code_must_hold():
    tags = {b.name: b.tags for b in verify_builds()}
    q8 = tags["kda_step_verify/tp8/b1/q8"]
    assert (q8["cluster"], q8["threads"], q8["ctas_per_sm"], q8["resident_ctas"], q8["columns"]) == (8, 128, 8, 5, 10)
    copies = ("weight_copies", "packed_copies", "tap_copies", "state_copies")
    assert tuple(q8[k] for k in copies) == (4, 40, 3, 1) and q8["prefetches"] == 4
    assert (q8["early_loads"], q8["late_loads"], q8["waits"], q8["pushes"]) == (7, 5, 8, 24)
    assert (q8["state_stores"], q8["tap_stores"], q8["out_stores"], q8["shuffles"]) == (32, 10, 16, 456)
    q2 = tags["kda_step_verify/tp16/b16/q2"]
    assert (q2["cluster"], q2["threads"], q2["ctas"], q2["packed_copies"], q2["shuffles"]) == (2, 512, 192, 10, 114)


def test_expectations_judge_every_verify_build():
    expectations = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    builds = select_builds(K3_KERNEL_BUILDS, "sm_90a", expectations, "kda_step_verify/*")  # every named tag exists
    assert len(builds) == 22
    verify = expectations["kda_step_verify"]
    assert verify.max_registers == 64 and verify.max_frame_bytes == 0 and len(verify.rules) >= 40


def test_a_build_table_the_model_cannot_shard_is_an_error(monkeypatch):
    table = K3_KERNEL_BUILDS.table | {"kda_step_verify": K3_KERNEL_BUILDS.table["kda_step_verify"] | {"tp": [7]}}
    builds = K3KernelBuilds()
    monkeypatch.setattr(K3KernelBuilds, "table", table)
    with pytest.raises(ValueError, match=r"builds\.toml kda_step_verify\.tp"):
        builds.kda_step_verify_builds()


# --- the launcher and the provider (torch, no GPU) ----------------------------------------------------------------


def _verify_inputs(q: int = 2, batch: int = 2):
    import torch

    from k3_decode.reference.kda import KdaCache

    spec = KdaSpec.for_rank(K3, 16)
    packed = torch.zeros(batch, q, spec.in_proj_rows, dtype=torch.bfloat16)
    cache = KdaCache(torch.zeros(5, spec.conv_channels, 2 + q, dtype=torch.bfloat16), torch.zeros(5, 6, 128, 128))
    slots = torch.ones(batch, q, dtype=torch.int32)
    return spec, packed, cache, slots, torch.ones(batch, dtype=torch.int32)


@needs_torch
def test_the_verify_launcher_refuses_what_the_kernel_cannot_take():
    import torch

    from k3_decode.kernels import kda_step_op

    spec, packed, cache, slots, accepted = _verify_inputs()
    with pytest.raises(ValueError, match="CUDA device"):
        kda_step_op.verify_step(spec, None, packed, cache, slots, accepted)
    with pytest.raises(ValueError, match=r"\[B, q\] int32 or int64 tensor with q in 1\.\.8"):
        kda_step_op.verify_step(spec, None, packed, cache, slots[:, 0], accepted)
    with pytest.raises(ValueError, match=r"q in 1\.\.8"):
        kda_step_op.verify_step(spec, None, packed, cache, torch.ones(2, 9, dtype=torch.int32), accepted)
    with pytest.raises(ValueError, match="num_accepted must be a 1-d int32 or int64"):
        kda_step_op.verify_step(spec, None, packed, cache, slots, accepted.float())


def _bind_anywhere(monkeypatch):
    """Lets the provider bind on this machine: its device check is what needs a GPU, the binding itself does not."""
    from k3_decode.kernels import providers

    monkeypatch.setattr(providers, "_check_target", lambda target, what: None)


@needs_torch
def test_the_kda_step_provider_binds_exactly_the_calls_the_runner_makes(monkeypatch):
    """The runner makes kda_decode on decode steps and kda_verify on verify steps (executor RUNNER_CALLS): the
    provider binds both, as the executor's bind check demands, kda_verify to the verify launcher; with the verify
    call taken out of RUNNER_CALLS it binds kda_decode alone; a call of op kda it has no kernel for is a bind error,
    not a silent stock call."""
    import torch

    from k3_decode.executor import executor
    from k3_decode.executor.executor import ProviderTarget
    from k3_decode.kernels import kda_step_op, providers

    pending = next(p for p in providers.PROVIDERS if p.op == "kda")
    target = ProviderTarget(K3, 16, 0, torch.device("cpu"))
    _bind_anywhere(monkeypatch)
    side, calls = executor.RUNNER_CALLS["kda"]
    bound = pending.bind(target)
    assert sorted(bound) == ["kda_decode", "kda_verify"]
    seen = []
    monkeypatch.setattr(kda_step_op, "verify_step", lambda *args: seen.append(args) or "out")
    spec, packed, cache, slots, accepted = _verify_inputs()
    assert bound["kda_verify"](packed, "weights", cache, slots, accepted) == "out"  # the stock method's signature
    ((got_spec, weights, got_packed, got_cache, got_slots, got_accepted),) = seen
    assert got_spec == spec and weights == "weights" and got_cache is cache
    assert got_packed.is_contiguous() and torch.equal(got_slots, slots) and torch.equal(got_accepted, accepted)

    decode_only = {c: ops for c, ops in calls.items() if c != "kda_verify"}
    monkeypatch.setitem(executor.RUNNER_CALLS, "kda", (side, decode_only))
    assert list(pending.bind(target)) == ["kda_decode"]

    monkeypatch.setitem(executor.RUNNER_CALLS, "kda", (side, {**calls, "kda_prefill": ("kda",)}))
    with pytest.raises(providers.ProviderBindError, match=r"\['kda_prefill'\]"):
        pending.bind(target)


@needs_torch
def test_the_stock_verify_method_has_the_signature_the_provider_binds():
    import inspect

    from k3_decode.stock.attention_ops import StockAttentionOps

    params = list(inspect.signature(StockAttentionOps.kda_verify).parameters)
    assert params == ["self", "packed", "weights", "cache", "slots", "num_accepted"]


# --- the real builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------


@pytest.mark.slow
@needs_cutedsl
def test_one_verify_build_per_cluster_compiles_and_meets_its_expectations(tmp_path):
    out = tmp_path / "out"
    match = "kda_step_verify/tp8/b[148]/q8"
    proc = build_command(tmp_path, "--out", str(out), "--json", "--jobs", "2", "--match", match)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["subjects"]["K3_KERNEL_BUILDS"]
    assert report["ok"] and sorted(b["tags"]["cluster"] for b in report["builds"]) == [2, 4, 8]
    assert all(b["ok"] and len(b["checks"]) >= 45 for b in report["builds"])
    for b in report["builds"]:
        name, tags = b["build"], b["tags"]
        ptx = (out / name / "kernel.ptx").read_text()
        sass = (out / name / "kernel.sass").read_text()
        ((entry, res),) = cubin_resources((out / name / "kernel.cubin").read_bytes()).items()
        # One op, one kernel name: the ledger, the profiler and the sanitizer know it as the decode kernel's.
        assert "KdaStepKernel" in entry and "verify_kernel" in entry, entry
        assert res.frame_bytes == 0 and not re.search(r"\b(LDL|STL)\b", sass), f"{name} spills"
        assert res.registers * tags["threads"] * tags["ctas_per_sm"] <= 65536, (name, res)
        assert res.shared_bytes <= STATIC_SMEM, (name, res)
        head, _, tail = sass.partition("ACQBULK")
        assert tail and (head.count("UBLKCP"), head.count("UBLKPF")) == (4, 4), name
        assert "LDS" not in head and "STG" not in head, name
        assert ptx.count("st.async.shared::cluster") == 3 * tags["tokens"], name


BROKEN_KERNELS = {
    "griddepcontrol_wait": ("ptx 'griddepcontrol\\\\.wait;'", "sass has '\\\\bACQBULK\\\\b'"),
    "cluster_wait": ("ptx 'barrier\\\\.cluster\\\\.wait;'", "sass '\\\\bUCGABAR_(ARV|WAIT)\\\\b'"),
}


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.parametrize("removed", sorted(BROKEN_KERNELS))
def test_a_verify_kernel_without_its_synchronization_fails_its_build(tmp_path, removed):
    patch = f"cute.arch.{removed} = lambda *args, **kwargs: None"
    prelude = f"import os\nos.environ['CUTE_DSL_ARCH'] = 'sm_90a'\nimport cutlass.cute as cute\n{patch}"
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--match", "kda_step_verify/tp16/b4/q2", prelude=prelude)
    assert proc.returncode == 1, proc.stderr
    (result,) = json.loads((out / "report.json").read_text())["builds"]
    failed = {c["name"] for c in result["checks"] if not c["passed"]}
    assert "compiles" not in failed and "registers" not in failed
    assert set(BROKEN_KERNELS[removed]) <= failed, sorted(failed)
    assert len(failed) <= 8, sorted(failed)


LAUNCH_ON_CPU = """
import torch
from k3_decode.kernels import kda_step_op
from k3_decode.kernels.kda_step_plan import KdaVerifyPlan

compiled = kda_step_op._compiled_verify(KdaVerifyPlan.for_shape(6, 3216, 3, tokens=4))
p = 768
def z(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)
f32, i32 = torch.float32, torch.int32
tensors = (z(3, 4, 3216), z(p, 128), z(3 * p * 4), z(6, dtype=f32), z(p, dtype=f32), z(128), z(9, 3 * p * 6),
           z(9, 6, 128, 128, dtype=f32), z(3, 4, dtype=i32), z(3, dtype=i32), z(3, 4, p), z(1, dtype=i32))
kda_step_op.launch(compiled, tensors, (-5.0, 1e-6, 1e-5), 0)
"""


@pytest.mark.slow
@needs_cutedsl
@needs_torch
def test_the_verify_launch_path_binds_every_argument(tmp_path):
    """The verify launcher compiles from the build's fake signature (a run-time slot count) and hands over every
    argument; without a driver the call gets as far as the launch (CUDA error 35)."""
    assert_launch_reaches_the_driver(LAUNCH_ON_CPU, tmp_path)
