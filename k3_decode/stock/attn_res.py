"""Stock AttnRes: one launch per application, on preallocated BF16 state buffers updated in place.

Semantics are those of the oracle (k3_decode.reference.attn_res): before attention (add the previous MLP output,
save a block at a block-write layer, mix), after attention (restart or add the attention output, mix for the MLP)
and final (add the last MLP output, mix every block, no output norm). The oracle is pure and returns new state;
the stock op writes the prefix and the saved block into the buffers, as vLLM's kernel does, so a CUDA graph can
capture it. Output: BF16 [T, hidden].

Implementations: "triton" on CUDA (triton_kernels.attn_res, one program per token) and "torch-cpu" on the CPU
(the same math in FP32 torch ops).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from k3_decode.attn_res_state import STATE_DTYPE, AttnResBuffers, AttnResSite
from k3_decode.reference.attn_res import MixWeights
from k3_decode.stock.dispatch import Implementation, implementation_for


def _check(buffers: AttnResBuffers, site: AttnResSite, delta: Tensor | None, weights: MixWeights) -> None:
    tokens, hidden = buffers.prefix.shape
    if buffers.prefix.dtype != STATE_DTYPE or buffers.blocks.dtype != STATE_DTYPE:
        raise ValueError(f"AttnRes buffers must be {STATE_DTYPE}; allocate them with AttnResBuffers.allocate")
    if buffers.blocks.shape[0] != tokens or buffers.blocks.shape[2] != hidden:
        raise ValueError(f"bank {tuple(buffers.blocks.shape)} does not match prefix {tuple(buffers.prefix.shape)}")
    if buffers.num_blocks != site.bank_before:
        raise ValueError(
            f"AttnRes: the bank holds {buffers.num_blocks} blocks, this site expects {site.bank_before}; "
            "pass the layer index that matches the buffers"
        )
    if site.save_index is not None and site.save_index >= buffers.capacity:
        raise ValueError(f"AttnRes: block {site.save_index} does not fit a bank of {buffers.capacity}; allocate more")
    if site.save_index is not None and site.save_index < site.num_blocks:
        # The kernel reads the bank while it writes the saved block; a site must never read what it saves.
        raise ValueError(f"AttnRes: a site may not read block {site.save_index}, the block it saves")
    if (delta is None) != (site.delta == "none"):
        raise ValueError(f"AttnRes: this site takes {'no' if site.delta == 'none' else 'a'} delta")
    if delta is not None and tuple(delta.shape) != (tokens, hidden):
        raise ValueError(f"AttnRes: delta {tuple(delta.shape)} must be [tokens, hidden] = {(tokens, hidden)}")
    for name, w in (("res_norm", weights.res_norm), ("res_proj", weights.res_proj), ("out_norm", weights.out_norm)):
        if w is not None and w.numel() != hidden:
            raise ValueError(f"AttnRes weight {name} has {w.numel()} elements, expected hidden = {hidden}")


def apply(
    buffers: AttnResBuffers,
    site: AttnResSite,
    delta: Tensor | None,
    weights: MixWeights,
    eps: float,
    implementation: Implementation | None = None,
) -> Tensor:
    """Run one AttnRes application in place on `buffers`; returns the mixed (and normed) row, BF16 [T, hidden]."""
    _check(buffers, site, delta, weights)
    impl = implementation or implementation_for(buffers.prefix.device)
    out = torch.empty_like(buffers.prefix)
    if impl == "triton":
        from k3_decode.stock.triton_kernels.attn_res import launch_attn_res

        # The kernel's FP32 row of [mix | new prefix] between its passes (allocated per call; graph-safe).
        scratch = torch.empty(out.shape[0], 2, out.shape[1], dtype=torch.float32, device=out.device)
        launch_attn_res(
            buffers.prefix,
            None if delta is None else delta.contiguous(),
            buffers.blocks,
            out,
            scratch,
            weights.res_norm.reshape(-1),
            weights.res_proj.reshape(-1),
            None if weights.out_norm is None else weights.out_norm.reshape(-1),
            num_blocks=site.num_blocks,
            save_index=site.save_index,
            restart=site.delta == "restart",
            eps=eps,
        )
    else:
        out.copy_(_apply_torch(buffers, site, delta, weights, eps))
    if site.save_index is not None:
        buffers.num_blocks = site.save_index + 1
    return out


def _apply_torch(
    buffers: AttnResBuffers, site: AttnResSite, delta: Tensor | None, weights: MixWeights, eps: float
) -> Tensor:
    p = buffers.prefix.float()
    if delta is not None:
        p = (delta.float() if site.delta == "restart" else p + delta.float()).to(STATE_DTYPE)
        buffers.prefix.copy_(p)
    if site.save_index is not None:
        buffers.blocks[:, site.save_index].copy_(buffers.prefix)
    sources = torch.cat([buffers.blocks[:, : site.num_blocks], buffers.prefix.unsqueeze(1)], dim=1).float()
    w = weights.res_norm.float().reshape(-1) * weights.res_proj.float().reshape(-1)
    logits = (sources @ w) * torch.rsqrt(sources.square().mean(dim=-1) + eps)
    mixed = (torch.softmax(logits, dim=-1).unsqueeze(-1) * sources).sum(dim=1)
    if weights.out_norm is not None:
        mixed = mixed * torch.rsqrt(mixed.square().mean(dim=-1, keepdim=True) + eps) * weights.out_norm.float()
    return mixed


def before_attention(
    buffers: AttnResBuffers,
    layer: int,
    delta: Tensor | None,
    weights: MixWeights,
    block_size: int,
    eps: float,
    implementation: Implementation | None = None,
) -> Tensor:
    """The oracle's before_attention, in place: returns the attention input (BF16)."""
    return apply(buffers, AttnResSite.before_attention(layer, block_size), delta, weights, eps, implementation)


def after_attention(
    buffers: AttnResBuffers,
    layer: int,
    attn_out: Tensor,
    weights: MixWeights,
    block_size: int,
    eps: float,
    implementation: Implementation | None = None,
) -> Tensor:
    """The oracle's after_attention, in place: returns the MLP input (BF16)."""
    return apply(buffers, AttnResSite.after_attention(layer, block_size), attn_out, weights, eps, implementation)


class FusedReduceAttnRes(Protocol):
    """A TP all-reduce of the attention's o_proj partial that runs the AttnRes application after attention as its
    epilogue, in one launch (k3_decode.distributed.allreduce.PeerAllReduce)."""

    def attn_res_after(
        self,
        partial: Tensor,
        prefix: Tensor,
        blocks: Tensor,
        res_norm: Tensor,
        res_proj: Tensor,
        out_norm: Tensor | None,
        *,
        num_blocks: int,
        restart: bool,
        eps: float,
    ) -> Tensor: ...


def after_attention_reduced(
    buffers: AttnResBuffers,
    layer: int,
    partial: Tensor,
    weights: MixWeights,
    block_size: int,
    eps: float,
    fused: FusedReduceAttnRes,
) -> Tensor:
    """after_attention on the TP all-reduce of this rank's o_proj `partial`, both done by `fused` in one launch."""
    site = AttnResSite.after_attention(layer, block_size)
    _check(buffers, site, partial, weights)
    return fused.attn_res_after(
        partial,
        buffers.prefix,
        buffers.blocks,
        weights.res_norm.reshape(-1),
        weights.res_proj.reshape(-1),
        None if weights.out_norm is None else weights.out_norm.reshape(-1),
        num_blocks=site.num_blocks,
        restart=site.delta == "restart",
        eps=eps,
    )


def final(
    buffers: AttnResBuffers,
    delta: Tensor,
    num_layers: int,
    weights: MixWeights,
    block_size: int,
    eps: float,
    implementation: Implementation | None = None,
) -> Tensor:
    """The oracle's final mixing, in place on the prefix: returns the last hidden state (BF16)."""
    return apply(buffers, AttnResSite.final(num_layers, block_size), delta, weights, eps, implementation)
