"""The CuTe DSL AttnRes kernel (k3_decode/kernels/attn_res.py) called on torch tensors, like the stock op.

The provider of its op (providers.py) calls it; so does its GPU test, which it passed on an H200 before it became one.

`apply` has the stock op's contract (k3_decode.stock.attn_res.apply): it updates the prefix and saves a block in
place in `AttnResBuffers` and returns the BF16 output; the kernel is compiled once per (hidden, kind, batch, bank
capacity) for the GPU in use, from the same fake-tensor signature that `k3gate kernels build` checks.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import Tensor

from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
from k3_decode.kernels.attn_res_plan import AttnResKind, ClusterPlan
from k3_decode.kernels.counters import count, device_counter
from k3_decode.reference.attn_res import MixWeights

_COUNTERS: dict[int, Tensor] = {}
STATE_DTYPE = torch.bfloat16
DELTA_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
ALIGN = 16  # bytes: every row is moved in 16-byte vectors


def kind_for(site: AttnResSite, delta: Tensor | None, weights: MixWeights) -> AttnResKind:
    """The compiled kind that runs `site` with this delta and these weights."""
    delta_dtype = "bfloat16" if delta is None else DELTA_DTYPES.get(delta.dtype)
    if delta_dtype is None:
        raise ValueError(f"AttnRes delta must be BF16 or FP32, got {delta.dtype}; convert it before the call")
    return AttnResKind(
        num_blocks=site.num_blocks,
        delta=site.delta,
        save=site.save_index is not None,
        out_norm=weights.out_norm is not None,
        delta_dtype=delta_dtype,  # type: ignore[arg-type]
    )


@cache
def _compiled(hidden: int, kind: AttnResKind, batch: int, capacity: int) -> Any:
    import cutlass.cute as cute

    from k3_decode.kernels.attn_res import AttnResKernel, compile_args

    return cute.compile(AttnResKernel(hidden, kind), *compile_args(hidden, kind, batch, capacity))


def _check_tensor(name: str, t: Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if t.device != device or t.dtype != dtype:
        raise ValueError(f"AttnRes {name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    if not t.is_contiguous() or t.data_ptr() % ALIGN:
        raise ValueError(f"AttnRes {name} must be contiguous and {ALIGN}-byte aligned; pass .contiguous() rows")


def _check(buffers: AttnResBuffers, site: AttnResSite, delta: Tensor | None, weights: MixWeights) -> None:
    prefix, blocks = buffers.prefix, buffers.blocks
    tokens, hidden = prefix.shape
    ClusterPlan.for_hidden(hidden)  # raises for a width the kernel cannot split
    if prefix.device.type != "cuda":
        raise ValueError(f"the CuTe DSL AttnRes runs on a CUDA device, got {prefix.device}; use the stock op")
    _check_tensor("prefix", prefix, STATE_DTYPE, prefix.device)
    _check_tensor("bank", blocks, STATE_DTYPE, prefix.device)
    if blocks.shape[0] != tokens or blocks.shape[2] != hidden:
        raise ValueError(f"bank {tuple(blocks.shape)} does not match prefix {tuple(prefix.shape)}")
    if buffers.num_blocks != site.bank_before:
        raise ValueError(
            f"AttnRes: the bank holds {buffers.num_blocks} blocks, this site expects {site.bank_before}; "
            "pass the site that matches the buffers"
        )
    if site.save_index is not None and not site.num_blocks <= site.save_index < buffers.capacity:
        raise ValueError(
            f"AttnRes: block {site.save_index} must lie in the bank ({buffers.capacity}) and not be one it reads"
        )
    if (delta is None) != (site.delta == "none"):
        raise ValueError(f"AttnRes: this site takes {'no' if site.delta == 'none' else 'a'} delta")
    if delta is not None:
        if tuple(delta.shape) != (tokens, hidden):
            raise ValueError(f"AttnRes: delta {tuple(delta.shape)} must be [tokens, hidden] = {(tokens, hidden)}")
        _check_tensor("delta", delta, delta.dtype, prefix.device)
    for name, w in (("res_norm", weights.res_norm), ("res_proj", weights.res_proj), ("out_norm", weights.out_norm)):
        if w is not None:
            if w.numel() != hidden:
                raise ValueError(f"AttnRes weight {name} has {w.numel()} elements, expected hidden = {hidden}")
            _check_tensor(name, w, STATE_DTYPE, prefix.device)


def apply(buffers: AttnResBuffers, site: AttnResSite, delta: Tensor | None, weights: MixWeights, eps: float) -> Tensor:
    """Run one AttnRes application in place on `buffers`; returns the mixed (and normed) row, BF16 [T, hidden]."""
    _check(buffers, site, delta, weights)
    prefix = buffers.prefix
    tokens, hidden = prefix.shape
    out = torch.empty_like(prefix)
    # res_proj is stored [1, hidden]; the kernel takes every weight as [hidden].
    flat = [None if w is None else w.reshape(-1) for w in (weights.res_norm, weights.res_proj, weights.out_norm)]
    launch(
        _compiled(hidden, kind_for(site, delta, weights), tokens, buffers.capacity),
        (prefix, delta, buffers.blocks, out, *flat, launch_counter(prefix.device)),
        -1 if site.save_index is None else site.save_index,
        eps,
        torch.cuda.current_stream(prefix.device).cuda_stream,
    )
    if site.save_index is not None:
        buffers.num_blocks = site.save_index + 1
    return out


def launch_counter(device: torch.device) -> Tensor:
    """The device's launch counter: every launch of the kernel on `device` adds one to it, on the device."""
    return device_counter(_COUNTERS, device)


def launch_count() -> int:
    """Launches the device counters have seen in this process, over every device (reads them: synchronizes)."""
    return count(_COUNTERS)


def launch(compiled: Any, tensors: tuple[Tensor | None, ...], save_index: int, eps: float, stream: int) -> None:
    """Call a compiled kernel: tensors in the kernel's order (prefix, delta, bank, out, res_norm, res_proj,
    out_norm, launches; None where the kind has none), on the CUDA stream with handle `stream`. No checks: see
    `apply`."""
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    args = [None if t is None else from_dlpack(t, assumed_align=ALIGN) for t in tensors]
    compiled(*args, Int32(save_index), Float32(eps), cuda.CUstream(stream))
