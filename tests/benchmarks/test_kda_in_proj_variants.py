"""kda_in_proj_choice.toml's wgmma batches and providers.toml's [in_proj] rows against the committed KDA layer runs
that decided them: the TMA + wgmma projection served exactly where it saved layer time in every round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import kda_layer_h200 as bench
from k3_decode.config import K3
from k3_decode.kernels.kda_in_proj_choice import kernel_for_rows
from k3_decode.kernels.providers import max_rows

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results"
# Layer 6 at TP8 and TP16, B16, B32 and B64: the tree's projection against the wgmma stream served at B16-B64 (and
# providers.toml's [in_proj] at 64 rows). Two rounds on one H200 at fdbaa63, whose stream let its dependents launch
# only at its end, and one on one H100 at 482ab2d, which lets them launch after its dependency wait.
H200, H100 = RESULTS / "kda-layer-variants-h200", RESULTS / "kda-layer-variants-h100"
ROUNDS = [
    *((H200 / f"inproj-late-trigger-base-{i}.json", H200 / f"inproj-late-trigger-{i}.json") for i in (1, 2)),
    (H100 / "inproj-wgmma-base-1.json", H100 / "inproj-wgmma-1.json"),
]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def rows_at(tp: int) -> int:
    return K3.shard(tp).kda_in_proj_rows


def wgmma_verdicts(rounds: list[tuple[Path, Path]]) -> dict[tuple[int, int], bool]:
    """Per measured (TP, batch): whether serving the wgmma projection saved layer time in every round, after checking
    that each variant ran it there and no base did."""
    per_round = []
    for base, variant in rounds:
        for path, on in ((base, False), (variant, True)):
            for key, cell in bench.cells_by_key(load(path)).items():
                assert (cell.get("in_proj_kernel") == "wgmma") is on, (path.name, key)
        layer, saved = bench.layer_savings(load(base), load(variant))
        assert layer == 6, variant.name
        per_round.append(saved)
    return {key: all(saved[key] > 0 for saved in per_round) for key in per_round[0]}


def served(tp: int, batch: int) -> bool:
    """Whether the tree serves the wgmma projection at (TP, batch): the provider takes the rows and the choice file
    picks the build."""
    limit, _ = max_rows("in_proj", "cute-kda-in-proj", tp)
    return batch <= limit and kernel_for_rows(batch, rows_at(tp)) == "wgmma"


def test_the_wgmma_projection_serves_exactly_the_tp16_batches_that_saved_in_every_round():
    verdicts = wgmma_verdicts(ROUNDS)
    assert verdicts == {
        (8, 16): True,
        (8, 32): False,
        (8, 64): True,
        (16, 16): True,
        (16, 32): False,
        (16, 64): True,
    }
    for (tp, batch), won in verdicts.items():
        if tp == 16:
            assert served(tp, batch) == won, f"TP16 B{batch}"
    # TP8 serves none: B32 lost, and providers.toml's one TP8 limit cannot take B33-B64 without B9-B32 too
    assert not any(served(8, b) for b in range(1, 65))
    assert max_rows("in_proj", "cute-kda-in-proj", 8)[0] == 8


def test_the_served_tp16_batches_drop_the_split_k_launch_at_b64():
    """The attention side at TP16 B64 took one launch fewer in every round with the stream (no split-K reduce)."""
    for base, variant in ROUNDS:
        b, v = (bench.cells_by_key(load(p))[(16, 64)] for p in (base, variant))
        assert v["attention"]["specialized"]["launches"] == 4, variant.name
        assert b["paths"]["specialized"]["in_proj"] == "stock"


def test_a_round_where_tp16_b32_saved_would_serve_it(tmp_path: Path):
    """Broken case: every round's TP16 B32 loss mirrored into a gain flips its verdict, which the served table then
    contradicts."""
    mirrored = []
    for base, variant in ROUNDS:
        doc, base_cells = load(variant), bench.cells_by_key(load(base))
        for run in doc["runs"]:
            for cell in run["cells"]:
                if (cell["tp"], cell["batch"]) == (16, 32):
                    s_base = base_cells[(16, 32)]["layer_speedup"]["speedup"]
                    cell["layer_speedup"]["speedup"] = s_base**2 / cell["layer_speedup"]["speedup"]
        path = tmp_path / f"{len(mirrored)}-{variant.name}"
        path.write_text(json.dumps(doc))
        mirrored.append((base, path))
    verdicts = wgmma_verdicts(mirrored)
    assert verdicts[(16, 32)] is True
    assert served(16, 32) != verdicts[(16, 32)]


def test_a_base_that_ran_the_wgmma_projection_is_not_a_base():
    _, variant = ROUNDS[0]
    with pytest.raises(AssertionError, match=r"inproj-late-trigger-1\.json"):
        wgmma_verdicts([(variant, variant)])
