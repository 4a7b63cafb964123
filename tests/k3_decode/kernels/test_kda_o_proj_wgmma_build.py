"""The fused o_proj's wgmma build (kda_o_proj_wgmma.py): its plan and choice (fast, no CuTe DSL), and its sm_90a
builds judged by expectations.toml, with broken variants the rules must fail (needs CuTe DSL)."""

from __future__ import annotations

import dataclasses
import re
import tempfile
from functools import cache
from pathlib import Path

import pytest

from harness.kernels_cmd import KernelArtifacts, judge, parse_expectations
from k3_decode.config import K3
from k3_decode.kernels.attn_res_plan import AttnResKind
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, KdaOProjBuild, KdaOProjWgmmaBuild
from k3_decode.kernels.kda_o_proj_plan import DRIVER_SMEM_BYTES, SMEM_PER_SM, choice, wgmma_at
from k3_decode.kernels.kda_o_proj_wgmma_plan import CTAS_PER_SM, MIN_BATCH, OProjWgmmaPlan

N1_ADD = AttnResKind.from_tag("n1-add-norm")
TP8, TP16 = K3.shard(8).kda_o_proj, K3.shard(16).kda_o_proj


def plan(
    tp_shape: tuple[int, int], batch: int, kind: AttnResKind = N1_ADD, sm_count: int = 132, ctas_per_sm: int = 3
) -> OProjWgmmaPlan:
    """The plan at three CTAs an SM unless asked (kda_o_proj_choice.toml serves two at some batches)."""
    hidden, k = tp_shape
    return OProjWgmmaPlan.for_shape(hidden, k, batch, kind, sm_count, ctas_per_sm=ctas_per_sm)


# --- the plan (no CuTe DSL) ----------------------------------------------------------------------------------------


def test_the_grid_is_112_stream_ctas_and_up_to_32_epilogue_clusters():
    p = plan(TP8, 64)
    assert (p.cluster, p.threads, p.stream_clusters, p.first_epilogue_cluster) == (7, 128, 16, 16)
    assert (p.epilogue_clusters, p.epilogue_rows, p.clusters, p.ctas) == (32, 2, 48, 336)
    assert p.arrival_master == (1 << 31) - 335
    assert p.stream.m_tiles == 112 and p.stream.k_splits == 1 and p.stream.n == 64
    small = plan(TP16, 16)
    assert (small.epilogue_clusters, small.epilogue_rows, small.ctas) == (16, 1, 224)
    odd = plan(TP8, 33)  # 17 clusters of two rows, the last one's second row past the batch
    assert (odd.epilogue_clusters, odd.epilogue_rows, odd.stream.n) == (17, 2, 48)


@pytest.mark.parametrize("tp_shape", [TP8, TP16], ids=["tp8", "tp16"])
@pytest.mark.parametrize(
    ("batch", "per_sm"),
    # two an SM: at most 24 epilogue clusters, which the driver's 32 hold with the margin (test_a_ring_for_two_...)
    [(b, CTAS_PER_SM) for b in (MIN_BATCH, 16, 17, 32, 33, 48, 64)] + [(b, 2) for b in (MIN_BATCH, 16, 24, 32, 48, 64)],
)
def test_the_ring_fits_the_ctas_an_sm_it_is_sized_for_and_the_grid_runs(tp_shape, batch, per_sm):
    p = plan(tp_shape, batch, AttnResKind.from_tag("n8-add-norm"), ctas_per_sm=per_sm)
    assert p.ctas_per_sm == per_sm and 2 <= p.stages <= min(8, p.k // p.k_tile)
    assert per_sm * (p.smem_bytes + DRIVER_SMEM_BYTES) <= SMEM_PER_SM
    assert p.smem_bytes >= p.stream.smem_bytes + p.exchange_bytes  # the ring, then the exchanges
    assert p.resident_clusters > p.epilogue_clusters
    if per_sm == CTAS_PER_SM:
        assert p.ctas <= 132 * per_sm  # one wave
    else:  # more than one wave from B24 at two an SM: the driver's 32 clusters hold the waiting ones and the margin
        assert p.epilogue_clusters + p.resident_margin <= 32
    assert p.epilogue_clusters * p.epilogue_rows >= batch > (p.epilogue_clusters - 1) * p.epilogue_rows


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((TP8, MIN_BATCH - 1), r"serves 9\.\.64 rows, got 8; use the mma\.sync build"),
        ((TP8, 65), r"serves 9\.\.64 rows, got 65"),
        (((7168 + 256, 1536), 32), r"one warpgroup \(128 threads\); hidden 7424 gives 928"),
        (((3584, 768), 32), r"one warpgroup"),
        ((TP8, 64, N1_ADD, 10), r"hold 4 clusters at once, not more than the 32"),
        ((TP8, 32, AttnResKind(1, "add", False, True, "float32")), r"BF16 o_proj output as delta"),
    ],
)
def test_a_shape_it_cannot_take_is_refused_in_one_line(args, says):
    with pytest.raises(ValueError, match=says) as err:
        plan(*args)
    assert "\n" not in str(err.value)


def test_a_ring_for_two_ctas_an_sm_holds_more_stages_and_passes_the_sm_count_but_not_the_drivers():
    """Counting SMs, 132 x 2 // 7 = 37 clusters of the two-a-SM build fit at once, more than the 32 that wait at
    B64, so the plan passes; on one H100 it hung there and at B32 (b8e3e11). What the op checks before launching is
    the driver's count (cluster_residency), which the GPU test holds at most 32 there: this is the refusal then."""
    three = OProjWgmmaPlan.for_shape(*TP8, 64, N1_ADD, 132, ctas_per_sm=3, paired_rows=False)
    two = OProjWgmmaPlan.for_shape(*TP8, 64, N1_ADD, 132, ctas_per_sm=2, paired_rows=False, max_epilogue_clusters=32)
    assert (three.ctas_per_sm, two.ctas_per_sm) == (3, 2) and two.stages > three.stages
    assert 2 * (two.smem_bytes + DRIVER_SMEM_BYTES) <= SMEM_PER_SM < 3 * (two.smem_bytes + DRIVER_SMEM_BYTES)
    assert two.resident_clusters == 132 * 2 // 7 > two.epilogue_clusters == 32
    assert two.tag.endswith("/c2/e32") and three.tag.endswith("/c3")
    assert two.residency == (128, 2, two.smem_bytes) and three.residency == (128, 3, three.smem_bytes)
    assert two.resident_margin == three.resident_margin == 8  # half the 16 stream clusters
    two.check_resident(40)
    with pytest.raises(ValueError) as err:
        two.check_resident(39)
    says = str(err.value)
    assert "holds 39 of its clusters of 7 CTAs at once" in says and "fewer than the 32 that wait" in says
    assert "and 8 more" in says and "wgmma_ctas_per_sm" in says and "\n" not in says
    with pytest.raises(ValueError, match=r"serve the mma\.sync build at these rows"):
        three.check_resident(39)
    three.check_resident(47)  # what the driver holds on an H100/H200: the ring for three passes at B64

    # two an SM, 32 held: with up to 32 epilogue clusters refused at B25-B32 and B49-B64 (25 or more waiting with the
    # 8), where the runs hung at B32 and B64 and finished at B21-B24
    def fits(cap: int | None) -> list[int]:
        plans = [OProjWgmmaPlan.for_shape(*TP8, b, N1_ADD, 132, ctas_per_sm=2, max_epilogue_clusters=cap) for b in B]
        return [p.batch for p in plans if p.epilogue_clusters + p.resident_margin <= 32]

    B = range(9, 65)
    assert fits(32) == [*range(9, 25), *range(33, 49)]
    # so two-an-SM plans wait on at most 24 (TWO_PER_SM_EPILOGUE_CLUSTERS): every batch fits, two rows a cluster from
    # 25 and three from 49; below 25 and at 33-48 the grid is the one with 32
    assert fits(None) == list(B)
    capped = {b: OProjWgmmaPlan.for_shape(*TP8, b, N1_ADD, 132, ctas_per_sm=2) for b in B}
    assert {b: p.epilogue_rows for b, p in capped.items() if b in (24, 25, 32, 33, 48, 49, 64)} == {
        24: 1,
        25: 2,
        32: 2,
        33: 2,
        48: 2,
        49: 3,
        64: 3,
    }
    assert (capped[64].epilogue_clusters, capped[32].epilogue_clusters) == (22, 16)
    for b in [*range(9, 25), *range(33, 49)]:
        same = OProjWgmmaPlan.for_shape(*TP8, b, N1_ADD, 132, ctas_per_sm=2, max_epilogue_clusters=32)
        assert (capped[b].epilogue_rows, capped[b].epilogue_clusters) == (same.epilogue_rows, same.epilogue_clusters)
        assert capped[b].tag == same.tag.removesuffix("/e32")
    capped[64].check_resident(30)  # 22 waiting and the 8 beside them
    with pytest.raises(ValueError, match=r"fewer than the 22 that wait for the grid and 8 more"):
        capped[64].check_resident(29)
    with pytest.raises(ValueError, match=r"max_epilogue_clusters is 1\.\.32, got 33"):
        OProjWgmmaPlan.for_shape(*TP8, 64, N1_ADD, 132, max_epilogue_clusters=33)
    with pytest.raises(ValueError, match=r"sized for \(2, 3\) CTAs an SM, got 4"):
        OProjWgmmaPlan.for_shape(*TP8, 64, N1_ADD, 132, ctas_per_sm=4)


def test_the_choice_file_serves_it_by_batch_range(tmp_path):
    path = tmp_path / "choice.toml"
    path.write_text("cap_batches = []\none_pass = []\nwgmma_batches = [[32, 64]]\n")
    assert choice(path).wgmma_batches == ((32, 64),)
    assert [wgmma_at(b, path) for b in (16, 31, 32, 64)] == [False, False, True, True]
    two = tmp_path / "two.toml"  # (choice files are read once per path)
    two.write_text("cap_batches = []\none_pass = []\nwgmma_ctas_per_sm = 2\n")
    assert (
        choice(two).wgmma_ctas_per_sm == 2 and choice(two).wgmma_batches == () and choice(path).wgmma_ctas_per_sm == 3
    )
    bad_sm = tmp_path / "bad-sm.toml"
    bad_sm.write_text("cap_batches = []\none_pass = []\nwgmma_ctas_per_sm = 4\n")
    with pytest.raises(ValueError, match=r"wgmma_ctas_per_sm is one of \(2, 3\)"):
        choice(bad_sm)
    for i, bad in enumerate(("[[64, 32]]", "[[8, 64]]", "[[32, 65]]")):  # reversed, below its least, past 64
        path = tmp_path / f"bad-{i}.toml"
        path.write_text(f"cap_batches = []\none_pass = []\nwgmma_batches = {bad}\n")
        with pytest.raises(ValueError, match=r"wgmma_batches\[0\] is a \[first, last\] range within 9\.\.64"):
            choice(path)
    for i, bad in enumerate(("[[64, 32]]", "[[8, 64]]")):
        path = tmp_path / f"bad-l2-{i}.toml"
        path.write_text(f"cap_batches = []\none_pass = []\nwgmma_w_l2_batches = {bad}\n")
        with pytest.raises(ValueError, match=r"wgmma_w_l2_batches\[0\] is a \[first, last\] range within 9\.\.64"):
            choice(path)


def test_two_per_sm_batches_size_the_ring_for_two_ctas_an_sm_only_there(tmp_path, monkeypatch):
    """wgmma_two_per_sm_batches: the plan is sized for two CTAs an SM within its ranges (more stages), three
    elsewhere; the argument overrides the file; a range outside 9..64 is a one-line error."""
    from k3_decode.kernels import kda_o_proj_plan

    path = tmp_path / "two-range.toml"
    path.write_text("cap_batches = []\none_pass = []\nwgmma_two_per_sm_batches = [[33, 48]]\n")
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", path)
    per_sm = {b: OProjWgmmaPlan.for_shape(*TP8, b, N1_ADD, 132).ctas_per_sm for b in (32, 33, 40, 48, 49, 64)}
    assert per_sm == {32: 3, 33: 2, 40: 2, 48: 2, 49: 3, 64: 3}
    two, three = (OProjWgmmaPlan.for_shape(*TP8, 48, N1_ADD, 132, ctas_per_sm=n) for n in (2, 3))
    assert two.stages > three.stages and OProjWgmmaPlan.for_shape(*TP8, 40, N1_ADD, 132).tag.count("/c2") == 1
    # At 33-48 rows the driver's 32 clusters of the two-an-SM build hold the waiting ones and the margin.
    assert all(
        OProjWgmmaPlan.for_shape(*TP8, b, N1_ADD, 132).epilogue_clusters + two.resident_margin <= 32 for b in (33, 48)
    )
    bad = tmp_path / "two-bad.toml"
    bad.write_text("cap_batches = []\none_pass = []\nwgmma_two_per_sm_batches = [[4, 48]]\n")
    with pytest.raises(ValueError, match=r"wgmma_two_per_sm_batches\[0\] is a \[first, last\] range within 9\.\.64"):
        kda_o_proj_plan.choice(bad)


def test_two_per_sm_rules_size_the_ring_for_two_ctas_an_sm_at_one_width_only(tmp_path, monkeypatch):
    """wgmma_two_per_sm_rules: two CTAs an SM at their batches where o_proj's K is theirs (TP8's 1536 here), three at
    the other width; a rule without k, with a k that is no width, or with a batch below 9 is a one-line error."""
    from k3_decode.kernels import kda_o_proj_plan

    path = tmp_path / "two-rule.toml"
    path.write_text("cap_batches = []\none_pass = []\nwgmma_two_per_sm_rules = [{ batches = [64, 64], k = 1536 }]\n")
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", path)
    assert [OProjWgmmaPlan.for_shape(*TP8, b, N1_ADD, 132).ctas_per_sm for b in (48, 64)] == [3, 2]
    assert [OProjWgmmaPlan.for_shape(*TP16, b, N1_ADD, 132).ctas_per_sm for b in (48, 64)] == [3, 3]
    bad = {
        "{ batches = [64, 64] }": r"is \{ batches = \[first, last\], k = N \}",
        "{ batches = [64, 64], k = true }": r"k is o_proj's K at one TP size",
        "{ batches = [4, 64], k = 1536 }": r"batches is a \[first, last\] range within 9\.\.64",
    }
    for i, (rule, message) in enumerate(bad.items()):
        wrong = tmp_path / f"two-rule-bad-{i}.toml"
        wrong.write_text(f"cap_batches = []\none_pass = []\nwgmma_two_per_sm_rules = [{rule}]\n")
        with pytest.raises(ValueError, match=rf"wgmma_two_per_sm_rules\[0\].*{message}") as err:
            kda_o_proj_plan.choice(wrong)
        assert "\n" not in str(err.value)


def test_w_l2_sends_each_stream_rows_columns_past_the_rings_first_tiles(tmp_path, monkeypatch):
    """wgmma_w_l2_batches: a stream CTA's ring takes its first `ahead` k tiles of W before the wait; w_l2 sends the
    rest of each of its rows to L2 (nothing twice, nothing left out), at the batches the choice file says."""
    from k3_decode.kernels import kda_o_proj_plan

    path = tmp_path / "w-l2.toml"
    path.write_text("cap_batches = []\none_pass = []\nwgmma_w_l2_batches = [[48, 64]]\n")
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", path)
    for (hidden, k), batch in ((TP8, 64), (TP8, 48), ((7168, 768), 64)):
        plan = OProjWgmmaPlan.for_shape(hidden, k, batch, N1_ADD, 132)
        assert plan.w_l2 and plan.tag.endswith("/w-l2")
        assert plan.l2_first == plan.stream.ahead * plan.k_tile and plan.l2_first + plan.l2_columns == k
        assert 0 < plan.l2_columns < k and plan.l2_columns * 2 % 16 == 0  # a bulk prefetch moves 16-byte multiples
    assert (
        OProjWgmmaPlan.for_shape(*TP8, 64, N1_ADD, 132).l2_first,
        OProjWgmmaPlan.for_shape(*TP8, 64, N1_ADD, 132).l2_columns,
    ) == (256, 1280)
    assert not OProjWgmmaPlan.for_shape(*TP8, 32, N1_ADD, 132).w_l2
    assert OProjWgmmaPlan.for_shape(*TP8, 32, N1_ADD, 132, w_l2=True).w_l2  # the argument over the file
    late = OProjWgmmaPlan.for_shape(*TP8, 64, N1_ADD, 132, w_l2=False, w_l2_late=True)
    assert late.w_l2_late and late.tag.endswith("/w-l2-late") and not late.w_l2
    with pytest.raises(ValueError, match=r"before the wait .* or after it .*, not both"):
        OProjWgmmaPlan.for_shape(*TP8, 64, N1_ADD, 132, w_l2=True, w_l2_late=True)
    both = tmp_path / "both.toml"
    both.write_text(
        "cap_batches = []\none_pass = []\nwgmma_w_l2_batches = [[32, 48]]\nwgmma_w_l2_late_batches = [[48, 64]]\n"
    )
    with pytest.raises(ValueError, match="overlap"):
        kda_o_proj_plan.choice(both)
    # A K the ring takes whole before the wait leaves nothing to send: refused, not a silent no-op.
    with pytest.raises(ValueError, match="no W left to send to L2"):
        OProjWgmmaPlan.for_shape(7168, 256, 64, N1_ADD, 132, w_l2=True)


# --- the builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------------


def _builds() -> list[KdaOProjWgmmaBuild]:
    return [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaOProjWgmmaBuild)]


@cache
def artifacts(name: str) -> KernelArtifacts:
    return next(b for b in _builds() if b.name == name).compile("sm_90a")


def failed_checks(build: KdaOProjWgmmaBuild, art: KernelArtifacts) -> list[str]:
    """Names of the expectations.toml checks `art` fails as `build` (backslashes dropped)."""
    expect = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    result = judge(build, "sm_90a", art, "", expect["kda_o_proj_wgmma"], Path(tempfile.mkdtemp()))
    return sorted(c.name.replace("\\", "") for c in result.checks if not c.passed)


def test_ci_builds_every_tp_batch_and_kind_builds_toml_lists():
    names = {b.name for b in _builds()}
    kinds = ("n1-restart-norm", "n1-add-norm", "n8-add-norm")
    adds, ones = ("n1-add-norm", "n8-add-norm"), ("n1-restart-norm", "n1-add-norm")

    def named(batches: tuple[int, ...], kinds: tuple[str, ...], suffix: str = "") -> set[str]:
        return {f"kda_o_proj_wgmma/tp{tp}/b{b}/{k}{suffix}" for tp in (8, 16) for b in batches for k in kinds}

    served = named((16, 32, 33, 64), kinds)
    two = named((16, 32, 33, 48, 64), adds, "/2-per-sm")
    # two an SM and paired rows at once: as served at 48 rows on one-block layers, and three rows together at 64
    two_paired = named((48, 64), ones, "/2-per-sm/paired")
    paired = named((33, 64), ones, "/paired")
    in_l2 = named((32, 64), adds, "/w-l2")
    late = named((32, 64), ("n1-add-norm",), "/w-l2-late")
    assert names == served | two | two_paired | paired | in_l2 | late
    assert {b.plan.w_l2_late for b in _builds() if b.name in late} == {True}
    assert {b.plan.ctas_per_sm for b in _builds() if b.name in two | two_paired} == {2}
    assert {b.plan.paired_rows for b in _builds() if b.name in two_paired | paired} == {True}
    assert not any(b.plan.paired_rows for b in _builds() if b.name in two | served)
    assert {b.plan.w_l2 for b in _builds() if b.name in in_l2} == {True}
    assert not any(b.plan.w_l2 for b in _builds() if b.name not in in_l2)


def test_every_build_passes_its_expectations():
    pytest.importorskip("cutlass")
    for b in _builds():
        assert failed_checks(b, artifacts(b.name)) == [], b.name


def test_the_rules_fail_o_copied_before_the_dependency_wait():
    """Broken case: the stream's first dependency wait gone, as if o's first tiles went out before it."""
    pytest.importorskip("cutlass")
    b = next(b for b in _builds() if b.name == "kda_o_proj_wgmma/tp8/b64/n1-add-norm")
    art = artifacts(b.name)
    broken = dataclasses.replace(art, ptx=art.ptx.replace("griddepcontrol.wait;", "", 1))
    assert failed_checks(b, broken) == [
        "ptx 'cp.async.bulk.tensor.2d.shared::cta.global' before 'griddepcontrol.wait;'",
        "ptx 'griddepcontrol.wait;'",
    ]


def without_first(art: KernelArtifacts, pattern: str) -> tuple[KernelArtifacts, re.Match[str]]:
    """The artifacts with the PTX's first line matching `pattern` cut out, and that match."""
    found = re.search(pattern, art.ptx, re.M)
    assert found is not None, pattern
    return dataclasses.replace(art, ptx=art.ptx[: found.start()] + art.ptx[found.end() :]), found


def test_the_rules_fail_a_w_l2_build_without_its_prefetch_and_a_plain_one_with_it():
    """Broken cases: the w_l2 build's prefetch gone (the ring would wait out HBM as before), and moved past the
    dependency wait (too late to overlap anything); the plain build's code judged as w_l2 fails on the count."""
    pytest.importorskip("cutlass")
    l2 = next(b for b in _builds() if b.name == "kda_o_proj_wgmma/tp8/b64/n1-add-norm/w-l2")
    art = artifacts(l2.name)
    gone, prefetch = without_first(art, r"^\s*cp\.async\.bulk\.prefetch\.L2\.global[^\n]*\n")
    assert failed_checks(l2, gone) == [
        "ptx 'cp.async.bulk.prefetch.L2.global'",
        "ptx 'cp.async.bulk.prefetch.L2.global' before 'griddepcontrol.wait;'",
    ]
    wait = art.ptx.index("griddepcontrol.wait;")
    assert prefetch.start() < wait
    late = art.ptx[: prefetch.start()] + art.ptx[prefetch.end() : wait + 21] + prefetch.group(0) + art.ptx[wait + 21 :]
    assert failed_checks(l2, dataclasses.replace(art, ptx=late)) == [
        "ptx 'cp.async.bulk.prefetch.L2.global' before 'griddepcontrol.wait;'"
    ]
    # The prefetch moved past the wait is what the w_l2_late build has: it passes as that build, and fails as w_l2.
    late_build = next(b for b in _builds() if b.name == "kda_o_proj_wgmma/tp8/b64/n1-add-norm/w-l2-late")
    late_art = artifacts(late_build.name)
    assert failed_checks(late_build, late_art) == []
    assert late_art.ptx.index("griddepcontrol.wait;") < late_art.ptx.index("cp.async.bulk.prefetch.L2.global")
    assert failed_checks(l2, late_art) == ["ptx 'cp.async.bulk.prefetch.L2.global' before 'griddepcontrol.wait;'"]
    assert failed_checks(late_build, art) == ["ptx 'cp.async.bulk.prefetch.L2.global' before 'griddepcontrol.wait;'"]
    plain = next(b for b in _builds() if b.name == "kda_o_proj_wgmma/tp8/b64/n1-add-norm")
    assert failed_checks(l2, artifacts(plain.name)) == [
        "ptx 'cp.async.bulk.prefetch.L2.global'",
        "ptx 'cp.async.bulk.prefetch.L2.global' before 'griddepcontrol.wait;'",
    ]


def test_the_rules_fail_a_stream_that_never_arrives():
    """Broken case: the stream CTAs' release add gone: the epilogue would wait for arrivals that never come."""
    pytest.importorskip("cutlass")
    b = next(b for b in _builds() if b.name == "kda_o_proj_wgmma/tp16/b32/n8-add-norm")
    art = artifacts(b.name)
    broken, _ = without_first(art, r"^\s*atom\.global\.release\.add\.u32[^\n]*\n")
    failed = failed_checks(b, broken)
    assert "ptx 'batom.'" in failed and "ptx 'atom.global.release(.gpu)?.add.u32'" in failed, failed


def test_the_rules_fail_the_mma_sync_build_in_its_place():
    """Broken case: the mma.sync fused o_proj's code judged as the wgmma build fails on the warpgroup MMAs, the tile
    copies, the waits and the residency it is built for."""
    pytest.importorskip("cutlass")
    wgmma = next(b for b in _builds() if b.name == "kda_o_proj_wgmma/tp8/b32/n1-add-norm")
    mma = next(
        b
        for b in K3_KERNEL_BUILDS.builds("sm_90a")
        if isinstance(b, KdaOProjBuild) and b.name == "kda_o_proj/tp8/b32/n1-add-norm"
    )
    failed = failed_checks(wgmma, mma.compile("sm_90a"))
    for rule in (
        "sass 'bHGMMA.64xd+x16.F32.BF16b'",
        "sass 'bHMMAb|bLDLb|bSTLb'",
        "ptx 'cp.async.bulk.tensor.2d.shared::cta.global'",
        "ptx 'griddepcontrol.wait;'",
        "ptx '^.minnctapersm 3$'",
    ):
        assert rule in failed, failed


def exchange_order(ptx: str) -> str:
    """After the epilogue's poll of the arrival word (the code's first acquire load), each DSMEM push (st.async) as
    P and each barrier wait (mbarrier.try_wait) as W, in code order."""
    tail = ptx[ptx.index("ld.acquire.gpu.global") :]
    return "".join("P" if m.group(0) == "st.async" else "W" for m in re.finditer(r"st\.async|mbarrier\.try_wait", tail))


@pytest.mark.parametrize(
    "plain",
    ["kda_o_proj_wgmma/tp8/b64/n1-add-norm", "kda_o_proj/tp16/b64/n1-restart-norm/one-pass"],
    ids=["wgmma", "mma-sync"],
)
def test_paired_rows_push_both_rows_before_either_waits(plain: str):
    """kda_o_proj_choice.toml paired_rows in the code, either build: one row at a time pushes a row's logit
    partials, waits, pushes its norm partial, waits, then the next row (PWPW PWPW); paired, both rows' logit
    partials go out before the first wait and the second row's norm partial before the first norm wait (PPWPWPWW).
    The plain build is the broken case: its order must not pass for paired."""
    pytest.importorskip("cutlass")
    builds = {b.name: b for b in K3_KERNEL_BUILDS.builds("sm_90a")}
    one_at_a_time = exchange_order(builds[plain].compile("sm_90a").ptx)
    paired = exchange_order(builds[plain + "/paired"].compile("sm_90a").ptx)
    assert one_at_a_time == "PWPW" * 2 and paired == "PPWPWPWW", (one_at_a_time, paired)


def test_paired_rows_of_the_eight_block_kinds_spill():
    """Why builds.toml pairs only the one-block kinds (and a paired_rows rule should say max_blocks = 1): two rows
    of the eight-block epilogue's 9 sources held at once leave the wgmma build a frame. The build must fail on it."""
    pytest.importorskip("cutlass")
    plan = OProjWgmmaPlan.for_shape(*TP8, 64, AttnResKind.from_tag("n8-add-norm"), 132, paired_rows=True)
    build = KdaOProjWgmmaBuild(8, plan, 8)
    failed = failed_checks(build, build.compile("sm_90a"))
    assert "local-memory frame bytes" in failed, failed
