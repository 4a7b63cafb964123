"""Declared write sets: which elements of which tensors one step may write.

A step may write the KDA state slots of its own requests (conv and recurrent, per KDA layer), the MLA cache slots its
slot_mapping names (per MLA layer) and its named scratch buffers; the isolation audit (`audit.py`) checks every other
element of every tensor is unchanged. Tensors are named as the executor registers them for the audit:
`layers.<i>.kda.conv`, `layers.<i>.kda.recurrent`, `layers.<i>.mla.kv_cache`, `scratch.<name>`.

Slot semantics come from the oracles: KDA slots <= 0 are the NULL block and are never written, a decode step
rewrites the first W-1 conv columns of a slot and a verify step the first W-2+q (`k3_decode.reference.kda`); an MLA
slot s >= 0 is page s // page_size, offset s % page_size of the [pages, page_size, row] cache, and s < 0 is
padding (`k3_decode.reference.mla`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from k3_decode.reference.kda import StateTensor, decode_write_set, verify_write_set

Span = tuple[int, int] | None  # half-open [start, stop) along one dim; None: the whole dim


def kda_state_name(layer: int, which: StateTensor) -> str:
    return f"layers.{layer}.kda.{which}"


def mla_cache_name(layer: int) -> str:
    return f"layers.{layer}.mla.kv_cache"


def scratch_name(name: str) -> str:
    return f"scratch.{name}"


@dataclass(frozen=True)
class Region:
    """Elements of one tensor: a span per leading dim; dims past `index` are whole."""

    tensor: str
    index: tuple[Span, ...] = ()

    def __post_init__(self) -> None:
        bad = [s for s in self.index if s is not None and not 0 <= s[0] < s[1]]
        if bad:
            raise ValueError(f"region of {self.tensor}: spans {bad} are not half-open ranges 0 <= start < stop")

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(None) if s is None else slice(*s) for s in self.index)

    def __str__(self) -> str:
        if not self.index:
            return f"{self.tensor}[...]"
        return f"{self.tensor}[{', '.join(':' if s is None else f'{s[0]}:{s[1]}' for s in self.index)}]"


@dataclass(frozen=True)
class WriteSet:
    regions: frozenset[Region] = frozenset()

    def __or__(self, other: WriteSet) -> WriteSet:
        return WriteSet(self.regions | other.regions)

    def tensors(self) -> frozenset[str]:
        return frozenset(r.tensor for r in self.regions)

    def of(self, tensor: str) -> list[Region]:
        return sorted((r for r in self.regions if r.tensor == tensor), key=str)

    def mask(self, tensor: str, shape: Sequence[int]) -> Tensor:
        """Boolean mask [shape] of the elements of `tensor` this set allows a step to write."""
        allowed = torch.zeros(tuple(shape), dtype=torch.bool)
        for region in self.of(tensor):
            if len(region.index) > len(shape):
                raise ValueError(f"declared region {region} has more dims than tensor shape {tuple(shape)}")
            over = [s for s, n in zip(region.index, shape, strict=False) if s is not None and s[1] > n]
            if over:
                raise ValueError(f"declared region {region} reaches past tensor shape {tuple(shape)}")
            allowed[region.slices()] = True
        return allowed

    def describe(self) -> list[str]:
        return sorted(str(r) for r in self.regions)


def _ints(table: Tensor, what: str) -> list[int]:
    if table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
        raise ValueError(f"{what}: expected an integer tensor, got {table.dtype}")
    return [int(v) for v in table.reshape(-1).tolist()]


def kda_regions(layer: int, slots: Tensor, conv_width: int) -> list[Region]:
    """A KDA layer's state writes for slot table [B] (decode) or [B, q] (verify)."""
    if slots.dim() == 1:
        writes, taps = decode_write_set(slots), conv_width - 1
    elif slots.dim() == 2:
        writes, taps = verify_write_set(slots), conv_width - 2 + slots.shape[1]
    else:
        raise ValueError(f"KDA slot table must be [B] (decode) or [B, q] (verify), got {tuple(slots.shape)}")
    out = []
    for w in sorted(writes):
        span = (w.slot, w.slot + 1)
        index: tuple[Span, ...] = (span, None, (0, taps)) if w.tensor == "conv" else (span,)
        out.append(Region(kda_state_name(layer, w.tensor), index))
    return out


def mla_regions(layer: int, slot_mapping: Tensor, page_size: int) -> list[Region]:
    """An MLA layer's cache writes: one row per slot_mapping entry >= 0 (the cache is [pages, page_size, row])."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    slots = [s for s in _ints(slot_mapping, "slot_mapping") if s >= 0]
    if dup := sorted(s for s, n in Counter(slots).items() if n > 1):
        raise ValueError(f"slot_mapping writes cache slots {dup} twice; each request owns distinct slots")
    return [
        Region(mla_cache_name(layer), ((s // page_size, s // page_size + 1), (s % page_size, s % page_size + 1)))
        for s in slots
    ]


def scratch_regions(names: Iterable[str]) -> list[Region]:
    """Private scratch buffers, whole: the step owns them and nothing reads them across steps."""
    return [Region(scratch_name(n)) for n in names]


def declare_step(
    *,
    kda_layers: Sequence[int],
    kda_slots: Tensor,
    conv_width: int,
    mla_layers: Sequence[int],
    slot_mapping: Tensor | Mapping[int, Tensor],
    page_size: int,
    scratch: Iterable[str] = (),
) -> WriteSet:
    """The write set of one step over a stack of layers.

    `kda_slots`: the step's state slot table, shared by every KDA layer (vLLM's non_spec_state_indices_tensor [B]
    or spec_state_indices_tensor [B, q]); `slot_mapping`: one table for every MLA layer, or one per layer.
    """
    regions: list[Region] = []
    for layer in kda_layers:
        regions += kda_regions(layer, kda_slots, conv_width)
    for layer in mla_layers:
        if isinstance(slot_mapping, Mapping):
            if layer not in slot_mapping:
                raise ValueError(f"slot_mapping has no table for MLA layer {layer}; pass one per MLA layer")
            table = slot_mapping[layer]
        else:
            table = slot_mapping
        regions += mla_regions(layer, table, page_size)
    regions += scratch_regions(scratch)
    return WriteSet(frozenset(regions))
