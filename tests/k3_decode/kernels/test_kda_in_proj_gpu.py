"""The CuTe DSL KDA input projection on an H200 against torch's linear, at every shape CI compiles (the packed input
projection and, with the same kernel, o_proj).

This must pass on a GPU before the kernel may be registered as a specialized provider (it is not registered now).

Tolerance (elementwise, stated from the arithmetic, so it holds for any FP32 summation order): with e the exact
dot product (FP64, exact for BF16 products at this K) and a = sum |x_k w_k|,
    |out - e| <= 2^-8 |e| + 2 K 2^-24 a
i.e. one BF16 rounding (unit roundoff 2^-8) of an FP32 sum whose error is at most K u32 a (the worst case of any
order, so cuBLAS meets it too). Dropping a single 8-column vector of the 7168 exceeds it on most outputs. Against
`torch.nn.functional.linear` (cuBLAS) both sides are within that of e, so they differ by at most twice it; and as
the two FP32 sums differ by ~1e-6 relative, their BF16 roundings differ on ~0.1% of outputs, so >= 98% must be
bit-equal.

The bandwidth test prints the kernel's achieved fraction of the copy bandwidth measured in the same process (it
writes nothing), next to cuBLAS's and the eager per-call time, and asserts that providers.toml's row limits are
honest: every row count a provider serves is one where the kernel is not slower than cuBLAS (beyond timing noise).
The issue's bandwidth target (85% at TP8, B = 1..8) is judged by the KDA layer benchmark, which writes its JSON
(benchmarks/kda_layer_h200.py); at B = 8 the kernel reaches ~60% (CUDA-core bound) and cuBLAS serves those rows.
It times launches captured in a CUDA graph, as decode runs them: eagerly, each call also pays CuTe DSL's host-side
argument conversion (measured 66 us per call on the H200, longer than the kernel), which a graph replay does not.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from k3_decode.kernels import kda_in_proj_op
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, KdaInProjBuild
from k3_decode.kernels.providers import max_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
BUILDS = [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaInProjBuild)]  # what CI compiles
SHAPES = [(b.tp, b.plan.rows, b.plan.k, b.plan.batch) for b in BUILDS]
SPARE = 3  # rows after x and W, and elements after out, that the kernel must neither read into a result nor write
BIT_EQUAL_FLOOR = 0.98
NOISE = 1.03  # graph-replay timings of the same kernel differ by up to ~2% between runs on the H200


def operands(rows: int, k: int, batch: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x, W, out, out's whole buffer): views of buffers with NaN spare rows after x and W and a NaN tail after
    out, so a read past the batch or the rows poisons a result and a write past the end changes the tail."""
    gen = torch.Generator().manual_seed(seed)
    xbuf = torch.full((batch + SPARE, k), float("nan"), dtype=torch.bfloat16)
    xbuf[:batch] = torch.randn(batch, k, generator=gen).bfloat16()
    wbuf = torch.full((rows + SPARE, k), float("nan"), dtype=torch.bfloat16)
    wbuf[:rows] = (torch.randn(rows, k, generator=gen) * 0.02).bfloat16()
    obuf = torch.full((batch * rows + 64,), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = obuf[: batch * rows].view(batch, rows)
    return xbuf.to(DEV)[:batch], wbuf.to(DEV)[:rows], out, obuf


def linear_fp32_reduction(x: Tensor, w: Tensor) -> Tensor:
    """cuBLAS's linear with every reduction in FP32 (torch otherwise lets a split-K reduce in BF16)."""
    saved = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved


def bound(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(exact x @ w^T in FP64, the tolerance of the module docstring)."""
    xd, wd = x.double(), w.double()
    exact = xd @ wd.T
    absolute = xd.abs() @ wd.abs().T
    k = x.shape[1]
    return exact, exact.abs() * 2.0**-8 + absolute * (2.0 * k * 2.0**-24)


@pytest.mark.parametrize("tp, rows, k, batch", SHAPES, ids=[b.name for b in BUILDS])
def test_kernel_matches_linear_within_one_bf16_rounding(tp: int, rows: int, k: int, batch: int):
    x, w, out, obuf = operands(rows, k, batch, seed=tp * 100 + batch)
    tail = obuf[batch * rows :].clone()
    got = kda_in_proj_op.linear(x, w, out)
    want = linear_fp32_reduction(x, w)
    torch.cuda.synchronize()

    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16 and got.shape == (batch, rows)
    assert torch.isfinite(got).all(), "a NaN: the kernel read past the batch or the rows, or left an output unset"
    assert torch.equal(obuf[batch * rows :].isnan(), tail.isnan()), "the kernel wrote past the end of out"
    exact, tol = bound(x, w)
    err = (got.double() - exact).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{tp=} {batch=}: error reaches {worst:.2f}x the bound"
    assert ((got.double() - want.double()).abs() <= 2 * tol).all(), "farther from cuBLAS than two roundings"
    same = (got == want).double().mean().item()
    print(f"METRIC KDA in_proj TP{tp} B{batch}: error/bound max {worst:.3f}, bit-equal to cuBLAS {same:.4f}")
    assert same >= BIT_EQUAL_FLOOR, f"only {same:.4f} of outputs equal cuBLAS's bits (FP32 sum, one RTNE rounding)"


def test_runs_are_deterministic_and_replay_in_a_cuda_graph():
    """Same inputs, same bits: eagerly twice and from a captured graph (a PDL launch inside a graph)."""
    build = next(b for b in BUILDS if b.op == "kda_in_proj" and b.tp == 8 and b.plan.batch == 8)
    x, w, out, _ = operands(build.plan.rows, build.plan.k, build.plan.batch, seed=5)
    first = kda_in_proj_op.linear(x, w).clone()
    second = kda_in_proj_op.linear(x, w).clone()
    assert torch.equal(first, second), "two eager runs differ"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_in_proj_op.linear(x, w, out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first), "the graph replay differs from the eager run"


def test_inputs_the_kernel_cannot_take_are_refused():
    x = torch.zeros(2, 7168, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(3216, 7168, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match=r"must be torch\.bfloat16"):
        kda_in_proj_op.linear(x.float(), w)
    with pytest.raises(ValueError, match="contiguous"):
        kda_in_proj_op.linear(torch.zeros(7168, 2, dtype=torch.bfloat16, device=DEV).t(), w)
    with pytest.raises(ValueError, match="CUDA device"):
        kda_in_proj_op.linear(x.cpu(), w.cpu())
    with pytest.raises(ValueError, match=r"\[B, K\] x \[R, K\]"):
        kda_in_proj_op.linear(x, w[:, :4096])
    with pytest.raises(ValueError, match="multiple of 8"):
        kda_in_proj_op.linear(x, w[:3212])
    with pytest.raises(ValueError, match="out"):
        kda_in_proj_op.linear(x, w, torch.empty(2, 3200, dtype=torch.bfloat16, device=DEV))


# --- bandwidth (measured, printed, nothing written) ---------------------------------------------------------------


def _eager_seconds_per_call(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    start.record()
    for i in range(calls):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def _graph_seconds_per_call(fn, calls: int, replays: int = 5) -> float:
    """`calls` back-to-back launches captured in one CUDA graph, as decode runs them: the host's per-call cost
    (CuTe DSL's argument conversion, tens of microseconds) is paid at capture, not per replay. Median of replays."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write), the achievable HBM bandwidth."""
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device=DEV), torch.empty(n, dtype=torch.uint8, device=DEV)
    return 2 * n / _eager_seconds_per_call(lambda _: dst.copy_(src), 20)


@pytest.mark.parametrize("tp", [8, 16])
def test_bandwidth_fraction_of_copy(tp: int):
    copy = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    missed = []
    for build in (b for b in BUILDS if b.tp == tp):
        p = build.plan
        # Enough distinct weights that each call streams its weight from HBM, not from L2 (TP16's fits in L2).
        copies = max(2, math.ceil(3 * l2 / p.weight_bytes))
        x, _, out, _ = operands(p.rows, p.k, p.batch, seed=1)
        weights = [(torch.randn(p.rows, p.k, device=DEV) * 0.02).bfloat16() for _ in range(copies)]
        moved = p.weight_bytes + x.numel() * 2 + out.numel() * 2
        timed = {}
        for name, fn in (
            ("cute", lambda i, x=x, ws=weights, out=out: kda_in_proj_op.linear(x, ws[i % len(ws)], out)),
            ("cublas", lambda i, x=x, ws=weights, out=out: torch.matmul(x, ws[i % len(ws)].T, out=out)),
        ):
            timed[name] = _graph_seconds_per_call(fn, 4 * copies)
        eager = _eager_seconds_per_call(
            lambda i, x=x, ws=weights, out=out: kda_in_proj_op.linear(x, ws[i % len(ws)], out), 20
        )
        fraction = moved / timed["cute"] / copy
        print(
            f"METRIC {build.op} TP{tp} B{p.batch}: graph {timed['cute'] * 1e6:.1f} us "
            f"({moved / timed['cute'] / 1e12:.2f} TB/s, {fraction:.1%} of copy {copy / 1e12:.2f} TB/s); "
            f"cuBLAS graph {timed['cublas'] * 1e6:.1f} us ({moved / timed['cublas'] / copy:.1%}); "
            f"eager {eager * 1e6:.1f} us per call"
        )
        del weights
        served = max_rows("in_proj", "", tp)
        if (served is None or p.batch <= served[0]) and timed["cute"] > timed["cublas"] * NOISE:
            missed.append(f"{build.op} B{p.batch}: {timed['cute'] * 1e6:.1f} vs cuBLAS {timed['cublas'] * 1e6:.1f} us")
    assert not missed, (
        f"TP{tp}: providers.toml has the kernel serve rows where cuBLAS is faster: {'; '.join(missed)} — lower "
        "max_rows there"
    )
