"""The runtime isolation suite on the CPU: the shipped stock path passes and says what it could not run; an honest
test-double provider passes too (the control of the red team); a cell whose specialized path falls back to stock
unexpectedly fails; the data file is checked."""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources

import pytest

from harness.isolation.runtime import timeline, to_records
from harness.verdicts import Verdict, derive_verdict
from k3_decode.isolation_redteam import RedTeamKdaProvider, private_scope, suite_for
from k3_decode.isolation_suite import K3IsolationSuite, SuiteDataError, describe_writes, parse_data, suite_data
from k3_decode.runtime.audit import Change
from k3_decode.runtime.ledger import Ledger
from k3_decode.runtime.optable import OpTable
from k3_decode.runtime.writeset import Region, WriteSet
from tests.k3_decode.executor.helpers import LayerLimitedKda

CELLS = [c.name for c in suite_data().cells]
SPECULATIVE = suite_data().speculative
assert SPECULATIVE is not None
VERIFY_RUN = f"q{1 + SPECULATIVE.num_speculative_tokens}"  # the speculative runs' name suffix


def _run(suite: K3IsolationSuite):
    evidence = suite.run(lambda what, done: None)
    return evidence, to_records("isolation", evidence)


@pytest.fixture(scope="module")
def stock():
    return _run(K3IsolationSuite("k3-hopper", "k3-mini", (1,), "cpu"))


def test_the_stock_path_passes_every_check_of_every_eager_cell(stock):
    evidence, records = stock
    assert derive_verdict(records.to_json()).verdict is Verdict.PASSED, [c.name for c in records.checks]
    names = [c.name for c in evidence.checks]
    for cell in ("prefill", "decode", "decode-single", "mixed"):
        assert sum(n.startswith(f"tp1 auto {cell} step ") for n in names) == 1, names
        assert f"tp1 auto {cell}: the dispatch ledger shows the expected stock path" in names
    assert "tp1 auto: weights bit-identical after every step" in names
    assert "tp1 auto: every op the executor ran is the path its ledger records (op log)" in names
    assert not any("provider calls" in n for n in names)  # no provider ran, so the probe proves nothing here
    for cell in SPECULATIVE.cells:
        assert sum(n.startswith(f"tp1 auto {VERIFY_RUN} {cell.name} step ") for n in names) == 1, names
    assert f"tp1 auto {VERIFY_RUN}: every op the executor ran is the path its ledger records (op log)" in names


def test_the_evidence_says_where_the_time_went(stock):
    """Seconds per TP's weights and per run's start-up, cells and closing checks: on a GPU the stage takes minutes,
    and these say which part to make faster. A run start-up refuses has no cells timed."""
    evidence, _ = stock
    seconds = evidence.metrics["seconds"]
    assert set(seconds) == {"weights tp1", "tp1 auto", f"tp1 auto {VERIFY_RUN}", "tp1 latency_specialized",
                            f"tp1 latency_specialized {VERIFY_RUN}"}  # fmt: skip
    assert set(seconds["tp1 auto"]) == {"start", "cells", "finish"}
    assert list(seconds["tp1 auto"]["cells"]) == CELLS  # the graph cell too: it is timed, and says why it cannot run
    assert list(seconds[f"tp1 auto {VERIFY_RUN}"]["cells"]) == [c.name for c in SPECULATIVE.cells]
    assert seconds["tp1 latency_specialized"] == {"cells": {}, "start": seconds["tp1 latency_specialized"]["start"]}
    timed = [seconds["weights tp1"]] + [
        t for run in seconds.values() if isinstance(run, dict) for t in (run.get("start", 0.0), run.get("finish", 0.0))
    ]
    timed += [t for run in seconds.values() if isinstance(run, dict) for t in run["cells"].values()]
    assert all(isinstance(t, float) and t >= 0 for t in timed), seconds
    assert sum(seconds["tp1 auto"]["cells"].values()) > 0  # eager steps of a real stack take time


def test_the_speculative_run_makes_verify_steps_with_the_cells_accepted_counts(stock):
    """The verify cells run as verify steps: q tokens per request in the ledger, the stock kda_verify in the op log
    (so the specialized path's verify body is what a GPU run reaches), and each request's q slots written."""
    evidence, _ = stock
    run = next(r for r in evidence.runs if r.name == f"tp1 auto {VERIFY_RUN}")
    ledger = Ledger.from_json(run.ledger)
    q = 1 + SPECULATIVE.num_speculative_tokens
    verify_steps = [s for s, c in run.cells.items() if c.startswith("verify")]
    assert len(verify_steps) == sum(c.kind == "verify" for c in SPECULATIVE.cells) >= 2
    for cell in (c for c in SPECULATIVE.cells if c.kind == "verify"):
        (step,) = [s for s, c in run.cells.items() if c == cell.name]
        records = [r for r in ledger.records() if r.step == step]
        assert {(r.tokens_per_request, r.batch) for r in records} == {(q, len(cell.verify))}
        assert all(f"num_accepted a = {list(cell.accepted)}" in r.reason for r in records)
    assert {c.accepted for c in SPECULATIVE.cells if c.kind == "verify"} != {(1,) * 2}  # counts vary
    (wrote,) = [w.wrote for w in run.steps if w.cell == "verify-single"]
    first = 1 + 3 * q  # request 3's q slots
    assert wrote.startswith(f"KDA slots {first}-{first + q - 1} of layers 4-6; MLA cache"), wrote
    assert wrote.endswith("nothing else changed"), wrote


def test_what_could_not_run_is_said_with_its_reason(stock):
    evidence, _ = stock
    not_run = {n.name: n.reason for n in evidence.not_run}
    assert not_run["tp1 auto: graph-decode cell"] == "CUDA graphs need a CUDA device; this run is on the CPU"
    every = f"tp1 latency_specialized, tp1 latency_specialized {VERIFY_RUN}: every cell"
    assert "specialized kernels are not built" in not_run[every]
    assert "the CPU has neither" in not_run["every run: device-side execution counters and profiler kernel names"]
    assert [r.name for r in evidence.runs] == ["tp1 auto", f"tp1 auto {VERIFY_RUN}"]


def test_the_ledger_evidence_is_valid_and_carries_each_cells_expectation(stock):
    evidence, _ = stock
    ledger = Ledger.from_json(evidence.runs[0].ledger)
    assert ledger.check() == []
    assert {e.by for e in ledger.expectations()} == {
        f"isolation cell {c} (tp1 auto)" for c in CELLS if c != "graph-decode"
    }
    assert evidence.runs[0].cells == {0: "prefill", 1: "decode", 2: "decode-single", 3: "mixed"}


@pytest.fixture(scope="module")
def honest():
    return _run(suite_for(RedTeamKdaProvider("honest")))


def test_an_honest_specialized_provider_passes(honest):
    """The control of the runtime red team: same deployment, same cells, a provider that breaks nothing."""
    evidence, records = honest
    assert derive_verdict(records.to_json()).verdict is Verdict.PASSED, [c.name for c in records.checks]
    names = [c.name for c in evidence.checks]
    assert "tp1 latency_specialized: no stock code ran inside the 6 specialized provider calls" in names
    summary = evidence.runs[0].ledger["summary"]["dispatches"]
    assert summary["by_op"]["kda"] == {"specialized": 6, "stock": 6}  # 3 KDA layers x 2 decode steps; prefill, mixed
    # The speculative run: every verify step's KDA layers through the provider's verify call, the prefill stock.
    verify_cells = sum(c.kind == "verify" for c in SPECULATIVE.cells)
    run = f"tp1 latency_specialized {VERIFY_RUN}"
    assert f"{run}: no stock code ran inside the {3 * verify_cells} specialized provider calls" in names
    summary = evidence.runs[1].ledger["summary"]["dispatches"]
    assert summary["by_op"]["kda"] == {"specialized": 3 * verify_cells, "stock": 3}


def test_a_per_layer_row_limit_is_expected_at_its_layer_only():
    """The provider serves one row at layer 5: the decode cell (2 rows) and the verify cells expect layer 5's KDA
    stock and layers 4 and 6 specialized, the one-row decode cell all three specialized, and the suite passes."""
    evidence, records = _run(suite_for(LayerLimitedKda("honest")))
    failed = [c.name for c in evidence.checks if not c.passed]
    assert derive_verdict(records.to_json()).verdict is Verdict.PASSED, failed
    assert evidence.runs[0].ledger["summary"]["dispatches"]["by_op"]["kda"] == {"specialized": 2 + 3, "stock": 6 + 1}
    verify_cells = sum(c.kind == "verify" for c in SPECULATIVE.cells)
    by_op = evidence.runs[1].ledger["summary"]["dispatches"]["by_op"]["kda"]
    assert by_op == {"specialized": 2 * verify_cells, "stock": 3 + verify_cells}


def test_expectations_that_ignore_a_per_layer_limit_fail(monkeypatch):
    """Broken case: the expected paths drop the per-layer limits, so the cells expect layer 5 specialized where the
    plan (which keeps them) ran it stock."""
    plain = OpTable.expected_paths

    def without_layer_limits(self, dims, layers, rows, limits, kept=(), layer_limits=None):
        return plain(self, dims, layers, rows, limits, kept)

    monkeypatch.setattr(OpTable, "expected_paths", without_layer_limits)
    evidence, records = _run(suite_for(LayerLimitedKda("honest")))
    assert derive_verdict(records.to_json()).verdict is Verdict.FAILED
    failed = [c for c in evidence.checks if not c.passed]
    assert failed and all("layer 5 kda ran stock" in str(c.detail) for c in failed)
    assert "but specialized was expected by isolation cell decode" in str(failed[0].detail)


def test_the_timeline_says_when_the_specialized_path_ran_and_why_execution_returned_to_stock(honest):
    evidence, _ = honest
    rows = timeline(evidence.runs[0])
    decode = [r for r in rows if r["cell"] == "decode"]
    assert decode[0]["event"] == "specialized path chosen" and decode[0]["where"] == "layers 4-6: kda"
    assert decode[0]["reason"].startswith("pure decode, batch 2 prepared; provider redteam-kda-honest")
    assert decode[0]["wrote"].startswith("KDA slots 1-2 of layers 4-6; MLA cache (page, row)")
    assert decode[0]["wrote"].endswith("nothing else changed")
    assert {r["event"] for r in decode[1:]} == {"returns to stock within the step"}
    assert any(r["reason"].startswith("MLA layers stay stock") for r in decode[1:])
    (mixed,) = [r for r in rows if r["cell"] == "mixed"]
    assert mixed["event"] == "returns to stock" and mixed["reason"].startswith("mixed batch (1 prefill and 1 decode")


def test_a_cell_whose_specialized_path_falls_back_to_stock_fails():
    """Broken case of proof of path: the decode cell's batch of 2 is not prepared in this deployment, so the plan
    sends it to stock while the cell expects the specialized path."""
    scope = dataclasses.replace(private_scope(), prepared_batches=(1,))
    suite = suite_for(RedTeamKdaProvider("honest"))
    suite.scope = scope
    evidence, records = _run(suite)
    assert derive_verdict(records.to_json()).verdict is Verdict.FAILED
    # The plain run's decode cell; the speculative run's verify cells of 2 x q rows are not prepared either.
    (failed,) = [
        c for c in evidence.checks if not c.passed and not c.name.startswith(f"tp1 latency_specialized {VERIFY_RUN}")
    ]
    assert (
        failed.name == "tp1 latency_specialized decode: the dispatch ledger shows the expected specialized (where "
        "the op table says) path"
    )
    assert "ran stock (reason: batch 2 not prepared (prepared rows: 1, 4)" in failed.detail
    assert "but specialized was expected by isolation cell decode (tp1 latency_specialized)" in failed.detail


def test_describe_writes_names_slots_rows_buffers_and_what_else_changed():
    declared = WriteSet(
        frozenset(
            {
                Region("layers.4.kda.recurrent", ((2, 3),)),
                Region("layers.5.kda.conv", ((1, 2), None, (0, 3))),
                Region("layers.7.mla.kv_cache", ((3, 4), (1, 2))),
                Region("scratch.eager.seq_lens"),
            }
        )
    )
    assert describe_writes(declared, []) == (
        "KDA slots 1-2 of layers 4-5; MLA cache (page, row) (3, 1) of layer 7; step buffers of eager; nothing else "
        "changed"
    )
    stray = Change("layers.4.kda.recurrent", ((5, 6), (0, 8)), 64)
    assert describe_writes(declared, [stray]).endswith(
        "ALSO CHANGED outside the write set: layers.4.kda.recurrent[5:6, 0:8]: 64 elements changed outside the "
        "declared write set"
    )


def _raw() -> dict:
    return tomllib.loads(resources.files("k3_decode").joinpath("isolation_suite.toml").read_text())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw["audit"].update(cuda="hash"), r"methods \{'cuda': 'hash'\} are not among"),
        (lambda raw: raw.update(backends=["fast"]), "must be decode backends"),
        (lambda raw: raw.update(cells=[]), "has no \\[\\[cells\\]\\]"),
        (lambda raw: raw["cells"][0].update(kind="verify"), r"cells\[0\]: kind 'verify' is not one of"),
        (lambda raw: raw["speculative"]["cells"][1].update(kind="decode"), r"speculative.cells\[1\]: kind 'decode'"),
        (lambda raw: raw["speculative"]["cells"][1].update(accepted=[1]), "one count >= 1 per verify request"),
        (lambda raw: raw["speculative"].update(num_speculative_tokens=0), "must be an integer >= 1"),
        (lambda raw: raw["cells"][1].update(expect="fast"), r"cells\[1\]: expect 'fast'"),
        (
            lambda raw: raw["cells"][1].update(prefill={"0": 1}),
            r"a decode cell needs prefill False, decode True and verify False",
        ),
        (lambda raw: raw["cells"][1].update(replays=2), "replays applies to graph cells only"),
        (lambda raw: raw["cells"][1].update(speed=2), r"unknown keys \['speed'\]"),
    ],
)
def test_a_malformed_data_file_is_a_one_line_error(edit, message):
    raw = _raw()
    parse_data(raw)
    edit(raw)
    with pytest.raises(SuiteDataError, match=message):
        parse_data(raw)


def test_a_model_without_a_stack_is_refused():
    with pytest.raises(SuiteDataError, match="names no stack for model 'k4'"):
        K3IsolationSuite("k3-hopper", "k4", (1,), "cpu")


def test_a_distributed_config_says_its_ranks_are_not_audited():
    from harness.config.loader import load_config

    suite = K3IsolationSuite.from_config("k3-hopper", load_config("tp8-h200"))
    assert suite.distributed and suite.tps == (8,) and suite.device.type == "cuda"
    assert not K3IsolationSuite.from_config("k3-hopper", load_config("cpu-smoke")).distributed
    evidence = K3IsolationSuite("k3-hopper", "k3-mini", (1,), "cpu", backends=("auto",), distributed=True).run(
        lambda what, done: None
    )
    (item,) = [n for n in evidence.not_run if n.name == "every run: the audit across tensor-parallel ranks"]
    assert "auditing every rank of the distributed executor (k3_decode.distributed) is not built" in item.reason
