"""The TMA + wgmma weight stream (wgmma_stream.py) on a GPU, at every plan its build test compiles: within one BF16
rounding of the exact product, nothing read past x or W into a result (both sit in NaN-padded buffers), nothing
written past the output (NaN tail), and the same bits launch after launch (each launch sets up its barriers afresh;
a K split adds its partials in rank order). Run it under `timeout`: a stage barrier armed for the wrong bytes or
waited on at the wrong parity hangs rather than fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from tests.k3_decode.kernels.test_wgmma_stream_build import PLANS, plan_id  # noqa: E402 -- skips without CuTe DSL

SPARE = 64  # NaN rows after x and W, NaN elements after out
LAUNCHES = 3


def operands(rows: int, k: int, batch: int, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x, W, out, out's whole buffer) on the GPU: x ~ 0.5 N(0, 1) and W ~ 0.02 N(0, 1) in BF16, each followed by NaN
    rows, and out followed by a NaN tail."""
    gen = torch.Generator().manual_seed(seed)
    xbuf = torch.full((batch + SPARE, k), float("nan"), dtype=torch.bfloat16)
    xbuf[:batch] = (torch.randn(batch, k, generator=gen) * 0.5).bfloat16()
    wbuf = torch.full((rows + SPARE, k), float("nan"), dtype=torch.bfloat16)
    wbuf[:rows] = (torch.randn(rows, k, generator=gen) * 0.02).bfloat16()
    obuf = torch.full((batch * rows + SPARE,), float("nan"), dtype=torch.bfloat16, device="cuda")
    return xbuf.cuda()[:batch], wbuf.cuda()[:rows], obuf[: batch * rows].view(batch, rows), obuf


def within_one_rounding(got: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """Where |got - exact| <= |exact| * 2**-8 + 1e-3, exact being x @ w^T in FP64 (benchmarks/mma_stream_shapes.py)."""
    exact = x.double() @ w.double().T
    return (got.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-3


@pytest.mark.parametrize("plan", PLANS, ids=plan_id)
def test_the_stream_is_exact_to_one_rounding_and_repeatable(plan):
    from k3_decode.kernels import kda_in_proj_op

    x, w, out, obuf = operands(plan.rows, plan.k, plan.batch, seed=plan.rows + plan.batch)
    fn = kda_in_proj_op._compiled(plan)
    stream = torch.cuda.current_stream().cuda_stream
    launches = torch.zeros(1, dtype=torch.int32, device="cuda")
    results = []
    for _ in range(LAUNCHES):
        out.fill_(float("nan"))
        kda_in_proj_op.launch(fn, x, w, out, launches, stream)
        torch.cuda.synchronize()
        results.append(out.clone())
        assert obuf[out.numel() :].isnan().all(), "written past the output"
    got = results[0]
    assert not got.isnan().any(), f"{got.isnan().sum().item()} outputs not written or read past x or W"
    ok = within_one_rounding(got, x, w)
    assert ok.all(), f"{(~ok).sum().item()} of {ok.numel()} outputs off by more than one BF16 rounding"
    for again in results[1:]:
        assert torch.equal(again, got), f"{(again != got).sum().item()} outputs changed between launches"
    assert launches.item() == LAUNCHES, "the launch counter is not one add per launch"
