"""The head-ordered input projection (kda_head_stream.py): its plan (fast, no CuTe DSL) and its sm_90a builds with
their PTX, SASS and cubin checked, and the broken builds the checks must catch (slow; needs CuTe DSL)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from harness.kernels_cmd import cubin_resources, parse_expectations, select_builds
from k3_decode.config import K3
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, K3KernelBuilds, KdaHeadStreamBuild
from k3_decode.kernels.kda_head_stream_plan import MAX_BATCH, HeadStreamPlan
from tests.k3_decode.kernels.helpers import (
    assert_launch_reaches_the_driver,
    build_command,
    failed_checks_of_broken_build,
    needs_cutedsl,
)

H200_SMS = 132
SMEM_PER_SM = 228 * 1024


def plan_at(
    tp: int, batch: int = 1, split: int = 2, sm_count: int = H200_SMS, watch: bool = False, stages: int = 0
) -> HeadStreamPlan:
    s = K3.shard(tp)
    return HeadStreamPlan.for_shape(
        s.kda_in_proj_rows, s.hidden, batch, s.kda_heads, K3.kda.head_dim, split, sm_count, watch, stages
    )


def head_stream_builds() -> list[KdaHeadStreamBuild]:
    return [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaHeadStreamBuild)]


# --- the plan -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp, split, ctas, trips", [(8, 2, 262, 6), (8, 4, 262, 12), (16, 2, 134, 6), (16, 4, 134, 12)])
def test_the_grid_fills_every_sm_in_whole_trips(tp, split, ctas, trips):
    plan = plan_at(tp, split=split)
    assert (plan.ctas, plan.trips) == (ctas, trips)
    assert plan.row_groups * plan.trips == plan.rows  # every trip whole: no SM idles in a partial last trip
    assert H200_SMS <= plan.ctas <= 2 * H200_SMS and plan.ctas_per_sm == 2
    assert plan.steps_per_unit * plan.split * 256 == K3.hidden_size
    assert 2 * (plan.smem_bytes + 1024) <= SMEM_PER_SM  # two CTAs an SM at the largest batch too
    assert 2 * (plan_at(tp, MAX_BATCH, split).smem_bytes + 1024) <= SMEM_PER_SM


@pytest.mark.parametrize("tp", [8, 16])
def test_the_stream_order_is_every_packed_row_once_shared_rows_then_head_by_head(tp):
    plan, shard = plan_at(tp), K3.shard(tp)
    order = [plan.row_at(p) for p in range(plan.rows)]
    assert sorted(order) == list(range(plan.rows))  # a permutation: every row streamed exactly once
    sections = shard.in_proj_sections()
    shared = set(range(sections["f_a"].start, plan.rows))  # f_a, beta and the padding
    assert set(order[: plan.shared_rows]) == shared and plan.group_rows(0) == len(shared) == plan.shared_rows
    for h in range(plan.heads):
        rows = {plan.row_at(p) for p in plan.positions(1 + h)}
        want = set()
        for name in ("q", "k", "v", "g"):  # head h's rows of each of the four sections
            start = sections[name].start + h * plan.head_dim
            want |= set(range(start, start + plan.head_dim))
        assert rows == want, f"head {h}'s positions hold other rows"
        assert {plan.group_of(p) for p in plan.positions(1 + h)} == {1 + h}
    assert sum(plan.group_rows(g) for g in range(plan.groups)) == plan.rows


@pytest.mark.parametrize("tp", [8, 16])
def test_heads_finish_in_order_trip_by_trip(tp):
    """At trip t the grid streams positions Q t .. Q (t + 1) - 1, so a head's last row is in a trip no earlier than the
    previous head's: the ordering the plan's head pipelining relies on."""
    plan = plan_at(tp, split=4)
    last_trip = [plan.trip_of(plan.positions(g)[-1]) for g in range(plan.groups)]
    assert last_trip == sorted(last_trip) and last_trip[-1] == plan.trips - 1
    assert last_trip[1] < last_trip[-1]  # not every head at the end: the first head is done trips before the last
    covered = sorted(q + plan.row_groups * t for q in range(plan.row_groups) for t in range(plan.trips))
    assert covered == list(range(plan.rows))  # the row groups' trips are every position once


def test_the_watching_warp_adds_threads_and_words_not_stream_work():
    plain, watched = plan_at(8), plan_at(8, watch=True)
    assert (watched.threads, plain.threads) == (288, 256) and watched.stream_threads == 256
    assert (watched.ctas, watched.trips, watched.fill_loads) == (plain.ctas, plain.trips, plain.fill_loads)
    assert watched.epoch_word == plain.trace_words and watched.done_word == plain.trace_words + 1
    assert watched.trace_words == plain.trace_words + 2 + watched.ctas * watched.groups


def test_a_copy_fed_ring_leaves_two_ctas_an_sm_room_or_is_refused():
    ring = plan_at(16, split=4, stages=3)
    assert ring.ring_bytes == 8 * 3 * 3584 and 2 * (ring.smem_bytes + 1024) <= SMEM_PER_SM
    assert ring.smem_bytes == plan_at(16, split=4).smem_bytes + ring.ring_bytes + 8 * 8 * 3
    with pytest.raises(ValueError, match="do not fit an SM"):  # x of 4 rows beside the ring: over 114 KB a CTA
        plan_at(16, batch=4, split=4, stages=3)
    with pytest.raises(ValueError, match=r"0\.\.4 stages"):
        plan_at(16, split=4, stages=5)


def test_the_plan_refuses_shapes_it_cannot_take():
    s = K3.shard(8)
    with pytest.raises(ValueError, match="2 or 4 slices"):
        HeadStreamPlan.for_shape(s.kda_in_proj_rows, s.hidden, 1, s.kda_heads, 128, split=3)
    with pytest.raises(ValueError, match=r"batches 1\.\.8"):
        HeadStreamPlan.for_shape(s.kda_in_proj_rows, s.hidden, 9, s.kda_heads, 128)
    with pytest.raises(ValueError, match="multiple of 1024"):
        HeadStreamPlan.for_shape(s.kda_in_proj_rows, 7168 - 512, 1, s.kda_heads, 128, split=4)
    with pytest.raises(ValueError, match="cannot hold 12 heads"):
        HeadStreamPlan.for_shape(6144, s.hidden, 1, s.kda_heads, 128)
    with pytest.raises(ValueError, match="pad the packed rows"):  # 6289 is prime: no grid divides it
        HeadStreamPlan.for_shape(6289, s.hidden, 1, s.kda_heads, 128)


# --- what is built ----------------------------------------------------------------------------------------------


def test_builds_are_every_tp_batch_and_split_at_the_ranks_rows_and_b1_watched_and_copy_fed():
    builds = head_stream_builds()
    assert {(b.tp, b.plan.batch, b.plan.split, b.plan.watch, b.plan.stages) for b in builds} == (
        {(tp, b, s, False, 0) for tp in (8, 16) for b in (1, 4, 8) for s in (2, 4)}
        | {(tp, 1, s, True, 0) for tp in (8, 16) for s in (2, 4)}
        | {(tp, 1, 4, False, 3) for tp in (8, 16)}
    )
    assert len({b.name for b in builds}) == len(builds) == 18
    assert {b.tp: (b.plan.rows, b.plan.heads) for b in builds} == {8: (6288, 12), 16: (3216, 6)}
    tags = {b.name: b.tags for b in builds}
    b8 = tags["kda_head_stream/tp8/b8/s4"]  # 7 steps a trip, 28 staging passes, slice sums in two 4-word vectors
    assert (b8["weight_loads_ahead"], b8["global_loads"], b8["x_stages"], b8["x_reads"]) == (7, 7 + 7 + 28, 28, 56)
    assert (b8["shared_stores"], b8["shared_loads"], b8["fmas"], b8["out_stores"]) == (28 + 2, 56 + 3 * 2, 448, 8)
    b1 = tags["kda_head_stream/tp16/b1/s2"]  # 14 steps a trip, 896 vectors of x over 256 threads: 4 passes
    assert (b1["global_loads"], b1["shared_stores"], b1["shared_loads"], b1["group_threads"]) == (32, 5, 15, 64)
    assert (b1["threads"], b1["acquire_loads"], b1["stamps"], b1["release_adds"], b1["cta_barriers"]) == (
        256,
        0,
        2,
        1,
        1,
    )
    w = tags["kda_head_stream/tp16/b1/s2/watch"]  # 7 groups: the epoch and two polls each; a stamp each
    assert (w["threads"], w["acquire_loads"], w["stamps"], w["release_adds"], w["cta_barriers"]) == (288, 15, 9, 2, 2)
    assert w["global_loads"] == b1["global_loads"] and w["shared_loads"] == b1["shared_loads"]  # the same stream
    r = tags["kda_head_stream/tp8/b1/s4/ring3"]  # 3 trips copied ahead, 1 refill; W read back from the ring
    assert (r["bulk_copies"], r["bulk_copies_ahead"], r["proxy_fences"], r["weight_loads_ahead"]) == (4, 3, 2, 0)
    assert (r["global_loads"], r["x_reads"], r["shared_loads"]) == (4, 7 + 7, 7 + 7 + 3)
    assert tags["kda_head_stream/tp8/b1/s4"]["bulk_copies"] == 0


def test_expectations_judge_every_head_stream_build():
    expectations = parse_expectations(K3_KERNEL_BUILDS.expectations_text(), "expectations.toml", "sm_90a")
    assert len(select_builds(K3_KERNEL_BUILDS, "sm_90a", expectations, "kda_head_stream/*")) == 18
    assert expectations["kda_head_stream"].max_registers == 128 and expectations["kda_head_stream"].max_frame_bytes == 0
    assert len(expectations["kda_head_stream"].rules) >= 25


def test_a_tp_the_model_cannot_shard_is_a_build_table_error(monkeypatch):
    table = K3_KERNEL_BUILDS.table | {"kda_head_stream": K3_KERNEL_BUILDS.table["kda_head_stream"] | {"tp": [7]}}
    builds = K3KernelBuilds()
    monkeypatch.setattr(K3KernelBuilds, "table", table)
    with pytest.raises(ValueError, match=r"builds\.toml kda_head_stream\.tp"):
        builds.kda_head_stream_builds()


# --- the real builds (CuTe DSL, no GPU) ---------------------------------------------------------------------------


@pytest.mark.slow
@needs_cutedsl
def test_every_head_stream_build_compiles_and_meets_its_expectations(tmp_path):
    out = tmp_path / "out"
    proc = build_command(tmp_path, "--out", str(out), "--json", "--jobs", "2", "--match", "kda_head_stream/*")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)["subjects"]["K3_KERNEL_BUILDS"]
    assert report["ok"] and len(report["builds"]) == 18
    assert all(b["ok"] and len(b["checks"]) >= 39 for b in report["builds"])
    for b in report["builds"]:  # facts read straight from the artifacts, independent of the expectations file
        name = b["build"]
        ptx = (out / name / "kernel.ptx").read_text()
        sass = (out / name / "kernel.sass").read_text()
        (res,) = cubin_resources((out / name / "kernel.cubin").read_bytes()).values()
        assert res.frame_bytes == 0 and res.registers * b["tags"]["threads"] * 2 <= 65536, (name, res)
        head, _, tail = sass.partition("ACQBULK")
        assert tail and "LDS" not in head, f"{name}: x or the ring read before the dependency wait"
        publish = ptx.index("atom.global.release.add.u32")
        # the row's outputs are stored after its group meets and before it is published
        assert ptx.rfind("st.global.b16", 0, publish) > ptx.rfind("bar.sync", 0, publish), name
        assert sass.count("FFMA") == b["tags"]["fmas"], name


def patched_cute(patch: str) -> str:
    """A broken case's patch module: CuTe DSL imported for sm_90a as `cute`, then `patch`, in the compiling process."""
    return 'import os\nos.environ["CUTE_DSL_ARCH"] = "sm_90a"\nimport cutlass.cute as cute\n' + patch


# Each broken case removes one thing a check exists for, in the compiling process only; the named rule must catch it
# while the build still compiles within its register cap.
UNSYNCHRONIZED_SLICES = patched_cute("""
cute.arch.barrier = lambda *args, **kwargs: None
""")

RELAXED_PUBLISH = patched_cute("""
add = cute.arch.atomic_add
cute.arch.atomic_add = lambda ptr, value, sem=None, scope=None, **kw: add(ptr, value, sem="relaxed", scope=scope, **kw)
""")


@pytest.mark.slow
@needs_cutedsl
def test_a_row_group_that_does_not_meet_before_summing_its_slices_fails_its_build(tmp_path):
    """Without the named barrier the leading warp reads slice sums the other warps have not written yet (and a warp
    two trips ahead overwrites them): the barrier rule catches it."""
    failed = failed_checks_of_broken_build(tmp_path, "kda_head_stream/tp8/b1/s4", UNSYNCHRONIZED_SLICES)
    assert len(failed) == 2 and all("bar" in name for name in failed), sorted(failed)


@pytest.mark.slow
@needs_cutedsl
def test_a_row_published_with_a_relaxed_add_fails_its_build(tmp_path):
    """A relaxed add lets a waiter that sees the full count read outputs not yet visible: the release rules catch
    it (and the rule that allows only the two kinds of add)."""
    failed = failed_checks_of_broken_build(tmp_path, "kda_head_stream/tp16/b4/s2", RELAXED_PUBLISH)
    assert any("release" in name for name in failed) and any("atom" in name for name in failed), sorted(failed)
    assert len(failed) <= 4, sorted(failed)


LAUNCH_ON_CPU = """
import torch
from k3_decode.kernels import kda_head_stream_op
from k3_decode.kernels.kda_head_stream_plan import HeadStreamPlan

plan = HeadStreamPlan.for_shape(3216, 7168, 2, 6, 128, split=4)
compiled = kda_head_stream_op._compiled(plan)
x, w, out = (torch.zeros(*s, dtype=torch.bfloat16) for s in ((2, 7168), (3216, 7168), (2, 3216)))
kda_head_stream_op.launch(compiled, x, w, out, torch.zeros(plan.trace_words, dtype=torch.int32), 0)
"""


@pytest.mark.slow
@needs_cutedsl
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_gpu_launch_path_binds_every_argument(tmp_path):
    """The launcher the GPU test and the benchmark use compiles from the build's fake signature and hands over
    every argument; without a driver the call gets as far as the launch (CUDA error 35), not a binding error."""
    assert_launch_reaches_the_driver(LAUNCH_ON_CPU, tmp_path)


RELAXED_POLL = patched_cute("""
load = cute.arch.load
cute.arch.load = lambda ptr, dtype, sem=None, scope=None, **kw: load(ptr, dtype, sem="relaxed", scope=scope, **kw)
""")


@pytest.mark.slow
@needs_cutedsl
def test_a_watcher_that_polls_with_relaxed_loads_fails_its_build(tmp_path):
    """A relaxed poll that sees a group's full count does not order the watcher's later reads of the group's outputs
    after it (the step's workers would read q, k, v not yet visible): the acquire-load rule catches it."""
    failed = failed_checks_of_broken_build(tmp_path, "kda_head_stream/tp8/b1/s4/watch", RELAXED_POLL)
    assert failed == {"ptx 'ld\\\\.acquire\\\\.gpu\\\\.global\\\\.b32'"}, sorted(failed)


NO_PROXY_FENCE = patched_cute("""
cute.arch.fence_proxy = lambda *args, **kwargs: None
""")


@pytest.mark.slow
@needs_cutedsl
def test_a_ring_refilled_without_the_proxy_fence_fails_its_build(tmp_path):
    """Without the async-proxy fence the copy engine's refill of a stage is not ordered after the warp's reads of
    it, so a refill may land under a read of the trip before: the fence rule catches it, and only that rule."""
    failed = failed_checks_of_broken_build(tmp_path, "kda_head_stream/tp16/b1/s4/ring3", NO_PROXY_FENCE)
    assert failed == {"ptx 'fence\\\\.proxy\\\\.async\\\\.shared::cta'"}, sorted(failed)
