"""The CuTe DSL fused KDA decode step (k3_decode/kernels/kda_step.py) called on torch tensors, like the stock op.

Its GPU test calls it (tests/k3_decode/kernels/test_kda_step_gpu.py); so will its provider (providers.py,
CuteKdaStepProvider), once that test has passed on an H200.

`decode_step(spec, weights, packed, cache, slots)` has the contract of the stock `k3_decode.stock.kda.kda_decode_step`
for q = 1: packed [B, rows] BF16 (the in_proj output), slots [B] (int32 or int64; <= 0 is NULL), the KdaCache's conv
state [slots, 3P, 3] BF16 and recurrent state [slots, H, 128, 128] FP32 updated in place at the live slots; returns
BF16 [B, P]. One launch does what the stock op does in two (the f_b GEMM and the fused Triton kernel). The kernel is
compiled once per plan (heads, packed width, batch, the device's SM count, the slot dtype), from the same fake-tensor
signature that `k3gate kernels build` checks; the cache's slot count is a run-time value of that compile.

`verify_step(spec, weights, packed, cache, slots, num_accepted)` has the contract of the stock
`k3_decode.stock.kda.kda_verify_step`: packed [B, q, rows], slots [B, q], num_accepted [B] (int32 or int64, each
1..q), the conv state holding the q - 1 speculative columns (2 + q in all); returns BF16 [B, q, P]. One launch of the
same kernel class (KdaStepKernel.verify) in place of stock's five, counted by the same device counter.

Slot contents are not checked here (that would need a device sync, and CUDA-graph capture forbids one): as for the
stock kernel, every live slot must be in range and distinct (the oracle's `decode_write_set` and `verify_write_set`
say why), and a verify step's accepted counts in 1..q with a real slot (the kernel clamps a count, and reads slot 0
for a NULL accepted slot, as stock's sanitized tables do).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import Tensor

from k3_decode.kernels import phase_trace
from k3_decode.kernels.counters import count, device_counter, leading
from k3_decode.kernels.kda_step_plan import (
    CONV_WIDTH,
    GATE_RANK,
    HEAD_DIM,
    MAX_TOKENS,
    KdaStepPlan,
    KdaVerifyPlan,
)
from k3_decode.reference.kda import KdaCache, KdaSpec

_COUNTERS: dict[int, Tensor] = {}
ALIGN = 16  # bytes: rows, weights and state are moved in 16-byte vectors
SLOT_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


@cache
def _compiled(plan: KdaStepPlan, trace: bool = False) -> Any:
    import cutlass.cute as cute

    from k3_decode.kernels.kda_step import compile_args
    from k3_decode.kernels.kda_step_group import step_kernel

    return cute.compile(step_kernel(plan, trace), *compile_args(plan, trace))


@cache
def _compiled_verify(plan: KdaVerifyPlan) -> Any:
    import cutlass.cute as cute

    from k3_decode.kernels.kda_step import KdaStepKernel, verify_compile_args

    return cute.compile(KdaStepKernel(plan).verify, *verify_compile_args(plan))


def _check_tensor(name: str, t: Tensor, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    if t.device != device or t.dtype != dtype:
        raise ValueError(f"CuTe KDA step: {name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"CuTe KDA step: {name} has shape {tuple(t.shape)}, expected {shape}")
    if not t.is_contiguous() or t.data_ptr() % ALIGN:
        raise ValueError(f"CuTe KDA step: {name} must be contiguous and {ALIGN}-byte aligned; pass .contiguous()")


def plan_for(spec: KdaSpec, packed: Tensor, slots: Tensor, **choice: Any) -> KdaStepPlan:
    """The plan that runs this step on packed's device: KdaStepPlan.for_shape's choice, each keyword of `choice`
    (cluster, resident_threads, warm_ahead, requests_per_cta, local_decays, lean_start, lean_conv, joint_sums,
    wide_warps, max_ctas_per_sm; KdaStepPlan.choice gives a plan's own) overriding it; raises for what the kernel
    cannot take."""
    if packed.device.type != "cuda":
        raise ValueError(f"the CuTe DSL KDA step runs on a CUDA device, got {packed.device}; use the stock op")
    if (spec.head_dim, spec.gate_rank, spec.conv_width) != (HEAD_DIM, GATE_RANK, CONV_WIDTH):
        raise ValueError(
            f"the CuTe DSL KDA step is built for head_dim {HEAD_DIM}, gate rank {GATE_RANK} and conv width "
            f"{CONV_WIDTH} (K3's); this spec has {spec.head_dim}, {spec.gate_rank}, {spec.conv_width}"
        )
    if slots.dim() != 1 or slots.dtype not in SLOT_DTYPES:
        raise ValueError(f"decode slots must be a 1-d int32 or int64 tensor, got {slots.dim()}-d {slots.dtype}")
    sms = torch.cuda.get_device_properties(packed.device).multi_processor_count
    dtype = SLOT_DTYPES[slots.dtype]
    plan = KdaStepPlan.for_shape(spec.heads, spec.in_proj_rows, slots.shape[0], sms, dtype, **choice)
    starts = {name: s.start for name, s in spec.sections.items() if name != "pad"}
    if starts != plan.sections:
        raise ValueError(f"the packed row's sections {starts} are not the kernel's {plan.sections}")
    return plan


def decode_step(
    spec: KdaSpec,
    weights: Any,
    packed: Tensor,
    cache: KdaCache,
    slots: Tensor,
    out: Tensor | None = None,
    **choice: Any,
) -> Tensor:
    """One q = 1 KDA decode step on the current stream of packed's device; returns BF16 [B, P].

    `weights` has f_b [P, 128] BF16, conv [3P, 4] BF16, a_log [H] FP32, dt_bias [P] FP32 and o_norm [128] BF16
    (k3_decode.weights.KdaWeights). The conv state must hold exactly the 3 decode taps (no speculative columns).
    `choice` overrides the plan's choice (plan_for: the cluster, the register budget, each knob); the provider
    passes none.
    """
    plan = plan_for(spec, packed, slots, **choice)
    dev, p, batch = packed.device, spec.proj, slots.shape[0]
    bf16 = torch.bfloat16
    _check_tensor("packed", packed, bf16, (batch, spec.in_proj_rows), dev)
    _check_tensor("slots", slots, slots.dtype, (batch,), dev)
    _check_state(spec, weights, cache, spec.conv_taps(1), dev)
    if out is None:
        out = torch.empty(batch, p, dtype=bf16, device=dev)
    _check_tensor("out", out, bf16, (batch, p), dev)
    trace = phase_trace.enabled()
    counter = leading(launch_counter(dev), phase_trace.words_for(plan.ctas, trace))
    _launch(_compiled(plan, trace), spec, weights, packed, cache, (slots, out), counter)
    return out


def _check_state(spec: KdaSpec, weights: Any, cache: KdaCache, columns: int, dev: torch.device) -> None:
    """The weights and the cache (`columns` conv columns) both steps read, as the kernel assumes them."""
    bf16, fp32, p = torch.bfloat16, torch.float32, spec.proj
    _check_tensor("f_b", weights.f_b, bf16, (p, GATE_RANK), dev)
    _check_tensor("conv weight", weights.conv, bf16, (spec.conv_channels, CONV_WIDTH), dev)
    _check_tensor("a_log", weights.a_log, fp32, (spec.heads,), dev)
    _check_tensor("dt_bias", weights.dt_bias, fp32, (p,), dev)
    _check_tensor("o_norm", weights.o_norm, bf16, (HEAD_DIM,), dev)
    num_slots = cache.conv.shape[0]
    _check_tensor("conv state", cache.conv, bf16, (num_slots, spec.conv_channels, columns), dev)
    shape = (num_slots, spec.heads, HEAD_DIM, HEAD_DIM)
    _check_tensor("recurrent state", cache.recurrent, fp32, shape, dev)


def _launch(
    compiled: Any,
    spec: KdaSpec,
    weights: Any,
    packed: Tensor,
    cache: KdaCache,
    tables: tuple[Tensor, ...],
    counter: Tensor,
) -> None:
    """One launch of a compiled decode or verify step: the operands both take, in their order, with `tables` (the
    slot table, verify's accepted counts, the output) between the state and the launch counter (its first word, or
    with a traced decode kernel's stamps after it)."""
    dev = packed.device
    launch(
        compiled,
        (
            packed,
            weights.f_b,
            weights.conv.view(-1),
            weights.a_log,
            weights.dt_bias,
            weights.o_norm,
            cache.conv.view(cache.conv.shape[0], -1),
            cache.recurrent,
            *tables,
            counter,
        ),
        (spec.gate_lower_bound, spec.l2_eps, spec.norm_eps),
        torch.cuda.current_stream(dev).cuda_stream,
    )


def verify_plan_for(spec: KdaSpec, packed: Tensor, slots: Tensor, num_accepted: Tensor) -> KdaVerifyPlan:
    """The plan that runs this verify step on packed's device; raises for what the kernel cannot take."""
    if slots.dim() != 2 or slots.dtype not in SLOT_DTYPES or not 1 <= slots.shape[1] <= MAX_TOKENS:
        raise ValueError(
            f"verify slots must be a [B, q] int32 or int64 tensor with q in 1..{MAX_TOKENS}, got "
            f"{tuple(slots.shape)} {slots.dtype}"
        )
    if num_accepted.dim() != 1 or num_accepted.dtype not in SLOT_DTYPES:
        raise ValueError(
            f"num_accepted must be a 1-d int32 or int64 tensor, got {num_accepted.dim()}-d {num_accepted.dtype}"
        )
    step = plan_for(spec, packed, slots[:, 0])  # the device, the spec and the sections, as for decode
    return KdaVerifyPlan(
        step.heads,
        step.rows,
        step.batch,
        step.cluster,
        step.slot_dtype,
        tokens=slots.shape[1],
        accepted_dtype=SLOT_DTYPES[num_accepted.dtype],
    )


def verify_step(
    spec: KdaSpec,
    weights: Any,
    packed: Tensor,
    cache: KdaCache,
    slots: Tensor,
    num_accepted: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """One verify step (q tokens per request) on the current stream of packed's device; returns BF16 [B, q, P].

    `weights` as for `decode_step`. The conv state must have exactly 2 + q columns (vLLM's for q - 1 speculative
    tokens; the stock op also takes wider rows, whose extra columns it leaves alone)."""
    plan = verify_plan_for(spec, packed, slots, num_accepted)
    dev, p, (batch, q) = packed.device, spec.proj, slots.shape
    bf16 = torch.bfloat16
    _check_tensor("packed", packed, bf16, (batch, q, spec.in_proj_rows), dev)
    _check_tensor("slots", slots, slots.dtype, (batch, q), dev)
    _check_tensor("num_accepted", num_accepted, num_accepted.dtype, (batch,), dev)
    _check_state(spec, weights, cache, plan.columns, dev)
    if out is None:
        out = torch.empty(batch, q, p, dtype=bf16, device=dev)
    _check_tensor("out", out, bf16, (batch, q, p), dev)
    counter = leading(launch_counter(dev), 1)  # the verify kernel is never traced
    _launch(_compiled_verify(plan), spec, weights, packed, cache, (slots, num_accepted, out), counter)
    return out


def launch_counter(device: torch.device) -> Tensor:
    """The device's launch counter: every launch of the kernel on `device`, decode or verify, adds one to it."""
    return device_counter(_COUNTERS, device, phase_trace.counter_size())


def launch_count() -> int:
    """Launches the device counters have seen in this process, over every device (reads them: synchronizes)."""
    return count(_COUNTERS)


def launch(compiled: Any, tensors: tuple[Tensor, ...], scalars: tuple[float, float, float], stream: int) -> None:
    """Call a compiled kernel: tensors in the kernel's order (packed, f_b, conv weight flat, A_log, dt_bias, o_norm,
    conv state [slots, 3P * T], recurrent state, slots, [num_accepted for a verify step,] out, launches), then (lower
    bound, L2 eps, norm eps), on the CUDA stream with handle `stream`. No checks: see `decode_step`, `verify_step`."""
    import cuda.bindings.driver as cuda
    from cutlass import Float32
    from cutlass.cute.runtime import from_dlpack

    args = [from_dlpack(t, assumed_align=ALIGN) for t in tensors]
    compiled(*args, *(Float32(x) for x in scalars), cuda.CUstream(stream))
