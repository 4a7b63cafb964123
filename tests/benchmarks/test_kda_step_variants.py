"""The KDA step's variant results off the GPU: labels against the plan's names, the tables, the choice rules a
measurement supports (and that kda_step_choice.toml accepts), and a results file that holds one run only."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import pytest

from benchmarks import kda_layer_h200 as bench
from benchmarks import kda_step_variants as kv
from k3_decode.config import K3
from k3_decode.kernels.kda_step_plan import (
    CLUSTERS,
    PAIRED_KNOBS,
    REQUEST_GROUPS,
    RESIDENT_CHOICES,
    KdaStepPlan,
    chosen_variant,
    variant_rules,
)
from tests.benchmarks.mirror import mirrored_rounds

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks/results"
COMMITTED = RESULTS / "kda-step-clusters-h200.json"
VARIANTS = RESULTS / "kda-step-variants-h200.json"  # every variant timed at 1e59838, B16-B64
# The layer benchmark with those rules served beside 1024 threads everywhere, two rounds per timed layer, each in one
# session: layer 6 (k3-kda-mla) at 1e59838 and layer 86 (k3-kda-mla-late) at f29943c
LAYER_ROUNDS = [
    [
        (
            RESULTS / f"kda-layer-variants-h100/{stem}-base-{i}.json",
            RESULTS / f"kda-layer-variants-h100/{stem}-1536-{i}.json",
        )
        for stem in ("budget", "late")
    ]
    for i in (1, 2)
]
ENV = {"gpu": "NVIDIA H200", "commit": "abc1234", "dirty": False, "driver": "580"}
TP8_HEADS = K3.shard(8).kda_heads


def row(tp: int, batch: int, plan: str, us: dict[str, float]) -> dict:
    return {"tp": tp, "batch": batch, "plan": plan, "fastest": min(us, key=us.__getitem__), "us": us, "bytes": 10**7}


def cells(*rows: dict) -> list[kv.Cell]:
    return [kv.Cell.of(r, "test") for r in rows]


def test_labels_parse_back_to_the_plan_that_named_them():
    """Every label the timing test can write (c<cluster> + KdaStepPlan.variant_suffix) parses to its plan's knobs:
    a suffix renamed in the plan and not here fails."""
    seen = 0
    for cluster, threads, warm, group in product(CLUSTERS, RESIDENT_CHOICES, (False, True), REQUEST_GROUPS):
        if warm and group > 1:
            continue  # not built together
        plan = KdaStepPlan(12, 6288, 64, cluster, resident_threads=threads, warm_ahead=warm, requests_per_cta=group)
        got = kv.Variant.parse(f"c{plan.cluster}{plan.variant_suffix}")
        assert got == kv.Variant(cluster, threads, warm, group), plan.tag
        seen += 1
    assert seen >= 12
    with pytest.raises(kv.ResultsError, match="not c<cluster>"):
        kv.Variant.parse("c2/t1536/fast")


def test_the_committed_clusters_file_gives_the_docs_table():
    """30aac8f's clusters-only file reads (its own row format): the served cluster in bold, the fastest, and the
    two cells where another cluster was faster."""
    env, got = kv.load(COMMITTED)
    assert env["gpu"] == "NVIDIA H200" and len(got) == 14
    text = kv.table(got)
    assert "| 64 | 49.65 | 47.86 | **46.34** | c2 | 1.000 | 2.26 |" in text  # TP8 B64, as docs/kda-layer-h200.md
    assert "| 16 | 14.19 | 14.66 | **15.51** | c8 | 1.093 | 1.71 |" in text
    rules, notes = kv.suggest(got)
    assert rules == []  # no other budget, warming or group was timed then
    assert [n.split(":")[0] for n in notes] == ["TP8 B16", "TP16 B32"]


def model_savings(rounds: list[list[tuple[Path, Path]]], rules: list[kv.Rule]) -> list[dict[tuple[int, int], float]]:
    """Per round, per (TP, batch): the time the variant saved on every timed layer, times the KDA layers it stands
    for (us per decode step of the whole model's KDA layers)."""
    out = []
    for pairs in rounds:
        saved: dict[tuple[int, int], float] = {}
        for base, variant in pairs:
            ran = json.loads(variant.read_text())["variant"]["kda_step_choice_rules"]
            assert ran == [r.toml() for r in rules], variant.name  # the layer run served what --rules prints
            assert json.loads(base.read_text())["variant"]["kda_step_choice_rules"] == []
            layer, by_cell = bench.layer_savings(*(json.loads(p.read_text()) for p in (base, variant)))
            for key, us in by_cell.items():
                saved[key] = saved.get(key, 0.0) + bench.kda_layers_like(K3, layer) * us
        out.append(saved)
    return out


def test_the_served_choice_file_is_what_the_committed_runs_support():
    """At every batch the committed variant run measured, kda_step_choice.toml serves the variant `--rules` derives
    from it where that variant also saved model time in every committed layer round beside 1024 threads everywhere
    (LAYER_ROUNDS, which ran exactly those rules): the time each timed layer saved, times the KDA layers it stands
    for. The default serves elsewhere: a rule served without both measurements, or a winner of both left unserved,
    fails here."""
    env, got = kv.load(VARIANTS)
    assert env["gpu"] == "NVIDIA H200" and not env["dirty"]
    assert {(c.tp, c.batch) for c in got} == {(tp, b) for tp in (8, 16) for b in (16, 32, 64)}
    rules, notes = kv.suggest(got)
    assert notes == []  # the plan's cluster rule holds: the winners are budgets at its cluster
    rounds = model_savings(LAYER_ROUNDS, rules)
    default, _ = variant_rules()
    plain = kv.Variant(0, default.resident_threads, default.warm_ahead, 1)
    for c in got:
        heads = K3.shard(c.tp).kda_heads
        rule = next((r for r in rules if r.heads == heads and r.first <= c.batch <= r.last), None)
        won = rule is not None and all(saved[(c.tp, c.batch)] > 0 for saved in rounds)
        want = rule.variant if won else plain
        served = chosen_variant(heads, c.batch)
        if served.wide_warps:  # its rounds bind it, at 1024 threads (test_wide_warps_and_the_lean_conv_are_served_...)
            assert (c.tp, c.batch) in WIDE_LEAN_CONV_SERVED and served.resident_threads == 1024
            continue
        got_knobs = kv.Variant(0, served.resident_threads, served.warm_ahead, served.requests_per_cta).choice()
        assert got_knobs == want.choice(), f"TP{c.tp} B{c.batch}"


def test_the_weighting_decides_where_the_two_layers_disagree(tmp_path):
    """At TP8 B32 layer 6 lost in both rounds and layer 86 won: the 60 layers like 86 carry it. A copy of round 1
    whose layer-86 gain there is turned into a loss as large decides against the rule."""
    _, got = kv.load(VARIANTS)
    rules, _ = kv.suggest(got)
    (six_base, six), (late_base, late) = LAYER_ROUNDS[0]
    (saved,) = model_savings([LAYER_ROUNDS[0]], rules)
    _, on_six = bench.layer_savings(json.loads(six_base.read_text()), json.loads(six.read_text()))
    assert on_six[(8, 32)] < 0 < saved[(8, 32)]  # layer 6 lost, the model gained
    ((_, worse),) = mirrored_rounds([(late_base, late)], tmp_path, lambda key: key == (8, 32))  # the gain, inverted
    (flipped,) = model_savings([[(six_base, six), (late_base, worse)]], rules)
    assert flipped[(8, 32)] < 0
    assert flipped[(8, 64)] == pytest.approx(saved[(8, 64)])  # only the tampered cell moved


def test_a_variant_that_wins_at_neighbouring_batches_gives_one_rule_the_choice_file_accepts(tmp_path):
    rows = [
        row(8, 8, "c2", {"c2": 8.8, "c2/t1536": 8.7}),  # inside the margin: no rule
        row(8, 16, "c2", {"c2": 15.5, "c2/t1536": 12.0, "c2/warm": 15.0}),
        row(8, 32, "c2", {"c2": 24.8, "c2/t1536": 20.0, "c8": 25.0}),
        row(8, 64, "c2", {"c2": 46.3, "c2/t1536": 44.0, "c2/r2": 38.0}),
        row(16, 8, "c4", {"c4": 5.7, "c4/t1536": 5.0}),  # the same knobs at another cluster: one rule with B16
        row(16, 16, "c2", {"c2": 8.6, "c2/t1536": 7.5}),
        row(16, 64, "c2", {"c2": 24.4, "c2/t1536/warm": 20.0}),
    ]
    rules, notes = kv.suggest(cells(*rows))
    assert notes == []
    assert [(r.heads, r.first, r.last, r.variant.choice()) for r in rules] == [
        (TP8_HEADS, 16, 32, {"resident_threads": 1536, "warm_ahead": False}),
        (TP8_HEADS, 64, 64, {"resident_threads": 1024, "warm_ahead": False, "requests_per_cta": 2}),
        (K3.shard(16).kda_heads, 8, 16, {"resident_threads": 1536, "warm_ahead": False}),
        (K3.shard(16).kda_heads, 64, 64, {"resident_threads": 1536, "warm_ahead": True}),
    ]
    assert rules[0].gain == pytest.approx(24.8 / 20.0 - 1)  # the smaller of B16's and B32's gains
    # The printed rules are a valid choice file that serves what was measured fastest.
    choice = tmp_path / "choice.toml"
    choice.write_text("default = { resident_threads = 1024, warm_ahead = false }\nrules = [\n")
    choice.write_text(choice.read_text() + "".join(f"  {r.toml()},\n" for r in rules) + "]\n")
    assert chosen_variant(TP8_HEADS, 24, choice).resident_threads == 1536  # between two measured batches that agree
    assert chosen_variant(TP8_HEADS, 64, choice).requests_per_cta == 2
    assert chosen_variant(TP8_HEADS, 8, choice).resident_threads == 1024
    assert chosen_variant(K3.shard(16).kda_heads, 64, choice).warm_ahead is True


def test_a_faster_cluster_is_a_note_not_a_rule():
    rules, notes = kv.suggest(cells(row(8, 16, "c2", {"c2": 15.5, "c8": 14.0, "c2/t1536": 15.4})))
    assert rules == []
    assert notes and notes[0].startswith("TP8 B16: c8 is 10.7% faster than the served c2")


def test_the_cli_prints_rules_and_refuses_bad_input(tmp_path, capsys):
    path = tmp_path / "r.json"
    kv.append_rows(path, [row(8, 32, "c2", {"c2": 24.8, "c2/t1536": 20.0})], ENV)
    assert kv.main(["--rules", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{{ heads = {TP8_HEADS}, batches = [32, 32], resident_threads = 1536, warm_ahead = false }}" in out
    assert kv.main(["--table", str(path)]) == 0
    assert "**24.80**" in capsys.readouterr().out
    for argv, says in (
        (["--rules", str(tmp_path / "none.json")], "no such results file"),
        (["--rules", str(path), "--margin", "1.5"], "--margin is a fraction"),
    ):
        assert kv.main(argv) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1
    (tmp_path / "bad.json").write_text(json.dumps({"env": {}, "cells": [{"tp": 8, "batch": 1}]}))
    assert kv.main(["--table", str(tmp_path / "bad.json")]) == 2
    assert "not a timing row" in capsys.readouterr().err


def test_a_results_file_holds_one_run(tmp_path):
    """Calls of one run append (TP8, then TP16); a file of another commit or GPU is refused and left unchanged,
    so no row is ever filed under the environment of a run that did not measure it."""
    path = tmp_path / "r.json"
    kv.append_rows(path, [row(8, 16, "c2", {"c2": 15.5})], ENV)
    kv.append_rows(path, [row(16, 16, "c2", {"c2": 8.6})], {**ENV, "driver": "other"})  # same run
    before = path.read_text()
    assert [c["tp"] for c in json.loads(before)["cells"]] == [8, 16]
    for other in ({**ENV, "commit": "def5678"}, {**ENV, "gpu": "NVIDIA H100 80GB HBM3"}, {**ENV, "dirty": True}):
        with pytest.raises(kv.ResultsError, match="holds another run"):
            kv.append_rows(path, [row(8, 32, "c2", {"c2": 24.8})], other)
        assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left behind


def test_a_tie_serves_the_variant_with_the_fewest_extras():
    """Within TIE of the fastest, the rule takes no warming and one request per cluster (1e59838's TP8 B32: the
    warming variant 0.01 us ahead); an extra that is faster by more than TIE is served."""
    tied = {"c2": 24.21, "c2/t1536": 22.35, "c2/t1536/warm": 22.34, "c2/r2": 22.36}
    rules, _ = kv.suggest(cells(row(8, 32, "c2", tied)))
    assert [r.variant for r in rules] == [kv.Variant(2, 1536, False, 1)]
    clear = {**tied, "c2/t1536/warm": 21.5}
    rules, _ = kv.suggest(cells(row(8, 32, "c2", clear)))
    assert [r.variant for r in rules] == [kv.Variant(2, 1536, True, 1)]
    # Ties never hide a gain: the served variant itself within TIE of the fastest gives no rule.
    rules, _ = kv.suggest(cells(row(8, 32, "c2", {"c2": 22.4, "c2/t1536": 22.35})))
    assert rules == []


# Layer 6 on one H100, three rounds of 60 against the tree (each run records d34115c, the tree it ran plus the step's
# local-decays build): every CTA computing its head's 128 decays (kda_step_choice.toml rule `local_decays = true` at
# B1-B8, both TP sizes) instead of exchanging them.
LOCAL_DECAY_ROUNDS = [
    (RESULTS / f"kda-layer-variants-h100/step-local-decays-base-{i}.json",
     RESULTS / f"kda-layer-variants-h100/step-local-decays-{i}.json")
    for i in (1, 2, 3)
]  # fmt: skip


def knob_verdicts(rounds: list[tuple[Path, Path]], knob: str, layer: int) -> dict[tuple[int, int], str]:
    """Per measured (TP, batch): the rounds' verdict on serving `knob` (bench.every_round), after checking that each
    variant ran the step with it at every cell and no base did, all on `layer`."""
    docs = [(json.loads(base.read_text()), json.loads(variant.read_text())) for base, variant in rounds]
    suffix = "/" + knob.replace("_", "-")
    for base, variant in docs:
        assert base["variant"] == {"name": "plain", "choice_files": {}}
        assert f"{knob} = true" in variant["variant"]["choice_files"]["kda_step_choice.toml"]
        for doc, on in ((base, False), (variant, True)):
            for key, cell in bench.cells_by_key(doc).items():
                assert cell["kda_step_plan"].endswith(suffix) == on, (key, cell["kda_step_plan"])
    timed, saved = bench.round_savings(docs)
    assert timed == layer
    return {key: bench.every_round(per_round) for key, per_round in saved.items()}


def knob_problems(verdicts: dict[tuple[int, int], str], knob: str, choice: Path | None = None) -> list[str]:
    """Where the choice file (the served one by default) serves `knob` at a measured cell that did not save layer
    time in every round."""
    return [
        f"TP{tp} B{batch}: {knob} served but {verdict}"
        for (tp, batch), verdict in sorted(verdicts.items())
        if getattr(chosen_variant(K3.shard(tp).kda_heads, batch, choice), knob) and verdict != "saved in every round"
    ]


def test_local_decays_are_served_nowhere_because_they_lost_or_saved_only_on_one_stack():
    """Lost in every round at TP8 B1-B4 (-0.65 to -2.57 us a layer) and TP16 B1 and B4, mixed at TP16 B2 and B8;
    TP8 B8 saved +0.16 to +0.37 us in every round (inside the intervals) on layer 6 only. The served file has no
    local-decays rule."""
    verdicts = knob_verdicts(LOCAL_DECAY_ROUNDS, "local_decays", 6)
    assert set(verdicts) == {(tp, b) for tp in (8, 16) for b in (1, 2, 4, 8)}
    assert {key for key, verdict in verdicts.items() if verdict == "saved in every round"} == {(8, 8)}
    assert knob_problems(verdicts, "local_decays") == []
    default, rules = variant_rules()
    assert not default.local_decays and not any(r.variant.local_decays for r in rules)


def test_a_choice_serving_local_decays_at_b1_to_b8_contradicts_the_rounds(tmp_path):
    """Broken case: the rule the rounds ran, served; every cell that lost or was mixed is named."""
    choice = tmp_path / "kda_step_choice.toml"
    choice.write_text(
        "default = { resident_threads = 1024, warm_ahead = false }\n"
        "rules = [{ batches = [1, 8], resident_threads = 1024, warm_ahead = false, local_decays = true }]\n"
    )
    problems = knob_problems(knob_verdicts(LOCAL_DECAY_ROUNDS, "local_decays", 6), "local_decays", choice)
    assert len(problems) == 7 and "TP8 B8" not in " ".join(problems), problems


# One H100 at 326f26f, three rounds of 60 against the tree, the lean start served everywhere (kda_step_choice.toml with
# `lean_start = true` on every rule and the default): layer 6 at B16, B32 and B64, both TP sizes; layer 86 (the late
# stack) at TP8 B32 and B64, and at TP8 B48 and B56.
def _rounds(stem: str, indices: Iterable[int] = (1, 2, 3)) -> list[tuple[Path, Path]]:
    """The (base, variant) files of rounds `indices` of `stem`, as the layer benchmark's rounds are named."""
    folder = RESULTS / "kda-layer-variants-h100"
    return [(folder / f"{stem}-base-{i}.json", folder / f"{stem}-{i}.json") for i in indices]


LEAN_SIX_ROUNDS = _rounds("step-lean")
LEAN_LATE_ROUNDS = _rounds("step-lean-late")
LEAN_LATE_48_ROUNDS = _rounds("step-lean-late48")
LATE_LAYER = 86


def knob_savings(
    rounds: list[tuple[Path, Path]],
    layer: int,
    knobs: tuple[str, ...] | dict[str, bool | int],
    commit: str,
    unchanged: frozenset[tuple[int, int]] = frozenset(),
) -> list[dict]:
    """Per round, the layer time the variant saved per cell, after checking that each variant served `knobs` (names,
    each on; or names and values) at every cell (its choice file's rules say so, and its plan's name holds their
    segments in order) and no base did, all on one H100 at `commit`, with a clean tree. The `unchanged` cells, where
    the base already serves the variant's plan, must run the same plan in both and are left out."""
    values = dict.fromkeys(knobs, True) if isinstance(knobs, tuple) else knobs
    suffix = KdaStepPlan(12, 6288, 64, 2, **values).variant_suffix  # the plans' own names
    out = []
    for base_path, variant_path in rounds:
        base, variant = json.loads(base_path.read_text()), json.loads(variant_path.read_text())
        assert base["variant"] == {"name": "plain", "choice_files": {}}, base_path.name
        for knob, value in values.items():
            rule = f"{knob} = {str(value).lower()}"
            assert rule in variant["variant"]["choice_files"]["kda_step_choice.toml"], variant_path.name
        plans = {}
        for doc, on in ((base, False), (variant, True)):
            assert (doc["env"]["gpu"], doc["env"]["commit"][:7], doc["env"]["dirty"]) == (
                "NVIDIA H100 80GB HBM3", commit, False
            )  # fmt: skip
            for key, cell in bench.cells_by_key(doc).items():
                plans.setdefault(key, []).append(cell["kda_step_plan"])
                # the knobs' segments in the plan's name, in order (a served pair's own segments may follow them)
                named = suffix + "/" in cell["kda_step_plan"] + "/"
                assert key in unchanged or named == on, (key, cell["kda_step_plan"])
        assert all(len(set(plans[key])) == 1 for key in unchanged), {key: plans[key] for key in unchanged}
        timed, saved = bench.layer_savings(base, variant)
        assert timed == layer, variant_path.name
        out.append({key: us for key, us in saved.items() if key not in unchanged})
    return out


def lean_savings(rounds: list[tuple[Path, Path]], layer: int) -> list[dict[tuple[int, int], float]]:
    return knob_savings(rounds, layer, ("lean_start",), "326f26f")


def paired_model_savings(on_six: list[dict], on_late: list[dict]) -> dict[tuple[int, int], list[float | None]]:
    """Per (TP, batch) timed on both layers, round i of each paired: each layer's saving times the KDA layers it
    stands for, summed (bench.model_round_savings: 9 for layer 6, 60 for layer 86)."""

    def by_cell(rounds: list[dict]) -> dict[tuple[int, int], list[float | None]]:
        return {key: [saved.get(key) for saved in rounds] for key in set().union(*rounds)}

    return bench.model_round_savings({6: by_cell(on_six), LATE_LAYER: by_cell(on_late)}, K3)


def model_verdicts(on_six: list[dict], on_late: list[list[dict]]) -> dict[tuple[int, int], bool]:
    """Per (TP, batch) timed: whether the variant saved model time in every round (paired_model_savings) where both
    stacks were timed; where only one was, that stack's rounds, which cannot serve it alone (the step's rules are
    judged on both)."""
    verdicts = {key: False for saved in on_six for key in saved}  # layer 6 alone never serves
    for rounds in on_late:
        verdicts |= {key: False for saved in rounds for key in saved}
        model = paired_model_savings(on_six, rounds)
        verdicts |= {key: bench.every_round(per_round) == "saved in every round" for key, per_round in model.items()}
    return verdicts


def lean_verdicts(six: list[tuple[Path, Path]], late: list[list[tuple[Path, Path]]]) -> dict[tuple[int, int], bool]:
    return model_verdicts(lean_savings(six, 6), [lean_savings(rounds, LATE_LAYER) for rounds in late])


def lean_problems(verdicts: dict[tuple[int, int], bool], choice: Path | None = None) -> list[str]:
    return [
        f"TP{tp} B{batch}: the lean start {'saved in every round but is not' if won else 'is'} served"
        for (tp, batch), won in sorted(verdicts.items())
        if chosen_variant(K3.shard(tp).kda_heads, batch, choice).lean_start != won
    ]


def test_the_lean_start_is_served_exactly_where_it_saved_model_time_in_every_round():
    """Only TP8 B64 saved on both stacks in every round (+0.25 to +1.62 us on layer 6, +2.34 to +3.58 on layer 86) and
    is served; TP8 B32 saved on layer 6 but lost model time in the round where layer 86 lost 0.72 us; TP8 B48 and B56
    (layer 86 only) were mixed; TP8 B16 and TP16 B32-B64 lost on layer 6. Between the timed batches nothing else is."""
    verdicts = lean_verdicts(LEAN_SIX_ROUNDS, [LEAN_LATE_ROUNDS, LEAN_LATE_48_ROUNDS])
    assert set(verdicts) == {(tp, b) for tp in (8, 16) for b in (16, 32, 64)} | {(8, 48), (8, 56)}
    assert {key for key, won in verdicts.items() if won} == {(8, 64)}
    assert lean_problems(verdicts) == []
    for tp in (8, 16):
        heads = K3.shard(tp).kda_heads
        # TP16 B2 from the rounds at B1-B8 (test_the_lean_start_at_b1_to_b8_is_served_exactly_where_...)
        assert [b for b in range(1, 65) if chosen_variant(heads, b).lean_start] == ([64] if tp == 8 else [2])


def test_rounds_where_the_lean_start_lost_at_tp8_b64_take_it_away(tmp_path):
    """Broken case: layer 86's rounds with B64's gains mirrored into losses; the weighted verdict at TP8 B64 flips and
    the served rule no longer matches."""
    mirrored = mirrored_rounds(LEAN_LATE_ROUNDS, tmp_path, lambda key: key[1] == 64)
    verdicts = lean_verdicts(LEAN_SIX_ROUNDS, [mirrored, LEAN_LATE_48_ROUNDS])
    assert not verdicts[(8, 64)]
    assert lean_problems(verdicts) == ["TP8 B64: the lean start is served"]


def savings_by_commit(
    rounds: list[tuple[Path, Path]], commits: Iterable[str], late: bool, knobs: tuple[str, ...] | dict[str, bool | int]
) -> list[dict[tuple[int, int], float]]:
    """knob_savings of each round at its own commit (rounds taken in sessions apart)."""
    layer = LATE_LAYER if late else 6
    pairs = zip(rounds, commits, strict=True)
    return [saved for pair, commit in pairs for saved in knob_savings([pair], layer, knobs, commit)]


@dataclass(frozen=True)
class RoundSet:
    """Rounds of one variant against the tree on layer 6 (`stem`-base-i / `stem`-i) and layer 86 (`stem`-late-...),
    round i taken at commits[i] (late_commits[i] on layer 86 where its rounds ran at other commits)."""

    stem: str
    knobs: tuple[str, ...]
    commits: dict[int, str]
    late_commits: dict[int, str] | None = None
    cells: frozenset[tuple[int, int]] | None = None  # every round times exactly these, where given

    def commits_of(self, late: bool) -> dict[int, str]:
        return self.late_commits if late and self.late_commits else self.commits

    def rounds(self, late: bool) -> list[tuple[Path, Path]]:
        return _rounds(f"{self.stem}-late" if late else self.stem, self.commits_of(late))

    def savings(self, late: bool, rounds: list[tuple[Path, Path]] | None = None) -> list[dict[tuple[int, int], float]]:
        """Per round (`rounds`, else the committed ones of that layer), the layer time the variant saved per cell,
        each round checked at its own commit (savings_by_commit)."""
        saved = savings_by_commit(rounds or self.rounds(late), self.commits_of(late).values(), late, self.knobs)
        assert self.cells is None or all(set(cells) == self.cells for cells in saved)
        return saved

    def verdicts(self, late: list[tuple[Path, Path]] | None = None) -> dict[tuple[int, int], bool]:
        """Model-time verdicts of the rounds (`late`: other layer-86 rounds in place of the committed ones)."""
        return model_verdicts(self.savings(False), [self.savings(True, late)])


# One H100, five rounds of 60 at B1-B8, both TP sizes and layers: the lean start added to the served tree of 4f0836b
# (on the pair at TP8 B8 and TP16 B1, alone elsewhere) against that tree; rounds 1-2 at 4f0836b, rounds 3-5 at
# 278ab2b (the same kernels and choice: only tests and builds changed between them).
LEAN_SMALL = RoundSet(
    "step-lean-small",
    ("lean_start",),
    {1: "4f0836b", 2: "4f0836b", 3: "278ab2b", 4: "278ab2b", 5: "278ab2b"},
    cells=frozenset((tp, b) for tp in (8, 16) for b in (1, 2, 4, 8)),
)


def test_the_lean_start_at_b1_to_b8_is_served_exactly_where_it_saved_model_time_in_five_rounds():
    """TP16 B2 saved model time in every one of five rounds (layer 86 +0.11 to +0.90 us in each, outweighing layer 6's
    -0.87 in round 5) and is served there, beside no other knob; TP8 B1 and B8, which saved in the first two rounds,
    lost in later ones (TP8 B8 on layer 86 in rounds 3-5, beside the pair): served at no other batch of B1-B8."""
    six, late = LEAN_SMALL.savings(False), LEAN_SMALL.savings(True)
    assert [round(saved[(16, 2)], 2) for saved in late] == [0.13, 0.9, 0.72, 0.11, 0.35]
    assert [round(saved[(8, 8)], 2) for saved in late] == [0.98, 0.99, -0.19, -0.04, -0.55]
    verdicts = model_verdicts(six, [late])
    assert {key for key, won in verdicts.items() if won} == {(16, 2)}
    assert lean_problems(verdicts) == []
    # the rounds where each cell lost model time, as docs/kda-layer-h200.md's table of these rounds quotes them
    model = paired_model_savings(six, late)
    lost = {key: [i + 1 for i, us in enumerate(per_round) if us < 0] for key, per_round in model.items()}
    assert lost == {
        (8, 1): [4, 5], (8, 2): [1, 2, 4], (8, 4): [2, 4, 5], (8, 8): [3, 5],
        (16, 1): [2, 5], (16, 2): [], (16, 4): [2, 4], (16, 8): [1, 3, 4, 5],
    }  # fmt: skip
    served = chosen_variant(K3.shard(16).kda_heads, 2)
    assert served.lean_start and not (served.wide_warps or served.lean_conv or served.local_decays)
    assert [b for b in range(1, 9) if chosen_variant(K3.shard(8).kda_heads, b).lean_start] == []
    assert [b for b in range(1, 9) if chosen_variant(K3.shard(16).kda_heads, b).lean_start] == [2]


def test_lean_start_rounds_where_tp16_b2_lost_on_layer_86_take_it_away(tmp_path):
    """Broken case: layer 86's rounds with TP16 B2's gains mirrored into losses; its weighted verdict flips and the
    served rule no longer matches the rounds."""
    mirrored = mirrored_rounds(LEAN_SMALL.rounds(True), tmp_path, lambda key: key == (16, 2))
    verdicts = LEAN_SMALL.verdicts(mirrored)
    assert not any(verdicts.values())
    assert lean_problems(verdicts) == ["TP16 B2: the lean start is served"]


# One H100 at ec00445, against the tree, joint sums on every rule and the default (`joint_sums = true`): layer 6 at
# B16-B64, three rounds of 60, and layer 86 at B32 and B64, two rounds.
JOINT_SIX_ROUNDS = _rounds("step-joint-sums")
JOINT_LATE_ROUNDS = [
    (RESULTS / f"kda-layer-variants-h100/step-joint-sums-late-base-{i}.json",
     RESULTS / f"kda-layer-variants-h100/step-joint-sums-late-{i}.json")
    for i in (1, 2)
]  # fmt: skip


def test_joint_sums_are_served_nowhere_because_they_saved_in_no_cell():
    """Twenty shuffles and 28 adds fewer a warp, the same bits, and yet slower: layer 6 lost in every round at TP8
    B16-B64 (B16 -1.32, -0.77, -0.78 us) and was mixed or lost at TP16; layer 86 saved in no cell in every round."""
    six = knob_verdicts(JOINT_SIX_ROUNDS, "joint_sums", 6)
    late = knob_verdicts(JOINT_LATE_ROUNDS, "joint_sums", LATE_LAYER)
    assert set(six) == {(tp, b) for tp in (8, 16) for b in (16, 32, 64)}
    assert set(late) == {(tp, b) for tp in (8, 16) for b in (32, 64)}
    assert "saved in every round" not in {*six.values(), *late.values()}
    assert [six[(8, b)] for b in (16, 32, 64)] == ["lost in every round"] * 3
    assert knob_problems(six, "joint_sums") == knob_problems(late, "joint_sums") == []
    default, rules = variant_rules()
    assert not default.joint_sums and not any(r.variant.joint_sums for r in rules)


def test_a_choice_serving_joint_sums_contradicts_the_rounds(tmp_path):
    """Broken case: the choice the rounds ran, served; every measured cell is named on both layers."""
    served = REPO / "k3_decode/kernels/kda_step_choice.toml"
    text = served.read_text().replace("lean_conv = true, wide_warps = true }", "joint_sums = true }")
    text = text.replace("warm_ahead = false }", "warm_ahead = false, joint_sums = true }")
    choice = tmp_path / "kda_step_choice.toml"
    choice.write_text(text.replace("lean_start = true }", "lean_start = true, joint_sums = true }"))
    assert chosen_variant(12, 64, choice).joint_sums and chosen_variant(6, 16, choice).joint_sums
    six = knob_problems(knob_verdicts(JOINT_SIX_ROUNDS, "joint_sums", 6), "joint_sums", choice)
    late = knob_problems(knob_verdicts(JOINT_LATE_ROUNDS, "joint_sums", LATE_LAYER), "joint_sums", choice)
    assert len(six) == 6 and len(late) == 4, (six, late)


# One H100 at aec1ce9, three rounds of 60 against the tree (one shared base per round on layer 6 at B16 and B64), wide
# warps and the lean conv on every rule and the default at 1024 threads: layer 6 at B16 and B64 (and B32 in its own
# pairs), layer 86 at B16-B64; wide warps alone on layer 6 at B16 and B64 against the same bases.
WIDE_DIR = RESULTS / "kda-layer-variants-h100"
WIDE_LEAN_CONV_SIX = [
    [(WIDE_DIR / f"step-knobs-base-{i}.json", WIDE_DIR / f"step-wide-lean-conv-{i}.json") for i in (1, 2, 3)],
    [
        (WIDE_DIR / f"step-wide-lean-conv-b32-base-{i}.json", WIDE_DIR / f"step-wide-lean-conv-b32-{i}.json")
        for i in (1, 2, 3)
    ],
]
WIDE_LEAN_CONV_LATE = [
    (WIDE_DIR / f"step-wide-lean-conv-late-base-{i}.json", WIDE_DIR / f"step-wide-lean-conv-late-{i}.json")
    for i in (1, 2, 3)
]
WIDE_ALONE_SIX = [(WIDE_DIR / f"step-knobs-base-{i}.json", WIDE_DIR / f"step-wide-warps-{i}.json") for i in (1, 2, 3)]
WIDE_LEAN_CONV_SERVED = {(8, 16), (16, 32), (8, 64), (8, 8), (16, 1), (8, 6), (8, 7)}
# One H100 at ebd4bcb, three rounds of 60 against the served tree (TP8 B64: 1536 threads and the lean start) on
# layers 6 and 86 at TP8 and TP16 B32 and B64: the pair (step-cap-pair, step-cap-late-pair) and the pair held to three
# CTAs an SM (step-cap, step-cap-late), each round timing the base, the cap and the pair in turn. TP16 B32 already
# serves the pair, uncapped (the cap does not bind there): the same plan in all three, left out.
CAP_COMMIT = "ebd4bcb"
PAIR_AGAIN = {(8, 32), (8, 64), (16, 64)}  # the pair's cells these rounds time again, against the served tree
CAPPED_KNOBS = {**dict.fromkeys(PAIRED_KNOBS, True), "max_ctas_per_sm": 3}


def cap_rounds(variant: str, late: bool) -> list[tuple[Path, Path]]:
    stem = "step-cap-late" if late else "step-cap"
    return [(WIDE_DIR / f"{stem}-base-{i}.json", WIDE_DIR / f"{stem}{variant}-{i}.json") for i in (1, 2, 3)]


# One H100, four rounds of 60 against the tree at B1-B8, both TP sizes, the pair on a rule at B1-B8: round 1 at
# eaf08f2, rounds 2-4 at fe9509a (the same kernels), layers 6 and 86 (step-small-*, step-small-late-*).
SMALL = RoundSet("step-small", PAIRED_KNOBS, {1: "eaf08f2", 2: "fe9509a", 3: "fe9509a", 4: "fe9509a"})


def session_verdicts(variant: str, knobs: dict[str, bool | int], late: list[tuple[Path, Path]] | None = None):
    """Model-time verdicts of this session's rounds of `variant` ("" the cap, "-pair" the pair) against the tree."""
    six = knob_savings(cap_rounds(variant, False), 6, knobs, CAP_COMMIT, frozenset({(16, 32)}))
    on_late = knob_savings(late or cap_rounds(variant, True), LATE_LAYER, knobs, CAP_COMMIT, frozenset({(16, 32)}))
    return model_verdicts(six, [on_late])


def wide_lean_conv_verdicts(
    late: list[tuple[Path, Path]],
    late_again: list[tuple[Path, Path]] | None = None,
    late_small: list[tuple[Path, Path]] | None = None,
    late_b5_7: list[tuple[Path, Path]] | None = None,
) -> dict[tuple[int, int], bool]:
    """The pair's verdict per cell: at aec1ce9 (against the tree at 1024 threads), where the rounds at ebd4bcb
    timed it again against the served tree, theirs (the served tree is what a rule replaces), at B1-B8 the
    small-batch rounds', and at TP8 B5-B7 theirs."""
    six_sets = [knob_savings(rounds, 6, PAIRED_KNOBS, "aec1ce9") for rounds in WIDE_LEAN_CONV_SIX]
    on_six = [{k: v for saved in per_round for k, v in saved.items()} for per_round in zip(*six_sets, strict=True)]
    first = model_verdicts(on_six, [knob_savings(late, LATE_LAYER, PAIRED_KNOBS, "aec1ce9")])
    again = session_verdicts("-pair", dict.fromkeys(PAIRED_KNOBS, True), late_again)
    assert set(again) == PAIR_AGAIN
    small = SMALL.verdicts(late_small)
    assert set(small) == {(tp, b) for tp in (8, 16) for b in (1, 2, 4, 8)}
    return first | again | small | PAIR_B5_7.verdicts(late_b5_7)


def paired_problems(verdicts: dict[tuple[int, int], bool], choice: Path | None = None) -> list[str]:
    """Where the choice file serves wide warps and the lean conv otherwise than the rounds decided: both where they
    saved model time in every round (at 1024 threads, what the rounds ran), neither elsewhere."""
    out = []
    for (tp, batch), won in sorted(verdicts.items()):
        served = chosen_variant(K3.shard(tp).kda_heads, batch, choice)
        pair = (served.lean_conv, served.wide_warps, served.resident_threads if served.wide_warps else None)
        if pair != ((True, True, 1024) if won else (False, False, None)):
            out.append(f"TP{tp} B{batch}: {'saved in every round' if won else 'did not save'} but served {pair}")
    return out


def test_wide_warps_and_the_lean_conv_are_served_exactly_where_they_saved_model_time_in_every_round():
    """At aec1ce9 TP8 B16 (+1.10 to +1.79 us on layer 6, -0.13 to +0.27 on layer 86) and TP16 B32 (+0.03 to +1.10,
    +1.34 to +2.00) saved model time in every round, TP16 B16 lost it in one. Timed again at ebd4bcb against the
    served tree, TP8 B64 saved it in every round (+0.75 to +1.36 on layer 6, +1.57 to +3.87 on layer 86; at aec1ce9,
    against 1024 threads, it was mixed) and TP8 B32 and TP16 B64 did not, as before. Served exactly at the three
    winners, at 1024 threads. At B1-B8, four rounds on both layers: TP8 B8 (+1.72 to +2.08 us on layer 6, +0.03 to
    +1.98 on layer 86) and TP16 B1 (-0.28 to +0.26, +0.16 to +0.66) saved model time in every round and are served;
    TP16 B8 lost it in round 1, the other cells in one round or more; at TP8 B5-B7, four rounds on both layers: B6 and
    B7 saved it in every round and are served, B5 lost it in round 2. Between and beyond the timed batches nothing
    serves either knob, and wide warps alone (layer 6 only: TP8 B16 and B64 saved, TP16 mixed or lost) serve nowhere."""
    verdicts = wide_lean_conv_verdicts(WIDE_LEAN_CONV_LATE)
    assert set(verdicts) == {(tp, b) for tp in (8, 16) for b in (1, 2, 4, 8, 16, 32, 64)} | {(8, 5), (8, 6), (8, 7)}
    assert {key for key, won in verdicts.items() if won} == WIDE_LEAN_CONV_SERVED
    assert paired_problems(verdicts) == []
    for tp in (8, 16):
        heads = K3.shard(tp).kda_heads
        both = {b for b in range(1, 65) if chosen_variant(heads, b).wide_warps or chosen_variant(heads, b).lean_conv}
        assert both == {b for t, b in WIDE_LEAN_CONV_SERVED if t == tp}
    alone = knob_savings(WIDE_ALONE_SIX, 6, ("wide_warps",), "aec1ce9")
    assert [round(saved[(8, 16)], 2) for saved in alone] == [1.28, 0.89, 0.45]
    assert min(saved[(16, 64)] for saved in alone) < 0  # and the late stack was not timed: it cannot serve alone


def test_rounds_where_the_pair_lost_at_tp16_b32_take_it_away(tmp_path):
    """Broken case: layer 86's rounds with TP16 B32's gains mirrored into losses; the weighted verdict there flips
    and the served rule no longer matches, while TP8 B16 still does."""
    mirrored = mirrored_rounds(WIDE_LEAN_CONV_LATE, tmp_path, lambda key: key == (16, 32))
    verdicts = wide_lean_conv_verdicts(mirrored)
    assert not verdicts[(16, 32)] and verdicts[(8, 16)]
    assert paired_problems(verdicts) == ["TP16 B32: did not save but served (True, True, 1024)"]


def test_rounds_where_the_pair_lost_at_tp8_b64_take_it_away(tmp_path):
    """Broken case: the later rounds' layer 86 with TP8 B64's gains mirrored into losses; the verdict the served
    tree's rounds give there flips, whatever the earlier rounds said, and the served rule no longer matches."""
    mirrored = mirrored_rounds(cap_rounds("-pair", True), tmp_path, lambda key: key == (8, 64))
    verdicts = wide_lean_conv_verdicts(WIDE_LEAN_CONV_LATE, mirrored)
    assert not verdicts[(8, 64)] and verdicts[(8, 16)] and verdicts[(16, 32)]
    assert paired_problems(verdicts) == ["TP8 B64: did not save but served (True, True, 1024)"]


def test_rounds_where_the_pair_lost_at_tp16_b1_take_it_away(tmp_path):
    """Broken case: the small-batch rounds' layer 86 with TP16 B1's gains mirrored into losses; the verdict there
    flips and the served rule no longer matches, while TP8 B8 still does."""
    mirrored = mirrored_rounds(SMALL.rounds(True), tmp_path, lambda key: key == (16, 1))
    verdicts = wide_lean_conv_verdicts(WIDE_LEAN_CONV_LATE, late_small=mirrored)
    assert not verdicts[(16, 1)] and verdicts[(8, 8)]
    assert paired_problems(verdicts) == ["TP16 B1: did not save but served (True, True, 1024)"]


def test_the_small_batch_rounds_are_the_ones_the_choice_file_quotes():
    """The layer time each round saved, as kda_step_choice.toml's comment quotes it (layer 6 / layer 86, round 1 at
    eaf08f2): a round recomputed differently, or a results file swapped, fails here."""
    quoted = {
        (8, 8): ([1.72, 1.73, 2.08, 2.03], [0.03, 1.35, 1.98, 1.93]),
        (16, 1): ([0.03, -0.28, 0.18, 0.26], [0.56, 0.16, 0.35, 0.66]),
        (16, 8): ([0.22, 0.43, 0.28, 0.56], [-0.07, 0.13, 0.11, 0.25]),
    }
    for late in (False, True):
        saved = SMALL.savings(late)
        for key, both in quoted.items():
            assert [round(s[key], 2) for s in saved] == both[late], (key, late)


# One H100, the pair on a rule at TP8 B5-B7 against the tree (clusters of 4 at B5, of 2 at B6 and B7, as at the served
# B8), four rounds of 60 on layers 6 and 86 (step-pair-b5-7-*, step-pair-b5-7-late-*): layer 6 rounds 1-2 and layer 86
# round 1 at 4736f0e, the rest at 7c5690a (the same kernels and choice: tests, tools and docs changed between them).
PAIR_B5_7 = RoundSet(
    "step-pair-b5-7",
    PAIRED_KNOBS,
    {1: "4736f0e", 2: "4736f0e", 3: "7c5690a", 4: "7c5690a"},
    late_commits={1: "4736f0e", 2: "7c5690a", 3: "7c5690a", 4: "7c5690a"},
    cells=frozenset((8, b) for b in (5, 6, 7)),
)


def test_the_pair_at_tp8_b5_to_b7_rounds_are_the_ones_the_choice_file_quotes():
    """The layer time each round saved, as kda_step_choice.toml's comment quotes it (layer 6 / layer 86): a round
    recomputed differently, or a results file swapped, fails here."""
    quoted = {
        (8, 5): ([0.01, 0.91, 0.83, 0.03], [0.08, -0.96, 0.37, 0.93]),
        (8, 6): ([3.18, 3.12, 2.51, 1.85], [1.66, 1.78, 1.62, 1.26]),
        (8, 7): ([2.44, 2.26, 2.60, 1.60], [1.31, 0.84, 1.79, 1.48]),
    }
    for late in (False, True):
        saved = PAIR_B5_7.savings(late)
        assert {key: [round(s[key], 2) for s in saved] for key in quoted} == {k: v[late] for k, v in quoted.items()}
    text = (REPO / "k3_decode/kernels/kda_step_choice.toml").read_text()
    quoted_text = " ".join(line.lstrip("# ") for line in text.splitlines())
    for (_, batch), (six, late) in quoted.items():
        signed = [", ".join(f"{us:+.2f}" for us in rounds) for rounds in (six, late)]
        assert f"B{batch} {signed[0]} / {signed[1]}" in quoted_text, batch


def pair_b5_7_doc_rows(six: list[dict], late: list[dict]) -> list[str]:
    """The rows of docs/kda-layer-h200.md's table of these rounds: each layer's savings, then the model time where it
    saved in every round, else the first round that lost it."""
    model = paired_model_savings(six, late)
    rows = []
    for key in sorted(model):
        signed = [" ".join(f"{s[key]:+.2f}" for s in rounds) for rounds in (six, late)]
        per_round = model[key]
        lost = next((i for i, us in enumerate(per_round, 1) if us <= 0), None)
        verdict = (
            f"lost in round {lost} ({per_round[lost - 1]:.1f})"
            if lost
            else "**" + ", ".join(f"{us:+.1f}" for us in per_round) + "**"
        )
        rows.append(f"| {key[0]} {key[1]} | {signed[0]} | {signed[1]} | {verdict} |")
    return rows


def test_the_docs_table_of_the_pair_at_tp8_b5_to_b7_is_the_rounds():
    """docs/kda-layer-h200.md quotes these rounds row for row; a misquoted row fails (broken case below)."""
    doc = (REPO / "docs/kda-layer-h200.md").read_text().splitlines()
    six, late = PAIR_B5_7.savings(False), PAIR_B5_7.savings(True)
    rows = pair_b5_7_doc_rows(six, late)
    assert len(rows) == 3 and all(row in doc for row in rows), rows
    broken = [s | {(8, 6): -s[(8, 6)]} for s in late]
    assert not any(row in doc for row in pair_b5_7_doc_rows(six, broken) if "| 8 6 |" in row)


def test_the_pair_is_served_at_tp8_b6_and_b7_where_it_saved_model_time_in_every_round_and_not_at_b5():
    """B6 (+1.85 to +3.18 us a layer on layer 6, +1.26 to +1.78 on layer 86) and B7 (+1.60 to +2.60, +0.84 to +1.79)
    saved model time in every round, as B8 does at the same cluster: served on B8's rule, which now starts at B6. B5
    (clusters of 4, as at B4, where the pair was mixed) lost model time in round 2 (layer 86 -0.96 us): not served."""
    verdicts = PAIR_B5_7.verdicts()
    assert verdicts == {(8, 5): False, (8, 6): True, (8, 7): True}
    assert paired_problems(verdicts) == []
    heads = K3.shard(8).kda_heads
    served = [chosen_variant(heads, b) for b in (6, 7, 8)]
    assert all(v == served[-1] for v in served)  # one rule, B8's


def test_rounds_where_the_pair_lost_at_tp8_b6_take_it_away(tmp_path):
    """Broken case: layer 86's rounds with B6's gains mirrored into losses; the verdict there flips and the served rule
    no longer matches, while B7 still does."""
    mirrored = mirrored_rounds(PAIR_B5_7.rounds(True), tmp_path, lambda key: key == (8, 6))
    verdicts = PAIR_B5_7.verdicts(mirrored)
    assert not verdicts[(8, 6)] and verdicts[(8, 7)]
    assert paired_problems(verdicts) == ["TP8 B6: did not save but served (True, True, 1024)"]


def test_the_cap_is_served_nowhere_and_beat_the_uncapped_pair_only_at_tp16_b64():
    """The pair held to three CTAs an SM (max_ctas_per_sm = 3: two waves of three where four an SM leave a second
    wave of 1.8) against the served tree saved model time in every round only at TP8 B64, where the uncapped pair
    (served there) beat it in every round; TP8 B32 lost in some round and TP16 B64 was mixed. Against the uncapped
    pair in the same rounds the cap saved on both layers in every round at TP16 B64 (layer 6 +1.11 to +2.20 us, layer
    86 +1.27 to +3.71), as three an SM should on a grid of 768 CTAs, but not at TP8 B32, which has as many: the
    wave count alone does not decide. Nothing serves it."""
    verdicts = session_verdicts("", CAPPED_KNOBS)
    assert verdicts == {(8, 32): False, (8, 64): True, (16, 64): False}
    against_pair = {}
    for late in (False, True):
        caps, pairs = cap_rounds("", late), cap_rounds("-pair", late)
        rounds = [(pair, cap) for (_, cap), (_, pair) in zip(caps, pairs, strict=True)]
        saved = [bench.layer_savings(json.loads(p.read_text()), json.loads(c.read_text()))[1] for p, c in rounds]
        against_pair[late] = {key: [round(s[key], 2) for s in saved] for key in PAIR_AGAIN}
    assert all(us > 1 for late in (False, True) for us in against_pair[late][(16, 64)]), against_pair
    assert all(us < 0 for us in against_pair[True][(8, 64)]) and max(against_pair[True][(8, 32)]) > 0 > min(
        against_pair[True][(8, 32)]
    )
    for tp in (8, 16):
        heads = K3.shard(tp).kda_heads
        assert not any(chosen_variant(heads, b).max_ctas_per_sm for b in range(1, 65))


def test_a_choice_serving_the_pair_at_the_tp8_budget_rule_contradicts_the_rounds(tmp_path):
    """Broken case: the pair served on TP8's B16-B64 rule (at 1536 threads, as that rule has it) instead of its own:
    B32 did not save, and B16 saved at 1024 threads, not 1536; both are named (B64 keeps its own rule, which comes
    first)."""
    served = REPO / "k3_decode/kernels/kda_step_choice.toml"
    budget_rule = "{ heads = 12, batches = [16, 64], resident_threads = 1536, warm_ahead = false"
    text = served.read_text().replace(budget_rule + " }", budget_rule + ", lean_conv = true, wide_warps = true }")
    text = text.replace(
        "{ heads = 12, batches = [16, 16], resident_threads = 1024,",
        "{ heads = 12, batches = [3, 3], resident_threads = 1024,",  # a batch no round timed
    )
    choice = tmp_path / "kda_step_choice.toml"
    choice.write_text(text)
    problems = paired_problems(wide_lean_conv_verdicts(WIDE_LEAN_CONV_LATE), choice)
    assert [p.split(":")[0] for p in problems] == ["TP8 B16", "TP8 B32"], problems
