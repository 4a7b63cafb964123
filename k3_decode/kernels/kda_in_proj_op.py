"""The CuTe DSL KDA input projection called on torch tensors: the CUDA-core weight stream (kda_in_proj.py), the
tensor-core one (kda_in_proj_mma.py) or the TMA + wgmma one (wgmma_stream.py), whichever kda_in_proj_choice.toml
picks for the weight and batch.

The provider of its op (providers.py) calls it; so does its GPU test, which it passed on an H200 before it became one.

`linear(x, weight)` has the contract of the stock `k3_decode.stock.gemm.linear` for this projection: x [B, K] and
weight [R, K] in BF16, out [B, R] BF16 = x @ weight^T with FP32 accumulation. The kernel is compiled once per plan
(rows, K, batch, the device's SM count), from the same fake-tensor signature that `k3gate kernels build` checks.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import Tensor

from k3_decode.kernels import phase_trace
from k3_decode.kernels.counters import count, device_counter, leading
from k3_decode.kernels.kda_in_proj_choice import kernel_for_rows, wgmma_plan
from k3_decode.kernels.kda_in_proj_mma_plan import InProjMmaPlan
from k3_decode.kernels.kda_in_proj_plan import InProjPlan
from k3_decode.kernels.wgmma_stream_plan import WgmmaStreamPlan

_COUNTERS: dict[int, Tensor] = {}
DTYPE = torch.bfloat16
ALIGN = 16  # bytes: x and the weight are read in 16-byte vectors
KERNELS = ("cuda_core", "tensor_core", "wgmma")
Plan = InProjPlan | InProjMmaPlan | WgmmaStreamPlan


@cache
def _compiled(plan: Plan, trace: bool = False) -> Any:
    import cutlass.cute as cute

    if isinstance(plan, WgmmaStreamPlan):
        from k3_decode.kernels import wgmma_stream

        return cute.compile(wgmma_stream.KdaInProjKernelWgmma(plan, trace), *wgmma_stream.compile_args(plan, trace))
    if isinstance(plan, InProjMmaPlan):
        from k3_decode.kernels import kda_in_proj_mma as module

        kernel: Any = module.KdaInProjKernelMma(plan, trace)
    else:
        from k3_decode.kernels import kda_in_proj as module

        kernel = module.KdaInProjKernel(plan, trace)
    return cute.compile(kernel, *module.compile_args(plan, trace))


def _check_tensor(name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device or t.dtype != DTYPE:
        raise ValueError(f"KDA in_proj {name} must be {DTYPE} on {device}, got {t.dtype} on {t.device}")
    if not t.is_contiguous() or t.data_ptr() % ALIGN:
        raise ValueError(f"KDA in_proj {name} must be contiguous and {ALIGN}-byte aligned; pass .contiguous()")


def plan_for(x: Tensor, weight: Tensor, kernel: str | None = None) -> Plan:
    """The plan that runs x @ weight^T on x's device with `kernel` (one of KERNELS; None: the one for the batch);
    raises for what the kernel cannot take."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"KDA in_proj kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    if x.device.type != "cuda":
        raise ValueError(f"the CuTe DSL KDA in_proj runs on a CUDA device, got {x.device}; use the stock op")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"KDA in_proj: x {tuple(x.shape)} and weight {tuple(weight.shape)} need [B, K] x [R, K]")
    _check_tensor("x", x, x.device)
    _check_tensor("weight", weight, x.device)
    chosen = kernel or kernel_for_rows(x.shape[0], weight.shape[0])
    if chosen == "wgmma":
        plan = wgmma_plan(weight.shape[0], weight.shape[1], x.shape[0])
        if (why := plan.problem()) is not None:
            raise ValueError(f"KDA in_proj: the wgmma stream cannot take x {tuple(x.shape)}: {why}; use another kernel")
        return plan
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    plan_type = InProjMmaPlan if chosen == "tensor_core" else InProjPlan
    return plan_type.for_shape(weight.shape[0], weight.shape[1], x.shape[0], sms)


def linear(x: Tensor, weight: Tensor, out: Tensor | None = None, kernel: str | None = None) -> Tensor:
    """x [B, K] @ weight[R, K]^T -> [B, R] BF16, on the current stream of x's device (`kernel`: see plan_for)."""
    plan = plan_for(x, weight, kernel)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=DTYPE, device=x.device)
    elif tuple(out.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"KDA in_proj out {tuple(out.shape)} must be [B, R] = {(x.shape[0], weight.shape[0])}")
    _check_tensor("out", out, x.device)
    trace = phase_trace.enabled()
    counter = leading(launch_counter(x.device), phase_trace.words_for(plan.ctas, trace))
    launch(_compiled(plan, trace), x, weight, out, counter, torch.cuda.current_stream(x.device).cuda_stream)
    return out


def launch_counter(device: torch.device) -> Tensor:
    """The device's launch counter: every launch of the kernel on `device` adds one to it, on the device."""
    return device_counter(_COUNTERS, device, phase_trace.counter_size())


def launch_count() -> int:
    """Launches the device counters have seen in this process, over every device (reads them: synchronizes)."""
    return count(_COUNTERS)


def launch(compiled: Any, x: Tensor, weight: Tensor, out: Tensor, launches: Tensor, stream: int) -> None:
    """Call a compiled kernel on the CUDA stream with handle `stream`. No checks: see `linear`."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import from_dlpack

    args = [from_dlpack(t, assumed_align=ALIGN) for t in (x, weight, out, launches)]
    compiled(*args, cuda.CUstream(stream))
