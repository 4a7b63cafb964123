"""The k3-hopper kernel builds: what is built (fast, no CuTe DSL), and the real sm_90a builds of every kernel with
their PTX, SASS and cubin checked (slow; needs CuTe DSL, `pip install 'k3gate[cutedsl]'`).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.kernels_cmd import cubin_resources, parse_expectations, select_builds
from harness.subjects import load_subject
from k3_decode.attn_res_state import AttnResSite
from k3_decode.config import K3, K3_MINI
from k3_decode.kernels.attn_res_plan import AttnResKind, ClusterPlan, site_kinds
from k3_decode.kernels.builds import K3_KERNEL_BUILDS
from tests.k3_decode.kernels.helpers import (
    assert_launch_reaches_the_driver,
    build_command,
    needs_cutedsl,
)

BROKEN = Path(__file__).with_name("broken_expectations.toml")


# --- what is built ----------------------------------------------------------------------------------------------


def stock_kinds(dims) -> set[AttnResKind]:
    """The kinds the stock op's site table implies over the whole layer stack (the final mixing with and without
    the model norm)."""
    bs, kinds = dims.attn_res_block_size, set()
    sites = [AttnResSite.before_attention(i, bs) for i in range(dims.num_layers)]
    sites += [AttnResSite.after_attention(i, bs) for i in range(dims.num_layers)]
    for site in sites:
        kinds.add(AttnResKind(site.num_blocks, site.delta, site.save_index is not None, True))
        # The kernel writes the saved block at a run-time index; in K3 it is the first block the site does not read.
        assert site.save_index in (None, site.num_blocks)
        assert site.bank_before == site.num_blocks
    final = AttnResSite.final(dims.num_layers, bs)
    return kinds | {AttnResKind(final.num_blocks, final.delta, False, norm) for norm in (True, False)}


@pytest.mark.parametrize("dims", [K3, K3_MINI], ids=lambda d: d.name)
def test_site_kinds_are_those_of_the_stock_site_table(dims):
    kinds = site_kinds(dims)
    assert set(kinds) == stock_kinds(dims)
    assert sum(len(sites) for sites in kinds.values()) == 2 * dims.num_layers + 2
    assert kinds[AttnResKind(0, "none", True, True)] == ("before attention of layer 0",)


def test_builds_cover_every_k3_kind_at_every_batch():
    builds = K3_KERNEL_BUILDS.attn_res_builds()
    assert builds == [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if b.kernel == "attn_res"]
    kinds = set(site_kinds(K3)) | {
        AttnResKind(8, "add", False, True, "float32"),
        AttnResKind(8, "restart", False, True, "float32"),
    }
    assert len(kinds) == 27
    assert {(b.batch, b.kind) for b in builds} == {(batch, k) for batch in (1, 8, 64) for k in kinds}
    assert len({b.name for b in builds}) == len(builds) == 81
    assert {b.hidden for b in builds} == {7168} and {b.capacity for b in builds} == {8}
    assert {b.tags["tp"] for b in builds} == {"8,16"}  # AttnRes rows are whole on every rank


def test_build_tags_count_what_the_kernel_moves():
    by_name = {b.name: b.tags for b in K3_KERNEL_BUILDS.builds("sm_90a")}
    heavy = by_name["attn_res/b8/n8-add-norm"]  # 8 blocks, prefix, delta; both exchanges
    assert (heavy["weight_loads"], heavy["row_loads"], heavy["row_stores"]) == (3, 10, 2)
    assert (heavy["pushes"], heavy["exchanges"], heavy["cluster"], heavy["threads"]) == (5 + 1, 2, 7, 128)
    first = by_name["attn_res/b1/n0-none-save-norm"]  # layer 0: p is the embedding, saved as block 0
    assert (first["weight_loads"], first["row_loads"], first["row_stores"], first["pushes"]) == (1, 1, 2, 1)
    f32 = by_name["attn_res/b64/n8-restart-norm-f32delta"]  # restart: no old prefix, two loads of FP32 delta
    assert (f32["row_loads"], f32["row_stores"]) == (8 + 2, 2)


def test_kind_tags_round_trip_and_reject_what_is_not_a_kind():
    for kind in site_kinds(K3):
        assert AttnResKind.from_tag(kind.tag) == kind
    for bad in ("n8-add", "n8-multiply-norm", "x8-add-norm", "n8-add-norm-save"):
        with pytest.raises(ValueError):
            AttnResKind.from_tag(bad)
    with pytest.raises(ValueError, match="no delta dtype"):
        AttnResKind(0, "none", True, True, "float32")


def test_cluster_plan_splits_a_row_into_whole_warps():
    plan = ClusterPlan.for_hidden(7168)
    assert (plan.cluster, plan.threads, plan.warps, plan.slots) == (7, 128, 4, 28)
    assert plan.cluster * plan.threads * 8 == 7168
    mini = ClusterPlan.for_hidden(K3_MINI.hidden_size)
    assert mini.cluster * mini.threads * 8 == K3_MINI.hidden_size and mini.threads % 32 == 0
    for bad in (0, 7000, 100):
        with pytest.raises(ValueError, match="multiple of 256"):
            ClusterPlan.for_hidden(bad)


def test_expectations_judge_every_build():
    expectations = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    builds = select_builds(K3_KERNEL_BUILDS, "sm_90a", expectations)  # every tag a rule names exists
    # AttnRes, the KDA in_proj (CUDA-core, tensor-core and wgmma builds), o_proj + AttnRes (test_kda_o_proj_build.py)
    # and its wgmma build (test_kda_o_proj_wgmma_build.py), the KDA step and its verify step (test_kda_step_build.py),
    # and the head-ordered projection probe (test_kda_head_stream_build.py)
    assert len(builds) == 81 + 12 + 16 + 10 + 114 + 72 + 90 + 22 + 18
    assert expectations["attn_res"].max_registers == 128 and expectations["attn_res"].max_frame_bytes == 0


def test_the_k3_hopper_subject_declares_these_builds():
    adapter = load_subject("k3-hopper")
    make = getattr(adapter, "kernel_builds", None)
    assert make is not None, "K3Subject needs kernel_builds() returning k3_decode.kernels.builds.K3_KERNEL_BUILDS"
    assert make() is K3_KERNEL_BUILDS
    assert load_subject("vllm-k3").kernel_builds() is None  # vLLM's subject builds no kernels of ours


def test_without_cutedsl_the_command_exits_2_naming_the_extra(tmp_path):
    proc = build_command(tmp_path, "--out", str(tmp_path / "out"), prelude="import sys\nsys.modules['cutlass'] = None")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("k3gate: error: CuTe DSL is not installed") and "pip install 'k3gate[cutedsl]'" in line
    assert not (tmp_path / "out").exists()


# --- the real builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------


def _artifact(out: Path, build: str, suffix: str) -> str:
    return (out / build / f"kernel.{suffix}").read_text()


@pytest.mark.slow
@needs_cutedsl
def test_every_kernel_compiles_for_sm90a_and_meets_its_expectations(tmp_path):
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--json", "--jobs", "2", "--match", "attn_res/*")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["subjects"]["K3_KERNEL_BUILDS"]
    assert report["ok"] and len(report["builds"]) == 81
    assert all(b["ok"] and len(b["checks"]) >= 20 for b in report["builds"])  # the rules were applied, not skipped

    # Facts read straight from the artifacts, independent of the expectations file.
    cuobjdump = _cuobjdump()
    for b in report["builds"]:
        name, tags = b["build"], b["tags"]
        ptx, sass = _artifact(out, name, "ptx"), _artifact(out, name, "sass")
        cubin = (out / name / "kernel.cubin").read_bytes()
        assert re.search(r"^\.target sm_90a$", ptx, re.M), name
        assert not re.search(r"\b(LDL|STL)\b", sass), f"{name} spills to local memory"
        (res,) = cubin_resources(cubin).values()
        assert res.registers <= 128 and res.frame_bytes == 0, (name, res)
        assert res.registers == b["resources"]["registers"]
        # Activations are read only after the wait for the previous kernel; weights only before it.
        head, _, tail = sass.partition("ACQBULK")
        assert tail, f"{name} has no griddepcontrol.wait"
        assert head.count("LDG.E.128") == tags["weight_loads"], name
        assert tail.count("LDG.E.128") == tags["row_loads"], name
        assert ptx.count("st.async.shared::cluster") == tags["pushes"], name
        if cuobjdump and name.startswith("attn_res/b8/"):  # our cubin reader agrees with NVIDIA's
            usage = subprocess.run(
                [cuobjdump, "--dump-resource-usage", str(out / name / "kernel.cubin")],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert f"REG:{res.registers} STACK:{res.frame_bytes} " in usage, (name, usage)
    # The kinds compile to different code; the batch only sets the grid, so the device code is the same.
    assert _artifact(out, "attn_res/b8/n0-none-save-norm", "ptx") != _artifact(out, "attn_res/b8/n8-add-norm", "ptx")
    assert _kernel_body(_artifact(out, "attn_res/b1/n8-add-norm", "sass")) == _kernel_body(
        _artifact(out, "attn_res/b64/n8-add-norm", "sass")
    )


def _kernel_body(sass: str) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", sass)


def _cuobjdump() -> str | None:
    """cuobjdump from Triton's wheel (the test extra installs Triton) or the CUDA toolkit, if either is here."""
    triton = importlib.util.find_spec("triton")
    if triton is not None and triton.origin:
        path = Path(triton.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if path.exists():
            return str(path)
    return shutil.which("cuobjdump")


@pytest.mark.slow
@needs_cutedsl
def test_a_violated_expectation_fails_the_build(tmp_path):
    out = tmp_path / "out"
    build = "attn_res/b1/n8-add-norm"
    proc = build_command(tmp_path, "--out", str(out), "--expectations", str(BROKEN), "--match", build)
    assert proc.returncode == 1, proc.stderr
    (result,) = json.loads((out / "report.json").read_text())["builds"]
    failed = sorted(c["name"] for c in result["checks"] if not c["passed"])
    assert len(failed) == 2 and failed[0].startswith("ptx 'wgmma") and failed[1] == "registers"
    held = [c["name"] for c in result["checks"] if c["passed"]]
    assert held[:2] == ["compiles", "ptx .target"] and any("LDG" in name for name in held)
    assert "0 of 1 builds passed" in proc.stderr and re.search(r"registers \(\d+ <= 32\)", proc.stderr)


LAUNCH_ON_CPU = """
import torch
from k3_decode.kernels import attn_res_op
from k3_decode.kernels.attn_res_plan import AttnResKind

kind = AttnResKind.from_tag("n7-add-save-norm")
compiled = attn_res_op._compiled(7168, kind, 4, 8)
def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)
tensors = (bf16(4, 7168), bf16(4, 7168), bf16(4, 8, 7168), bf16(4, 7168), bf16(7168), bf16(7168), bf16(7168),
           torch.zeros(1, dtype=torch.int32))
attn_res_op.launch(compiled, tensors, 7, 1e-5, 0)
"""


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_gpu_launch_path_binds_every_argument(tmp_path):
    """The launcher the GPU test uses compiles from the same fake signature and hands over every argument; on a
    machine without a driver the call gets as far as the launch (CUDA error 35), not a binding error."""
    assert_launch_reaches_the_driver(LAUNCH_ON_CPU, tmp_path)
