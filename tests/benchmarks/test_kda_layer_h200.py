"""The CPU-checkable parts of benchmarks/kda_layer_h200.py: attribution of one graph replay's kernels to runtime ops,
grouping of profiled replays, the interleaved speedup statistics, the issue's target verdicts, the results table,
and the refusal to run without a CUDA device. The GPU run itself is not exercised here."""

from __future__ import annotations

import json
import re
from functools import cache

import pytest
import torch

from benchmarks import kda_layer_h200 as bench
from k3_decode.config import K3
from k3_decode.executor.attribution import DeviceEvent, stock_kernel_info
from k3_decode.executor.opmap import load_op_map
from k3_decode.executor.roofline import StepShape, layer_bytes
from k3_decode.kernels.kda_step_plan import KdaStepPlan
from k3_decode.kernels.providers import PROVIDERS
from k3_decode.runtime.ledger import KernelCatalog
from k3_decode.runtime.optable import load_op_table

LAYER = 6  # K3 layer 6: KDA + latent MoE, as in the benchmark's stack
TABLE = load_op_table()
OPMAP = load_op_map(TABLE)
PAIRS = OPMAP.layer_ops(TABLE, K3, LAYER)
CATALOG = KernelCatalog.build(PROVIDERS, OPMAP.stock_launches()).launches
INFO = {op: (i.names, i.absorbs_unnamed) for op, i in stock_kernel_info().items()}
STOCK_PATHS = {op: "stock" for op, _ in PAIRS}
SPECIAL_PATHS = {**STOCK_PATHS, "attn_res": "specialized", "in_proj": "specialized"}
CUTE_ATTN_RES = "kernel_cutlass_kernel_k3_decodekernelsattn_resAttnResKernel_object_at_0x7f00_tensor"
CUTE_IN_PROJ = "kernel_cutlass_kernel_k3_decodekernelskda_in_projKdaInProjKernel_object_at_0x7f00_tensor"
MOE_TAIL = [
    "nvjet_route_gemm",  # route: its GEMM, then its Triton kernel
    "k3_moe_route_kernel",
    "nvjet_latent_down",
    "k3_moe_align_kernel",
    "k3_moe_fc1_kernel",
    "k3_moe_situ_kernel",
    "k3_moe_fc2_kernel",
    "k3_moe_sum_kernel",
    "nvjet_shared_gate_up",
    "k3_situ_and_mul_kernel",
    "nvjet_shared_down",
    "k3_rms_norm_kernel",
    "Memcpy DtoD (Device -> Device)",
    "nvjet_latent_up",
]
# One replay of the KDA layer's graph per path, as the profiler lists it.
STOCK_REPLAY = [
    "Memcpy DtoD (Device -> Device)",
    "attn_res_kernel",
    "nvjet_in_proj",
    "nvjet_f_b",
    "kda_decode_kernel",
    "nvjet_o_proj",
    "attn_res_kernel",
    *MOE_TAIL,
]
SPECIAL_REPLAY = [
    "Memcpy DtoD (Device -> Device)",
    CUTE_ATTN_RES,
    CUTE_IN_PROJ,
    "nvjet_f_b",
    "kda_decode_kernel",
    "nvjet_o_proj",
    "attn_res_kernel",
    *MOE_TAIL,
]


def events(names: list[str], dur: float = 2.0, t0: float = 0.0, corr: int | None = None) -> list[DeviceEvent]:
    out = []
    for i, name in enumerate(names):
        cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        out.append(DeviceEvent(name, cat, t0 + 10.0 * i, dur, corr))
    return out


def slots(paths: dict[str, str]) -> list[bench.Slot]:
    return bench.layer_slots(PAIRS, paths, CATALOG, INFO)


# -- attribution ------------------------------------------------------------------------------------------------


def test_slots_follow_the_op_map_and_collapse_a_provider_into_one_step() -> None:
    stock, special = slots(STOCK_PATHS), slots(SPECIAL_PATHS)
    assert [s.stock_op for s in stock[:6]] == [
        "attn_res",
        "kda_in_proj",
        "kda_f_b",
        "kda_decode",
        "kda_o_proj",
        "attn_res",
    ]
    assert [s.op for s in stock[:6]] == ["attn_res", "in_proj", "kda", "kda", "o_proj", "o_proj"]
    assert [(s.op, s.path, s.names) for s in special[:2]] == [
        ("attn_res", "specialized", ("AttnResKernel",)),
        ("in_proj", "specialized", ("KdaInProjKernel",)),
    ]
    assert len(special) == len(stock)
    # A provider that replaces two stock ops (o_proj: the GEMM and the AttnRes after) is one step.
    catalog = {**CATALOG, ("o_proj", "specialized"): {"OprojKernel": 1}}
    fused = bench.layer_slots(PAIRS, {**STOCK_PATHS, "o_proj": "specialized"}, catalog, INFO)
    assert [s.op for s in fused].count("o_proj") == 1
    unnamed = {k: v for k, v in CATALOG.items() if k != ("kda", "specialized")}
    with pytest.raises(ValueError, match="names none of its provider"):
        bench.layer_slots(PAIRS, {**STOCK_PATHS, "kda": "specialized"}, unnamed, INFO)
    with pytest.raises(ValueError, match="no path recorded"):
        bench.layer_slots(PAIRS, {"attn_res": "stock"}, CATALOG, INFO)


def test_stock_replay_attribution_tells_the_two_attn_res_kernels_apart() -> None:
    names = STOCK_REPLAY  # after the graph's entry copy, two AttnRes kernels of one name
    labels = bench.attribute_events(events(names), slots(STOCK_PATHS), entry_launches=1)
    assert labels[:7] == ["entry", "attn_res", "in_proj", "kda", "kda", "o_proj", "o_proj"]
    assert labels[7:] == ["moe"] * len(MOE_TAIL)


def test_only_the_declared_entry_copies_are_left_out_of_the_ops() -> None:
    # Two copies before the first AttnRes kernel, one of them the entry state's: the other is the AttnRes op's.
    names = ["Memcpy DtoD (Device -> Device)", "Memcpy DtoD (Device -> Device)", CUTE_ATTN_RES, CUTE_IN_PROJ]
    assert bench.attribute_events(events(names), slots(SPECIAL_PATHS), entry_launches=1)[:3] == [
        "entry",
        "attn_res",
        "attn_res",
    ]
    assert bench.attribute_events(events(names), slots(SPECIAL_PATHS))[:2] == ["attn_res", "attn_res"]
    # A named kernel is never taken for an entry copy, even where fewer copies came than declared.
    assert bench.attribute_events(events([CUTE_ATTN_RES, CUTE_IN_PROJ]), slots(SPECIAL_PATHS), 2) == [
        "attn_res",
        "in_proj",
    ]
    # Nor is an unnamed kernel after the first named one (the f_b GEMM here).
    assert (
        bench.attribute_events(
            events([CUTE_ATTN_RES, CUTE_IN_PROJ, "nvjet_f_b", "kda_decode_kernel"]), slots(SPECIAL_PATHS), 2
        )[2]
        == "kda"
    )


def test_the_fused_attention_side_is_four_steps_of_one_kernel_each() -> None:
    """The registered providers' whole KDA attention side: the KDA step replaces f_b + the Triton step, the fused
    o_proj the GEMM and the AttnRes after (one kernel for two stock ops)."""
    fused_paths = {**STOCK_PATHS, **dict.fromkeys(("attn_res", "in_proj", "kda", "o_proj"), "specialized")}
    fused = slots(fused_paths)
    assert [(s.op, s.names) for s in fused[:4]] == [
        ("attn_res", ("AttnResKernel",)),
        ("in_proj", ("KdaInProjKernel",)),
        ("kda", ("KdaStepKernel",)),
        ("o_proj", ("KdaOProjKernel",)),
    ]
    cute = [CUTE_ATTN_RES, CUTE_IN_PROJ, CUTE_IN_PROJ.replace("kda_in_projKdaInProj", "kda_stepKdaStep")]
    cute.append(CUTE_IN_PROJ.replace("kda_in_projKdaInProj", "kda_o_projKdaOProj"))
    labels = bench.attribute_events(events(["Memcpy DtoD (Device -> Device)", *cute, *MOE_TAIL]), fused, 1)
    assert labels[:5] == ["entry", "attn_res", "in_proj", "kda", "o_proj"] and set(labels[5:]) == {"moe"}


def test_cublas_kernels_that_cannot_be_told_apart_are_joined_not_guessed() -> None:
    # TP16: the in_proj GEMM with its split-K reduction, then the f_b GEMM: three unnamed kernels for two ops.
    names = ["attn_res_kernel", "nvjet_in_proj", "splitKreduce_kernel", "nvjet_f_b", "kda_decode_kernel"]
    labels = bench.attribute_events(events(names), slots(STOCK_PATHS))
    assert labels == ["attn_res", "in_proj+kda", "in_proj+kda", "in_proj+kda", "kda"]
    assert bench.side_of("in_proj+kda") == "attention"
    assert bench.side_of("o_proj+moe") == "mixed"
    assert bench.side_of("moe") == "moe"
    assert bench.side_of("entry") == "entry"


def test_specialized_replay_attribution_by_provider_kernel_names() -> None:
    names = [
        CUTE_ATTN_RES,
        CUTE_IN_PROJ,
        "nvjet_f_b",
        "kda_decode_kernel",
        "nvjet_o_proj",
        "attn_res_kernel",
        *MOE_TAIL,
    ]
    labels = bench.attribute_events(events(names), slots(SPECIAL_PATHS))
    assert labels[:6] == ["attn_res", "in_proj", "kda", "kda", "o_proj", "o_proj"]
    assert set(labels[6:]) == {"moe"}
    # On the stock path's steps the CuTe names anchor nothing: they are not stock kernels.
    stock_labels = bench.attribute_events(events(names), slots(STOCK_PATHS))
    assert "attn_res" not in stock_labels[:2]


def test_side_summary_counts_the_attention_side_alone() -> None:
    names = SPECIAL_REPLAY
    special = slots(SPECIAL_PATHS)
    rep = events(names, dur=3.0)
    labelled = [list(zip(bench.attribute_events(rep, special, entry_launches=1), rep, strict=True))]
    op_bytes = {"attn_res": 1_000_000, "in_proj": 9_000_000, "kda": 4_000_000, "o_proj": 2_000_000, "moe": 50_000_000}
    bw = 1e12  # 1 TB/s: 1 MB is 1 us
    att = bench.side_summary(labelled, "attention", op_bytes, bw)
    assert att["launches"] == 6 and att["kernels"] == 6
    assert att["time_us"] == pytest.approx(18.0)
    assert att["span_us"] == pytest.approx(10.0 * 5 + 3.0)  # first attention start to last attention end
    assert att["bytes"] == 16_000_000
    assert att["roofline_us"] == pytest.approx(16.0)
    assert att["roofline_fraction"] == pytest.approx(16.0 / 18.0)
    assert att["by_op"]["kda"]["launches"] == 2 and att["by_op"]["kda"]["roofline_fraction"] == pytest.approx(4 / 6)
    moe = bench.side_summary(labelled, "moe", op_bytes, bw)
    assert moe["launches"] == len(MOE_TAIL) and moe["bytes"] == 50_000_000
    entry = bench.side_summary(labelled, "entry", None, None)
    assert entry["launches"] == 1 and "bytes" not in entry


# -- the per-kernel timeline -------------------------------------------------------------------------------------

LONG_IN_PROJ = CUTE_IN_PROJ + "_tensorptrbf16gmemalign16o1716871681" * 6  # past the 120 characters kept


def _timed_replay(t0: float, attn_dur: float, in_lag: float, in_dur: float, kda_gap: float) -> list:
    """One labelled replay on its own clock (t0): the entry copy, then attn_res, in_proj starting `in_lag` after
    attn_res (inside it: an overlap), kda `kda_gap` after in_proj's end, then a MoE kernel."""
    kda_start = t0 + in_lag + in_dur + kda_gap
    return [
        ("entry", DeviceEvent("Memcpy DtoD (Device -> Device)", "gpu_memcpy", t0 - 3.0, 2.0, 1)),
        ("attn_res", DeviceEvent(CUTE_ATTN_RES, "kernel", t0, attn_dur, 1)),
        ("in_proj", DeviceEvent(LONG_IN_PROJ, "kernel", t0 + in_lag, in_dur, 1)),
        ("kda", DeviceEvent("kda_decode_kernel", "kernel", kda_start, 8.0, 1)),
        ("moe", DeviceEvent("k3_moe_fc1_kernel", "kernel", kda_start + 20.0, 5.0, 1)),
    ]


# Three replays on clocks far apart, each figure's median at replay 2 and neither replay 0's value nor the mean.
TIMED = [
    _timed_replay(1000.0, attn_dur=4.0, in_lag=0.4, in_dur=29.0, kda_gap=1.0),
    _timed_replay(5000.0, attn_dur=12.0, in_lag=0.9, in_dur=31.0, kda_gap=3.0),
    _timed_replay(9000.0, attn_dur=5.0, in_lag=0.6, in_dur=29.9, kda_gap=2.0),
]


def test_timeline_rows_are_median_offsets_from_each_replays_first_start_of_the_side() -> None:
    att = bench.side_summary(TIMED, "attention", None, None)
    rows = att["timeline"]
    assert "timeline_note" not in att
    assert [r["op"] for r in rows] == ["attn_res", "in_proj", "kda"]  # the entry copy and the MoE kernel are not
    assert [r["name"] for r in rows] == [CUTE_ATTN_RES, LONG_IN_PROJ[:120], "kda_decode_kernel"]
    assert [f"{r['op']}: {r['name']}" for r in rows] == att["kernel_names"]  # shortened alike
    approx = pytest.approx
    # Origin: attn_res's start in each replay (not the entry copy 3 us before it, not the trace's clock).
    assert rows[0] == {
        "op": "attn_res",
        "name": CUTE_ATTN_RES,
        "start_us": 0.0,
        "end_us": approx(5.0),  # ends 4, 12, 5: the median, not replay 0's 4 nor the mean 7
        "dur_us": approx(5.0),
        "gap_before_us": None,  # what ran before it is not on this side
    }
    assert rows[1]["start_us"] == approx(0.6)
    assert rows[1]["end_us"] == approx(30.5)  # 29.4, 31.9, 30.5
    assert rows[1]["dur_us"] == approx(29.9)
    # It starts inside attn_res (0.4 - 4, 0.9 - 12, 0.6 - 5): an overlap, a negative gap.
    assert rows[1]["gap_before_us"] == approx(-4.4)
    assert rows[2]["start_us"] == approx(32.5)  # 30.4, 34.9, 32.5
    assert rows[2]["end_us"] == approx(40.5)
    assert rows[2]["gap_before_us"] == approx(2.0)
    # Each side is timed from its own first kernel.
    moe = bench.side_summary(TIMED, "moe", None, None)["timeline"]
    assert [(r["op"], r["start_us"], r["gap_before_us"]) for r in moe] == [("moe", 0.0, None)]


def test_replays_with_different_kernels_give_no_timeline_and_say_why() -> None:
    cublas = ("in_proj", DeviceEvent("nvjet_in_proj", "kernel", 5001.0, 30.0, 1))  # replay 1 ran another build
    swapped = [TIMED[0], [*TIMED[1][:2], cublas, *TIMED[1][3:]], TIMED[2]]
    att = bench.side_summary(swapped, "attention", None, None)
    assert "timeline" not in att
    assert "kernel 1 of replay 1 is in_proj: nvjet_in_proj against in_proj: " in att["timeline_note"]
    assert att["time_us"] > 0 and att["launches"] == 3  # the other figures stand
    # The MoE side's kernels are the same in every replay: its timeline stands.
    assert len(bench.side_summary(swapped, "moe", None, None)["timeline"]) == 1
    short = [TIMED[0], TIMED[1][:-2] + TIMED[1][-1:], TIMED[2]]  # replay 1 lost its KDA kernel
    note = bench.side_summary(short, "attention", None, None)["timeline_note"]
    assert "replay 1 has 2 kernels on this side against 3 in replay 0" in note
    assert bench.side_summary(TIMED, "mixed", None, None)["timeline"] == []  # nothing on a side: no rows


def test_runtime_op_bytes_join_the_roofline_counts_in_launch_order() -> None:
    shape = StepShape(8, (4097,) * 8, 1, 100)
    per_stock = layer_bytes(K3, 8, LAYER, shape)
    per_op = bench.runtime_op_bytes(PAIRS, per_stock)
    assert per_op["attn_res"] == per_stock["attn_res_before"]
    assert per_op["o_proj"] == per_stock["kda_o_proj"] + per_stock["attn_res_after"]
    assert per_op["kda"] == per_stock["kda_f_b"] + per_stock["kda_decode"]
    assert sum(per_op.values()) == sum(per_stock.values())
    swapped = [PAIRS[1], PAIRS[0], *PAIRS[2:]]
    with pytest.raises(ValueError, match="launch orders differ"):
        bench.runtime_op_bytes(swapped, per_stock)


# -- profiled replays -------------------------------------------------------------------------------------------


def _trace() -> dict:
    """Two graph launches (correlations 10 and 30) with an L2 flush kernel launched between them (20)."""
    ev = []
    for corr, ts, name in ((10, 1.0, "cudaGraphLaunch"), (20, 2.0, "cudaLaunchKernel"), (30, 3.0, "cudaGraphLaunch")):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 0.5, "args": {"correlation": corr}})
    kernels = [
        (10, 100.0, "attn_res_kernel"),
        (10, 90.0, "Memcpy DtoD (Device -> Device)"),
        (20, 150.0, "vectorized_elementwise_kernel<FillFunctor>"),
        (30, 200.0, "attn_res_kernel"),
        (10, 110.0, "kda_decode_kernel"),
    ]
    for corr, ts, name in kernels:
        cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 1.0, "args": {"correlation": corr}})
    return {"traceEvents": ev}


def test_graph_replays_group_by_graph_launch_and_leave_the_flush_out() -> None:
    groups = bench.graph_replays(_trace())
    assert [[e.name for e in g] for g in groups] == [
        ["Memcpy DtoD (Device -> Device)", "attn_res_kernel", "kda_decode_kernel"],
        ["attn_res_kernel"],
    ]


def test_split_even_cuts_back_to_back_replays() -> None:
    ev = events(["a", "b", "c", "a", "b", "c"])
    assert [[e.name for e in r] for r in bench.split_even(ev, 2)] == [["a", "b", "c"], ["a", "b", "c"]]
    with pytest.raises(ValueError, match="do not split"):
        bench.split_even(ev, 4)


# -- statistics and verdicts ------------------------------------------------------------------------------------


def test_interleaving_puts_stock_first_in_even_rounds() -> None:
    assert bench.interleave_order(2, 0) == [0, 1]
    assert bench.interleave_order(2, 1) == [1, 0]
    assert bench.interleave_order(1, 1) == [0]


def test_speedup_is_stock_over_specialized_with_its_interval() -> None:
    s = bench.speedup_stats([100.0] * 8, [50.0] * 8)
    assert s["speedup"] == pytest.approx(2.0) and s["low"] == pytest.approx(2.0) and s["high"] == pytest.approx(2.0)
    assert s["rounds"] == 8 and s["ratio_of_medians"] == pytest.approx(2.0)
    slower = bench.speedup_stats([100.0, 101.0, 99.0, 100.0, 102.0, 98.0], [120.0, 119.0, 121.0, 120.0, 118.0, 122.0])
    assert slower["speedup"] < 1.0 and slower["low"] <= slower["speedup"] <= slower["high"] < 1.0


def test_speedup_cancels_the_order_effect_of_interleaving() -> None:
    # Whichever path replays first in a round runs 10% slow. Rounds alternate (interleave_order), so the two order
    # groups are biased in opposite directions; the estimate must be the true 2x, not either group's.
    stock = [110.0 if i % 2 == 0 else 100.0 for i in range(20)]
    special = [50.0 if i % 2 == 0 else 55.0 for i in range(20)]
    s = bench.speedup_stats(stock, special)
    assert s["speedup"] == pytest.approx(2.0, rel=1e-9)
    assert s["round_ratio_p10"] == pytest.approx(100 / 55) and s["round_ratio_p90"] == pytest.approx(110 / 50)


@pytest.mark.parametrize(
    ("tp", "batch", "target"),
    [(8, 1, 0.85), (8, 8, 0.85), (8, 16, None), (8, 32, None), (8, 64, 0.75), (16, 1, 0.70), (16, 64, 0.70)],
)
def test_roofline_targets_of_the_issue(tp: int, batch: int, target: float | None) -> None:
    assert bench.roofline_target(tp, batch) == target


# The docs' "Where the targets stand" table: one row per GPU's newest sweep, its results file named first in the row.
TARGETS_DOC = bench.REPO / "docs" / "kda-layer-h200.md"
TARGET_CELLS = [(8, b) for b in (1, 2, 4, 8, 16, 32, 64)] + [(16, b) for b in (1, 2, 4, 8, 16, 32, 64)]


@cache
def committed_results(name: str) -> dict:
    """A committed results file, read once per session (tests only read it)."""
    return json.loads((bench.REPO / "benchmarks" / "results" / name).read_text())


def quoted_target_problems(doc: str) -> tuple[int, list[str]]:
    """(rows checked, problems): each row of the targets table that names a committed results file right after its
    GPU and commit must quote that file's span fraction at every cell, to 0.1 point, and mark "(met)" exactly where
    the file's verdict says the target was met. A row whose file is only in git history is not checked."""
    checked, problems = 0, []
    for row in doc.splitlines():
        named = re.match(r"\| (H100|H200), \w+ \(`(kda-layer-[\w.-]+\.json)`", row)
        if not named:
            continue
        checked += 1
        cells = bench.cells_by_key(committed_results(named[2]))
        quoted = re.findall(r"(\d+\.\d)( \(met\))?", "|".join(row.split("|")[2:]))
        if len(quoted) != len(TARGET_CELLS):
            problems.append(f"{named[2]}: {len(quoted)} figures quoted, not {len(TARGET_CELLS)}")
            continue
        for (tp, batch), (figure, met) in zip(TARGET_CELLS, quoted, strict=True):
            verdict = cells[(tp, batch)]["targets"]["roofline"]
            if f"{100 * verdict['value']:.1f}" != figure or bool(met) != bool(verdict["met"]):
                problems.append(f"{named[2]} TP{tp} B{batch}: quoted {figure}{met}, the file has {verdict}")
    return checked, problems


def test_the_docs_targets_table_quotes_each_gpus_newest_sweep():
    checked, problems = quoted_target_problems(TARGETS_DOC.read_text())
    assert checked == 2 and problems == [], problems


def test_a_targets_table_misquoting_its_sweep_is_caught():
    """Broken case: one figure of the H200 row changed, and a target marked met that the file says was missed."""
    doc = TARGETS_DOC.read_text()
    h200 = next(row for row in doc.splitlines() if row.startswith("| H200, 15d0736"))
    wrong = h200.replace("73.3 /", "75.3 /").replace("| 73.9 |", "| 73.9 (met) |")
    checked, problems = quoted_target_problems(doc.replace(h200, wrong))
    assert checked == 2 and [p.split(":")[0] for p in problems] == [
        "kda-layer-h200.json TP8 B1",
        "kda-layer-h200.json TP8 B64",
    ], problems


def test_the_span_breakdown_reads_the_specialized_timeline() -> None:
    """The synthetic cell's specialized kernels: the projection 10-18 us (90 MB: 11.25 TB/s, 2.81x the 4 TB/s copy
    figure), the KDA step's two kernels ending at 38 (+20 after the projection), the side at 58 (+20); the roofline
    28.75 us over TP8 B1's 85 % target allows a 33.8 us span, which leaves the chain after the projection 15.8 us."""
    breakdown = bench.span_breakdown(_cell(8, True), 4e12)
    assert breakdown == pytest.approx(
        {
            "span_us": 58.0,
            "target_span_us": 28.75 / 0.85,
            "proj_start_us": 10.0,
            "proj_end_us": 18.0,
            "proj_bytes": 90e6,
            "proj_bytes_per_s": 11.25e12,
            "proj_fraction": 2.8125,
            "step_after_us": 20.0,
            "rest_after_us": 20.0,
        }
    )
    md = bench.markdown(json.loads(json.dumps(_results())))
    row = "| 8 | 1 | 58.0 / 33.8 | 10.0-18.0 us: 90.0 MB at 11.25 TB/s, 281.2% of copy | +20.0 | +20.0 | 40.0 / 15.8 |"
    assert row in md.splitlines()
    assert bench.span_breakdown(_cell(16, False), 4e12) is None  # no specialized path: nothing to break down
    no_proj = _cell(8, True)
    side = no_proj["attention"]["specialized"]
    side["timeline"] = [r for r in side["timeline"] if r["op"] != "in_proj"]
    assert bench.span_breakdown(no_proj, 4e12) is None  # a projection left stock is not read as another op


def test_the_docs_span_table_is_the_benchmarks_own_rows():
    """docs/kda-layer-h200.md's "Where the span goes on the H200" rows are `--table`'s rows of the committed sweep,
    character for character: a hand-edited figure there fails here."""
    doc = TARGETS_DOC.read_text()
    section = doc[doc.index("**Where the span goes on the H200 at 15d0736**") :]
    rows = [line for line in section.split("\n\n")[1].splitlines() if re.match(r"\| \d+ \| \d+ \|", line)]
    produced = bench.markdown(committed_results("kda-layer-h200.json"))
    assert len(rows) == 5 and all(row in produced.splitlines() for row in rows), rows


def test_target_verdicts_met_missed_and_not_judged() -> None:
    v = bench.target_verdicts(8, 4, {"roofline_fraction_span": 0.85, "launches": 4}, None)
    assert v["path"] == "specialized" and v["roofline"]["met"] is True and v["launches"]["met"] is True
    v = bench.target_verdicts(8, 4, {"roofline_fraction_span": 0.849, "launches": 5}, None)
    assert v["roofline"]["met"] is False and v["launches"]["met"] is False
    v = bench.target_verdicts(8, 64, {"roofline_fraction_span": 0.76, "launches": 6}, None)
    assert v["roofline"]["target"] == 0.75 and v["roofline"]["met"] is True and v["launches"]["met"] is False
    v = bench.target_verdicts(16, 64, {"roofline_fraction_span": 0.69, "launches": 4}, None)
    assert v["roofline"]["met"] is False
    v = bench.target_verdicts(8, 16, {"roofline_fraction_span": 0.99, "launches": 3}, None)
    assert v["roofline"]["met"] is None and "no roofline fraction" in v["roofline"]["why"]
    v = bench.target_verdicts(8, 1, {"roofline_fraction_span": None, "launches": 0}, None)
    assert v["roofline"]["met"] is False
    v = bench.target_verdicts(8, 1, None, "BackendError: the specialized kernels are not built")
    assert v["path"] is None and v["roofline"]["met"] is None and v["launches"]["met"] is None
    assert "not built" in v["roofline"]["why"]
    # The span is judged, never the sum of durations, which overlapping kernels inflate: a path whose kernels overlap
    # so much that the sum says 0.5 meets the target when its elapsed time does.
    v = bench.target_verdicts(8, 1, {"roofline_fraction": 0.5, "roofline_fraction_span": 0.9, "launches": 4}, None)
    assert v["roofline"]["met"] is True and v["roofline"]["value"] == 0.9 and v["roofline"]["basis"] == "span"
    v = bench.target_verdicts(8, 1, {"roofline_fraction": 0.9, "roofline_fraction_span": 0.5, "launches": 4}, None)
    assert v["roofline"]["met"] is False


# -- cells and the table ----------------------------------------------------------------------------------------

OP_BYTES = {"attn_res": 1_000_000, "in_proj": 90_000_000, "kda": 4_000_000, "o_proj": 20_000_000, "moe": 300_000_000}


def _cell(tp: int, special: bool) -> dict:
    samples = {"stock": [300.0 + (i % 3) for i in range(8)]}
    replays = {"stock": [events(STOCK_REPLAY, dur=10.0)] * 3}
    cell_slots = {"stock": slots(STOCK_PATHS)}
    paths = {"stock": STOCK_PATHS}
    if special:
        samples["specialized"] = [240.0 + (i % 3) for i in range(8)]
        replays["specialized"] = [events(SPECIAL_REPLAY, dur=8.0)] * 3
        cell_slots["specialized"] = slots(SPECIAL_PATHS)
        paths["specialized"] = SPECIAL_PATHS
    return bench.assemble_cell(
        tp=tp,
        batch=1,
        context=4096,
        layer=LAYER,
        kind="kda+moe",
        samples_us=samples,
        replays=replays,
        slots=cell_slots,
        paths=paths,
        op_bytes=OP_BYTES,
        bandwidth=4e12,
        unique_experts=16,
        agreement={"layer_output_rms_rel": 1.2e-3} if special else None,
        unmeasured=None if special else "BackendError: the specialized kernels are not built (no sm_90 GPU)",
        attribution="per graph launch, L2 flushed before each replay",
        entry_launches=1,
    )


def test_a_cell_keeps_the_paths_apart_and_never_files_stock_as_specialized() -> None:
    both, alone = _cell(8, True), _cell(16, False)
    assert both["specialized_ran"] and both["provider_kernels_per_replay"] == {"stock": 0, "specialized": 2}
    assert both["attention"]["stock"]["launches"] == 6 and both["attention"]["specialized"]["launches"] == 6
    assert both["attention"]["specialized"]["time_us"] == pytest.approx(48.0)
    # Kernels 10 us apart: spans 60 (stock, 10 us each) and 58 us (8 us each); the speedup is of the spans.
    assert both["attention"]["specialized"]["span_us"] == pytest.approx(58.0)
    assert both["attention_speedup"] == pytest.approx(60.0 / 58.0)
    assert both["moe"]["specialized"]["launches"] == len(MOE_TAIL)
    assert both["targets"]["launches"]["met"] is False  # 6 launches against at most 4
    assert both["kernel_names"]["specialized"][:2] == [
        "entry: Memcpy DtoD (Device -> Device)",
        f"attn_res: {CUTE_ATTN_RES}",
    ]
    assert both["layer_speedup"]["speedup"] > 1.2
    assert not alone["specialized_ran"] and "specialized" not in alone["attention"]
    assert "layer_speedup" not in alone and alone["targets"]["path"] is None
    # A specialized executor whose graph ran no provider kernel is not counted as the specialized path.
    cell = _cell(8, True)
    fake = bench.assemble_cell(
        **{
            **{k: cell[k] for k in ("tp", "batch", "context", "layer", "kind")},
            "samples_us": cell["samples_us"],
            "replays": {"stock": [events(STOCK_REPLAY)], "specialized": [events(STOCK_REPLAY)]},
            "slots": {"stock": slots(STOCK_PATHS), "specialized": slots(SPECIAL_PATHS)},
            "paths": {"stock": STOCK_PATHS, "specialized": SPECIAL_PATHS},
            "op_bytes": OP_BYTES,
            "bandwidth": 4e12,
            "unique_experts": 16,
            "agreement": None,
            "unmeasured": None,
            "attribution": "test",
            "entry_launches": 1,
        }
    )
    assert not fake["specialized_ran"] and fake["targets"]["path"] is None


def _results() -> dict:
    return {
        "copy_bandwidth": {"bandwidth_bytes_per_s": 4.0e12},
        "providers": {"declared": [{"op": "attn_res", "name": "cute-attn-res", "kernels": {"AttnResKernel": 1}}]},
        "runs": [
            {
                "tp": 8,
                "specialized_unavailable": None,
                "cells": [_cell(8, True), {"tp": 8, "batch": 2, "error": "X: y"}],
            },
            {"tp": 16, "specialized_unavailable": "BackendError: not built", "cells": [_cell(16, False)]},
        ],
    }


def test_markdown_tables_come_from_the_results() -> None:
    md = bench.markdown(json.loads(json.dumps(_results())))  # through JSON, as --table reads it
    assert "Copy bandwidth measured in the run: 4.00 TB/s." in md
    assert "- TP16: specialized path not measured (stock only): BackendError: not built" in md
    assert "- TP8 B2: failed: X: y" in md
    assert "layer 6 (kda+moe): one CUDA graph per path, interleaved replays" in md
    rows = [line for line in md.splitlines() if line.startswith("| 8 | 1 |")]
    assert rows[0].startswith("| 8 | 1 | 301.0 (300.0-302.0) | 241.0 (240.0-242.0) | 1.2")
    assert rows[0].endswith("| 1.2e-03 | attn_res, in_proj |")
    # Attention side: 115 MB at 4 TB/s = 28.75 us; stock 6 kernels x 10 us (span 60), specialized 6 x 8 us 10 us
    # apart (span 58, sum 48): the span is the time, its roofline fraction the one judged.
    assert rows[1].startswith(
        "| 8 | 1 | 115.00 | 28.8 | 60.0 us (sum 60.0), 6, 47.9% | 58.0 us (sum 48.0), 6, 49.6% | 1.03 |"
    )
    assert "MISSED (49.6% vs 85.0%)" in rows[1] and "MISSED (6 vs 4)" in rows[1]
    assert "the speedup and the roofline target are judged on the span" in md
    tp16 = [line for line in md.splitlines() if line.startswith("| 16 | 1 |")]
    assert tp16[0] == "| 16 | 1 | 301.0 (300.0-302.0) | not measured | - | - | - |"
    assert "| 16 | 1 | 115.00 | 28.8 | 60.0 us (sum 60.0), 6, 47.9% | - | - | not judged | not judged |" in md
    assert not any("| specialized |" in line for line in tp16)
    assert "| 8 | 1 | 300.0 |" in md and "| 16 | 1 | 300.0 |" in md  # the MoE table, 300 MB each


def test_the_timeline_table_lists_each_kernels_range_and_the_span() -> None:
    md = bench.markdown(json.loads(json.dumps(_results())))
    assert "Attention side timeline (specialized and stock), us from the first kernel's start" in md
    lines = [line for line in md.splitlines() if line.startswith("- TP") and " B1 " in line]
    # Kernels 10 us apart from the first attention kernel (the entry copy before it is on neither side).
    assert lines == [
        "- TP8 B1 specialized: attn_res 0.0-8.0 | in_proj 10.0-18.0 | kda 20.0-28.0 | kda 30.0-38.0 | "
        "o_proj 40.0-48.0 | o_proj 50.0-58.0 (span 58.0)",
        "- TP8 B1 stock: attn_res 0.0-10.0 | in_proj 10.0-20.0 | kda 20.0-30.0 | kda 30.0-40.0 | "
        "o_proj 40.0-50.0 | o_proj 50.0-60.0 (span 60.0)",
        "- TP16 B1 stock: attn_res 0.0-10.0 | in_proj 10.0-20.0 | kda 20.0-30.0 | kda 30.0-40.0 | "
        "o_proj 40.0-50.0 | o_proj 50.0-60.0 (span 60.0)",
    ]


def _without_timelines(results: dict) -> dict:
    """The results as a file written before the timeline was recorded."""
    for run in results["runs"]:
        for cell in run["cells"]:
            for side in ("attention", "moe", "entry"):
                for summary in cell.get(side, {}).values():
                    summary.pop("timeline", None)
    return results


def test_the_table_of_a_file_from_before_timelines_is_what_it_was() -> None:
    old = bench.markdown(_without_timelines(_results()))
    assert "timeline" not in old
    new = bench.markdown(_results())
    start = new.index("\nAttention side timeline")
    end = new.index("\nMoE part of the same layer")
    assert old == new[:start] + new[end:]  # the same tables, without the timeline section
    # A file with timelines in some cells only: the others say why they have none, and a note stands in its place.
    mixed = _results()
    mixed["runs"][1] = _without_timelines({"runs": [mixed["runs"][1]]})["runs"][0]
    del mixed["runs"][0]["cells"][0]["attention"]["stock"]["timeline"]
    mixed["runs"][0]["cells"][0]["attention"]["stock"]["timeline_note"] = "no timeline: the replays' kernels differ"
    md = bench.markdown(mixed)
    assert "- TP8 B1 stock: no timeline: the replays' kernels differ" in md
    assert "- TP16 B1 stock: no timeline (measured before timelines were recorded)" in md
    assert "- TP8 B1 specialized: attn_res 0.0-8.0 |" in md


@pytest.mark.parametrize(
    "name, layer", [("kda-layer-h200.json", 6), ("kda-layer-h200-tp16.json", 6), ("kda-layer-late-h200.json", 86)]
)
def test_the_committed_results_files_still_print_their_tables(capsys, name: str, layer: int) -> None:
    committed = bench.REPO / "benchmarks" / "results" / name
    assert bench.main(["--table", str(committed)]) == 0
    out = capsys.readouterr().out
    assert "Attention side per op" in out and "MoE part of the same layer" in out and f"layer {layer} (kda+moe)" in out


# -- main -------------------------------------------------------------------------------------------------------


def test_the_l2_flush_reads_by_default_and_writes_only_when_asked() -> None:
    """A read flush must leave the buffer as it was (clean lines) and touch all of it (its maximum lands in the
    result); a write flush rewrites it. The command line defaults to the read."""
    read = bench.L2Flush("read", torch.device("cpu"), size=4096)
    read.buffer[7] = 9
    read()
    assert int(read.result) == 9 and int(read.buffer.sum()) == 1023 + 9
    write = bench.L2Flush("write", torch.device("cpu"), size=4096)
    write()
    assert int(write.buffer.abs().sum()) == 0
    with pytest.raises(ValueError, match="'read' or 'write'"):
        bench.L2Flush("evict", torch.device("cpu"), size=4096)
    assert bench.parser().parse_args([]).flush == "read"
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--flush", "evict"])


def test_main_refuses_without_cuda_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert bench.main(["--out", str(out), "--tp", "8", "--batches", "1"]) != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "CUDA" in err
    assert not out.exists()


def test_main_prints_the_table_of_a_results_file(tmp_path, capsys) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_results()))
    assert bench.main(["--table", str(path)]) == 0
    assert capsys.readouterr().out == bench.markdown(_results())


def test_a_traced_run_prints_its_phases_and_says_its_timings_are_diagnostic() -> None:
    from k3_decode.kernels.phase_trace import CtaTrace, summarize

    untraced = bench.markdown(_results())
    assert "Phase traces" not in untraced
    traced = _results()
    traced["traced"] = True
    proj = [CtaTrace(c, c, (1_000 + 10 * c, 2_000, 20_000 + 100 * c), (0, 0, 0)) for c in range(3)]
    traced["runs"][0]["cells"][0]["phase_trace"] = summarize({"kda_in_proj": proj})
    md = bench.markdown(json.loads(json.dumps(traced)))
    assert md.startswith(untraced[: untraced.index("\nMoE part")])  # the tables before it are unchanged
    assert "(a traced build: its timings above are diagnostic, not the benchmark's figures)" in md
    block = md[md.index("TP8 B1\n") :]
    assert "kda_in_proj (3 CTAs on 3 SMs):" in block
    assert "19.10 (19.00-19.20)  end (after a CTA barrier: every store issued) [3 CTAs]" in block


def test_an_unknown_stack_is_refused_before_any_device_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path / "out.json"), "--stack", "k3-nope"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unknown stack 'k3-nope'" in err and "k3-kda-mla-late" in err
    assert not (tmp_path / "out.json").exists()


def test_a_cell_names_the_kda_step_variant_it_timed():
    """Variant runs of the layer benchmark are told apart by the step's plan each cell ran (the choice file's budget,
    warming and group, the plan's cluster), not only by a name written on the file by hand."""
    tag = bench.kda_step_plan_tag(K3, 8, 64, 132)
    shard = K3.shard(8)
    assert tag == KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, 64, 132).tag
    assert tag.startswith(f"h{shard.kda_heads}/b64/c") and tag != bench.kda_step_plan_tag(K3, 16, 64, 132)


def test_a_cell_names_the_o_proj_variant_it_timed(monkeypatch, tmp_path):
    """The o_proj cap and one pass are choice-file edits like the step's budget: a cell records what the file said
    at its batch and its layer's bank (layer 6 mixes one block after attention, layer 86 eight)."""
    from k3_decode.kernels import kda_o_proj_plan

    choice = tmp_path / "kda_o_proj_choice.toml"
    choice.write_text(
        "cap_batches = [[16, 32]]\none_pass = [{ batches = [33, 64], max_blocks = 1 }]\nwarm_batches = [[1, 8]]\n"
        "w_smem_batches = [[32, 64]]\nw_l2_batches = [[2, 4]]\nwgmma_batches = [[16, 16], [48, 64]]\n"
        "wgmma_w_l2_batches = [[48, 56]]\npaired_rows = [{ batches = [48, 64], max_blocks = 1 }]\n"
        "wgmma_two_per_sm_batches = [[33, 48]]\n"
    )
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", choice)
    assert [bench.o_proj_variant(K3, 6, 8, b)["capped"] for b in (8, 16, 32, 64)] == [False, True, True, False]
    assert [bench.o_proj_variant(K3, 6, 8, b)["warm"] for b in (1, 8, 16)] == [True, True, False]
    assert [bench.o_proj_variant(K3, layer, 8, 64)["one_pass"] for layer in (6, 86)] == [True, False]
    assert not bench.o_proj_variant(K3, 6, 8, 32)["one_pass"]
    assert [bench.o_proj_variant(K3, 6, 8, b)["w_smem"] for b in (16, 32, 64)] == [False, True, True]
    assert [bench.o_proj_variant(K3, 6, 8, b)["w_l2"] for b in (1, 2, 4, 8)] == [False, True, True, False]
    assert [bench.o_proj_variant(K3, 6, 8, b)["wgmma"] for b in (8, 16, 32, 48, 64)] == [False, True, False, True, True]
    assert [bench.o_proj_variant(K3, 6, 8, b)["wgmma_w_l2"] for b in (32, 48, 64)] == [False, True, False]
    assert [bench.o_proj_variant(K3, layer, 8, 64)["paired_rows"] for layer in (6, 86)] == [True, False]
    assert not bench.o_proj_variant(K3, 6, 8, 47)["paired_rows"]
    assert [bench.o_proj_variant(K3, 6, 8, b)["wgmma_ctas_per_sm"] for b in (32, 33, 48, 49)] == [3, 2, 2, 3]
    monkeypatch.undo()
    want = {
        "capped": kda_o_proj_plan.capped_at(64),
        "one_pass": kda_o_proj_plan.one_pass_at(64, K3.blocks_before(6)),
        "warm": kda_o_proj_plan.warm_at(64),
        "w_smem": kda_o_proj_plan.w_smem_at(64),
        "w_l2": kda_o_proj_plan.w_l2_at(64),
        "wgmma": kda_o_proj_plan.wgmma_at(64),
        "wgmma_w_l2": kda_o_proj_plan.wgmma_w_l2_at(64),
        "wgmma_w_l2_late": kda_o_proj_plan.wgmma_w_l2_late_at(64),
        "wgmma_ctas_per_sm": kda_o_proj_plan.wgmma_ctas_per_sm_at(64, K3.shard(8).kda_o_proj[1]),
        "paired_rows": kda_o_proj_plan.paired_at(64, K3.blocks_before(6)),
    }
    assert bench.o_proj_variant(K3, 6, 8, 64) == want


@pytest.fixture
def choice_modules(monkeypatch):
    """The modules' CHOICE paths (the two plans', providers.toml's) restored after a test that serves other files."""
    from k3_decode.kernels import kda_o_proj_plan, kda_step_plan, providers

    for module in (kda_step_plan, kda_o_proj_plan, providers):
        monkeypatch.setattr(module, "CHOICE", module.CHOICE)
    return kda_step_plan, kda_o_proj_plan, providers


def test_a_choice_file_given_on_the_command_line_is_what_the_plans_serve(tmp_path, choice_modules):
    """A variant run serves its choice files without editing the tree: the plans read them, and the results record
    their text (so a results file names what it timed, not a hand-written label)."""
    step_plan, o_proj_plan, providers = choice_modules
    step = tmp_path / "step.toml"
    step.write_text("default = { resident_threads = 1024, warm_ahead = false }\nrules = []\n")
    o_proj = tmp_path / "o_proj.toml"
    o_proj.write_text(
        "cap_batches = [[16, 64]]\none_pass = [{ batches = [33, 64], max_blocks = 1 }]\nwgmma_batches = [[48, 64]]\n"
    )
    rows = tmp_path / "providers.toml"
    rows.write_text('[o_proj]\nmax_rows = { "8" = 64, "16" = 16 }\nwhy = "a variant"\n')
    texts = bench.apply_choices(
        [f"kda_step_choice.toml={step}", f"kda_o_proj_choice.toml={o_proj}", f"providers.toml={rows}"]
    )
    assert texts == {
        "kda_step_choice.toml": step.read_text(),
        "kda_o_proj_choice.toml": o_proj.read_text(),
        "providers.toml": rows.read_text(),
    }
    shard = K3.shard(8)
    assert KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, 64, 132).resident_threads == 1024
    assert bench.o_proj_variant(K3, 6, 8, 64) == {
        "capped": True,
        "one_pass": True,
        "warm": False,
        "w_smem": False,
        "w_l2": False,
        "wgmma": True,
        "wgmma_w_l2": False,
        "wgmma_w_l2_late": False,
        "wgmma_ctas_per_sm": 3,
        "paired_rows": False,
    }
    assert not bench.o_proj_variant(K3, 6, 8, 32)["wgmma"]
    assert providers.max_rows("o_proj", "p", 8)[0] == 64 and providers.max_rows("in_proj", "p", 8) is None
    assert (step, o_proj, rows) == (step_plan.CHOICE, o_proj_plan.CHOICE, providers.CHOICE)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("kda_step_choice.toml", "write FILE=PATH"),
        ("nope.toml={path}", "no choice file 'nope.toml'"),
        ("kda_o_proj_choice.toml={missing}", "no such file"),
        ("kda_o_proj_choice.toml={path}", "kda_o_proj_choice.toml="),  # the step's format: not an o_proj file
        ("kda_step_choice.toml={bad}", "kda_step_choice.toml="),  # not TOML at all
        ("providers.toml={rows}", "[o_proj] max_rows is"),  # a row limit of zero
        ("providers.toml={path}", "[default] needs max_rows and a why"),  # the step's file, not row limits
    ],
)
def test_a_bad_choice_is_refused_in_one_line_before_any_device_work(tmp_path, capsys, choice_modules, spec, says):
    path = tmp_path / "step.toml"
    path.write_text("default = { resident_threads = 1024, warm_ahead = false }\nrules = []\n")
    bad = tmp_path / "bad.toml"
    bad.write_text("default = {\n")
    rows = tmp_path / "providers.toml"
    rows.write_text('[o_proj]\nmax_rows = { "8" = 0 }\nwhy = "none"\n')
    arg = spec.format(path=path, missing=tmp_path / "none.toml", bad=bad, rows=rows)
    before = tuple(m.CHOICE for m in choice_modules)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path / "out.json"), "--choice", arg])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and says in err, err
    assert tuple(m.CHOICE for m in choice_modules) == before  # nothing applied
    assert not (tmp_path / "out.json").exists()


def test_a_choice_named_twice_is_refused(tmp_path, choice_modules):
    path = tmp_path / "step.toml"
    path.write_text("default = { resident_threads = 1024, warm_ahead = false }\nrules = []\n")
    with pytest.raises(ValueError, match=r"names kda_step_choice\.toml twice"):
        bench.apply_choices([f"kda_step_choice.toml={path}"] * 2)
    assert path != choice_modules[0].CHOICE


VARIANTS_H100 = bench.REPO / "benchmarks" / "results" / "kda-layer-variants-h100"


def test_a_variant_run_is_compared_with_its_base_cell_by_cell(tmp_path, capsys):
    """--compare prints what the choice decisions rest on: each cell's speedups and intervals, a verdict, and the
    time saved on the layer and on the KDA layers it stands for (the late stack's layer 86 for 60)."""
    base, variant = VARIANTS_H100 / "late-base-1.json", VARIANTS_H100 / "late-1536-1.json"
    assert bench.main(["--compare", str(base), str(variant)]) == 0
    out = capsys.readouterr().out
    assert "late-1536-1 against late-base-1, layer 86 (stands for 60 KDA layers)" in out
    assert "| 8 | 32 | 1.2334 (1.2312-1.2341) | 1.2364 (1.2354-1.2373) | faster | +1.78 | +106.8 | 86.0 / 81.9 |" in out
    assert "| 16 | 64 | 1.2016 (1.2006-1.2023) | 1.2015 (1.1998-1.2027) | intervals overlap | -0.05 |" in out
    # A variant that lost at TP8 B64: its interval below the base's, its saving negative.
    doc = json.loads(variant.read_text())
    for run in doc["runs"]:
        for cell in run["cells"]:
            if (cell["tp"], cell["batch"]) == (8, 64):
                cell["layer_speedup"].update(speedup=1.10, low=1.09, high=1.11)
    worse = tmp_path / "worse.json"
    worse.write_text(json.dumps(doc))
    assert bench.main(["--compare", str(base), str(worse)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 | 64 |"))
    assert "| slower |" in row and "| -" in row


def test_compare_refuses_files_that_do_not_pair(tmp_path, capsys):
    six, late = VARIANTS_H100 / "budget-base-1.json", VARIANTS_H100 / "late-1536-1.json"
    assert bench.main(["--compare", str(six), str(late)]) == 2
    err = capsys.readouterr().err
    assert "different stacks" in err and err.count("\n") == 1
    assert bench.main(["--compare", str(six), str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    doc = json.loads(six.read_text())
    doc["runs"][0]["cells"] = doc["runs"][0]["cells"][:1]
    with pytest.raises(ValueError, match="different cells"):
        bench.layer_savings(json.loads(six.read_text()), doc)


def test_rounds_print_each_rounds_saving_and_the_every_round_verdict(tmp_path, capsys):
    """--rounds over the committed projection rounds (two pairs timing B32 only, two timing B24 and B32): a cell a
    pair did not time is '-', the verdict counts only the rounds that timed it. Broken case: one of TP8 B24's rounds
    turned into a loss takes its every-round verdict away."""
    v = VARIANTS_H100
    files = [v / f"inproj-{n}.json" for r in ("b32", "b24") for i in (1, 2) for n in (f"{r}-base-{i}", f"{r}-{i}")]
    assert bench.main(["--rounds", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert "| 8 | 24 | - | - | +3.75 | +4.70 | +4.23 | saved in every round |" in out
    assert "| 16 | 24 | - | - | -4.18 | -3.97 | -4.07 | lost in every round |" in out
    assert "| 8 | 32 | +0.81 | +1.20 | -0.33 | -0.73 | +0.24 | mixed |" in out
    docs = [json.loads(f.read_text()) for f in files]
    for run in docs[-1]["runs"]:
        for cell in run["cells"]:
            if (cell["tp"], cell["batch"]) == (8, 24):
                cell["layer_speedup"]["speedup"] = 1.0  # below the base's: the last round lost there
    _, saved = bench.round_savings(list(zip(docs[::2], docs[1::2], strict=True)))
    assert saved[(8, 24)][:2] == [None, None] and saved[(8, 24)][3] < 0 and bench.every_round(saved[(8, 24)]) == "mixed"
    lost = tmp_path / "lost.json"
    lost.write_text(json.dumps(docs[-1]))
    assert bench.main(["--rounds", *map(str, files[:-1]), str(lost)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 | 24 |"))
    assert row.endswith("| mixed |"), row


def test_rounds_refuse_an_odd_count_and_mixed_stacks_in_one_line(capsys):
    v = VARIANTS_H100
    assert bench.main(["--rounds", str(v / "inproj-b32-base-1.json")]) == 2
    err = capsys.readouterr().err
    assert "BASE VARIANT pairs, got 1 files" in err and err.count("\n") == 1
    assert bench.main(["--rounds", str(v / "budget-base-1.json"), str(v / "late-1536-1.json")]) == 2
    assert "different stacks" in capsys.readouterr().err
    assert bench.every_round([None, None]) == "not timed" and bench.every_round([None, -0.1]) == "lost in every round"


def test_rounds_of_two_stacks_print_the_model_time_each_round_saved(capsys):
    """--rounds over both stacks' committed rounds (the wide pair against the tree at ebd4bcb, three rounds of each):
    each stack's table, then per round 9 x layer 6's saving + 60 x layer 86's, round i of each paired. TP8 B32 won
    two rounds and lost the third by far (-118.0 us), so it is mixed however the layers' own verdicts read. Broken
    cases: a stack with one round fewer cannot be paired, and one layer's rounds alone weigh nothing."""
    v = VARIANTS_H100
    six = [str(v / f"step-cap-{n}-{i}.json") for i in (1, 2, 3) for n in ("base", "pair")]
    late = [str(v / f"step-cap-late-{n}-{i}.json") for i in (1, 2, 3) for n in ("base", "pair")]
    assert bench.main(["--rounds", *six, *late]) == 0
    out = capsys.readouterr().out
    assert "3 rounds, layer 6:" in out and "3 rounds, layer 86:" in out and "9 x layer 6 + 60 x layer 86" in out
    assert "| 8 | 64 | +240.2 | +106.6 | +228.5 | +191.7 | saved in every round |" in out
    assert "| 8 | 32 | +17.4 | +38.7 | -118.0 | -20.6 | mixed |" in out
    assert bench.main(["--rounds", *six, *late[:-2]]) == 2
    assert "as many rounds" in capsys.readouterr().err
    with pytest.raises(ValueError, match="two or more layers"):
        bench.model_round_savings({6: {(8, 64): [1.0]}}, K3)


def test_each_timed_layer_stands_for_the_kda_layers_on_its_side_of_the_mixing_rows():
    assert bench.kda_layers_like(K3, 6) + bench.kda_layers_like(K3, 86) == K3.layer_kinds.count("kda") == 69
    assert (bench.kda_layers_like(K3, 6), bench.kda_layers_like(K3, 86)) == (9, 60)


def test_a_declared_commit_wins_over_the_copys_git_folder(monkeypatch, tmp_path):
    """A device's copy of the tree carried git metadata from an older commit, so results recorded that commit as
    dirty; a declared commit (K3_COMMIT, else the gate's K3GATE_COMMIT) is what the run records, with K3_DIRTY."""
    from benchmarks import stock_h200

    for name in (*stock_h200.DECLARED_COMMIT, "K3_DIRTY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("K3GATE_COMMIT", "abc1234")
    assert stock_h200.commit_state(tmp_path) == ("abc1234", False)
    monkeypatch.setenv("K3_COMMIT", "def5678")
    monkeypatch.setenv("K3_DIRTY", "1")
    assert stock_h200.commit_state(tmp_path) == ("def5678", True)
    for name in (*stock_h200.DECLARED_COMMIT, "K3_DIRTY"):
        monkeypatch.delenv(name)
    assert stock_h200.commit_state(tmp_path) == ("unknown", False)  # no git checkout there
    if (stock_h200.REPO / ".git").exists():  # this checkout: git's HEAD
        commit, _ = stock_h200.commit_state()
        assert len(commit) == 40 and int(commit, 16) >= 0
