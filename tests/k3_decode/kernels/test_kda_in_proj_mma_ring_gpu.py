"""The tensor-core stream with W through a ring in shared memory (MmaStream.w_ring) on a GPU, at every ring tiling of
benchmarks/mma_stream_shapes.toml: the ring changes where W waits, never what is computed, so its output must be the
plain stream's bit for bit, launch after launch (each launch initializes its barriers afresh), with nothing read past
W's rows into a result and nothing written past the output. Run it under `timeout`: a stage barrier armed for the
wrong bytes or waited on at the wrong parity hangs rather than fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import mma_stream_shapes as mss
from k3_decode.kernels import kda_in_proj_op
from k3_decode.kernels.kda_in_proj_mma_plan import InProjMmaPlan
from tests.k3_decode.kernels.test_kda_in_proj_gpu import operands

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RINGS = [(s, v) for s in mss.load_shapes() for v in s.variants if isinstance(v.plan, InProjMmaPlan) and v.plan.w_ring]


def _run(plan, x, w, out) -> torch.Tensor:
    device = x.device
    compiled = kda_in_proj_op._compiled(plan)
    stream = torch.cuda.current_stream(device).cuda_stream
    kda_in_proj_op.launch(compiled, x, w, out, kda_in_proj_op.launch_counter(device), stream)
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.parametrize(("shape", "ring"), RINGS, ids=[f"{s.name}-{v.name}" for s, v in RINGS])
def test_the_ring_gives_the_plain_streams_bits(shape: mss.Shape, ring: mss.Variant):
    (plain,) = [v for v in shape.variants if v.plan == dataclasses.replace(ring.plan, w_ring=0)]  # all but the ring
    x, w, out, obuf = operands(shape.rows, shape.k, shape.batch, seed=11)
    want = _run(plain.plan, x, w, out)
    assert not want.isnan().any()
    for _ in range(3):
        out.fill_(float("nan"))
        got = _run(ring.plan, x, w, out)
        assert torch.equal(got, want), f"{(got != want).sum().item()} outputs differ from {plain.name}'s"
        assert obuf[out.numel() :].isnan().all(), "written past the output"
