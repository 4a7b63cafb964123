"""Oracle for the two-shot BF16 all-reduce of the Kimi K3 specialized decode.

vLLM 0.33.0 (vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/common/twoshot.py): with TP ranks and
rows of width W, rank o owns the columns [o·W/TP, (o+1)·W/TP).

1. Push: every rank stores its BF16 partial of each owner's chunk into that owner's slot for the rank.
2. Reduce: the owner widens its TP slots to FP32, adds them in rank order (0, 1, ..., TP-1), rounds the
   sum to BF16 once and multicasts the chunk into every rank's gather row.
3. Every rank reads the full row from its gather row, so all ranks end with identical bits.

Writers turn a BF16 -0.0 into +0.0 so that no real value can look like the mailbox sentinel
(vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/common/mailbox.py); the oracle does the same.

Why the rule is a real check: FP32 addition is not associative, and a plain BF16 running sum
(acc = bf16(acc + p_r), what a BF16 ring or a naive kernel computes) rounds TP-1 times instead of once.
Both differ from the rank-order FP32 sum in the last BF16 bit on ordinary data (see the tests), so a
kernel that sums in another order or rounds early produces different bits than this oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

FRAGMENT_COLS = 8
"""BF16 columns per 16-byte mailbox fragment: every owned chunk must be a whole number of fragments."""


class TwoShotMismatch(AssertionError):
    """Per-rank outputs that do not match the two-shot semantics."""


def owned_columns(width: int, tp: int, rank: int) -> slice:
    """The column range rank `rank` owns (reduces) in a row of `width` BF16 values."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside 0..{tp - 1}")
    if width % tp or (width // tp) % FRAGMENT_COLS:
        raise ValueError(f"width {width} does not split into {tp} chunks of whole {FRAGMENT_COLS}-column fragments")
    chunk = width // tp
    return slice(rank * chunk, (rank + 1) * chunk)


def canonicalize_zero(x: Tensor) -> Tensor:
    """Replace -0.0 by +0.0 and leave every other value, NaN included, alone."""
    return torch.where(x == 0, torch.zeros_like(x), x)


def _check_partials(partials: Sequence[Tensor]) -> None:
    if not partials:
        raise ValueError("an all-reduce needs at least one rank partial")
    shape = partials[0].shape
    for r, p in enumerate(partials):
        if p.dtype != torch.bfloat16:
            raise TypeError(f"rank {r} partial is {p.dtype}; the two-shot mailboxes carry BF16")
        if p.shape != shape:
            raise ValueError(f"rank {r} partial has shape {tuple(p.shape)}, rank 0 has {tuple(shape)}")


def reduce_rank_order(partials: Sequence[Tensor]) -> Tensor:
    """BF16 result of the owner's rule: FP32 sum in rank order, one rounding, -0.0 made +0.0.

    Works on whole rows as well as chunks, since the rule is elementwise.
    """
    _check_partials(partials)
    acc = partials[0].float()
    for p in partials[1:]:
        acc = acc + p.float()
    return canonicalize_zero(acc.bfloat16())


def two_shot_all_reduce(partials: Sequence[Tensor]) -> list[Tensor]:
    """Simulate push, reduce and gather; returns every rank's output row [..., W] (BF16), rank 0 first."""
    _check_partials(partials)
    tp, width = len(partials), partials[0].shape[-1]
    chunks = []
    for owner in range(tp):
        cols = owned_columns(width, tp, owner)
        slots = [canonicalize_zero(p[..., cols]) for p in partials]  # slot index = source rank
        chunks.append(reduce_rank_order(slots))
    gathered = torch.cat(chunks, dim=-1)
    return [gathered.clone() for _ in range(tp)]


def naive_bf16_sum(partials: Sequence[Tensor]) -> Tensor:
    """The contrast case: a BF16 running sum in rank order that rounds after every add."""
    _check_partials(partials)
    acc = partials[0]
    for p in partials[1:]:
        acc = acc + p  # BF16 + BF16 rounds the result to BF16
    return acc


def bf16_bits(x: Tensor) -> Tensor:
    """The raw 16-bit patterns, for bit-exact comparison (NaN == NaN, -0.0 != +0.0)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"expected BF16, got {x.dtype}")
    return x.contiguous().view(torch.int16)


def verify_two_shot(outputs: Sequence[Tensor], partials: Sequence[Tensor]) -> None:
    """Raise `TwoShotMismatch` unless every rank's output has the oracle's bits.

    The message names the first rank, row and column that differ, and the rank that owns the column.
    """
    expected = reduce_rank_order(partials)
    if len(outputs) != len(partials):
        raise TwoShotMismatch(f"{len(outputs)} rank outputs for {len(partials)} partials")
    want = bf16_bits(expected).reshape(-1, expected.shape[-1])
    chunk = expected.shape[-1] // len(partials)
    for r, out in enumerate(outputs):
        if out.dtype != torch.bfloat16 or out.shape != expected.shape:
            raise TwoShotMismatch(
                f"rank {r} output is {out.dtype} {tuple(out.shape)}, want BF16 {tuple(expected.shape)}"
            )
        diff = (bf16_bits(out).reshape(want.shape) != want).nonzero()
        if len(diff):
            row, col = diff[0].tolist()
            got, exp = out.reshape(want.shape)[row, col].item(), expected.reshape(want.shape)[row, col].item()
            raise TwoShotMismatch(
                f"rank {r}: {len(diff)} values differ; first at row {row}, column {col} (owned by rank "
                f"{col // chunk}): got {got!r}, want {exp!r}"
            )
