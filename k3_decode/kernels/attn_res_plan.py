"""What the AttnRes kernel (k3_decode/kernels/attn_res.py) is compiled for, without importing CuTe DSL.

An application's kind (bank blocks mixed, how delta enters the prefix, whether a block is saved, whether the output
is normed) is fixed at compile time; the launch plan splits a row over a cluster of CTAs. `site_kinds` walks a
model's layer stack with the oracle's block rules (k3_decode/reference/attn_res.py, restated here on plain ints
so that listing builds needs neither torch nor CuTe DSL; a test checks both agree) and returns every kind the
model uses, with the sites that use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from k3_decode.config import ModelDims

DeltaMode = Literal["none", "add", "restart"]
DeltaDtype = Literal["bfloat16", "float32"]

VECTOR = 8  # BF16 columns a thread owns: one 16-byte load per row
WARP = 32
MAX_CLUSTER = 8  # the portable cluster size on Hopper
MAX_SOURCES = 16  # the 2 partials of every source are totalled by one lane each
MAX_THREADS = 1024


@dataclass(frozen=True)
class AttnResKind:
    """What one application does. Every field is fixed at compile time: one compiled kernel per kind."""

    num_blocks: int  # bank blocks mixed before the prefix (0..8 in K3)
    delta: DeltaMode
    save: bool  # write p' into the bank block given at run time
    out_norm: bool
    delta_dtype: DeltaDtype = "bfloat16"

    def __post_init__(self) -> None:
        if not 0 <= self.num_blocks < MAX_SOURCES:
            raise ValueError(f"AttnRes mixes 0..{MAX_SOURCES - 1} bank blocks, not {self.num_blocks}")
        if self.delta not in ("none", "add", "restart"):
            raise ValueError(f"AttnRes delta mode {self.delta!r} is not one of none, add, restart")
        if self.delta_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"AttnRes delta dtype {self.delta_dtype!r} is not bfloat16 or float32")
        if self.delta == "none" and self.delta_dtype != "bfloat16":
            raise ValueError("an AttnRes site without delta has no delta dtype; leave delta_dtype at bfloat16")

    @property
    def sources(self) -> int:
        return self.num_blocks + 1

    @property
    def partials(self) -> int:
        """Floats one warp pushes in the first exchange: a dot and a square sum per source, in whole 16 B."""
        return -(-2 * self.sources // 4) * 4

    @property
    def tag(self) -> str:
        """A short, path-safe name, e.g. n3-add-save-norm."""
        parts = [f"n{self.num_blocks}", self.delta, *(["save"] if self.save else [])]
        parts.append("norm" if self.out_norm else "nonorm")
        if self.delta_dtype == "float32":
            parts.append("f32delta")
        return "-".join(parts)

    @classmethod
    def from_tag(cls, tag: str) -> AttnResKind:
        """The inverse of `tag` (data files name kinds by their tags)."""
        parts = tag.split("-")
        try:
            num_blocks = int(parts[0].removeprefix("n")) if parts[0].startswith("n") else -1
            kind = cls(
                num_blocks=num_blocks,
                delta=parts[1],  # type: ignore[arg-type]
                save="save" in parts[2:],
                out_norm="norm" in parts[2:],
                delta_dtype="float32" if "f32delta" in parts[2:] else "bfloat16",
            )
        except (IndexError, ValueError) as exc:
            raise ValueError(f"{tag!r} is not an AttnRes kind tag such as n3-add-save-norm ({exc})") from None
        if kind.tag != tag:
            raise ValueError(f"{tag!r} is not an AttnRes kind tag; the canonical spelling is {kind.tag!r}")
        return kind


@dataclass(frozen=True)
class ClusterPlan:
    """How a row of `hidden` columns is split: `cluster` CTAs of `threads` threads, 8 columns per thread."""

    hidden: int
    cluster: int
    threads: int

    @classmethod
    def for_hidden(cls, hidden: int) -> ClusterPlan:
        """The most CTAs per row (at most 8) whose share of the row is whole warps of one vector per thread."""
        if hidden <= 0 or hidden % (VECTOR * WARP):
            raise ValueError(f"AttnRes needs hidden to be a positive multiple of {VECTOR * WARP}, got {hidden}")
        vectors = hidden // VECTOR
        for cluster in range(MAX_CLUSTER, 0, -1):
            threads = vectors // cluster
            fits = vectors % cluster == 0 and threads % WARP == 0 and threads <= MAX_THREADS
            if fits and cluster * threads // WARP <= WARP:  # one lane per (CTA, warp) partial in the last sum
                return cls(hidden, cluster, threads)
        raise ValueError(f"AttnRes: hidden {hidden} does not split into whole warps on at most {MAX_CLUSTER} CTAs")

    @property
    def warps(self) -> int:
        return self.threads // WARP

    @property
    def slots(self) -> int:
        """Partials each CTA receives per exchange: one per (CTA, warp) of the cluster."""
        return self.cluster * self.warps


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def site_kinds(dims: ModelDims, final_norm: tuple[bool, ...] = (True, False)) -> dict[AttnResKind, tuple[str, ...]]:
    """Every AttnRes kind `dims`' layer stack uses, with its sites ("before attention of layer 12", ...).

    The final mixing is listed once per entry of `final_norm`: with the model norm fused (the specialized decode)
    and without it (stock leaves the norm to compute_logits).
    """
    bs = dims.attn_res_block_size
    sites: dict[AttnResKind, list[str]] = {}

    def add(kind: AttnResKind, site: str) -> None:
        sites.setdefault(kind, []).append(site)

    for layer in range(dims.num_layers):
        write = layer % bs == 0
        add(
            AttnResKind(
                num_blocks=_cdiv(layer, bs),  # the block just saved is p itself, so it is not read twice
                delta="add" if layer else "none",
                save=write,
                out_norm=True,
            ),
            f"before attention of layer {layer}",
        )
        add(
            AttnResKind(
                num_blocks=_cdiv(layer + 1, bs),  # the whole bank
                delta="restart" if write else "add",
                save=False,
                out_norm=True,
            ),
            f"after attention of layer {layer}",
        )
    for norm in final_norm:
        add(
            AttnResKind(num_blocks=_cdiv(dims.num_layers, bs), delta="add", save=False, out_norm=norm),
            "final mixing" + ("" if norm else " (norm left to the logits)"),
        )
    return {kind: tuple(names) for kind, names in sites.items()}
