"""The runtime half's records: checks and not-run items named as such, and the fallback timeline laid out from a
dispatch ledger (any subject's: only the ledger contract's fields are read)."""

from __future__ import annotations

import json

from harness.isolation.runtime import (
    NotRun,
    RunEvidence,
    RuntimeEvidence,
    StepWrites,
    evidence_files,
    records_parts,
    slug,
    timeline,
    to_records,
)
from harness.verdicts import Check, Verdict, derive_verdict


def _rec(step, layer, op, path, reason, graph=None):
    return {"step": step, "layer": layer, "op": op, "path": path, "reason": reason, "graph": graph}


SPEC, ATTN, MOE = "pure decode, batch 2 prepared", "attention stays stock", "the MoE stays stock"
LEDGER = {
    "records": [
        _rec(0, 0, "attn", "stock", "prefill batch"),
        _rec(0, 0, "moe", "stock", "prefill batch"),
        _rec(0, 1, "attn", "stock", "prefill batch"),
        _rec(0, 1, "moe", "stock", "prefill batch"),
        _rec(1, 0, "attn", "specialized", SPEC),
        _rec(1, 0, "moe", "stock", MOE),
        _rec(1, 1, "attn", "stock", ATTN),
        _rec(1, 1, "moe", "stock", MOE),
        _rec(2, 0, "attn", "stock", "mixed batch"),
        _rec(3, 0, "attn", "specialized", SPEC, "B4q1"),
        _rec(4, 0, "attn", "stock", "never replayed", "B8q1"),
    ],
    "replays": {"B4q1": 3},
    "summary": {"dispatches": {"by_path": {"specialized": 4, "stock": 9}}},
}
RUN = RunEvidence(
    "tp1 x",
    LEDGER,
    [
        StepWrites(0, None, "prefill", "slots 1-2"),
        StepWrites(1, None, "decode", "slot 1"),
        StepWrites(3, "B4q1", "graph", "slot 2"),
        StepWrites(3, "B4q1", "graph", "slot 3"),
    ],
    {0: "prefill", 1: "decode", 2: "mixed", 3: "graph"},
)


def test_timeline_rows_say_when_specialized_ran_and_where_and_why_it_returned_to_stock():
    rows = timeline(RUN)
    assert [(r["step"], r["event"], r["path"], r["where"], r["reason"]) for r in rows] == [
        (0, "stock", "stock", "layers 0-1: attn, moe", "prefill batch"),
        (1, "specialized path chosen", "specialized", "layer 0: attn", SPEC),
        (1, "returns to stock within the step", "stock", "layers 0-1: moe", MOE),
        (1, "returns to stock within the step", "stock", "layer 1: attn", ATTN),
        (2, "returns to stock", "stock", "layer 0: attn", "mixed batch"),
        (3, "specialized path chosen", "specialized", "layer 0: attn", SPEC),
        (4, "returns to stock", "stock", "layer 0: attn", "never replayed"),
    ]
    assert [r["mode"] for r in rows][4:] == ["eager", "graph B4q1: 3 replays", "graph B8q1: captured, never replayed"]
    assert [r["wrote"] for r in rows] == ["slots 1-2", "slot 1", "", "", "", "slot 2 | slot 3", ""]
    assert [r["cell"] for r in rows] == ["prefill", "decode", "decode", "decode", "mixed", "graph", ""]


def test_records_name_the_runtime_half_and_keep_not_run_items_out_of_the_checks():
    evidence = RuntimeEvidence(
        [Check("tp1 x decode step 1: nothing changed", 0, "==", 0)],
        [NotRun("graph cell", "no CUDA")],
        [RUN],
        {"device": "cpu"},
    )
    checks, metrics = records_parts(evidence)
    assert [c.name for c in checks] == ["runtime: tp1 x decode step 1: nothing changed"]
    assert metrics["not_run"] == [{"name": "runtime: graph cell", "reason": "no CUDA"}]
    assert metrics["runtime"]["runs"] == {"tp1 x": {"specialized": 4, "stock": 9}}
    assert metrics["runtime"]["device"] == "cpu"
    assert metrics["timelines"][0]["title"] == "Fallback timeline: tp1 x"
    files = evidence_files(evidence)
    assert sorted(files) == ["ledger-tp1-x.json", "timeline.json"]
    assert json.loads(files["ledger-tp1-x.json"]) == LEDGER
    assert derive_verdict(to_records("isolation", evidence).to_json()).verdict is Verdict.PASSED


def test_a_failed_runtime_check_fails_and_an_unavailable_suite_is_not_run():
    failing = RuntimeEvidence([Check("write set", 2, "==", 0)], [], [])
    assert derive_verdict(to_records("isolation", failing).to_json()).verdict is Verdict.FAILED
    nothing = RuntimeEvidence([], [], [], unavailable="no CUDA device here")
    verdict = derive_verdict(to_records("isolation", nothing).to_json())
    assert verdict.verdict is Verdict.NOT_RUN and verdict.reason.endswith("no CUDA device here")


def test_run_names_become_safe_file_names():
    assert slug("tp8 latency_specialized") == "tp8-latency_specialized"
    assert slug("../../x y") == "..-..-x-y" and slug("///") == "run"
