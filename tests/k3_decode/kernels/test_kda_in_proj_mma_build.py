"""The tensor-core KDA input projection's plan and builds: how it splits the work (fast, no CuTe DSL), and the real
sm_90a builds with their PTX, SASS and cubin checked (slow; needs CuTe DSL, `pip install 'k3gate[cutedsl]'`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from harness.kernels_cmd import cubin_resources, judge, parse_expectations, select_builds
from k3_decode.config import K3
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, KdaInProjMmaBuild
from k3_decode.kernels.kda_in_proj_mma_plan import (
    MAX_N_TILES,
    STEP,
    TILE_M,
    WARP,
    WIDE_N_TILES,
    WIDE_PASS_BY_WARPS,
    WIDE_PASSES_BY_WARPS,
    InProjMmaPlan,
)
from tests.k3_decode.kernels.helpers import build_command, needs_cutedsl

H200_SMS = 132
REGISTERS_PER_SM = 65536
SMEM_PER_CTA = 227 * 1024


def mma_builds() -> list[KdaInProjMmaBuild]:
    return [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaInProjMmaBuild)]


def covered_rows(plan: InProjMmaPlan) -> list[int]:
    """Every W row each (CTA, warp's m-tile, lane row) stores, as the kernel maps them (kda_in_proj_mma.py)."""
    stored = []
    for cta in range(plan.ctas):
        here = min(plan.rows_per_cta, plan.rows - cta * plan.rows_per_cta)
        for m in range(plan.m_tiles):
            for slot in range(TILE_M):
                local = slot * plan.m_tiles + m
                if local < here:
                    stored.append(cta * plan.rows_per_cta + local)
    return stored


# --- the plan -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp, ctas, m_tiles, k_splits", [(8, 131, 3, 4), (16, 129, 2, 7)])
def test_k3_rows_spread_over_every_sm_in_one_wave(tp, ctas, m_tiles, k_splits):
    rows = K3.shard(tp).kda_in_proj_rows
    for batch in (1, 8, 16, 24, 32, 64):
        plan = InProjMmaPlan.for_shape(rows, K3.hidden_size, batch, H200_SMS)
        # The same K split at every batch (batch invariance), ~12 warps, >= 48 KB of W in flight per SM.
        assert (plan.ctas, plan.m_tiles, plan.k_splits) == (ctas, m_tiles, k_splits)
        # >= 48 KB of W in flight per SM to 16 rows; the 32-row passes trade loads in flight for x fragments.
        wide = batch > MAX_N_TILES * 8
        assert plan.warps * WARP * plan.depth * 4 * 16 >= (28 if wide else 48) * 1024
        assert plan.ctas <= H200_SMS and plan.rows_per_cta - plan.rows / H200_SMS < 1  # one wave, within a row
        assert plan.m_tiles * TILE_M >= plan.rows_per_cta and plan.threads <= 512
        assert plan.split_steps * plan.k_splits * STEP == K3.hidden_size
        assert plan.depth * plan.groups == plan.split_steps
        table = WIDE_PASS_BY_WARPS if batch <= 32 else WIDE_PASSES_BY_WARPS  # one pass to 32 rows, several above
        assert plan.depth * 4 >= (table[plan.warps][0] if wide else 16)  # W loads per lane ahead
        # x staged in a ring per K slice only in TP16's one 32-row pass (its warps' registers hold no x then)
        assert plan.x_stages == (4 if (tp, batch) in ((16, 24), (16, 32)) else 0), batch
        assert plan.smem_bytes <= SMEM_PER_CTA
        # Every row is stored exactly once.
        stored = covered_rows(plan)
        assert sorted(stored) == list(range(rows))


def test_interleaved_rows_give_every_m_tile_nearly_the_same_number_of_real_rows():
    plan = InProjMmaPlan.for_shape(3216, 7168, 8, H200_SMS)  # 25 rows a CTA in two m-tiles of 16 slots
    assert plan.rows_per_cta == 25 and plan.masked and plan.last_rows == 16
    real = [sum(1 for slot in range(TILE_M) if slot * plan.m_tiles + m < plan.rows_per_cta) for m in range(2)]
    assert real == [13, 12]


@pytest.mark.parametrize("rows", [6288, 3216])
@pytest.mark.parametrize("batch", range(1, 65))
def test_passes_cover_the_batch(rows, batch):
    plan = InProjMmaPlan.for_shape(rows, 7168, batch, H200_SMS)
    tiles = MAX_N_TILES if batch <= MAX_N_TILES * 8 else WIDE_N_TILES  # both K3 ranks' warp counts take wide passes
    assert sum(plan.passes) == batch and all(0 < p <= tiles * 8 for p in plan.passes)
    assert len(plan.passes) == -(-batch // (tiles * 8)) and plan.n_tiles == min(-(-batch // 8), tiles)


@pytest.mark.parametrize("rows", [6288, 3216])
def test_wide_passes_keep_the_k_split_so_a_row_does_not_depend_on_the_batch(rows):
    narrow, wide = (InProjMmaPlan.for_shape(rows, 7168, b, H200_SMS) for b in (16, 17))
    assert wide.max_n_tiles == WIDE_N_TILES and narrow.max_n_tiles == MAX_N_TILES
    assert (wide.m_tiles, wide.k_splits, wide.rows_per_cta) == (narrow.m_tiles, narrow.k_splits, narrow.rows_per_cta)
    assert wide.passes == (17,) and wide.w_loads_in_flight < narrow.w_loads_in_flight


def test_a_warp_count_without_a_wide_entry_keeps_16_rows_a_pass():
    plan = InProjMmaPlan.for_shape(8448, 7168, 64, H200_SMS)  # 64 rows a CTA: 4 m-tiles x 4 slices, 16 warps
    assert plan.warps not in WIDE_PASS_BY_WARPS and plan.passes == (16, 16, 16, 16)


def test_plan_rejects_shapes_the_kernel_cannot_split():
    with pytest.raises(ValueError, match="multiple of 64"):
        InProjMmaPlan.for_shape(6288, 7000, 1)
    with pytest.raises(ValueError, match="multiple of 16"):
        InProjMmaPlan.for_shape(6280, 7168, 1)
    with pytest.raises(ValueError, match="batch"):
        InProjMmaPlan.for_shape(6288, 7168, 0)
    with pytest.raises(ValueError, match="sm_count"):
        InProjMmaPlan.for_shape(6288, 7168, 1, 0)
    small = InProjMmaPlan.for_shape(48, 7168, 1, H200_SMS)  # fewer rows than SMs: one row a CTA, still covered
    assert small.ctas == 48 and sorted(covered_rows(small)) == list(range(48))


# --- what is built ----------------------------------------------------------------------------------------------


def test_builds_are_every_tp_and_batch_at_the_ranks_rows():
    builds = mma_builds()
    assert {(b.tp, b.plan.batch) for b in builds} == {(tp, b) for tp in (8, 16) for b in (1, 2, 4, 8, 16, 17, 32, 64)}
    assert {b.tp: b.plan.rows for b in builds} == {8: 6288, 16: 3216}
    assert {b.kernel for b in builds} == {"kda_in_proj_mma"} and {b.choice for b in builds} == {"tensor_core"}
    assert len({b.name for b in builds}) == len(builds) == 16


def test_build_tags_count_what_the_code_must_hold():
    tags = {b.name: b.tags for b in mma_builds()}
    b8 = tags["kda_in_proj_mma/tp8/b8"]  # one batch tile, 4 steps a loop body, 4 slices of K
    assert (b8["weight_loads_ahead"], b8["global_loads"], b8["mmas"]) == (16, 16 + 16 + 2 * (2 + 4), 16)
    assert (b8["partial_loads"], b8["out_stores"], b8["barriers"]) == (4 * 4, 4, 1)
    b1 = tags["kda_in_proj_mma/tp16/b1"]  # a one-row tile: only c0 and c2 can hold an output
    assert (b1["out_stores"], b1["partial_loads"], b1["partial_stores"]) == (2, 2 * 7, 4)
    b16 = tags["kda_in_proj_mma/tp8/b16"]  # one pass of two tiles, 16 W loads ahead
    assert (b16["passes"], b16["mmas"], b16["weight_loads_ahead"], b16["barriers"]) == (1, 32, 16, 1)
    b64 = tags["kda_in_proj_mma/tp8/b64"]  # two passes of four tiles, 8 W loads ahead (2 steps a loop body)
    assert (b64["passes"], b64["mmas"], b64["weight_loads_ahead"]) == (2, 2 * 4 * 2 * 4, 8)
    assert (b64["global_loads"], b64["barriers"]) == (2 * (8 + 8) + 2 * 2 * 4 * (2 + 2), 3)
    # TP16 B32: one pass of four tiles, 8 W loads ahead (2 steps a body, 8 loops over the 16 steps of a slice); x in a
    # ring of 4 stages per K slice: 3 steps x 4 tiles x 2 vectors copied ahead, 2 steps a body; one group per step
    # ahead and per body step, a wait per body step and one at the end, as many named barriers of the slice's two
    # warps beside the CTA's one barrier; no x read from global memory but by cp.async.
    w32 = tags["kda_in_proj_mma/tp16/b32"]
    assert (w32["passes"], w32["mmas"], w32["weight_loads_ahead"], w32["x_stages"]) == (1, 4 * 2 * 4, 8, 4)
    assert (w32["x_copies"], w32["x_commits"], w32["x_waits"], w32["x_reads"]) == (8 * (3 + 2), 3 + 2, 3, 8 * 2)
    assert (w32["global_loads"], w32["barriers"]) == (8 + 8, 1 + 3)
    w64 = tags["kda_in_proj_mma/tp16/b64"]  # two passes keep x in registers (the ring spilled there)
    assert (w64["x_stages"], w64["x_copies"], w64["weight_loads_ahead"], w64["barriers"]) == (0, 0, 4, 3)


def test_expectations_judge_every_mma_build():
    expectations = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    assert len(select_builds(K3_KERNEL_BUILDS, "sm_90a", expectations, "kda_in_proj_mma/*")) == 16
    section = expectations["kda_in_proj_mma"]
    assert section.max_registers == 168 and section.max_frame_bytes == 0 and len(section.rules) >= 20


# --- the real builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------


@pytest.mark.slow
@needs_cutedsl
def test_every_mma_build_compiles_and_meets_its_expectations(tmp_path):
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--json", "--jobs", "2", "--match", "kda_in_proj_mma/*")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["subjects"]["K3_KERNEL_BUILDS"]
    assert report["ok"] and len(report["builds"]) == 16
    assert all(b["ok"] and len(b["checks"]) >= 25 for b in report["builds"])
    for b in report["builds"]:  # facts read straight from the artifacts, independent of the expectations file
        name, tags = b["build"], b["tags"]
        ptx = (out / name / "kernel.ptx").read_text()
        sass = (out / name / "kernel.sass").read_text()
        (res,) = cubin_resources((out / name / "kernel.cubin").read_bytes()).values()
        assert re.search(r"^\.target sm_90a$", ptx, re.M) and "mma.sync.aligned.m16n8k16" in ptx, name
        spills = len(re.findall(r"\b(LDL|STL)\b", sass))
        if tags["partial_ring_pass"]:  # TP16's 32-row pass short of 32 rows: the spill the allowance bounds
            assert name == "kda_in_proj_mma/tp16/b17" and 0 < res.frame_bytes <= 16 and 0 < spills <= 16, (name, res)
        else:
            assert res.frame_bytes == 0 and spills == 0, f"{name} spills"
        assert res.registers * tags["threads"] <= REGISTERS_PER_SM, (name, res)  # one CTA fits an SM
        head, _, tail = sass.partition("ACQBULK")
        ahead = tags["weight_loads_ahead"]  # W only, before the wait
        assert tail and head.count("LDG.E.128") == ahead and "HMMA" not in head, name
        assert sass.count("HMMA.16816.F32.BF16") == tags["mmas"] and "FFMA" not in sass, name


@dataclass(frozen=True)
class Retagged:
    """A build under another name with some of its tags replaced: its artifacts judged as another build's."""

    name: str
    kernel: str
    tags: dict


def test_partial_ring_pass_is_tp16s_one_pass_short_of_32_rows():
    partial = {b: InProjMmaPlan.for_shape(3216, 7168, b, H200_SMS).partial_ring_pass for b in (16, 17, 24, 31, 32, 64)}
    assert partial == {16: False, 17: True, 24: True, 31: True, 32: False, 64: False}
    assert not any(InProjMmaPlan.for_shape(6288, 7168, b, H200_SMS).partial_ring_pass for b in (17, 24, 31))


@pytest.mark.slow
@needs_cutedsl
def test_the_spill_is_allowed_only_where_the_partial_ring_pass_is(tmp_path):
    """TP16 B17's 16-byte frame passes under the allowance (expectations.toml, with the timings behind it); the same
    code judged as a build that is not a partial ring pass fails on the frame and the spill count."""
    expect = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    b17 = next(b for b in mma_builds() if b.name == "kda_in_proj_mma/tp16/b17")
    art = b17.compile("sm_90a")
    assert [
        c.name for c in judge(b17, "sm_90a", art, "", expect[b17.kernel], tmp_path / "a").checks if not c.passed
    ] == []
    full = Retagged(b17.name, b17.kernel, {**b17.tags, "partial_ring_pass": False})
    failed = [c.name for c in judge(full, "sm_90a", art, "", expect[b17.kernel], tmp_path / "b").checks if not c.passed]
    assert failed == ["local-memory frame bytes", "sass " + repr(r"\b(LDL|STL)\b")], failed


def _broken(text: str) -> str:
    """The real expectations with the MMA count one too many and the register cap too low."""
    head, sep, rest = text.partition("[sm_90a.kda_in_proj_mma]")
    end = rest.find("\n[sm_90a.") if "\n[sm_90a." in rest else len(rest)  # the next kernel's section
    section, tail = rest[:end], rest[end:]
    rule = 'count = "mmas"\nwhy = "the products on tensor cores'
    assert sep and section.count(rule) == 1 and section.count("max_registers = 168") == 1
    section = section.replace("max_registers = 168", "max_registers = 96", 1)
    section = section.replace(rule, rule.replace('"mmas"', '"mmas + 1"'))
    return head + sep + section + tail


@pytest.mark.slow
@needs_cutedsl
def test_a_violated_expectation_fails_the_build(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text(_broken(K3_KERNEL_BUILDS.expectations_text()))
    out = tmp_path / "out"
    proc = build_command(
        tmp_path, "--out", str(out), "--expectations", str(broken), "--match", "kda_in_proj_mma/tp8/b8"
    )
    assert proc.returncode == 1, proc.stderr
    (result,) = json.loads((out / "report.json").read_text())["builds"]
    failed = sorted(c["name"] for c in result["checks"] if not c["passed"])
    assert failed == [r"ptx 'mma\\.sync\\.aligned\\.m16n8k16\\.row\\.col\\.f32\\.bf16\\.bf16\\.f32'", "registers"], (
        failed
    )


# The launch path of this build is checked beside the CUDA-core one (test_kda_in_proj_build.py).


def test_the_op_picks_the_build_from_its_data(tmp_path, monkeypatch):
    from k3_decode.kernels import kda_in_proj_choice, kda_in_proj_op

    pick = kda_in_proj_op.kernel_for_rows
    shipped = [pick(b, 6288) for b in (1, 4, 5, 16, 24, 32, 64)]  # the wgmma stream at TP8 B16-B31 and B33-B64
    assert shipped == ["cuda_core", "cuda_core", "tensor_core", "wgmma", "wgmma", "tensor_core", "wgmma"]
    assert pick(1, 3216) == "tensor_core" and pick(4, 1024) == "cuda_core" and pick(5, 1024) == "tensor_core"
    # The choice is the data file's: a changed table changes it.
    table = tmp_path / "choice.toml"
    tiling = "[wgmma_tiling]\ndefault = { k_tile = 64, stages = 4, k_splits = 1 }\n"
    limits = "[cuda_core_max_batch]\n3216 = 2\ndefault = 0\n[wgmma_batches]\n6288 = [[16, 64]]\ndefault = []\n"
    table.write_text(limits + tiling)
    monkeypatch.setattr(kda_in_proj_choice, "CHOICE", table)
    assert pick(2, 3216) == "cuda_core" and pick(3, 3216) == "tensor_core" and pick(1, 6288) == "tensor_core"
    # the wgmma stream from its first batch, to the 64 rows one wgmma N covers
    assert [pick(b, 6288) for b in (15, 16, 64, 65)] == ["tensor_core", "wgmma", "wgmma", "tensor_core"]
    assert pick(64, 3216) == "tensor_core"
