"""kda_in_proj_choice.toml's wgmma batches and providers.toml's [in_proj] rows against the committed KDA layer runs
that decided them: the TMA + wgmma projection served exactly where it saved layer time in every round of each set, at
TP8 and TP16, and at TP8 the provider's row ranges take no batch beyond those and the 1-8 its other builds win per
call."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import kda_layer_h200 as bench
from k3_decode.config import K3
from k3_decode.kernels.kda_in_proj_choice import kernel_for_rows
from k3_decode.kernels.providers import served_rows
from tests.benchmarks.mirror import mirrored_rounds

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results"
# Layer 6 at TP8 and TP16, B16, B32 and B64: the tree's projection against the wgmma stream served at B16-B64 (and
# providers.toml's [in_proj] at 64 rows at both sizes; the bases ran cuBLAS at TP8 B16-B64 and TP16 B64, the
# tensor-core build at TP16 B16 and B32). Two rounds on one H200 at fdbaa63, whose stream let its dependents launch
# only at its end, and one on one H100 at 482ab2d, which lets them launch after its dependency wait.
H200, H100 = RESULTS / "kda-layer-variants-h200", RESULTS / "kda-layer-variants-h100"
ROUNDS = [
    *((H200 / f"inproj-late-trigger-base-{i}.json", H200 / f"inproj-late-trigger-{i}.json") for i in (1, 2)),
    (H100 / "inproj-wgmma-base-1.json", H100 / "inproj-wgmma-1.json"),
]
# Layer 6 at TP8 and TP16, B24 and B32, on one H100 at b8e3e11, 60 rounds each: the same stream at B16-B64 (and
# providers.toml's TP8 [in_proj] rows 1-8, 16-64) against the tree, whose wgmma o_proj served B32-B64 on both sides (a
# different base from the first set's): two rounds at B32 alone, two at B24 and B32.
SECOND_ROUNDS = [
    *((H100 / f"inproj-b32-base-{i}.json", H100 / f"inproj-b32-{i}.json") for i in (1, 2)),
    *((H100 / f"inproj-b24-base-{i}.json", H100 / f"inproj-b24-{i}.json") for i in (1, 2)),
]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def rows_at(tp: int) -> int:
    return K3.shard(tp).kda_in_proj_rows


def wgmma_verdicts(rounds: list[tuple[Path, Path]]) -> dict[tuple[int, int], bool]:
    """Per measured (TP, batch): whether serving the wgmma projection saved layer time in every round that timed it,
    after checking that each variant ran it there and no base did."""
    for base, variant in rounds:
        for path, on in ((base, False), (variant, True)):
            for key, cell in bench.cells_by_key(load(path)).items():
                assert (cell.get("in_proj_kernel") == "wgmma") is on, (path.name, key)
    layer, saved = bench.round_savings([(load(base), load(variant)) for base, variant in rounds])
    assert layer == 6, [variant.name for _, variant in rounds]
    return {key: bench.every_round(per_round) == "saved in every round" for key, per_round in saved.items()}


def served(tp: int, batch: int) -> bool:
    """Whether the tree serves the wgmma projection at (TP, batch): the provider takes the rows and the choice file
    picks the build."""
    limit = served_rows("in_proj", "cute-kda-in-proj", tp)
    return (limit is None or limit.serves(batch)) and kernel_for_rows(batch, rows_at(tp)) == "wgmma"


MEASURED = {(8, 16): True, (8, 32): False, (8, 64): True, (16, 16): True, (16, 32): False, (16, 64): True}
SECOND_MEASURED = {(8, 24): True, (8, 32): False, (16, 24): False, (16, 32): False}
SETS = {"first": (ROUNDS, MEASURED), "second": (SECOND_ROUNDS, SECOND_MEASURED)}
# The batches the wgmma build serves per TP size: the measured wins, B17-B31 at TP8 following B16 and B24, B33-B63
# following B64 at both.
WGMMA = {8: [*range(16, 32), *range(33, 65)], 16: [16, *range(33, 65)]}


@pytest.mark.parametrize("name", sorted(SETS))
def test_the_wgmma_projection_serves_exactly_the_batches_that_saved_in_every_round(name: str):
    rounds, measured = SETS[name]
    verdicts = wgmma_verdicts(rounds)
    assert verdicts == measured
    for (tp, batch), won in verdicts.items():
        assert served(tp, batch) == won, f"TP{tp} B{batch}"


def test_the_second_set_ran_beside_the_wgmma_o_proj_at_b32_on_both_sides():
    """Its base differs from the first set's: the tree's wgmma o_proj served B32 in base and variant alike (B24 kept
    the mma.sync build)."""
    for base, variant in SECOND_ROUNDS:
        for path in (base, variant):
            for (tp, batch), cell in bench.cells_by_key(load(path)).items():
                assert cell["o_proj_variant"]["wgmma"] is (batch == 32), (path.name, tp, batch)


@pytest.mark.parametrize("tp", [8, 16])
def test_the_provider_takes_no_batch_beyond_the_wgmma_ones_and_the_rows_its_other_builds_win(tp: int):
    """Every batch the wgmma build serves is one the provider takes (the choice file alone cannot serve it), and at
    TP8 the provider takes nothing else above 8 rows: there the CUDA-core and tensor-core builds beat cuBLAS per
    call only to B8 (providers.toml's why), so B9-B15 and B32 stay stock. B17-B31 follow B16 and B24 at TP8,
    B33-B63 follow B64 at both sizes; TP16 B24 lost, so TP16 serves the stream at B16 and B33-B64 only."""
    limit = served_rows("in_proj", "cute-kda-in-proj", tp)
    assert limit is not None
    wgmma = [b for b in range(1, 65) if kernel_for_rows(b, rows_at(tp)) == "wgmma"]
    assert wgmma == WGMMA[tp]
    assert all(limit.serves(b) for b in wgmma)
    if tp == 8:
        assert [b for b in range(1, 65) if limit.serves(b) and b not in wgmma] == list(range(1, 9))
    else:
        assert limit.ranges == ((1, 64),)


def test_the_served_tp16_batches_drop_the_split_k_launch_at_b64():
    """The attention side at TP16 B64 took one launch fewer in every round with the stream (no split-K reduce)."""
    for base, variant in ROUNDS:
        b, v = (bench.cells_by_key(load(p))[(16, 64)] for p in (base, variant))
        assert v["attention"]["specialized"]["launches"] == 4, variant.name
        assert b["paths"]["specialized"]["in_proj"] == "stock"


def turned_over(
    measured_rounds: list[tuple[Path, Path]], key: tuple[int, int], tmp_path: Path
) -> list[tuple[Path, Path]]:
    """The rounds with the verdict at `key` turned over by mirroring the variant's layer speedup about the base's
    (which flips the sign of the time saved): where it lost in some round, those losses become gains; where it saved
    in every round, every gain becomes a loss."""
    won = wgmma_verdicts(measured_rounds)[key]
    rounds = []
    for i, (base, variant) in enumerate(measured_rounds):
        _, saved = bench.layer_savings(load(base), load(variant))
        picked = {key} if won or saved.get(key, 0.0) <= 0 else set()  # a round that did not time it has no cell
        rounds += mirrored_rounds([(base, variant)], tmp_path, picked.__contains__, prefix=f"{i}-")
    return rounds


CELLS = [(name, key) for name in sorted(SETS) for key in sorted(SETS[name][1])]


@pytest.mark.parametrize(("name", "key"), CELLS, ids=[f"{name}-tp{tp}-b{b}" for name, (tp, b) in CELLS])
def test_rounds_with_a_verdict_turned_over_contradict_the_served_table(name: str, key: tuple[int, int], tmp_path: Path):
    """Broken cases: the losses at TP8 and TP16 B32 (both sets) and TP16 B24 mirrored into gains would have served
    them, and the gains at TP8 and TP16 B16 and B64 and at TP8 B24 mirrored into losses would have kept them off; the
    served tables contradict each."""
    rounds, measured = SETS[name]
    verdicts = wgmma_verdicts(turned_over(rounds, key, tmp_path))
    assert verdicts[key] is not measured[key]
    assert {k: v for k, v in verdicts.items() if k != key} == {k: v for k, v in measured.items() if k != key}
    assert served(*key) != verdicts[key]


@pytest.mark.parametrize("name", sorted(SETS))
def test_a_base_that_ran_the_wgmma_projection_is_not_a_base(name: str):
    _, variant = SETS[name][0][0]
    with pytest.raises(AssertionError, match=re.escape(variant.name)):
        wgmma_verdicts([(variant, variant)])
