"""Broken cases for the choice-file binding tests: copies of layer rounds whose verdicts are turned over.

A variant's layer speedup at a cell, mirrored about its base's (s_base**2 / s), turns a loss into an equal gain and
a gain into an equal loss, so the time it saved changes sign and nothing else moves."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from benchmarks import kda_layer_h200 as bench

Cell = tuple[int, int]  # (TP, batch)


def mirror(variant: dict, base: dict, picked: Callable[[Cell], bool]) -> dict:
    """`variant` (a layer benchmark's results) with the speedups of the cells `picked` selects mirrored about
    `base`'s, in place; returned for chaining."""
    base_cells = bench.cells_by_key(base)
    for run in variant["runs"]:
        for cell in run["cells"]:
            key = (cell["tp"], cell["batch"])
            if picked(key):
                s_base = base_cells[key]["layer_speedup"]["speedup"]
                cell["layer_speedup"]["speedup"] = s_base**2 / cell["layer_speedup"]["speedup"]
    return variant


def mirrored_rounds(
    rounds: list[tuple[Path, Path]], out: Path, picked: Callable[[Cell], bool], prefix: str = ""
) -> list[tuple[Path, Path]]:
    """Copies (in `out`, named `prefix` + the variant's name) of the rounds' variant files with the cells `picked`
    selects mirrored, each beside its own base."""
    pairs = []
    for base, variant in rounds:
        doc = mirror(json.loads(variant.read_text()), json.loads(base.read_text()), picked)
        path = out / f"{prefix}{variant.name}"
        path.write_text(json.dumps(doc))
        pairs.append((base, path))
    return pairs
