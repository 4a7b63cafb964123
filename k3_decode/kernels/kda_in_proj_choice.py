"""Which build of the KDA input projection serves a batch, and how the TMA + wgmma build is tiled: the data of
kda_in_proj_choice.toml, read here without torch or CuTe DSL (the build table and the benchmarks read it too)."""

from __future__ import annotations

import tomllib
from functools import cache
from pathlib import Path
from typing import Any

from k3_decode.kernels.wgmma_stream_plan import MAX_BATCH as WGMMA_MAX_BATCH
from k3_decode.kernels.wgmma_stream_plan import MIN_BATCH as WGMMA_MIN_BATCH
from k3_decode.kernels.wgmma_stream_plan import WgmmaStreamPlan

CHOICE = Path(__file__).with_name("kda_in_proj_choice.toml")
TILING_KEYS = ("k_tile", "stages", "k_splits")


def choice(path: Path | None = None) -> dict[str, Any]:
    """The choice file (CHOICE unless `path`), checked: each table has a default, every limit is a count of rows, every
    wgmma entry a list of [first, last] batch ranges within the 9-64 rows one wgmma N of 16-64 covers, every tiling
    names its k_tile, stages and k_splits. Raises ValueError, one line, naming the entry."""
    return _choice_at(path or CHOICE)


def _entry_ok(name: str, value: Any) -> bool:
    if name == "wgmma_tiling":
        return isinstance(value, dict) and all(isinstance(value.get(k), int) for k in TILING_KEYS)
    if name == "wgmma_batches":
        return isinstance(value, list) and all(
            isinstance(r, list)
            and len(r) == 2
            and all(isinstance(b, int) for b in r)
            and WGMMA_MIN_BATCH <= r[0] <= r[1] <= WGMMA_MAX_BATCH
            for r in value
        )
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


WANT = {
    "cuda_core_max_batch": "rows >= 0",
    "wgmma_batches": f"a list of [first, last] batch ranges within {WGMMA_MIN_BATCH}..{WGMMA_MAX_BATCH}",
    "wgmma_tiling": f"{{ {', '.join(f'{k} = N' for k in TILING_KEYS)} }}",
}


@cache
def _choice_at(path: Path) -> dict[str, Any]:
    table = tomllib.loads(path.read_text())
    for name, want in WANT.items():
        entries = table.get(name)
        if not isinstance(entries, dict) or "default" not in entries:
            raise ValueError(f"{path.name}: [{name}] needs a default entry")
        for rows, value in entries.items():
            if not _entry_ok(name, value):
                raise ValueError(f"{path.name}: [{name}] {rows} = {value!r}; write {want}")
    return table


def _by_rows(table: str, weight_rows: int) -> Any:
    entries = choice()[table]
    return entries.get(str(weight_rows), entries["default"])


def kernel_for_rows(batch: int, weight_rows: int) -> str:
    """The build that serves `batch` rows of x against a weight of `weight_rows` rows (kda_in_proj_choice.toml):
    the TMA + wgmma stream in the batch ranges where it saved layer time, else the CUDA-core stream while its FMAs
    hide under the weight stream, tensor cores above."""
    if any(first <= batch <= last for first, last in _by_rows("wgmma_batches", weight_rows)):
        return "wgmma"
    return "cuda_core" if batch <= int(_by_rows("cuda_core_max_batch", weight_rows)) else "tensor_core"


def wgmma_plan(rows: int, k: int, batch: int) -> WgmmaStreamPlan:
    """The TMA + wgmma stream's plan for this shape, its tiling from kda_in_proj_choice.toml's [wgmma_tiling]."""
    tiling = _by_rows("wgmma_tiling", rows)
    return WgmmaStreamPlan(rows, k, batch, **{key: tiling[key] for key in TILING_KEYS})
