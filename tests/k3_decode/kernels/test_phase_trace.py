"""Phase traces (k3_decode/kernels/phase_trace.py): decoding and summarizing a traced counter (fast, no GPU), the
phase table against the stamps in the kernels' source, and real sm_90a builds showing that a traced kernel stamps
every phase and an untraced one has no stamp at all (slow; needs CuTe DSL)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from k3_decode.kernels import phase_trace
from k3_decode.kernels.phase_trace import CLOCK_BASE, SM_WORD, WORDS, CtaTrace, decode, summarize, words_for
from tests.k3_decode.kernels.helpers import REPO, needs_cutedsl

KERNEL_SOURCES = {
    "kda_in_proj": ["kda_in_proj.py", "kda_in_proj_mma.py", "wgmma_stream.py"],
    "kda_step": ["kda_step.py"],
    "kda_o_proj": ["kda_o_proj.py", "kda_o_proj_wgmma.py"],
}


def counter(rows: dict[int, dict[int, int]], ctas: int, sm: int = 7) -> list[int]:
    """A traced counter's words as the GPU leaves them (signed Int32): `rows[cta][phase]` = timer ns."""
    words = [1] + [0] * (ctas * WORDS)
    for cta, stamps in rows.items():
        base = 1 + cta * WORDS
        for phase, ns in stamps.items():
            words[base + phase] = ns - (1 << 32) if ns >= 1 << 31 else ns
            words[base + CLOCK_BASE + phase] = 1000 + phase
        words[base + SM_WORD] = sm + cta
    return words


def test_decode_keeps_the_ctas_that_started_and_marks_phases_not_reached():
    words = counter({0: {0: 100, 1: 200, 2: 300}, 2: {0: 150, 1: 400}}, ctas=3)
    traces = decode(words, "kda_in_proj")
    assert [t.cta for t in traces] == [0, 2]  # CTA 1 never stamped its start
    assert traces[0].timer == (100, 200, 300) and traces[0].sm == 7
    assert traces[1].timer == (150, 400, None) and traces[1].clock == (1000, 1001, None)
    with pytest.raises(ValueError, match="1 \\+ 32 x CTAs"):
        decode(words[:-1], "kda_in_proj")


def test_summary_is_relative_to_the_earliest_start_across_the_timer_wrap():
    """The low timer word wraps every 4.3 s and the counter is signed: a projection stamped just before the wrap
    and a step just after it must come out 1.5 us apart, not 4.3 s."""
    before = (1 << 32) - 1_000  # 1 us before the wrap
    proj = decode(counter({0: {0: before, 1: before + 200, 2: before + 900}}, ctas=1), "kda_in_proj")
    step_rows = {c: {0: 500 + 100 * c, 2: 600 + 100 * c} for c in range(3)}  # after the wrap
    step = decode(counter(step_rows, ctas=3), "kda_step")
    summary = summarize({"kda_in_proj": proj, "kda_step": step})
    by_kernel = {k["kernel"]: k for k in summary["kernels"]}
    start = by_kernel["kda_in_proj"]["phases"][0]
    assert start["min_us"] == 0.0 and by_kernel["kda_in_proj"]["phases"][2]["max_us"] == pytest.approx(0.9)
    step_start = by_kernel["kda_step"]["phases"][0]
    assert (step_start["min_us"], step_start["median_us"], step_start["max_us"]) == pytest.approx((1.5, 1.6, 1.7))
    assert by_kernel["kda_step"]["phases"][1]["ctas"] == 0  # phase 1 not stamped: reported as not reached
    assert by_kernel["kda_step"]["phases"][2]["ctas"] == 3 and by_kernel["kda_step"]["sms"] == 3
    assert [k["kernel"] for k in summary["kernels"]] == ["kda_in_proj", "kda_step"]  # launch order kept
    text = "\n".join(phase_trace.lines(summary))
    assert "not reached" in text and "1.60 (1.50-1.70)" in text


def test_a_summary_of_no_stamps_says_tracing_was_off():
    with pytest.raises(ValueError, match="tracing enabled"):
        summarize({"kda_step": [CtaTrace(0, 0, (None,) * 11, (None,) * 11)]})


def test_counter_words_untraced_traced_and_too_many_ctas():
    assert words_for(448, False) == 1
    assert words_for(448, True) == 1 + 448 * WORDS
    with pytest.raises(ValueError, match="at most 2048 CTAs"):
        words_for(phase_trace.MAX_CTAS + 1, True)
    phase_trace.enable()
    try:
        assert phase_trace.counter_size() == 1 + phase_trace.MAX_CTAS * WORDS
    finally:
        phase_trace.enable(False)
    assert phase_trace.counter_size() == 1


@pytest.mark.parametrize("kernel", sorted(KERNEL_SOURCES))
def test_the_phase_table_names_exactly_the_phases_the_kernels_stamp(kernel):
    """A stamp added to a kernel without its name in phase_trace.toml (or a name left for a stamp removed) would
    mislabel every phase after it: the stamped indices of each kernel's sources must be 0 .. len(phases) - 1."""
    stamped: set[int] = set()
    for name in KERNEL_SOURCES[kernel]:
        source = (REPO / "k3_decode" / "kernels" / name).read_text()
        stamped |= {int(m) for m in re.findall(r"trace_stamp\(.*?, (\d+), tidx\)", source)}
    assert stamped == set(range(len(phase_trace.phases(kernel)))), (stamped, phase_trace.phases(kernel))


BUILD_BOTH = """
import json
from k3_decode.kernels import cutedsl
from k3_decode.kernels.attn_res_plan import AttnResKind
from k3_decode.kernels.kda_in_proj import KdaInProjKernel, compile_args as in_args
from k3_decode.kernels.kda_in_proj_mma import KdaInProjKernelMma
from k3_decode.kernels.kda_in_proj_mma_plan import InProjMmaPlan
from k3_decode.kernels.kda_in_proj_plan import InProjPlan
from k3_decode.kernels.kda_o_proj import KdaOProjKernel, compile_args as o_args
from k3_decode.kernels.kda_o_proj_plan import OProjPlan
from k3_decode.kernels.kda_o_proj_wgmma import KdaOProjKernelWgmma
from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan
from k3_decode.kernels.kda_step import KdaStepKernel, compile_args as step_args
from k3_decode.kernels.kda_step_plan import KdaStepPlan
from k3_decode.kernels.wgmma_stream import KdaInProjKernelWgmma, compile_args as w_args
from k3_decode.kernels.wgmma_stream_plan import WgmmaStreamPlan

wg = WgmmaStreamPlan(3216, 7168, 64, stages=8, k_splits=2)
step = KdaStepPlan.for_shape(6, 3216, 1, 132, "int32")
proj = InProjPlan.for_shape(3216, 7168, 1)
mma = InProjMmaPlan.for_shape(3216, 7168, 1)
o = OProjPlan.for_shape(7168, 768, 1, AttnResKind.from_tag("n3-add-norm"))
ow = OProjWgmmaPlan.for_shape(7168, 768, 33, AttnResKind.from_tag("n3-add-norm"))
builds = {
    "kda_step": lambda t: (KdaStepKernel(step, t), step_args(step, t)),
    "kda_in_proj": lambda t: (KdaInProjKernel(proj, t), in_args(proj, t)),
    "kda_in_proj_mma": lambda t: (KdaInProjKernelMma(mma, t), in_args(mma, t)),
    "kda_in_proj_wgmma": lambda t: (KdaInProjKernelWgmma(wg, t), w_args(wg, t)),
    "kda_o_proj": lambda t: (KdaOProjKernel(o, t), o_args(o, 8, t)),
    "kda_o_proj_wgmma": lambda t: (KdaOProjKernelWgmma(ow, t), o_args(ow, 8, t)),
}
out = {}
for name, make in builds.items():
    for traced in (False, True):
        kernel, args = make(traced)
        art = cutedsl.compile_artifacts(kernel, args, "sm_90a")
        out[f"{name}/{traced}"] = {
            "timer": art.ptx.count("%globaltimer_lo"),
            "clock": art.ptx.count("%clock;") + art.ptx.count("%clock}"),
            "smid": art.ptx.count("%smid"),
        }
print(json.dumps(out))
"""


@pytest.mark.slow
@needs_cutedsl
def test_traced_builds_stamp_every_phase_and_untraced_builds_none(tmp_path):
    """What the flag changes in the PTX: a traced kernel reads the timer once per phase it stamps in its code (the
    step's eleven, o_proj's six, its wgmma build's nine in two kinds of CTA, the projection's three) and the SM id
    once; the shipped (untraced) kernel reads neither, so tracing cannot leak into the builds `k3gate kernels build`
    checks."""
    script = tmp_path / "build_both.py"
    script.write_text(BUILD_BOTH)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # o_proj's wgmma build stamps o_proj's six phases in two kinds of CTA: the start once, then 1-3 in the stream
    # CTAs' code and 1-5 in the epilogue CTAs' (nine reads of the timer in the code)
    expected = {
        "kda_step": 11,
        "kda_in_proj": 3,
        "kda_in_proj_mma": 3,
        "kda_in_proj_wgmma": 3,
        "kda_o_proj": 6,
        "kda_o_proj_wgmma": 9,
    }
    for name, phases in expected.items():
        assert got[f"{name}/False"] == {"timer": 0, "clock": 0, "smid": 0}, (name, got[f"{name}/False"])
        traced = got[f"{name}/True"]
        assert traced["timer"] == phases and traced["smid"] == 1, (name, traced)


def _cta(cta: int, sm: int, *ns: int | None, phases: int) -> CtaTrace:
    timer = tuple(ns) + (None,) * (phases - len(ns))
    return CtaTrace(cta, sm, timer, timer)


def test_the_summary_names_the_slowest_ctas_and_what_shared_their_sm():
    """o_proj's grid waits for its last arrival: the summary must name the CTA that arrived last, say that its SM
    held three o_proj CTAs and a step CTA that ended late, and split the arrival times by CTAs per SM, so a
    straggler from crowding reads apart from one that started late."""
    n_step, n_o = len(phase_trace.phases("kda_step")), len(phase_trace.phases("kda_o_proj"))
    step = [_cta(0, 1, 0, *[None] * 9, 5_000, phases=n_step), _cta(1, 2, 0, *[None] * 9, 9_000, phases=n_step)]
    # phases: start, released, stored, arrived; CTAs 0-2 share SM 2 (where the step ended last), CTA 3 has SM 1 alone
    o_proj = [
        _cta(0, 2, 9_000, 10_000, 14_000, 14_100, phases=n_o),
        _cta(1, 2, 9_000, 10_000, 15_000, 15_100, phases=n_o),
        _cta(2, 2, 9_000, 10_000, 19_000, 19_100, phases=n_o),
        _cta(3, 1, 6_000, 10_000, 12_000, 12_100, 19_500, phases=n_o),  # an epilogue CTA: one more phase
    ]
    summary = summarize({"kda_step": step, "kda_o_proj": o_proj}, stragglers=2)
    o = summary["kernels"][1]
    assert o["straggler_phase"] == "arrived on the grid's arrival word"  # the last phase every CTA stamped
    first, second = o["stragglers"]
    assert (first["cta"], first["sm"], first["same_sm"]) == (2, 2, 3)
    assert first["us"][:4] == pytest.approx([9.0, 10.0, 19.0, 19.1]) and first["us"][4] is None
    assert first["before"] == {"kda_step": {"ctas": 1, "last_end_us": pytest.approx(9.0)}}
    assert second["cta"] == 1
    assert o["by_sm_load"] == [
        {"per_sm": 1, "sms": 1, "median_us": pytest.approx(12.1), "max_us": pytest.approx(12.1)},
        {"per_sm": 3, "sms": 1, "median_us": pytest.approx(15.1), "max_us": pytest.approx(19.1)},
    ]
    assert summary["kernels"][0]["stragglers"][0]["before"] == {}  # nothing ran before the first kernel
    text = "\n".join(phase_trace.lines(summary))
    assert "3 a SM (1 SMs): median 15.10, max 19.10" in text
    assert "CTA 2 SM 2 (3 here): 9.00 10.00 19.00 19.10 - - | kda_step 1, 9.00" in text
    json.dumps(summary)  # stored as is in the results file
