"""AttnRes state as both decode paths hold it: the BF16 buffers updated in place and the site of an application.

The stock op (k3_decode/stock/attn_res.py) and the specialized kernel (k3_decode/kernels/attn_res_op.py) read and
write the same buffers, so neither path owns them: a specialized provider that used the stock module's types would
run stock code inside its dispatch, which the isolation audit forbids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from k3_decode.reference.attn_res import (
    AttnResState,
    bank_blocks,
    blocks_before_attention,
    blocks_before_mlp,
    blocks_final,
    is_block_write,
)

STATE_DTYPE = torch.bfloat16
DeltaMode = Literal["none", "add", "restart"]


@dataclass
class AttnResBuffers:
    """Per-token AttnRes state: prefix [T, hidden] and a bank [T, capacity, hidden] (BF16), of which the first
    `num_blocks` are saved. `num_blocks` is host bookkeeping: the layer structure fixes it at every call."""

    prefix: Tensor
    blocks: Tensor
    num_blocks: int = 0

    @classmethod
    def allocate(cls, tokens: int, hidden: int, capacity: int, device: torch.device | str = "cpu") -> AttnResBuffers:
        prefix = torch.zeros(tokens, hidden, dtype=STATE_DTYPE, device=device)
        return cls(prefix, torch.zeros(tokens, capacity, hidden, dtype=STATE_DTYPE, device=device))

    @classmethod
    def from_state(cls, state: AttnResState, capacity: int) -> AttnResBuffers:
        """Copy an oracle state into fresh buffers with room for `capacity` blocks."""
        if capacity < state.num_blocks:
            raise ValueError(f"capacity {capacity} is below the {state.num_blocks} blocks the state holds")
        out = cls.allocate(state.prefix.shape[0], state.prefix.shape[1], capacity, state.prefix.device)
        out.prefix.copy_(state.prefix)
        out.blocks[:, : state.num_blocks].copy_(state.blocks)
        out.num_blocks = state.num_blocks
        return out

    def state(self) -> AttnResState:
        """The oracle's view of these buffers (copies, so later in-place updates do not alias it)."""
        return AttnResState(self.prefix.clone(), self.blocks[:, : self.num_blocks].clone())

    @property
    def capacity(self) -> int:
        return self.blocks.shape[1]


@dataclass(frozen=True)
class AttnResSite:
    """What one application does: how delta enters p, which block it saves, how many bank blocks it reads."""

    delta: DeltaMode
    save_index: int | None
    num_blocks: int
    bank_before: int  # blocks the bank must hold when the site runs (catches a wrong layer index)

    @classmethod
    def before_attention(cls, layer: int, block_size: int) -> AttnResSite:
        save = is_block_write(layer, block_size)
        return cls(
            delta="add" if layer > 0 else "none",
            save_index=layer // block_size if save else None,
            num_blocks=blocks_before_attention(layer, block_size),
            bank_before=bank_blocks(layer - 1, block_size) if layer else 0,
        )

    @classmethod
    def after_attention(cls, layer: int, block_size: int) -> AttnResSite:
        return cls(
            delta="restart" if is_block_write(layer, block_size) else "add",
            save_index=None,
            num_blocks=blocks_before_mlp(layer, block_size),
            bank_before=bank_blocks(layer, block_size),
        )

    @classmethod
    def final(cls, num_layers: int, block_size: int) -> AttnResSite:
        return cls(
            delta="add",
            save_index=None,
            num_blocks=blocks_final(num_layers, block_size),
            bank_before=bank_blocks(num_layers - 1, block_size),
        )
