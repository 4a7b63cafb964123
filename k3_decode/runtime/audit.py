"""The isolation audit: changes a step made outside its declared write set, named by tensor and index range.

Two ways to look, with the same masks:
- `changes_outside(before, after, declared)` compares full copies element by element and names the exact bounding box
  of each changed run (CPU tests, small stacks);
- `digest(tensors, declared)` keeps one hash per index along dim 0 of everything outside the declared set, so an
  audit of real-size weights need not hold a second copy; `digest_changes` then names the changed dim-0 ranges.

Elements are compared by their bits, so a NaN that stays NaN is unchanged and -0.0 replacing 0.0 is a change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from k3_decode.runtime.writeset import WriteSet

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Change:
    tensor: str
    index: tuple[tuple[int, int], ...]  # bounding box, one half-open span per dim
    elements: int | None  # elements changed; None when only hashes were compared
    note: str = "changed outside the declared write set"

    def __str__(self) -> str:
        where = f"{self.tensor}[{', '.join(f'{a}:{b}' for a, b in self.index)}]"
        count = "" if self.elements is None else f"{self.elements} elements "
        return f"{where}: {count}{self.note}"


def _bits(t: Tensor, name: str) -> Tensor:
    """The tensor reinterpreted as integers of its element size (its bits), on the CPU."""
    kind = _INT_OF_SIZE.get(t.element_size())
    if kind is None:
        raise ValueError(f"tensor {name}: {t.dtype} elements of {t.element_size()} bytes cannot be audited (1-8 only)")
    return t.detach().view(kind).cpu()


def _whole(shape: torch.Size) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, hit in enumerate(flags):
        if hit:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    return runs


def _bounding_box(block: Tensor, first: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Spans of the True elements of block (dim 0 already known as `first`) along every other dim."""
    spans = [first]
    for d in range(1, block.dim()):
        hit = block.movedim(d, 0).reshape(block.shape[d], -1).any(dim=1).nonzero().flatten()
        spans.append((int(hit[0]), int(hit[-1]) + 1))
    return tuple(spans)


def _check_names(before: Mapping[str, Tensor], after: Mapping[str, Tensor], declared: WriteSet) -> list[Change]:
    if unknown := sorted(declared.tensors() - set(before)):
        raise ValueError(f"the write set declares tensors {unknown} that the audit was not given; register them")
    out = [Change(n, (), None, "is missing after the step") for n in sorted(set(before) - set(after))]
    out += [
        Change(n, (), None, "appeared after the step (not in the audit before it)")
        for n in sorted(set(after) - set(before))
    ]
    return out


def changes_outside(before: Mapping[str, Tensor], after: Mapping[str, Tensor], declared: WriteSet) -> list[Change]:
    """Every run of changed elements outside `declared`, by tensor, with its bounding box and count.

    `before` holds copies taken before the step, `after` the same tensors after it (same names).
    """
    out = _check_names(before, after, declared)
    for name in sorted(set(before) & set(after)):
        b, a = before[name], after[name]
        if b.shape != a.shape or b.dtype != a.dtype:
            out.append(
                Change(
                    name,
                    _whole(b.shape),
                    None,
                    f"was replaced: {b.dtype} {tuple(b.shape)} became {a.dtype} {tuple(a.shape)}",
                )
            )
            continue
        outside = (_bits(b, name) != _bits(a, name)) & ~declared.mask(name, b.shape)
        if b.dim() == 0:
            if bool(outside):
                out.append(Change(name, (), 1))
            continue
        rows = outside.reshape(b.shape[0], -1).any(dim=1).tolist()
        for start, stop in _runs(rows):
            block = outside[start:stop]
            out.append(Change(name, _bounding_box(block, (start, stop)), int(block.sum())))
    return out


@dataclass(frozen=True)
class TensorDigest:
    shape: tuple[int, ...]
    dtype: str
    declared: str  # the declared regions this digest masked out, so before and after use the same set
    rows: tuple[str, ...]  # one hash per index along dim 0 (one for the whole tensor below 2 dims)


def digest(tensors: Mapping[str, Tensor], declared: WriteSet) -> dict[str, TensorDigest]:
    """Hashes of every tensor with its declared elements zeroed, per index along dim 0."""
    if unknown := sorted(declared.tensors() - set(tensors)):
        raise ValueError(f"the write set declares tensors {unknown} that the audit was not given; register them")
    out: dict[str, TensorDigest] = {}
    for name, t in sorted(tensors.items()):
        bits = _bits(t, name)
        regions = declared.of(name)
        if regions:
            bits = bits.masked_fill(declared.mask(name, t.shape), 0)
        bits = bits.contiguous()
        chunks = [bits] if bits.dim() < 2 else list(bits)
        rows = tuple(hashlib.blake2b(c.numpy().tobytes(), digest_size=16).hexdigest() for c in chunks)
        out[name] = TensorDigest(tuple(t.shape), str(t.dtype), ";".join(map(str, regions)), rows)
    return out


def digest_changes(before: Mapping[str, TensorDigest], after: Mapping[str, TensorDigest]) -> list[Change]:
    """Dim-0 ranges whose hashes differ: changes outside the declared set, by tensor."""
    out = [Change(n, (), None, "is missing after the step") for n in sorted(set(before) - set(after))]
    out += [
        Change(n, (), None, "appeared after the step (not in the audit before it)")
        for n in sorted(set(after) - set(before))
    ]
    for name in sorted(set(before) & set(after)):
        b, a = before[name], after[name]
        if b.declared != a.declared:
            raise ValueError(f"tensor {name} was digested with different write sets before and after; use one set")
        if (b.shape, b.dtype) != (a.shape, a.dtype):
            out.append(
                Change(
                    name,
                    _whole(torch.Size(b.shape)),
                    None,
                    f"was replaced: {b.dtype} {b.shape} became {a.dtype} {a.shape}",
                )
            )
            continue
        if len(b.rows) == 1 and len(b.shape) < 2:
            if b.rows != a.rows:
                out.append(Change(name, _whole(torch.Size(b.shape)), None))
            continue
        rest = tuple((0, n) for n in b.shape[1:])
        for start, stop in _runs([x != y for x, y in zip(b.rows, a.rows, strict=True)]):
            out.append(Change(name, ((start, stop), *rest), None))
    return out
