"""What enters a layer stack per token: the AttnRes state the layers before it left.

A stack that starts at layer L > 0 continues a forward pass: the AttnRes prefix p, the bank of saved blocks
(bank_blocks(L - 1) of them, b_0 being the token's embedding) and the previous layer's MLP output, which the
pre-attention AttnRes of layer L adds to p. A stack that starts at layer 0 takes the embedding as p, an empty
bank and no delta (k3_decode.reference.attn_res.init_state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3_decode.config import ModelDims
from k3_decode.reference.attn_res import bank_blocks

DTYPE = torch.bfloat16


def entry_blocks(dims: ModelDims, first_layer: int) -> int:
    """Bank blocks a token carries into `first_layer`."""
    return bank_blocks(first_layer - 1, dims.attn_res_block_size) if first_layer > 0 else 0


@dataclass(frozen=True)
class StackInput:
    """The entry state of n tokens, BF16: prefix [n, hidden], blocks [n, nb, hidden], delta [n, hidden] or None."""

    prefix: Tensor
    blocks: Tensor
    delta: Tensor | None

    def __post_init__(self) -> None:
        if self.prefix.dim() != 2 or self.blocks.dim() != 3:
            raise ValueError(
                f"stack input prefix must be [n, hidden] and blocks [n, nb, hidden], got "
                f"{tuple(self.prefix.shape)} and {tuple(self.blocks.shape)}"
            )
        n, h = self.prefix.shape
        if self.blocks.shape[0] != n or self.blocks.shape[2] != h:
            raise ValueError(f"stack input blocks {tuple(self.blocks.shape)} do not match prefix {(n, h)}")
        if self.delta is not None and tuple(self.delta.shape) != (n, h):
            raise ValueError(f"stack input delta {tuple(self.delta.shape)} must match prefix {(n, h)}")
        tensors = [self.prefix, self.blocks] + ([] if self.delta is None else [self.delta])
        if any(t.dtype != DTYPE for t in tensors):
            raise ValueError(f"stack inputs are {DTYPE} (the AttnRes state dtype); convert them with .to({DTYPE})")

    @property
    def tokens(self) -> int:
        return self.prefix.shape[0]

    def check_for(self, dims: ModelDims, first_layer: int) -> None:
        want = entry_blocks(dims, first_layer)
        if self.prefix.shape[1] != dims.hidden_size:
            raise ValueError(f"stack input hidden size {self.prefix.shape[1]} != {dims.name}'s {dims.hidden_size}")
        if self.blocks.shape[1] != want:
            raise ValueError(
                f"layer {first_layer} is entered with {want} AttnRes blocks, the input carries {self.blocks.shape[1]}"
            )
        if (self.delta is None) != (first_layer == 0):
            raise ValueError(f"a stack starting at layer {first_layer} needs {'no' if first_layer == 0 else 'a'} delta")

    def rows(self, index: slice | Tensor) -> StackInput:
        return StackInput(self.prefix[index], self.blocks[index], None if self.delta is None else self.delta[index])

    def to(self, device: torch.device | str) -> StackInput:
        return StackInput(
            self.prefix.to(device), self.blocks.to(device), None if self.delta is None else self.delta.to(device)
        )

    @classmethod
    def cat(cls, parts: list[StackInput]) -> StackInput:
        if not parts:
            raise ValueError("no stack inputs to concatenate")
        deltas = [p.delta for p in parts]
        if any(d is None for d in deltas) and not all(d is None for d in deltas):
            raise ValueError("stack inputs disagree on having a delta; they must enter the same layer")
        return cls(
            torch.cat([p.prefix for p in parts]),
            torch.cat([p.blocks for p in parts]),
            None if deltas[0] is None else torch.cat(deltas),  # type: ignore[arg-type]
        )


def random_input(
    dims: ModelDims, first_layer: int, tokens: int, seed: int, device: torch.device | str = "cpu"
) -> StackInput:
    """Unit-normal BF16 entry state (the scale of the embedding and of the sublayer outputs), seeded."""
    gen = torch.Generator().manual_seed(seed)
    h, nb = dims.hidden_size, entry_blocks(dims, first_layer)
    prefix = torch.randn(tokens, h, generator=gen).to(DTYPE)
    blocks = torch.randn(tokens, nb, h, generator=gen).to(DTYPE)
    delta = None if first_layer == 0 else torch.randn(tokens, h, generator=gen).to(DTYPE)
    return StackInput(prefix, blocks, delta).to(device)
