"""Tile shapes of the expert kernels, read from tiles.toml (data, not code) and checked once at load."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources


@dataclass(frozen=True)
class ExpertTiles:
    max_batch: int
    block_m: int
    fc1_block_n: int
    fc1_block_k: int
    fc1_warps: int
    fc1_stages: int
    fc1_splits: int
    fc2_block_n: int
    fc2_block_k: int
    fc2_warps: int
    fc2_stages: int
    fc2_splits: int
    situ_block_n: int
    sum_block_n: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"tiles.toml: {f.name} = {value!r} must be a positive integer")
        for name in ("block_m", "fc1_block_n", "fc2_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"tiles.toml: {name} = {value} must be a power of two >= 16 (the tl.dot minimum)")
        if self.block_m > 16:
            # The token tile is the MMA's N operand next to 64 or more weight rows; decode has 1-2 pairs per expert.
            raise ValueError(f"tiles.toml: block_m = {self.block_m}; the expert kernels take 16 tokens per block")
        for name in ("fc1_block_k", "fc2_block_k"):
            value = getattr(self, name)
            if value < 32 or value & (value - 1):
                raise ValueError(f"tiles.toml: {name} = {value} must be a power of two >= 32 (one MXFP4 scale block)")
        for name in ("situ_block_n", "sum_block_n"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"tiles.toml: {name} = {value} must be a power of two")


@dataclass(frozen=True)
class TileTable:
    rows: tuple[ExpertTiles, ...]

    def for_batch(self, batch: int) -> ExpertTiles:
        for row in self.rows:
            if batch <= row.max_batch:
                return row
        raise ValueError(f"no tiles.toml row covers batch {batch}; add a row with max_batch >= {batch}")


def parse_tiles(raw: dict) -> TileTable:
    try:
        rows = tuple(ExpertTiles(**row) for row in raw["experts"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"tiles.toml: missing or unknown key: {exc}; see the comments at its top") from exc
    if not rows or [r.max_batch for r in rows] != sorted({r.max_batch for r in rows}):
        raise ValueError("tiles.toml: [[experts]] rows need strictly increasing max_batch values")
    return TileTable(rows)


@cache
def default_tiles() -> TileTable:
    text = resources.files("k3_decode.stock.triton_moe").joinpath("tiles.toml").read_text()
    return parse_tiles(tomllib.loads(text))
