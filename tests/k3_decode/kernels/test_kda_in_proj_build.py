"""The KDA input projection kernel's plan and builds: what is built (fast, no CuTe DSL), and the real sm_90a builds
with their PTX, SASS and cubin checked (slow; needs CuTe DSL, `pip install 'k3gate[cutedsl]'`)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from harness.kernels_cmd import cubin_resources, parse_expectations, select_builds
from k3_decode.config import K3
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, K3KernelBuilds, KdaInProjBuild
from k3_decode.kernels.kda_in_proj_plan import MAX_CHUNK, STEP, InProjPlan
from tests.k3_decode.kernels.helpers import (
    assert_launch_reaches_the_driver,
    build_command,
    needs_cutedsl,
)

SMEM_PER_SM = 228 * 1024  # an H100/H200 SM's shared memory; the driver reserves 1 KiB per CTA
SMEM_PER_CTA = 227 * 1024
H200_SMS = 132


def in_proj_builds() -> list[KdaInProjBuild]:
    return [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaInProjBuild)]


# --- the plan -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp, ctas", [(8, 262), (16, 134)])
def test_k3_rows_fill_every_sm_in_one_wave(tp, ctas):
    rows = K3.shard(tp).kda_in_proj_rows
    for batch in (1, 2, 4, 8):
        plan = InProjPlan.for_shape(rows, K3.hidden_size, batch, H200_SMS)
        assert plan.rows_per_warp == 3 and plan.ctas == ctas
        assert plan.ctas * plan.rows_per_cta == rows  # no partial CTA, every row covered once
        assert H200_SMS <= plan.ctas <= plan.ctas_per_sm * H200_SMS  # every SM busy, no second wave
        # Two CTAs' staged x chunks fit in one SM, so all CTAs can be resident at once.
        assert plan.ctas_per_sm * (plan.smem_bytes + 1024) <= SMEM_PER_SM
        assert plan.steps * STEP == K3.hidden_size and plan.depth * plan.groups == plan.steps
        assert plan.depth * plan.rows_per_warp >= 12  # the loads in flight the docstring's bandwidth needs


@pytest.mark.parametrize("batch", range(1, 65))
def test_chunks_cover_the_batch_and_fit_in_shared_memory(batch):
    plan = InProjPlan.for_shape(6288, 7168, batch)
    assert sum(plan.chunks) == batch and all(0 < c <= MAX_CHUNK for c in plan.chunks)
    assert plan.chunked == (batch > MAX_CHUNK) and plan.smem_bytes <= SMEM_PER_CTA
    # The code holds one body per distinct chunk role; every chunk size the batch needs is among them.
    assert set(plan.chunks) == set(plan.code_chunks) and plan.code_chunks[0] == plan.chunks[0]
    assert len(plan.code_chunks) <= 3
    # Each thread's staging passes cover the chunk: enough passes, and no pass that is wholly idle.
    for c in plan.code_chunks:
        vectors = c * plan.k // 8
        assert (plan.fill_loads(c) - 1) * plan.threads < vectors <= plan.fill_loads(c) * plan.threads


def test_plan_rejects_shapes_the_kernel_cannot_split():
    with pytest.raises(ValueError, match="multiple of 256"):
        InProjPlan.for_shape(6288, 7000, 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        InProjPlan.for_shape(6284, 7168, 1)
    with pytest.raises(ValueError, match="batch"):
        InProjPlan.for_shape(6288, 7168, 0)
    # Rows too few to give every SM a CTA still plan (one row per warp) rather than refuse.
    small = InProjPlan.for_shape(64, 7168, 1)
    assert small.rows_per_warp == 1 and small.ctas == 8


# --- what is built ----------------------------------------------------------------------------------------------


def test_builds_are_every_tp_and_batch_at_the_ranks_rows():
    builds = in_proj_builds()
    assert {(b.tp, b.plan.batch) for b in builds} == {(tp, b) for tp in (8, 16) for b in (1, 2, 4, 8, 16, 64)}
    assert {b.tp: b.plan.rows for b in builds} == {8: 6288, 16: 3216}
    assert {b.plan.k for b in builds} == {7168} and {b.plan.sm_count for b in builds} == {H200_SMS}
    assert len({b.name for b in builds}) == len(builds) == 12
    assert {b.kernel for b in builds if b.plan.batch <= 8} == {"kda_in_proj"}
    assert {b.kernel for b in builds if b.plan.batch > 8} == {"kda_in_proj_chunked"}
    # Every build of this kernel is one of these (o_proj runs in a kernel of its own: test_kda_o_proj_build.py).
    assert [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaInProjBuild)] == builds


def test_build_tags_count_what_the_code_must_hold():
    tags = {b.name: b.tags for b in in_proj_builds()}
    b8 = tags["kda_in_proj/tp8/b8"]  # one chunk of 8: 4 steps x 3 rows per loop body, 28 staging passes
    assert (b8["weight_loads_ahead"], b8["global_loads"], b8["x_stages"], b8["x_reads"]) == (12, 12 + 12 + 28, 28, 32)
    assert (b8["fmas"], b8["out_stores"], b8["shuffles"], b8["barriers"]) == (4 * 3 * 8 * 8, 24, 120, 1)
    b1 = tags["kda_in_proj/tp16/b1"]  # 896 vectors of x over 256 threads: 4 passes, the last partial
    assert (b1["global_loads"], b1["x_stages"], b1["fmas"], b1["out_stores"]) == (12 + 12 + 4, 4, 96, 3)
    b64 = tags["kda_in_proj/tp8/b64"]  # the first chunk, then one rolled body for the 7 others
    assert (b64["global_loads"], b64["x_reads"], b64["barriers"]) == (12 + 2 * 12 + 12 + 2 * 28, 64, 3)
    assert b64["ctas_per_sm"] == 1 and tags["kda_in_proj/tp8/b4"]["ctas_per_sm"] == 2


def test_expectations_judge_every_in_proj_build():
    expectations = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    builds = select_builds(K3_KERNEL_BUILDS, "sm_90a", expectations, "kda_in_proj/*")  # every named tag exists
    assert len(builds) == 12
    assert expectations["kda_in_proj"].max_registers == 128 and expectations["kda_in_proj"].max_frame_bytes == 0
    assert expectations["kda_in_proj_chunked"].max_frame_bytes == 0
    assert len(expectations["kda_in_proj"].rules) == len(expectations["kda_in_proj_chunked"].rules) >= 20


def test_a_tp_the_model_cannot_shard_is_a_build_table_error(tmp_path, monkeypatch):
    table = K3_KERNEL_BUILDS.table | {"kda_in_proj": K3_KERNEL_BUILDS.table["kda_in_proj"] | {"tp": [7]}}
    builds = K3KernelBuilds()
    monkeypatch.setattr(K3KernelBuilds, "table", table)
    with pytest.raises(ValueError, match=r"builds\.toml kda_in_proj\.tp"):
        builds.kda_in_proj_builds()


# --- the real builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------


@pytest.mark.slow
@needs_cutedsl
def test_every_in_proj_build_compiles_and_meets_its_expectations(tmp_path):
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--json", "--jobs", "2", "--match", "kda_in_proj/*")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["subjects"]["K3_KERNEL_BUILDS"]
    assert report["ok"] and len(report["builds"]) == 12
    assert all(b["ok"] and len(b["checks"]) >= 25 for b in report["builds"])  # the rules ran, not skipped

    # Facts read straight from the artifacts, independent of the expectations file.
    for b in report["builds"]:
        name, tags = b["build"], b["tags"]
        ptx = (out / name / "kernel.ptx").read_text()
        sass = (out / name / "kernel.sass").read_text()
        (res,) = cubin_resources((out / name / "kernel.cubin").read_bytes()).values()
        assert re.search(r"^\.target sm_90a$", ptx, re.M), name
        assert res.frame_bytes == 0 and not re.search(r"\b(LDL|STL)\b", sass), f"{name} spills"
        assert res.registers * 256 * tags["ctas_per_sm"] <= 65536, (name, res)  # the CTAs per SM the plan needs
        assert re.search(rf"^\.minnctapersm {tags['ctas_per_sm']}$", ptx, re.M), name
        head, _, tail = sass.partition("ACQBULK")
        assert tail, f"{name} has no griddepcontrol.wait"
        assert head.count("LDG.E.128") == 12 and "LDS" not in head, name  # weights only, before the wait
        assert sass.count("FFMA") == tags["fmas"], name  # FP32 products and sums, one FFMA each
        assert not re.search(r"\b(fma|mul|add)(\.rn)?\.(bf16|f16)", ptx), f"{name} has half-precision math"
    # The batch is in the code (the chunk loop), so the builds differ; the rows only in the constants.
    b1 = (out / "kda_in_proj/tp8/b1" / "kernel.ptx").read_text()
    assert b1 != (out / "kda_in_proj/tp8/b8" / "kernel.ptx").read_text()


def _broken(text: str) -> str:
    """The real expectations with two of the B <= 8 kernel's numbers made wrong by one step each."""
    head, sep, section = text.partition("[sm_90a.kda_in_proj]")
    section, sep2, chunked = section.partition("[sm_90a.kda_in_proj_chunked]")
    rule = "pattern = 'fma\\.rn\\.f32'\ncount = \"fmas\""
    assert sep and sep2 and section.count(rule) == 1 and section.count("max_registers = 128") == 1
    section = section.replace("max_registers = 128", "max_registers = 64")
    section = section.replace(rule, rule[:-1] + ' + 1"')
    return head + sep + section + sep2 + chunked


@pytest.mark.slow
@needs_cutedsl
def test_a_violated_expectation_fails_the_build(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text(_broken(K3_KERNEL_BUILDS.expectations_text()))
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--expectations", str(broken), "--match", "kda_in_proj/tp16/b4")
    assert proc.returncode == 1, proc.stderr
    (result,) = json.loads((out / "report.json").read_text())["builds"]
    failed = sorted(c["name"] for c in result["checks"] if not c["passed"])
    assert failed == ["ptx 'fma\\\\.rn\\\\.f32'", "registers"], failed
    held = [c["name"] for c in result["checks"] if c["passed"]]
    assert held[:2] == ["compiles", "ptx .target"] and any("FFMA" in name for name in held)
    assert "0 of 1 builds passed" in proc.stderr and re.search(r"registers \(\d+ <= 64\)", proc.stderr)


LAUNCH_ON_CPU = """
import torch
from k3_decode.kernels import kda_in_proj_op
from k3_decode.kernels.{module} import {plan}

compiled = kda_in_proj_op._compiled({plan}.for_shape(3216, 7168, {batch}))
x, w, out = (torch.zeros(*s, dtype=torch.bfloat16) for s in (({batch}, 7168), (3216, 7168), ({batch}, 3216)))
kda_in_proj_op.launch(compiled, x, w, out, torch.zeros(1, dtype=torch.int32), 0)
"""


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize(
    "module, plan, batch", [("kda_in_proj_plan", "InProjPlan", 2), ("kda_in_proj_mma_plan", "InProjMmaPlan", 8)]
)
def test_the_gpu_launch_path_binds_every_argument(tmp_path, module, plan, batch):
    """The launcher the GPU test uses compiles either build from the same fake signature and hands over every
    argument; on a machine without a driver the call gets as far as the launch (CUDA error 35), not a binding
    error."""
    assert_launch_reaches_the_driver(LAUNCH_ON_CPU.format(module=module, plan=plan, batch=batch), tmp_path)
