"""The fused o_proj + AttnRes kernel (k3_decode/kernels/kda_o_proj.py) called on torch tensors.

The o_proj provider (providers.py) calls it; so does its GPU test (tests/k3_decode/kernels/test_kda_o_proj_gpu.py).

`apply` does in one launch what the stock path does in two calls: `linear(o, weight)` (o_proj, this rank's partial:
on one rank the attention output itself) and `attn_res_after` on that output (k3_decode.stock.attn_res contract:
the prefix and a saved block updated in place in `AttnResBuffers`, the BF16 MLP input returned). The kernel is
compiled once per plan (shape, batch, AttnRes kind, the device's SM count) and bank capacity, from the same
fake-tensor signature that `k3gate kernels build` checks.

Every launch on a device shares that device's arrival word (the grid-wide point of the kernel): each launch leaves
it as it found it but for the top bit, so it is never reset, also not between CUDA-graph replays, but two launches
must not run at the same time on it (one stream, as a decode step runs; launches on two streams that may overlap
need words of their own).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import Tensor

from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
from k3_decode.kernels import attn_res_op, cluster_residency, phase_trace
from k3_decode.kernels.counters import count, device_counter, leading
from k3_decode.kernels.kda_o_proj_plan import OProjPlan, wgmma_at
from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan
from k3_decode.reference.attn_res import MixWeights

_COUNTERS: dict[int, Tensor] = {}
_ARRIVALS: dict[int, Tensor] = {}
DTYPE = torch.bfloat16
ALIGN = 16  # bytes: every operand is moved in 16-byte vectors


@cache
def _compiled(plan: OProjPlan | OProjWgmmaPlan, capacity: int, trace: bool = False) -> Any:
    import cutlass.cute as cute

    from k3_decode.kernels.kda_o_proj import KdaOProjKernel, compile_args

    if isinstance(plan, OProjWgmmaPlan):
        from k3_decode.kernels.kda_o_proj_wgmma import KdaOProjKernelWgmma

        return cute.compile(KdaOProjKernelWgmma(plan, trace), *compile_args(plan, capacity, trace))
    return cute.compile(KdaOProjKernel(plan, trace), *compile_args(plan, capacity, trace))


def _check_tensor(name: str, t: Tensor, device: torch.device) -> None:
    if t.device != device or t.dtype != DTYPE:
        raise ValueError(f"fused o_proj {name} must be {DTYPE} on {device}, got {t.dtype} on {t.device}")
    if not t.is_contiguous() or t.data_ptr() % ALIGN:
        raise ValueError(f"fused o_proj {name} must be contiguous and {ALIGN}-byte aligned; pass .contiguous()")


def plan_for(
    o: Tensor,
    weight: Tensor,
    buffers: AttnResBuffers,
    site: AttnResSite,
    weights: MixWeights,
    wgmma: bool | None = None,
) -> OProjPlan | OProjWgmmaPlan:
    """The plan that runs o_proj and the AttnRes `site` on o's device; raises for what the kernel cannot take.
    `wgmma`: the wgmma build (True) or the mma.sync one (False); None: what kda_o_proj_choice.toml picks."""
    if o.device.type != "cuda":
        raise ValueError(f"the CuTe DSL fused o_proj runs on a CUDA device, got {o.device}; use the stock ops")
    if o.dim() != 2 or weight.dim() != 2 or o.shape[1] != weight.shape[1]:
        raise ValueError(f"fused o_proj: o {tuple(o.shape)} and weight {tuple(weight.shape)} need [B, K] x [H, K]")
    _check_tensor("o", o, o.device)
    _check_tensor("weight", weight, o.device)
    tokens, hidden = buffers.prefix.shape
    if (tokens, hidden) != (o.shape[0], weight.shape[0]):
        raise ValueError(
            f"fused o_proj: the AttnRes rows {(tokens, hidden)} must be o_proj's output [B, H] = "
            f"{(o.shape[0], weight.shape[0])}"
        )
    kind = attn_res_op.kind_for(site, o, weights)  # the delta is o_proj's BF16 output
    sms = torch.cuda.get_device_properties(o.device).multi_processor_count
    if wgmma_at(tokens) if wgmma is None else wgmma:
        plan: OProjPlan | OProjWgmmaPlan = OProjWgmmaPlan.for_shape(hidden, o.shape[1], tokens, kind, sms)
    else:
        plan = OProjPlan.for_shape(hidden, o.shape[1], tokens, kind, sms)
    # The plan counted SMs; whether the GPU's GPCs hold more clusters than wait is the driver's to say.
    index = o.device.index if o.device.index is not None else torch.cuda.current_device()
    plan.check_resident(cluster_residency.max_active_clusters(index, plan.cluster, *plan.residency))
    return plan


def apply(
    o: Tensor,
    weight: Tensor,
    buffers: AttnResBuffers,
    site: AttnResSite,
    weights: MixWeights,
    eps: float,
    attn_out: Tensor | None = None,
    wgmma: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """attn_out = o @ weight^T (BF16 [B, H]), then the AttnRes `site` with attn_out as delta, in place on
    `buffers`, in one launch on the current stream. Returns (attn_out, the MLP input BF16 [B, H]); `attn_out` may be
    given (the buffer o_proj's output is written to); `wgmma` as plan_for's."""
    plan = plan_for(o, weight, buffers, site, weights, wgmma)
    if attn_out is None:
        attn_out = torch.empty_like(buffers.prefix)
    attn_res_op._check(buffers, site, attn_out, weights)  # the AttnRes side: buffers, site, weights, attn_out
    _check_tensor("attn_out", attn_out, o.device)
    out = torch.empty_like(buffers.prefix)
    flat = [None if w is None else w.reshape(-1) for w in (weights.res_norm, weights.res_proj, weights.out_norm)]
    device, trace = o.device, phase_trace.enabled()
    counter = leading(launch_counter(device), phase_trace.words_for(plan.ctas, trace))
    launch(
        _compiled(plan, buffers.capacity, trace),
        (o, weight, attn_out, buffers.prefix, buffers.blocks, out, *flat, arrival_word(device), counter),
        -1 if site.save_index is None else site.save_index,
        eps,
        torch.cuda.current_stream(device).cuda_stream,
    )
    if site.save_index is not None:
        buffers.num_blocks = site.save_index + 1
    return attn_out, out


def arrival_word(device: torch.device) -> Tensor:
    """The device's arrival word: zero when created, and every launch leaves its low 31 bits zero."""
    return device_counter(_ARRIVALS, device)


def launch_counter(device: torch.device) -> Tensor:
    """The device's launch counter: every launch of the kernel on `device` adds one to it, on the device."""
    return device_counter(_COUNTERS, device, phase_trace.counter_size())


def launch_count() -> int:
    """Launches the device counters have seen in this process, over every device (reads them: synchronizes)."""
    return count(_COUNTERS)


def launch(compiled: Any, tensors: tuple[Tensor | None, ...], save_index: int, eps: float, stream: int) -> None:
    """Call a compiled kernel: tensors in the kernel's order (o, weight, attn_out, prefix, bank, out, res_norm,
    res_proj, out_norm, arrivals, launches; None where the kind has none), on the CUDA stream with handle `stream`.
    No checks: see `apply`."""
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    args = [None if t is None else from_dlpack(t, assumed_align=ALIGN) for t in tensors]
    compiled(*args, Int32(save_index), Float32(eps), cuda.CUstream(stream))
