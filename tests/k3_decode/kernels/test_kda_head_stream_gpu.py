"""The head-ordered projection probe (kda_head_stream.py) on a GPU, at every shape CI compiles: the product within
the error bound of the served projection's test (one BF16 rounding of an FP32 sum, any order), every row published
once per launch on its group's counter, the stamps showing the stream move through the heads in order, and the same
bits from a CUDA graph. The copy-fed builds too, whose ring's phases wrap over the trips. With the watching warp,
every CTA's watcher sees every group full once a launch, on the epoch the previous launch advanced. Its timing is
benchmarks/head_stream_h200.py's, not a test's."""

from __future__ import annotations

import itertools

import pytest
import torch

from k3_decode.config import K3
from k3_decode.kernels import kda_head_stream_op
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, KdaHeadStreamBuild
from k3_decode.kernels.kda_head_stream_trace import HeadStreamTimeline
from tests.k3_decode.kernels.test_kda_in_proj_gpu import bound, linear_fp32_reduction, operands

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BUILDS = [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaHeadStreamBuild)]
HEAD_DIM = K3.kda.head_dim


def run(build: KdaHeadStreamBuild, x, w, out, trace):
    p = build.plan
    return kda_head_stream_op.project(
        x, w, out, trace, heads=p.heads, head_dim=HEAD_DIM, split=p.split, watch=p.watch, stages=p.stages
    )


@pytest.mark.parametrize("build", BUILDS, ids=[b.name for b in BUILDS])
def test_the_head_stream_matches_linear_and_publishes_every_row_once_per_launch(build: KdaHeadStreamBuild):
    p = build.plan
    x, w, out, obuf = operands(p.rows, p.k, p.batch, seed=build.tp * 100 + p.batch + p.split)
    tail = obuf[p.batch * p.rows :].clone()
    trace = kda_head_stream_op.trace_buffer(p, x.device)
    for _ in range(3):
        run(build, x, w, out, trace)
    torch.cuda.synchronize()

    assert torch.isfinite(out).all(), "a NaN: the kernel read past the batch or the rows, or left an output unset"
    assert torch.equal(obuf[p.batch * p.rows :].isnan(), tail.isnan()), "the kernel wrote past the end of out"
    exact, tol = bound(x, w)
    worst = ((out.double() - exact).abs() / tol).max().item()
    assert worst <= 1.0, f"{build.name}: error reaches {worst:.2f}x the bound"
    assert ((out.double() - linear_fp32_reduction(x, w).double()).abs() <= 2 * tol).all()

    # from_words refuses counters other than 3 launches x each group's rows, and any CTA or row left unstamped; with
    # the watcher an epoch or done count other than the launches', and a group seen full before a row of it was out.
    timeline = HeadStreamTimeline.from_words(p, trace.tolist())
    assert timeline.launches == 3
    assert len(timeline.seen_median_us) == (p.groups if p.watch else 0)
    medians = timeline.trip_median_us
    assert all(a < b for a, b in itertools.pairwise(medians)), f"trips not in order: {medians}"
    heads = timeline.group_done_us[1:]
    last_trip = [p.trip_of(p.positions(1 + h)[-1]) for h in range(p.heads)]
    for h in range(1, p.heads):  # a head whose last row streams trips after another's is done after it
        if last_trip[h] > last_trip[h - 1] + 1:
            assert heads[h] > heads[h - 1], f"head {h} done at {heads[h]:.2f} us, before head {h - 1}"
    print(
        f"METRIC head stream {build.name}: end {timeline.end_us:.2f} us, heads done at "
        + ", ".join(f"{t:.1f}" for t in timeline.group_done_us)
    )


def test_graph_replays_give_the_eager_bits():
    build = next(b for b in BUILDS if b.tp == 16 and b.plan.batch == 4 and b.plan.split == 2)
    p = build.plan
    x, w, out, _ = operands(p.rows, p.k, p.batch, seed=7)
    trace = kda_head_stream_op.trace_buffer(p, x.device)
    run(build, x, w, out, trace)
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(build, x, w, out, trace)
    out.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first), "the graph replay differs from the eager run"
    assert HeadStreamTimeline.from_words(p, trace.tolist()).launches == 3  # eager, capture does not run, 2 replays


def test_inputs_the_probe_cannot_take_are_refused():
    dev = "cuda"
    x = torch.zeros(2, 7168, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(3216, 7168, dtype=torch.bfloat16, device=dev)
    out = torch.zeros(2, 3216, dtype=torch.bfloat16, device=dev)
    plan = kda_head_stream_op.plan_for(x, w, 6, HEAD_DIM, 4)
    trace = kda_head_stream_op.trace_buffer(plan, x.device)
    kw = {"heads": 6, "head_dim": HEAD_DIM, "split": 4}
    with pytest.raises(ValueError, match="CUDA device"):
        kda_head_stream_op.project(x.cpu(), w.cpu(), out.cpu(), trace.cpu(), **kw)
    with pytest.raises(ValueError, match=r"must be torch\.bfloat16"):
        kda_head_stream_op.project(x.float(), w, out, trace, **kw)
    with pytest.raises(ValueError, match="trace has"):
        kda_head_stream_op.project(x, w, out, trace[:-1], **kw)
    with pytest.raises(ValueError, match=r"out \(2, 3200\)"):
        kda_head_stream_op.project(x, w, out[:, :3200].contiguous(), trace, **kw)
    with pytest.raises(ValueError, match="cannot hold 7 heads"):
        kda_head_stream_op.project(x, w, out, trace, heads=7, head_dim=HEAD_DIM, split=4)
