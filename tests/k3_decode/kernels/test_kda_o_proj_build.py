"""The fused o_proj + AttnRes kernel's plan and builds: what is built and the arrival word's arithmetic (fast, no
CuTe DSL), and real sm_90a builds of a few shapes with their PTX, SASS and cubin checked, plus broken variants of
the grid-wide arrival that the expectations must fail (slow; needs CuTe DSL, `pip install 'k3gate[cutedsl]'`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import re
import subprocess
import sys

import pytest

from harness.kernels_cmd import cubin_resources, parse_expectations, select_builds
from k3_decode.config import K3
from k3_decode.kernels.attn_res_plan import AttnResKind, site_kinds
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, K3KernelBuilds, KdaOProjBuild
from k3_decode.kernels.kda_o_proj_plan import (
    ARRIVAL_TOP,
    MAX_BATCH,
    STEP,
    OProjPlan,
    capped_at,
    capped_batches,
    choice,
    one_pass_at,
    paired_at,
    w_l2_at,
    w_smem_at,
    warm_at,
)
from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan
from k3_decode.kernels.kda_step_plan import KdaStepPlan
from tests.k3_decode.kernels.helpers import (
    REPO,
    assert_launch_reaches_the_driver,
    build_command,
    failed_checks_of_broken_build,
    needs_cutedsl,
    sm90_ptx,
)

SMEM_PER_SM = 228 * 1024  # an H100/H200 SM's shared memory; the driver reserves 1 KiB per CTA
H200_SMS = 132
ADD8 = AttnResKind.from_tag("n8-add-norm")


def o_proj_builds() -> list[KdaOProjBuild]:
    return [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaOProjBuild)]


def after_attention_kinds() -> set[AttnResKind]:
    return {k for k, sites in site_kinds(K3).items() if any(s.startswith("after attention") for s in sites)}


# --- the plan -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("batch", range(1, MAX_BATCH + 1))
def test_k3_shapes_are_whole_clusters_resident_in_one_wave(tp, batch):
    hidden, k = K3.shard(tp).kda_o_proj
    plan = OProjPlan.for_shape(hidden, k, batch, ADD8, H200_SMS)
    assert (plan.cluster, plan.threads, plan.warps) == (7, 128, 4)  # the AttnRes kernel's cluster at 7168
    assert plan.rows_per_warp == 4 and plan.ctas == 448 and plan.clusters == 64 and plan.ctas_per_sm == 4
    assert plan.ctas * plan.rows_per_cta == hidden and plan.ctas % plan.cluster == 0  # every row once, whole clusters
    assert plan.ctas <= plan.ctas_per_sm * H200_SMS  # one wave: no CTA waits for a free SM behind the waiters
    assert plan.ctas_per_sm * plan.threads * 128 <= 65536  # the register cap ptxas is told to meet
    # Every row has exactly one epilogue cluster, and at most half the grid waits (the rest need not be resident
    # beside it): one row per cluster to 32 rows, two above.
    clusters, per = plan.epilogue_clusters, plan.epilogue_rows
    rows = sorted(c + j * clusters for c in range(clusters) for j in range(per))
    assert [r for r in rows if r < batch] == list(range(batch)) and len(rows) - batch < plan.epilogue_clusters
    assert 2 * plan.epilogue_clusters <= plan.clusters
    assert plan.epilogue_rows == (1 if batch <= 32 else 2) and 1 <= plan.preloaded_rows <= plan.epilogue_rows
    assert plan.steps * STEP == k and plan.depth * plan.groups == plan.steps
    assert plan.depth * plan.rows_per_warp >= 12  # the loads in flight the stream's bandwidth needs
    assert (plan.depth, plan.groups) == ((3, 2) if tp == 8 else (3, 1))
    assert plan.ctas_per_sm * plan.cta_smem_bytes <= SMEM_PER_SM


N1 = AttnResKind.from_tag("n1-add-norm")


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("batch", [1, 4, 8, 16, 32, 33, 64])
def test_a_capped_launch_lets_no_sm_hold_more_than_ctas_per_sm(tp, batch):
    """The n1 builds at 91-96 registers fit five CTAs an SM, and the SMs that held five held o_proj's last arrivals
    (kda_o_proj_choice.toml). Capped, the request alone must stop a fifth CTA whatever the driver charges a CTA
    beside it (nothing to its 1 KiB), still fit ctas_per_sm, and exceed what the kernel allocates; uncapped the
    launch asks for the kernel's own bytes (None)."""
    hidden, k = K3.shard(tp).kda_o_proj
    for kind in (N1, ADD8):
        plan = OProjPlan.for_shape(hidden, k, batch, kind, H200_SMS, capped=True, paired_rows=False)
        request = plan.launch_smem_bytes
        assert request is not None and request % 128 == 0 and request > plan.cta_smem_bytes, plan.tag
        for overhead in (0, 1024):
            assert SMEM_PER_SM // (request + overhead) == plan.ctas_per_sm == 4, (plan.tag, overhead)
        assert plan.ctas <= plan.ctas_per_sm * H200_SMS  # the grid is still resident in one wave
        assert plan.tag.endswith("/cap")
        plain = OProjPlan.for_shape(hidden, k, batch, kind, H200_SMS, capped=False, paired_rows=False)
        assert plain.launch_smem_bytes is None and plain != plan and not plain.tag.endswith("/cap")


def spread_step_batches(ranges) -> list[tuple[int, int]]:
    """(TP, batch) in `ranges` where the KDA step's launch is spread (pads its request): no place for a cap."""
    out = []
    for first, last in ranges:
        for batch in range(first, last + 1):
            for tp in (8, 16):
                shard = K3.shard(tp)
                step = KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, batch, H200_SMS)
                if step.launch_smem_bytes > step.smem_bytes:
                    out.append((tp, batch))
    return out


def test_the_cap_is_served_only_where_the_step_is_not_spread():
    """Beside a spread step CTA (one at TP8 B1, 114 KiB) registers let three o_proj CTAs in and capped requests
    only two, so a cap there would start o_proj's weight stream later: the served ranges leave those batches out,
    and the check finds them in a range that holds them."""
    assert spread_step_batches(capped_batches()) == []
    assert {(8, 1), (16, 1), (16, 8)} <= set(spread_step_batches([(1, 64)]))
    # the range the choice file names for its measurement held no spread step then (a6f799c); since the wide-warp
    # plans were served, TP8 B16 and TP16 B32 pad their request to three of the four CTAs an SM would hold
    assert spread_step_batches([(16, 64)]) == [(8, 16), (16, 32)]
    for batch in (1, 16, 32, 64):  # the served file's verdict reaches the plan
        plan = OProjPlan.for_shape(7168, 1536, batch, N1)
        assert plan.capped == capped_at(batch) == any(first <= batch <= last for first, last in capped_batches())


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("cap_batches = [[0, 4]]\none_pass = []", r"cap_batches\[0\] is a \[first, last\] range within 1\.\.64"),
        ("cap_batches = [[16, 8]]\none_pass = []", "within 1..64"),
        ("cap_batches = [[16, 65]]\none_pass = []", "within 1..64"),
        ("cap_batches = [16, 64]\none_pass = []", r"cap_batches\[0\]"),
        ("cap_batches = []", "nothing else"),
        ("cap_batches = []\none_pass = []\ncap = true", "nothing else"),
        ("cap_batches = true\none_pass = []", "the lists"),
        ("cap_batches = []\none_pass = [{ batches = [32, 64], max_blocks = 1 }]", r"one_pass\[0\] batches .* 33\.\.64"),
        ("cap_batches = []\none_pass = [{ batches = [33, 64] }]", r"one_pass\[0\] is \{ batches"),
        ("cap_batches = []\none_pass = [{ batches = [33, 64], max_blocks = -1 }]", "max_blocks is a count"),
        ("cap_batches = []\none_pass = [{ batches = [33, 64], max_blocks = true }]", "max_blocks is a count"),
        ("cap_batches = []\none_pass = []\nwarm_batches = [[0, 8]]", r"warm_batches\[0\] is a \[first, last\]"),
        ("cap_batches = []\none_pass = []\nwarm_batches = true", "the lists"),
        ("cap_batches = []\none_pass = []\nw_smem_batches = [[0, 64]]", r"w_smem_batches\[0\] .* range within 1\.\.64"),
        ("cap_batches = []\none_pass = []\nw_smem_batches = 32", "the lists"),
        ("cap_batches = []\none_pass = []\nw_l2_batches = [[1, 8]]", r"w_l2_batches\[0\] reaches 8 rows.*1\.\.4"),
        ("cap_batches = []\none_pass = []\nw_l2_batches = [[0, 2]]", r"w_l2_batches\[0\] .* range within 1\.\.64"),
        ("cap_batches = []\none_pass = []\nw_l2_batches = 2", "the lists"),
        (
            "cap_batches = []\none_pass = []\npaired_rows = [{ batches = [16, 64], max_blocks = 1 }]",
            r"paired_rows\[0\] batches .* 33\.\.64",
        ),
        ("cap_batches = []\none_pass = []\npaired_rows = [[33, 64]]", r"paired_rows\[0\] is \{ batches"),
        ("cap_batches = []\none_pass = []\npaired_rows = true", "the lists"),
        ("cap_batches = []\none_pass = []\npaired_rows = [{ batches = [33, 64], max_blocks = 2 }]", "at most 1"),
    ],
)
def test_a_malformed_choice_file_is_an_error_naming_it(tmp_path, text, says):
    path = tmp_path / "kda_o_proj_choice.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=says) as err:
        choice(path)
    assert str(err.value).startswith("kda_o_proj_choice.toml") and "\n" not in str(err.value)


def test_a_choice_file_serves_what_it_says(tmp_path):
    path = tmp_path / "kda_o_proj_choice.toml"
    path.write_text("cap_batches = [[16, 32], [40, 64]]\none_pass = [{ batches = [33, 64], max_blocks = 1 }]\n")
    assert capped_batches(path) == ((16, 32), (40, 64))
    assert [capped_at(b, path) for b in (8, 16, 36, 40)] == [False, True, False, True]
    assert [one_pass_at(b, N1.num_blocks, path) for b in (32, 33, 64)] == [False, True, True]
    assert not one_pass_at(64, ADD8.num_blocks, path)  # the rule's kinds mix at most one block
    assert not any(warm_at(b, path) for b in (1, 64))  # warm_batches may be left out: none
    assert not any(w_smem_at(b, path) for b in (8, 64))  # so may w_smem_batches
    staged = tmp_path / "staged.toml"  # choice() caches by path
    staged.write_text("cap_batches = []\none_pass = []\nw_smem_batches = [[16, 32]]\n")
    assert [w_smem_at(b, staged) for b in (8, 16, 32, 64)] == [False, True, True, False]
    assert not any(w_l2_at(b, path) for b in (1, 4))  # w_l2_batches may be left out: none
    in_l2 = tmp_path / "in_l2.toml"
    in_l2.write_text("cap_batches = []\none_pass = []\nw_l2_batches = [[1, 2]]\n")
    assert [w_l2_at(b, in_l2) for b in (1, 2, 4)] == [True, True, False]
    assert not any(paired_at(b, 1, path) for b in (33, 64))  # paired_rows may be left out: none
    paired = tmp_path / "paired.toml"
    paired.write_text("cap_batches = []\none_pass = []\npaired_rows = [{ batches = [40, 64], max_blocks = 1 }]\n")
    assert [paired_at(b, 1, paired) for b in (33, 40, 64)] == [False, True, True]
    assert not paired_at(64, 8, paired)


@pytest.mark.parametrize("wgmma", [False, True], ids=["mma-sync", "wgmma"])
def test_paired_rows_are_an_epilogue_clusters_two_rows_and_nothing_else(wgmma):
    """A plan pairs rows only where each epilogue cluster takes two or more (above 32 rows; the wgmma build at two
    CTAs an SM takes three from 49); below, asking is an error naming where pairing starts, and the tag names a
    paired plan."""
    hidden, k = K3.shard(8).kda_o_proj
    make = OProjWgmmaPlan.for_shape if wgmma else OProjPlan.for_shape
    paired = make(hidden, k, 33, N1, paired_rows=True)
    assert paired.paired_rows and paired.epilogue_rows == 2 and paired.tag.endswith("/paired")
    assert not make(hidden, k, 33, N1, paired_rows=False).tag.endswith("/paired")
    # The served file pairs 48-64 rows at one block (kda_o_proj_choice.toml paired_rows)
    assert make(hidden, k, 64, N1).paired_rows and not make(hidden, k, 47, N1).paired_rows
    assert not make(hidden, k, 64, ADD8).paired_rows
    with pytest.raises(ValueError, match=r"paired rows are an epilogue cluster's rows exchanged together.*from 33"):
        make(hidden, k, 32, N1, paired_rows=True)
    if wgmma:  # three rows a cluster, exchanged together
        three = OProjWgmmaPlan.for_shape(hidden, k, 64, N1, ctas_per_sm=2, paired_rows=True)
        assert three.paired_rows and three.epilogue_rows == 3 and three.tag.endswith("/c2/paired")


@pytest.mark.parametrize("tp", [8, 16])
def test_w_to_l2_alone_prefetches_whole_rows_and_holds_none_before_the_wait(tp):
    """w_l2 (kda_o_proj_choice.toml w_l2_batches, B1-B4): every row of the CTA's W prefetched whole into L2 by the
    copy engine before the wait, its first group loaded into the slots only after it. The stream, its steps and the
    CTA's shared memory are the plain plan's, so are its bits (the GPU test asks); only when W moves changes."""
    hidden, k = K3.shard(tp).kda_o_proj
    for batch in (1, 2, 4):
        for kind in (N1, ADD8):
            plain = OProjPlan.for_shape(hidden, k, batch, kind, w_l2=False, warm=False)
            in_l2 = OProjPlan.for_shape(hidden, k, batch, kind, w_l2=True)
            assert in_l2.w_l2 and in_l2.tag == plain.tag + "/w-l2"
            assert in_l2.late_runs == ((0, k),) and in_l2.l2_prefetched and not in_l2.warm_l2
            assert not plain.l2_prefetched
            assert (in_l2.depth, in_l2.groups, in_l2.rows_per_warp) == (plain.depth, plain.groups, plain.rows_per_warp)
            assert in_l2.cta_smem_bytes == plain.cta_smem_bytes
            assert in_l2.resident_ctas_per_sm == plain.resident_ctas_per_sm
    with pytest.raises(ValueError, match="only on the fused o_proj's CUDA-core stream"):
        OProjPlan.for_shape(hidden, k, 8, N1, w_l2=True)
    with pytest.raises(ValueError, match="either staged in shared memory or prefetched"):
        OProjPlan.for_shape(hidden, k, 1, N1, w_l2=True, w_smem=True)
    with pytest.raises(ValueError, match="not also warmed"):
        OProjPlan.for_shape(hidden, k, 1, N1, w_l2=True, warm=True)
    for batch in (1, 4):  # the served file's verdict reaches the plan
        assert OProjPlan.for_shape(hidden, k, batch, N1).w_l2 == w_l2_at(batch)


@pytest.mark.parametrize("tp", [8, 16])
def test_w_in_shared_memory_is_staged_whole_and_fits_beside_more_than_the_waiting_clusters(tp):
    """w_smem (kda_o_proj_choice.toml w_smem_batches): the CTA's 16 rows of W in shared memory instead of the first
    k steps in registers, nothing of W left for after the wait (so nothing to warm), the same K split and passes on
    tensor cores and the same steps on CUDA cores (so a row's bits: the GPU test asks for them). It costs 48 KB a CTA
    at TP8, so at B4 (beside 12 KB of staged o) and from B32 an SM holds three CTAs, not four: the grid then runs in
    more than one wave, and the plan makes sure that more clusters fit at once than wait for the grid (else the rest
    could never run)."""
    hidden, k = K3.shard(tp).kda_o_proj
    for batch, kind in ((1, N1), (4, ADD8), (8, N1), (16, ADD8), (32, N1), (64, ADD8), (64, N1)):
        plain = OProjPlan.for_shape(hidden, k, batch, kind, w_smem=False, paired_rows=False)
        staged = OProjPlan.for_shape(hidden, k, batch, kind, w_smem=True, paired_rows=False)
        assert staged.w_smem and staged.tag == plain.tag + "/w-smem"
        assert staged.late_runs == () and not staged.warmable
        assert staged.resident_ctas_per_sm * staged.cta_smem_bytes <= SMEM_PER_SM
        assert staged.resident_clusters > staged.epilogue_clusters
        want = 3 if tp == 8 and batch in (4, 32, 64) else 4
        assert staged.resident_ctas_per_sm == want and plain.resident_ctas_per_sm == 4, staged.tag
        if not plain.tensor_cores:  # CUDA cores: the rows unpadded (a load reads 512 bytes of one row)
            assert (staged.depth, staged.groups) == (plain.depth, plain.groups)
            assert staged.cta_smem_bytes - plain.cta_smem_bytes == 16 * k * 2 + 128
            continue
        assert staged.mma.w_smem and not plain.mma.w_smem
        assert (staged.mma.k_splits, staged.mma.passes) == (plain.mma.k_splits, plain.mma.passes)
        assert staged.cta_smem_bytes - plain.cta_smem_bytes == 16 * (k + 8) * 2 + 128
        counts = staged.mma.code_counts()
        assert counts["weight_loads_ahead"] == counts["weight_loads"] == 0 and counts["w_bulk_copies"] == 1
        assert counts["w_shared_loads"] == plain.mma.code_counts()["weight_loads"]
    with pytest.raises(ValueError, match="not both"):  # the cap's request is below the staged rows
        OProjPlan.for_shape(hidden, k, 16, N1, w_smem=True, capped=True)
    with pytest.raises(ValueError, match="holds all of W before its wait"):
        OProjPlan.for_shape(hidden, k, 32, N1, w_smem=True, warm=True)
    for batch in (16, 64):  # the served file's verdict reaches the plan
        assert OProjPlan.for_shape(hidden, k, batch, N1).w_smem == w_smem_at(batch)


def test_a_grid_whose_resident_clusters_cannot_outnumber_the_waiting_ones_is_refused():
    """Where the staged CTAs' shared memory leaves fewer clusters resident than the epilogue holds waiting (here a
    K whose 16 rows of W alone take 192 KB, so no CTA fits beside its partials), the grid-wide point could never be
    reached: the plan is refused, not launched to hang."""
    plain = OProjPlan.for_shape(7168, 6144, 64, N1, w_smem=False)
    assert plain.resident_clusters > plain.epilogue_clusters
    with pytest.raises(ValueError, match="could never run"):
        OProjPlan.for_shape(7168, 6144, 64, N1, w_smem=True)


def test_the_driver_count_the_op_checks_is_asked_about_the_plans_own_residency():
    """kda_o_proj_op.plan_for asks the driver how many of the plan's clusters fit at once (cluster_residency) with
    the plan's threads, CTAs an SM and shared memory, and the plan refuses where that does not outnumber the waiting
    clusters; the broken case: as many as wait."""
    for batch, w_smem in ((4, False), (32, False), (64, False), (64, True)):
        p = OProjPlan.for_shape(7168, 1536, batch, N1, w_smem=w_smem)
        threads, per_sm, smem = p.residency
        assert (threads, per_sm) == (128, p.resident_ctas_per_sm) and smem + 1024 == p.cta_smem_bytes, p.tag
        p.check_resident(p.epilogue_clusters + 1)
        with pytest.raises(ValueError, match=r"could hang or crawl; serve fewer rows with the fused o_proj"):
            p.check_resident(p.epilogue_clusters)


def test_late_runs_are_what_the_registers_do_not_hold_before_the_wait():
    """The runs of W a CTA's stream loads after griddepcontrol.wait, per row: on CUDA cores the K past the first
    `depth` steps of 256 columns (TP8: 768 of 1536; TP16 holds all 768); on tensor cores each warp's K slice past its
    first `depth` steps of 64 columns. Together with the held columns they cover K exactly once."""
    tp8, tp16 = (K3.shard(tp).kda_o_proj for tp in (8, 16))
    assert OProjPlan.for_shape(*tp8, 1, N1).late_runs == ((768, 768),)
    assert OProjPlan.for_shape(*tp16, 4, N1).late_runs == ()
    assert OProjPlan.for_shape(*tp8, 32, N1).late_runs == ((64, 320), (448, 320), (832, 320), (1216, 320))
    assert [OProjPlan.for_shape(*tp16, b, N1).late_runs != () for b in (8, 16, 32, 64)] == [False, False, True, True]
    for hidden, k in (tp8, tp16):
        for batch in (1, 4, 8, 16, 32, 64):
            plan = OProjPlan.for_shape(hidden, k, batch, N1)
            if plan.tensor_cores:
                width, held = plan.mma.split_steps * 64, plan.mma.depth * 64
                held_runs = [(s * width, held) for s in range(plan.mma.k_splits)]
            else:
                held_runs = [(0, plan.depth * STEP)]
            covered = sorted(c for first, n in held_runs + list(plan.late_runs) for c in range(first, first + n))
            assert covered == list(range(k)), plan.tag


def test_a_warm_plan_is_served_only_where_something_is_late(tmp_path, monkeypatch):
    """warm_batches reaches the plan where its stream loads part of W after the wait, and asking for warmth where
    the registers hold all of it is an error, not a plan that prefetches nothing."""
    from k3_decode.kernels import kda_o_proj_plan

    path = tmp_path / "kda_o_proj_choice.toml"
    path.write_text("cap_batches = []\none_pass = []\nwarm_batches = [[1, 32]]\n")
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", path)
    tp8, tp16 = (K3.shard(tp).kda_o_proj for tp in (8, 16))
    assert [OProjPlan.for_shape(*tp8, b, N1).warm_l2 for b in (1, 8, 32, 33, 64)] == [True] * 3 + [False] * 2
    assert [OProjPlan.for_shape(*tp16, b, N1).warm_l2 for b in (1, 16, 32)] == [False, False, True]
    assert OProjPlan.for_shape(*tp8, 1, N1).tag.endswith("/warm")
    with pytest.raises(ValueError, match="holds all of W before its wait"):
        OProjPlan.for_shape(*tp16, 1, N1, warm=True)
    assert not OProjPlan.for_shape(*tp8, 64, ADD8).warm_l2  # two passes (OProjPlan.warmable)
    with pytest.raises(ValueError, match="two-pass stream is not warmed"):
        OProjPlan.for_shape(*tp8, 64, ADD8, warm=True)


def test_the_build_table_holds_every_variant_beside_the_plain_stream_whatever_is_served(tmp_path, monkeypatch):
    """Serving a variant (here W to L2 alone at B1-B4, W staged at B16-B64, warmth everywhere) changes the served
    builds, never whether the table can be made: each variant's builds take the plain stream for everything else,
    since two of them in one plan are refused. With W to L2 alone served, the served B1 build is the w_l2 one and the
    warm build beside it is still made."""
    from k3_decode.kernels import kda_o_proj_plan

    path = tmp_path / "kda_o_proj_choice.toml"
    path.write_text(
        "cap_batches = []\none_pass = []\nwarm_batches = [[1, 64]]\nw_smem_batches = [[16, 64]]\n"
        "w_l2_batches = [[1, 4]]\n"
    )
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", path)
    names = {b.name for b in K3_KERNEL_BUILDS.kda_o_proj_builds()}
    assert "kda_o_proj/tp8/b1/n1-add-norm/w-l2" in names and "kda_o_proj/tp8/b1/n1-add-norm" not in names
    assert "kda_o_proj/tp8/b1/n1-add-norm/warm" in names and "kda_o_proj/tp8/b32/n1-add-norm/warm" in names
    assert "kda_o_proj/tp8/b32/n1-add-norm/w-smem" in names


@pytest.mark.parametrize("tp", [8, 16])
def test_one_pass_reads_w_once_with_every_batch_tile(tp):
    """Above 32 rows the two-pass stream takes two passes of four batch tiles, each reading the CTA's W; one_pass takes
    every row in one pass of up to eight, with the same K split (so a row's bits, the GPU test asks for them)."""
    hidden, k = K3.shard(tp).kda_o_proj
    for batch, tiles in ((33, 5), (40, 5), (64, 8)):
        two = OProjPlan.for_shape(hidden, k, batch, N1, one_pass=False, paired_rows=False)
        one = OProjPlan.for_shape(hidden, k, batch, N1, one_pass=True, paired_rows=False)
        assert len(two.mma.passes) == 2 and one.mma.passes == (batch,) and one.mma.n_tiles == tiles
        assert (one.mma.k_splits, one.mma.split_steps) == (two.mma.k_splits, two.mma.split_steps)
        assert one.tag == two.tag + "/one-pass" and one.epilogue_rows == two.epilogue_rows == 2
    with pytest.raises(ValueError, match="one pass is the fused o_proj's plan up to 32 rows"):
        OProjPlan.for_shape(hidden, k, 32, N1, one_pass=True)
    for batch in (33, 64):  # the served file's verdict reaches the plan
        assert OProjPlan.for_shape(hidden, k, batch, N1).one_pass == one_pass_at(batch, N1.num_blocks)


def test_plan_refuses_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match=r"1\.\.64 rows"):
        OProjPlan.for_shape(7168, 1536, 65, ADD8)
    with pytest.raises(ValueError, match=r"1\.\.64 rows"):
        OProjPlan.for_shape(7168, 1536, 0, ADD8)
    with pytest.raises(ValueError, match="multiple of 256"):
        OProjPlan.for_shape(7168, 1000, 1, ADD8)
    with pytest.raises(ValueError, match="multiple of 256"):
        OProjPlan.for_shape(7000, 1536, 1, ADD8)
    with pytest.raises(ValueError, match="add or restart"):
        OProjPlan.for_shape(7168, 1536, 1, AttnResKind.from_tag("n0-none-save-norm"))
    with pytest.raises(ValueError, match="add or restart"):
        OProjPlan.for_shape(7168, 1536, 1, AttnResKind(8, "add", False, True, "float32"))
    with pytest.raises(ValueError, match="fit on 8 SMs"):  # 448 CTAs cannot be resident on 8 SMs
        OProjPlan.for_shape(7168, 1536, 1, ADD8, sm_count=8)


# --- the arrival word (a model of the kernel's integer arithmetic) ----------------------------------------------


def _int32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x & 0x80000000 else x


def _waits(now: int, seen: int) -> bool:
    """The kernel's poll condition, in Int32: the top bits of `now` and `seen` are equal."""
    return _int32(now ^ seen) >= 0


@pytest.mark.parametrize("ctas", [1, 2, 7, 448])
def test_each_launch_flips_the_top_bit_exactly_at_its_last_arrival(ctas):
    """Launches of one plan and of others on the same word, arrivals in random orders: every CTA's poll waits until
    the last add of its launch lands and not after it, and each launch leaves the low 31 bits at zero."""
    rng = random.Random(ctas)
    word = 0
    for launch in range(40):
        n = ctas if launch % 3 else rng.choice([1, 2, 7, 448])  # plans of other sizes share the word
        master = ARRIVAL_TOP - (n - 1)
        adds = [master] + [1] * (n - 1)
        rng.shuffle(adds)
        seen = []
        for i, add in enumerate(adds):
            seen.append(word)
            word = _int32(word + add)
            last = i == n - 1
            # every CTA that has arrived so far waits exactly while the launch is incomplete
            assert all(_waits(word, s) != last for s in seen), (launch, i)
        assert word & 0x7FFFFFFF == 0 and (word < 0) == (launch % 2 == 0)


def test_the_arrival_master_is_what_the_plan_adds():
    plan = OProjPlan.for_shape(7168, 1536, 4, ADD8)
    assert plan.arrival_master + (plan.ctas - 1) == ARRIVAL_TOP and 0 < plan.arrival_master < ARRIVAL_TOP


# --- what is built ----------------------------------------------------------------------------------------------


def test_builds_are_every_tp_batch_and_listed_kind_at_the_ranks_shape():
    builds = o_proj_builds()
    kinds = {AttnResKind.from_tag(t) for t in ("n1-restart-norm", "n1-add-norm", "n8-restart-norm", "n8-add-norm")}
    assert {(b.tp, b.plan.batch, b.plan.kind) for b in builds if not b.plan.paired_rows} == {
        (tp, batch, kind) for tp in (8, 16) for batch in (1, 2, 4, 8, 16, 32, 64) for kind in kinds
    }
    assert kinds <= after_attention_kinds()
    assert {b.tp: (b.plan.hidden, b.plan.k) for b in builds} == {8: K3.shard(8).kda_o_proj, 16: K3.shard(16).kda_o_proj}
    assert {b.kernel for b in builds} == {"kda_o_proj"} and {b.capacity for b in builds} == {8}
    assert len({b.name for b in builds}) == len(builds) == 56 + 4 + 14 + 20 + 12 + 8
    # builds.toml's paired: B33 and B64 at the one-block kinds, with the stream the choice file serves (one pass)
    assert {b.name for b in builds if b.plan.paired_rows} == {
        f"kda_o_proj/tp{tp}/b{batch}/{tag}/one-pass/paired"
        for tp in (8, 16)
        for batch in (33, 64)
        for tag in ("n1-restart-norm", "n1-add-norm")
    }
    assert "kda_o_proj/tp16/b4/n8-add-norm" in {b.name for b in builds}
    # builds.toml's both_streams: at B64 for the one-block kinds, one pass and two, whichever the choice file serves
    one_block = [(tp, 64, tag) for tp in (8, 16) for tag in ("n1-restart-norm", "n1-add-norm")]
    for one_pass in (False, True):
        got = {(b.tp, b.plan.batch, b.plan.kind.tag) for b in builds if b.plan.one_pass == one_pass}
        assert set(one_block) <= got
    assert "kda_o_proj/tp8/b64/n1-add-norm/one-pass" in {b.name for b in builds}
    tags = {b.name: b.tags for b in builds}
    assert tags["kda_o_proj/tp8/b64/n1-add-norm/one-pass"]["passes"] == 1
    assert tags["kda_o_proj/tp8/b64/n1-add-norm"]["passes"] == 2
    # builds.toml's warm: each stream whose registers leave runs of W to after the wait, one prefetch per run
    warm = {b.name: b.tags["warm_prefetches"] for b in builds if b.plan.warm_l2}
    assert warm == {
        f"kda_o_proj/tp{tp}/b{batch}/{tag}{'/one-pass' * (batch == 64 and tag == 'n1-add-norm')}/warm": (
            1 if batch <= 4 else 4
        )
        for tag in ("n1-add-norm", "n8-add-norm")
        for tp, batch in ((8, 1), (8, 4), (8, 8), (8, 16), (8, 32), (8, 64), (16, 32), (16, 64))
        if not (batch == 64 and tag == "n8-add-norm")  # two passes: not warmable
    }
    assert all(b.tags["warm_prefetches"] == 0 for b in builds if not b.plan.l2_prefetched)
    # builds.toml's w_smem: B1, B4 (CUDA cores) and B16-B64 at both epilogue sizes, with the stream the choice file
    # serves (one pass at 64 rows for one block), one bulk copy in the code and the slot fills from shared memory
    staged = {b.name: b.tags for b in builds if b.plan.w_smem}
    assert set(staged) == {
        f"kda_o_proj/tp{tp}/b{batch}/{tag}{'/one-pass' * (batch == 64 and tag == 'n1-add-norm')}/w-smem"
        for tp in (8, 16)
        for batch in (1, 4, 16, 32, 64)
        for tag in ("n1-add-norm", "n8-add-norm")
    }
    for name, t in staged.items():
        assert (t["w_bulk_copies"], t["w_smem"], t["weight_loads_ahead"]) == (1, True, 0), name
        plain = tags[name.removesuffix("/w-smem").removesuffix("/one-pass")]
        assert t["w_shared_loads"] > 0 and t["stream_loads"] < plain["stream_loads"], name
    assert all(b.tags["w_bulk_copies"] == b.tags["w_shared_loads"] == 0 for b in builds if not b.plan.w_smem)
    # builds.toml's w_l2: B1, B2 and B4 at both epilogue sizes: one prefetch (the warp's rows, whole), no weight load
    # before the wait, and the plain build's loads after it
    in_l2 = {b.name: b.tags for b in builds if b.plan.w_l2}
    assert set(in_l2) == {
        f"kda_o_proj/tp{tp}/b{batch}/{tag}/w-l2"
        for tp in (8, 16)
        for batch in (1, 2, 4)
        for tag in ("n1-add-norm", "n8-add-norm")
    }
    for name, t in in_l2.items():
        assert (t["warm_prefetches"], t["w_l2"], t["weight_loads_ahead"], t["warm"]) == (1, True, 0, False), name
        plain = tags[name.removesuffix("/w-l2")]
        assert plain["weight_loads_ahead"] > 0 and (t["stream_loads"], t["global_loads"]) == (
            plain["stream_loads"],
            plain["global_loads"],
        ), name
    assert not any(b.tags["w_l2"] for b in builds if not b.plan.w_l2)


def test_both_streams_kinds_must_be_built_kinds(monkeypatch):
    table = K3_KERNEL_BUILDS.table
    bad = table | {"kda_o_proj": table["kda_o_proj"] | {"both_streams": {"batches": [64], "kinds": ["n2-add-norm"]}}}
    monkeypatch.setattr(K3KernelBuilds, "table", bad)
    with pytest.raises(ValueError, match=r"builds\.toml kda_o_proj\.both_streams\.kinds must be among kinds"):
        K3KernelBuilds().kda_o_proj_builds()


def test_after_attention_kinds_are_restarts_and_adds_over_every_bank_size():
    kinds = after_attention_kinds()
    assert kinds == {AttnResKind(n, d, False, True) for n in range(1, 9) for d in ("add", "restart")}


def test_build_tags_count_what_the_code_must_hold():
    tags = {b.name: b.tags for b in o_proj_builds()}
    t = tags["kda_o_proj/tp8/b4/n8-add-norm"]  # 2 groups of 3 steps x 4 rows; 768 vectors of o over 128 threads
    assert (t["weight_loads_ahead"], t["stream_loads"], t["o_stages"], t["o_reads"]) == (12, 12 + 12 + 6, 6, 12)
    assert t["epilogue_loads_before_wait"] == 3 + 8 + 1 and t["global_loads"] == 30 + 12 + 1
    assert (t["stream_fmas"], t["stream_shuffles"], t["out_stores"], t["row_stores"]) == (384, 80, 16, 2)
    assert (t["pushes"], t["exchanges"]) == (5 + 1, 2)
    r = tags["kda_o_proj/tp16/b1/n1-restart-norm"]  # one group covers K (no refill), one pass of o, no old prefix
    assert (r["stream_loads"], r["epilogue_loads_before_wait"], r["global_loads"]) == (12 + 1, 3 + 1, 13 + 4 + 1)
    assert (r["stream_fmas"], r["out_stores"], r["pushes"]) == (3 * 4 * 1 * 8, 4, 1 + 1)
    assert (t["passes"], t["arrival_barriers"], r["passes"], r["arrival_barriers"]) == (1, 2, 1, 2)
    # Tensor cores: one pass of two batch tiles to 16 rows, a pass per 32 rows (four tiles) above; 4 warps split
    # K=1536 (TP8) into 6 steps each: 6 x 4 W loads ahead, refilled by none (one group covers the slice).
    for batch, passes, tiles in ((8, 1, 1), (16, 1, 2), (32, 1, 4), (64, 2, 4)):
        m = tags[f"kda_o_proj/tp8/b{batch}/n8-add-norm"]
        assert (m["tensor_cores"], m["passes"], m["arrival_barriers"]) == (True, passes, 2 * passes), batch
        assert m["stream_mmas"] == passes * tiles * 4 * m["depth"] and m["o_stages"] == m["stream_fmas"] == 0
        assert m["out_stores"] == passes * tiles * 4, batch  # 2 rows x 2 batch columns per lane and tile
    # B64: 32 epilogue clusters of two rows, each row with its own exchanges and stores; the heavy kind holds one
    # row's bank across the wait (12 vectors with the weights), the light one both rows'.
    heavy, light = tags["kda_o_proj/tp8/b64/n8-add-norm"], tags["kda_o_proj/tp16/b64/n1-restart-norm"]
    assert (heavy["epilogue_clusters"], heavy["epilogue_rows"], heavy["preloaded_rows"]) == (32, 2, 1)
    assert heavy["epilogue_loads_before_wait"] == 3 + 9 and heavy["global_loads"] == heavy["stream_loads"] + 3 + 18 + 2
    assert (heavy["pushes"], heavy["exchanges"], heavy["row_stores"]) == (2 * (5 + 1), 4, 4)
    assert (light["preloaded_rows"], light["epilogue_loads_before_wait"], light["exchanges"]) == (2, 3 + 2, 4)
    assert tags["kda_o_proj/tp8/b32/n8-add-norm"]["epilogue_clusters"] == 32  # one row each, as before


def test_expectations_judge_every_o_proj_build():
    expectations = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    builds = select_builds(K3_KERNEL_BUILDS, "sm_90a", expectations, "kda_o_proj/*")  # every named tag exists
    # the stream not served at B64 for n1; 14 warm; 20 staged; 12 to L2; 8 paired
    assert len(builds) == 56 + 4 + 14 + 20 + 12 + 8
    spec = expectations["kda_o_proj"]
    assert spec.max_registers == 128 and spec.max_frame_bytes == 0 and len(spec.rules) >= 45


def test_a_kind_no_after_attention_site_uses_is_a_build_table_error(monkeypatch):
    table = K3_KERNEL_BUILDS.table
    bad = table | {"kda_o_proj": table["kda_o_proj"] | {"kinds": ["n0-none-save-norm"]}}
    monkeypatch.setattr(K3KernelBuilds, "table", bad)
    with pytest.raises(ValueError, match=r"builds\.toml kda_o_proj\.kinds: n0-none-save-norm"):
        K3KernelBuilds().kda_o_proj_builds()


# --- the real builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------


ONE_PASS_N8 = """
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, K3KernelBuilds
table = K3KernelBuilds().table
spec = table["kda_o_proj"] | {"both_streams": {"batches": [64], "kinds": ["n8-add-norm"]}}
K3_KERNEL_BUILDS.__dict__.pop("table", None)
K3KernelBuilds.table = table | {"kda_o_proj": spec}
"""


WARM_AFTER_WAIT = """
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import cutlass.cute as cute
from k3_decode.kernels import kda_o_proj

own = kda_o_proj.KdaOProjKernel._warm


@cute.jit
def late_warm(self, w, cta, warp, lane):
    cute.arch.griddepcontrol_wait()
    own(self, w, cta, warp, lane)


kda_o_proj.KdaOProjKernel._warm = late_warm
"""


@pytest.mark.slow
@needs_cutedsl
def test_a_warm_build_that_prefetches_after_the_wait_fails_its_build(tmp_path):
    """The broken case of the warm builds: prefetches issued behind a dependency wait (`_warm` patched in the
    compiling process only) warm L2 too late to help. The order rule catches it, and so does the single-wait rule;
    on tensor cores the warm comes before the first W loads, so those are behind the wait too, in PTX and SASS."""
    failed = failed_checks_of_broken_build(tmp_path, "kda_o_proj/tp8/b32/n1-add-norm/warm", WARM_AFTER_WAIT)
    assert failed == {
        r"ptx 'griddepcontrol\\.wait;'",
        r"ptx 'cp\\.async\\.bulk\\.prefetch\\.L2\\.global' before 'griddepcontrol\\.wait;'",
        r"ptx 'ld\\.global\\.v4\\.b32' before 'griddepcontrol\\.wait;'",
        r"sass '\\bLDG\\.E\\.128\\b' before '\\bACQBULK\\b'",
    }, sorted(failed)


W_COPIED_AFTER_WAIT = """
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import cutlass.cute as cute
from k3_decode.kernels import kda_in_proj_mma, kda_o_proj

own = kda_in_proj_mma.stage_w


@cute.jit
def late_stage(plan, w, smem, first, tidx, warp):
    cute.arch.griddepcontrol_wait()
    return own(plan, w, smem, first, tidx, warp)


kda_o_proj.stage_w = late_stage
"""


@pytest.mark.slow
@needs_cutedsl
def test_a_w_smem_build_that_copies_w_after_the_wait_fails_its_build(tmp_path):
    """The broken case of the w_smem builds: the rows of W copied behind a dependency wait (`stage_w` patched in the
    compiling process only) arrive only after the previous kernel, which is what staging them was for. The order rule
    catches it, and so does the single-wait rule."""
    failed = failed_checks_of_broken_build(tmp_path, "kda_o_proj/tp8/b32/n1-add-norm/w-smem", W_COPIED_AFTER_WAIT)
    assert failed == {
        r"ptx 'griddepcontrol\\.wait;'",
        r"ptx 'cp\\.async\\.bulk\\.shared::cluster\\.global\\.mbarrier::complete_tx::bytes' "
        r"before 'griddepcontrol\\.wait;'",
    }, sorted(failed)


W_LOADED_BEFORE_THE_WAIT = """
import dataclasses
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
from k3_decode.kernels import kda_o_proj

own = kda_o_proj.KdaOProjKernel.__init__


def loads_ahead(self, plan, *args, **kwargs):
    own(self, dataclasses.replace(plan, w_l2=False, warm_l2=True), *args, **kwargs)


kda_o_proj.KdaOProjKernel.__init__ = loads_ahead
"""


@pytest.mark.slow
@needs_cutedsl
def test_a_w_l2_build_that_loads_w_before_the_wait_fails_its_build(tmp_path):
    """The broken case of the w_l2 builds: the kernel built from the plan that prefetches its late runs but still
    loads the first group into registers before the wait (patched in the compiling process only), which is what
    sending W to L2 alone is to avoid. Its one prefetch passes; both rules on loads before the wait fail."""
    failed = failed_checks_of_broken_build(tmp_path, "kda_o_proj/tp8/b1/n1-add-norm/w-l2", W_LOADED_BEFORE_THE_WAIT)
    assert failed == {
        r"ptx 'ld\\.global\\.v4\\.b32' before 'griddepcontrol\\.wait;'",
        r"sass '\\bLDG\\.E\\.128\\b' before '\\bACQBULK\\b'",
    }, sorted(failed)


@pytest.mark.slow
@needs_cutedsl
def test_one_pass_where_the_epilogue_holds_eight_blocks_spills_and_fails_its_build(tmp_path):
    """Why one_pass names the kinds it serves: with the eight-block epilogue's vectors held across the wait, 32
    accumulators a lane no longer fit 128 registers. The build must fail on its frame, not pass with a spill."""
    out = tmp_path / "out"
    proc = build_command(
        tmp_path, "--out", str(out), "--match", "kda_o_proj/tp8/b64/n8-add-norm/one-pass", prelude=ONE_PASS_N8
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = json.loads((out / "report.json").read_text())["builds"]
    failed = {c["name"] for c in result["checks"] if not c["passed"]}
    assert result["build"] == "kda_o_proj/tp8/b64/n8-add-norm/one-pass" and result["tags"]["passes"] == 1
    assert result["resources"]["registers"] <= 128 and result["resources"]["frame_bytes"] > 0
    assert failed == {"local-memory frame bytes", r"sass '\\b(LDL|STL)\\b'"}, failed


@pytest.mark.slow
@needs_cutedsl
def test_a_few_o_proj_builds_compile_and_meet_their_expectations(tmp_path):
    out = tmp_path / "out"
    proc = build_command(
        tmp_path, "--out", str(out), "--json", "--jobs", "2", "--match", "kda_o_proj/tp*/b[14]/n*-add-norm"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["subjects"]["K3_KERNEL_BUILDS"]
    assert report["ok"] and len(report["builds"]) == 8
    assert all(b["ok"] and len(b["checks"]) >= 50 for b in report["builds"])  # the rules ran, not skipped

    # Facts read straight from the artifacts, independent of the expectations file.
    for b in report["builds"]:
        name, tags = b["build"], b["tags"]
        ptx = (out / name / "kernel.ptx").read_text()
        sass = (out / name / "kernel.sass").read_text()
        (res,) = cubin_resources((out / name / "kernel.cubin").read_bytes()).values()
        assert re.search(r"^\.target sm_90a$", ptx, re.M), name
        assert res.frame_bytes == 0 and not re.search(r"\b(LDL|STL)\b", sass), f"{name} spills"
        assert res.registers * 128 * 4 <= 65536, (name, res)  # four CTAs per SM
        head, _, tail = sass.partition("ACQBULK")
        assert tail and head.count("LDG.E.128") == 12 and "LDS" not in head, name  # W only, before the wait
        # The grid-wide point in program order: stores, release, then (epilogue) acquire polls, one row read.
        release, poll = sass.index("MEMBAR.ALL.GPU"), sass.index("LDG.E.STRONG.GPU")
        assert sass.rindex("STG.E.U16") < release < sass.index("ATOMG.E.ADD.STRONG.GPU") < poll, name
        assert sass[poll:].count("LDG.E.128") == 1, name  # only the o_proj row after the acquire
        assert sass.count("STAS") == tags["pushes"] and "STAS" not in sass[:poll], name
    # The batch and the kind are in the code; TP only in the constants and the k loop's trip count.
    b1 = (out / "kda_o_proj/tp8/b1/n1-add-norm" / "kernel.ptx").read_text()
    assert b1 != (out / "kda_o_proj/tp8/b4/n1-add-norm" / "kernel.ptx").read_text()
    assert b1 != (out / "kda_o_proj/tp8/b1/n8-add-norm" / "kernel.ptx").read_text()


BROKEN_ARRIVALS = """
import json, sys, tempfile
from pathlib import Path
import cutlass.cute as cute
from cutlass import Int32
from harness.kernels_cmd import judge, parse_expectations
from k3_decode.kernels import cutedsl
from k3_decode.kernels.builds import K3_KERNEL_BUILDS
from k3_decode.kernels.kda_o_proj import KdaOProjKernel, compile_args

class RelaxedArrival(KdaOProjKernel):  # the arrival's add without release: the stores may land after it
    @cute.jit
    def _arrive(self, arrivals, tidx, cta):
        seen = Int32(0)
        if tidx == 0:
            add = Int32(1)
            if cta == 0:
                add = Int32(self.plan.arrival_master)
            seen = cute.arch.atomic_add(arrivals.iterator, add, sem="relaxed", scope="gpu")
        return seen

class RelaxedPoll(KdaOProjKernel):  # the poll without acquire: the row may be read from before the flip
    @cute.jit
    def _wait_for_grid(self, arrivals, seen, tidx):
        if tidx == 0:
            now = cute.arch.load(arrivals.iterator, Int32, sem="relaxed", scope="gpu")
            while (now ^ seen) >= 0:
                now = cute.arch.load(arrivals.iterator, Int32, sem="relaxed", scope="gpu")
        cute.arch.sync_threads()

class NoWait(KdaOProjKernel):  # the epilogue reads the row without waiting for the grid
    @cute.jit
    def _wait_for_grid(self, arrivals, seen, tidx):
        cute.arch.sync_threads()

(build,) = [b for b in K3_KERNEL_BUILDS.kda_o_proj_builds() if b.name == "kda_o_proj/tp16/b2/n8-add-norm"]
expect = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")["kda_o_proj"]
failed = {}
for variant in (KdaOProjKernel, RelaxedArrival, RelaxedPoll, NoWait):
    art = cutedsl.compile_artifacts(variant(build.plan), compile_args(build.plan, build.capacity), "sm_90a")
    result = judge(build, "sm_90a", art, "", expect, Path(tempfile.mkdtemp()))
    failed[variant.__name__] = sorted(c.name for c in result.checks if not c.passed)
print(json.dumps(failed))
"""


@pytest.mark.slow
@needs_cutedsl
def test_broken_arrivals_fail_the_expectations(tmp_path):
    """The kernel's own build passes; a relaxed arrival, a relaxed poll and a missing wait each compile fine and
    each fails the rules that name what it broke."""
    script = tmp_path / "broken_arrivals.py"  # CuTe DSL compiles from source, so the variants live in a file
    script.write_text(BROKEN_ARRIVALS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failed["KdaOProjKernel"] == []
    relaxed = " ".join(failed["RelaxedArrival"])
    assert "atom\\\\.global\\\\.release" in relaxed and "MEMBAR" in relaxed, failed["RelaxedArrival"]
    poll = " ".join(failed["RelaxedPoll"])
    assert "ld\\\\.acquire\\\\.gpu\\\\.global\\\\.b32" in poll and "CCTL" in poll, failed["RelaxedPoll"]
    assert any("ld\\\\.acquire" in name for name in failed["NoWait"]), failed["NoWait"]


LAUNCH_ON_CPU = """
import torch
from k3_decode.kernels import kda_o_proj_op
from k3_decode.kernels.attn_res_plan import AttnResKind
from k3_decode.kernels.kda_o_proj_plan import OProjPlan

plan = OProjPlan.for_shape(7168, 768, 2, AttnResKind.from_tag("n3-add-norm"))
compiled = kda_o_proj_op._compiled(plan, 8)
def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)
tensors = (bf16(2, 768), bf16(7168, 768), bf16(2, 7168), bf16(2, 7168), bf16(2, 8, 7168), bf16(2, 7168),
           bf16(7168), bf16(7168), bf16(7168), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
kda_o_proj_op.launch(compiled, tensors, -1, 1e-5, 0)
"""


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_gpu_launch_path_binds_every_argument(tmp_path):
    """The launcher the provider and the GPU test use compiles from the same fake signature and hands over every
    argument; on a machine without a driver the call gets as far as the launch (CUDA error 35)."""
    assert_launch_reaches_the_driver(LAUNCH_ON_CPU, tmp_path)


CAPPED_ON_CPU = LAUNCH_ON_CPU.replace(
    'AttnResKind.from_tag("n3-add-norm"))\ncompiled',
    'AttnResKind.from_tag("n3-add-norm"), capped=True)\nassert plan.launch_smem_bytes == 46720, plan\ncompiled',
)


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_capped_launch_compiles_and_reaches_the_driver(tmp_path):
    """The cap is the launch's shared-memory request: the capped plan compiles and its launch gets as far as the
    driver, as the uncapped one does."""
    assert "capped=True" in CAPPED_ON_CPU and "46720" in CAPPED_ON_CPU
    assert_launch_reaches_the_driver(CAPPED_ON_CPU, tmp_path)


ONE_PASS_ON_CPU = (
    LAUNCH_ON_CPU.replace("768, 2, AttnResKind", "768, 64, AttnResKind")
    .replace('"n3-add-norm"))\ncompiled', '"n1-add-norm"), one_pass=True)\nassert plan.mma.passes == (64,)\ncompiled')
    .replace("bf16(2, ", "bf16(64, ")
)


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_one_pass_launch_compiles_and_reaches_the_driver(tmp_path):
    """The one-pass stream's launch path (TP16 B64, eight batch tiles) compiles from the same fake signature and hands
    over every argument, as the served two passes do."""
    assert ONE_PASS_ON_CPU.count("bf16(64, ") == 5 and "one_pass=True" in ONE_PASS_ON_CPU
    assert_launch_reaches_the_driver(ONE_PASS_ON_CPU, tmp_path)


def test_the_provider_never_serves_more_rows_than_the_kernel_takes():
    from k3_decode.kernels.providers import max_rows

    for tp in (8, 16):
        served = max_rows("o_proj", "cute-kda-o-proj", tp)
        assert served is not None and 1 <= served[0] <= MAX_BATCH, (tp, served)


# The knobs that change only when W's bytes arrive and where they are read from (prefetched into L2, staged in
# shared memory by bulk copies), never which thread computes what: their builds must store the plain stream's
# values. One pass and paired rows move partial sums and rows to other threads and shared-memory slots, so only
# their GPU tests compare bits.
SAME_VALUE_KNOBS = ("warm_l2", "w_l2", "w_smem")
SAME_VALUE_BUILDS = [
    b for b in o_proj_builds() if any(getattr(b.plan, k) for k in SAME_VALUE_KNOBS) and not b.plan.paired_rows
]
assert {k for b in SAME_VALUE_BUILDS for k in SAME_VALUE_KNOBS if getattr(b.plan, k)} == set(SAME_VALUE_KNOBS)


def plain_twin(build: KdaOProjBuild) -> KdaOProjBuild:
    return dataclasses.replace(build, plan=dataclasses.replace(build.plan, **dict.fromkeys(SAME_VALUE_KNOBS, False)))


def value_roles(plan: OProjPlan) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Threads (the first, one inside warp 1, the last) of a CTA of the first epilogue cluster, which also mixes
    AttnRes, and of the grid's last cluster, which only streams W (the grid is rank in cluster by cluster)."""
    assert plan.clusters - 1 >= plan.first_epilogue_cluster + plan.epilogue_clusters, plan.tag
    return [0, 37, plan.threads - 1], [
        (min(1, plan.cluster - 1), plan.first_epilogue_cluster, 0),
        (0, plan.clusters - 1, 0),
    ]


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.parametrize("build", SAME_VALUE_BUILDS, ids=[b.name for b in SAME_VALUE_BUILDS])
def test_a_build_that_only_moves_w_stores_the_plain_streams_values(build):
    """Warming L2, W in L2 and W staged in shared memory claim the plain stream's bits: every traced thread stores
    the same expressions at the same addresses (harness.ptx_values: integers concrete, floats symbolic; a shared
    load of W a bulk copy staged reads W's global word), for every input at once, where the GPU test compares one
    input's outputs."""
    from harness.ptx_values import compare

    plain, ptx = sm90_ptx(plain_twin(build)), sm90_ptx(build)
    threads, blocks = value_roles(build.plan)
    for block in blocks:
        assert compare(plain, ptx, threads, block, follow_copies=build.plan.w_smem) == [], block


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.parametrize("name", ["kda_o_proj/tp8/b4/n8-add-norm/w-l2", "kda_o_proj/tp16/b16/n8-add-norm/w-smem"])
def test_a_variant_whose_mixing_fuses_another_product_is_seen_in_every_mixing_thread(name, monkeypatch):
    """The broken case: a W-to-L2 and a W-in-shared-memory build compiled with AttnRes's mixing fusing each
    source's product into the sum instead of the compiler's choice (the rounding difference an unpinned
    `a * b + c * d` allows two builds) must store other output values than the plain stream in every thread of the
    mixing CTA, and nothing else in the CTA that only streams W."""
    import cutlass
    import cutlass.cute as cute

    from harness.ptx_values import compare
    from k3_decode.kernels import attn_res

    @cute.jit
    def mix_other_product(sources: list, alphas: list) -> cute.TensorSSA:
        m = sources[0] * alphas[0]
        for s in cutlass.range_constexpr(1, len(sources)):
            m = cute.math.fma(sources[s], cute.full_like(m, alphas[s]), m)
        return m

    (build,) = [b for b in SAME_VALUE_BUILDS if b.name == name]
    plain = sm90_ptx(plain_twin(build))  # compiled before the patch (or cached by the same-values test)
    threads, (mixing, streaming) = value_roles(build.plan)
    monkeypatch.setattr(attn_res, "_mix", mix_other_product)
    broken = build.compile("sm_90a").ptx
    diffs = compare(plain, broken, threads, mixing, follow_copies=build.plan.w_smem)
    assert {d.thread for d in diffs if d.space == "global"} == set(threads), diffs[:3]  # the output rows
    assert compare(plain, broken, threads, streaming, follow_copies=build.plan.w_smem) == []
