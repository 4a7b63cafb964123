"""Reference oracle for Kimi K3 AttnRes ("attention residuals"), the replacement of the residual stream.

Model (vLLM 0.33.0, vllm/models/kimi_k3/nvidia/model.py `KimiDecoderLayer` and
vllm/models/kimi_k3/nvidia/ops/attn_res.py): per token the decoder carries

- a running BF16 prefix p: the sum of the sublayer outputs since the current block began, and
- a bank of saved block rows b_0, b_1, ...; b_0 is the embedding, b_k is the prefix as it stood when layer
  k * block_size began.

A "mixing" turns a set of sources (some saved blocks plus p) into a sublayer input:

    logit_s = (s . (w_norm * w_q)) / sqrt(mean(s^2) + eps)
    alpha   = softmax_s(logit_s)
    out     = RMSNorm(sum_s alpha_s s) * norm_weight

Block counts (L = num_layers, bs = block_size, cdiv = ceiling division), all checked by the tests:

- bank after the pre-attention update of layer i: cdiv(i + 1, bs) blocks
  (`k3_decode.config.ModelDims.blocks_before`).
- pre-attention mixing of layer i: the first cdiv(i, bs) bank blocks, plus p. At a block-write layer
  (i % bs == 0) the block just saved is *not* read from the bank: it is bitwise p, and reading it twice
  would give it two softmax slots.
- pre-MLP mixing of layer i: cdiv(i, bs) + (i % bs == 0) blocks, i.e. the whole bank, plus p (which now
  holds the attention output, alone at a block-write layer).
- final mixing: cdiv(L, bs) blocks (8 for K3: cdiv(93, 12)), plus p after adding the last MLP output.

Seen as "the residual stream cut into blocks": the sources are always every completed block (b_0 = the
embedding) plus the sum of the sublayer outputs since the last block boundary *if that sum is non-empty*;
at a boundary the newest completed block enters as p instead of from the bank.

Numerics: sources are BF16 rows (the prefix is rounded to BF16 after every update, p <- bf16(p + delta),
where delta may be a BF16 sublayer output or an FP32 sum of TP partials); the mixing runs in `dtype`
(FP32 by default, FP64 for tight comparisons) and is returned in `dtype`. The kernels write BF16, so
compare them after rounding, with a tolerance. Sources are accumulated in bank order, then p.

All functions are pure: they return new state and never modify their arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3_decode.reference.norms import rms_norm

STATE_DTYPE = torch.bfloat16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_block_write(layer: int, block_size: int) -> bool:
    """Layer `layer` (0-indexed) saves the prefix as block layer // block_size before its attention."""
    return layer % block_size == 0


def bank_blocks(layer: int, block_size: int) -> int:
    """Blocks in the bank once the pre-attention update of `layer` has run (the block it writes included)."""
    return _cdiv(layer + 1, block_size)


def blocks_before_attention(layer: int, block_size: int) -> int:
    """Bank blocks read by the pre-attention mixing of `layer` (p is the extra source)."""
    return _cdiv(layer, block_size)


def blocks_before_mlp(layer: int, block_size: int) -> int:
    """Bank blocks read by the pre-MLP mixing of `layer`: prev_valid_blocks + is_block_write = the bank."""
    return blocks_before_attention(layer, block_size) + int(is_block_write(layer, block_size))


def blocks_final(num_layers: int, block_size: int) -> int:
    """Bank blocks read by the final mixing after the last layer: cdiv(num_layers, block_size)."""
    return _cdiv(num_layers, block_size)


@dataclass(frozen=True)
class MixWeights:
    """Weights of one mixing site.

    res_norm: the `*_res_norm` weight [hidden]; res_proj: the `*_res_proj` weight [1, hidden] or [hidden];
    out_norm: the norm applied to the mixed row (`input_layernorm`, `post_attention_layernorm`, or the
    model's final norm), or None for no output norm (stock's final AttnRes leaves it to compute_logits).
    """

    res_norm: Tensor
    res_proj: Tensor
    out_norm: Tensor | None


@dataclass(frozen=True)
class AttnResState:
    """Per-token AttnRes state: prefix [T, hidden] BF16, bank [T, n, hidden] BF16 (n blocks saved so far)."""

    prefix: Tensor
    blocks: Tensor

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[1]


def init_state(embedding: Tensor) -> AttnResState:
    """State before layer 0: p is the embedding [T, hidden]; the bank is empty until layer 0 saves b_0 = p."""
    if embedding.dim() != 2:
        raise ValueError(f"embedding must be [tokens, hidden], got {tuple(embedding.shape)}")
    prefix = embedding.to(STATE_DTYPE)
    return AttnResState(prefix=prefix, blocks=prefix.new_empty((prefix.shape[0], 0, prefix.shape[1])))


def add_to_prefix(prefix: Tensor, delta: Tensor) -> Tensor:
    """p <- bf16(p + delta), the sum taken in FP32 (exact for two BF16 operands up to the final rounding)."""
    return (prefix.float() + delta.float()).to(STATE_DTYPE)


def mixing_logits(sources: Tensor, res_norm: Tensor, res_proj: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """logit_s = s . (w_norm * w_q) / sqrt(mean(s^2) + eps) for sources [T, S, hidden]; returns [T, S]."""
    w = res_norm.to(dtype).reshape(-1) * res_proj.to(dtype).reshape(-1)
    return rms_norm(sources, None, eps, dtype) @ w


def mix(sources: Tensor, weights: MixWeights, eps: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """Softmax-weighted sum of sources [T, S, hidden] (S >= 1), then the output norm; returns [T, hidden]."""
    if sources.dim() != 3 or sources.shape[1] == 0:
        raise ValueError(f"sources must be [tokens, S >= 1, hidden], got {tuple(sources.shape)}")
    alpha = torch.softmax(mixing_logits(sources, weights.res_norm, weights.res_proj, eps, dtype), dim=-1)
    mixed = (alpha.unsqueeze(-1) * sources.to(dtype)).sum(dim=1)
    return mixed if weights.out_norm is None else rms_norm(mixed, weights.out_norm, eps, dtype)


def mix_state(
    state: AttnResState, num_blocks: int, weights: MixWeights, eps: float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Mix the first `num_blocks` bank blocks plus the prefix."""
    if not 0 <= num_blocks <= state.num_blocks:
        raise ValueError(f"mixing wants {num_blocks} blocks, the bank holds {state.num_blocks}")
    sources = torch.cat([state.blocks[:, :num_blocks], state.prefix.unsqueeze(1)], dim=1)
    return mix(sources, weights, eps, dtype)


def _check_bank(state: AttnResState, expected: int, where: str) -> None:
    # A wrong layer index would silently mix the wrong block set; the bank size pins it down.
    if state.num_blocks != expected:
        raise ValueError(f"{where}: bank holds {state.num_blocks} blocks, expected {expected}")


def before_attention(
    state: AttnResState,
    layer: int,
    delta: Tensor | None,
    weights: MixWeights,
    block_size: int,
    eps: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, AttnResState]:
    """AttnRes before the attention of `layer`: add the previous MLP output, save a block, mix.

    `delta` is the previous layer's MLP output; it must be None exactly at layer 0.
    Returns (attention input [T, hidden] in `dtype`, new state).
    """
    if (delta is None) != (layer == 0):
        raise ValueError(f"layer {layer}: delta must be given for every layer but 0")
    _check_bank(state, bank_blocks(layer - 1, block_size) if layer else 0, f"before attention of layer {layer}")
    prefix = state.prefix if delta is None else add_to_prefix(state.prefix, delta)
    blocks = state.blocks
    if is_block_write(layer, block_size):
        blocks = torch.cat([blocks, prefix.unsqueeze(1)], dim=1)
    new = AttnResState(prefix=prefix, blocks=blocks)
    return mix_state(new, blocks_before_attention(layer, block_size), weights, eps, dtype), new


def after_attention(
    state: AttnResState,
    layer: int,
    attn_out: Tensor,
    weights: MixWeights,
    block_size: int,
    eps: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, AttnResState]:
    """AttnRes after the attention of `layer`: fold the attention output into p, mix for the MLP.

    At a block-write layer p restarts as bf16(attn_out) (the old p is now the bank's newest block);
    otherwise p <- bf16(p + attn_out). Returns (MLP input [T, hidden] in `dtype`, new state).
    """
    _check_bank(state, bank_blocks(layer, block_size), f"after attention of layer {layer}")
    restart = is_block_write(layer, block_size)
    prefix = attn_out.to(STATE_DTYPE) if restart else add_to_prefix(state.prefix, attn_out)
    new = AttnResState(prefix=prefix, blocks=state.blocks)
    return mix_state(new, blocks_before_mlp(layer, block_size), weights, eps, dtype), new


def final(
    state: AttnResState,
    delta: Tensor,
    num_layers: int,
    weights: MixWeights,
    block_size: int,
    eps: float,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The final AttnRes after the last layer: add the last MLP output, mix over every block plus p.

    Pass the model's final norm as `weights.out_norm` to get what the specialized decode's fused final
    AttnRes writes; None gives stock's pre-norm hidden state (normed later in compute_logits).
    """
    _check_bank(state, bank_blocks(num_layers - 1, block_size), "final mixing")
    new = AttnResState(prefix=add_to_prefix(state.prefix, delta), blocks=state.blocks)
    return mix_state(new, blocks_final(num_layers, block_size), weights, eps, dtype)
