"""The head-ordered projection probe (kda_head_stream.py) called on torch tensors. Not a provider: the GPU test and
`benchmarks/head_stream_h200.py` call it, and read its trace words with kda_head_stream_trace.py.

`project(x, weight, out, trace, heads=, head_dim=, split=, watch=, stages=)` computes out = x @ weight^T (BF16, FP32
accumulation) with the weight's rows in head order. `trace` is the caller's Int32 buffer of `plan.trace_words`
words (`trace_buffer`): the launch count, one counter per group and the stamps (with `watch` also the epoch, the
done count and the watcher's stamps); the kernel adds to the counts and overwrites the stamps. Zero it once, then
reuse it: the counters and the epoch only work across launches that all used the same buffer.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import Tensor

from k3_decode.kernels.kda_head_stream_plan import HeadStreamPlan

DTYPE = torch.bfloat16
ALIGN = 16  # bytes: x and the weight are read in 16-byte vectors


@cache
def _compiled(plan: HeadStreamPlan) -> Any:
    import cutlass.cute as cute

    from k3_decode.kernels.kda_head_stream import KdaHeadStreamKernel, compile_args

    return cute.compile(KdaHeadStreamKernel(plan), *compile_args(plan))


def _check(name: str, t: Tensor, device: torch.device, dtype: torch.dtype = DTYPE) -> None:
    if t.device != device or t.dtype != dtype:
        raise ValueError(f"head stream {name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    if not t.is_contiguous() or t.data_ptr() % ALIGN:
        raise ValueError(f"head stream {name} must be contiguous and {ALIGN}-byte aligned; pass .contiguous()")


def plan_for(
    x: Tensor, weight: Tensor, heads: int, head_dim: int, split: int, watch: bool = False, stages: int = 0
) -> HeadStreamPlan:
    """The plan for x @ weight^T on x's device (`watch`: with the watching warp; `stages`: copy-fed through a ring
    of that many stages); raises for what the kernel cannot take."""
    if x.device.type != "cuda":
        raise ValueError(f"the head stream runs on a CUDA device, got {x.device}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"head stream: x {tuple(x.shape)} and weight {tuple(weight.shape)} need [B, K] x [R, K]")
    _check("x", x, x.device)
    _check("weight", weight, x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    rows, k, batch = weight.shape[0], weight.shape[1], x.shape[0]
    return HeadStreamPlan.for_shape(rows, k, batch, heads, head_dim, split, sms, watch, stages)


def trace_buffer(plan: HeadStreamPlan, device: torch.device) -> Tensor:
    return torch.zeros(plan.trace_words, dtype=torch.int32, device=device)


def project(
    x: Tensor,
    weight: Tensor,
    out: Tensor,
    trace: Tensor,
    *,
    heads: int,
    head_dim: int,
    split: int,
    watch: bool = False,
    stages: int = 0,
) -> HeadStreamPlan:
    """out[B, R] = x @ weight^T on the current stream of x's device; returns the plan that ran."""
    plan = plan_for(x, weight, heads, head_dim, split, watch, stages)
    if tuple(out.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"head stream out {tuple(out.shape)} must be [B, R] = {(x.shape[0], weight.shape[0])}")
    _check("out", out, x.device)
    if trace.numel() != plan.trace_words:
        raise ValueError(f"head stream trace has {trace.numel()} words, the plan needs {plan.trace_words}")
    _check("trace", trace, x.device, torch.int32)
    launch(_compiled(plan), x, weight, out, trace, torch.cuda.current_stream(x.device).cuda_stream)
    return plan


def launch(compiled: Any, x: Tensor, weight: Tensor, out: Tensor, trace: Tensor, stream: int) -> None:
    """Call a compiled kernel on the CUDA stream with handle `stream`. No checks: see `project`."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import from_dlpack

    args = [from_dlpack(t, assumed_align=ALIGN) for t in (x, weight, out, trace)]
    compiled(*args, cuda.CUstream(stream))
