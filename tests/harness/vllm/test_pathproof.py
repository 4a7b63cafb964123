"""Proof of path: the recorder's step accounting and the coverage rule built on it (no vLLM needed)."""

from __future__ import annotations

import json

from harness.runners import pathproof
from harness.vllm_plugin import perturb, probes
from harness.vllm_plugin.recorder import PathRecorder, StepInfo

DECODE = StepInfo("NONE", "tokens=4,reqs=4,uniform=True", "decode", 4, 4)
PREFILL = StepInfo("NONE", "tokens=40,reqs=1,uniform=False", "prefill_or_mixed", 40, 1)


def run_steps(rec: PathRecorder, steps: list[tuple[StepInfo, str | None]]) -> None:
    for info, path in steps:
        rec.begin_step(info)
        if path:
            rec.decide(path, "prefill goes to stock" if path == "stock" else "")
        rec.end_step()


def test_recorder_counts_steps_by_shape_and_path(tmp_path):
    rec = PathRecorder(tmp_path, "ToyForCausalLM", {"decode_backend": "latency_specialized"})
    rec.set_probe("toy:probe", "")
    run_steps(rec, [(PREFILL, "stock"), (DECODE, "specialized"), (DECODE, "specialized")])
    rec.flush()
    snap = json.loads(next(tmp_path.glob("path-*.json")).read_text())
    assert snap["steps"] == 3 and snap["by_shape"] == {"prefill_or_mixed": 1, "decode": 2}
    assert snap["by_path"] == {"prefill_or_mixed:stock": 1, "decode:specialized": 2}
    assert snap["additional_config"] == {"decode_backend": "latency_specialized"}


def test_full_graph_replays_inherit_the_decision_made_at_capture(tmp_path):
    rec = PathRecorder(tmp_path, "ToyForCausalLM", {})
    rec.set_probe("toy:probe", "")
    full = StepInfo("FULL", "tokens=8,reqs=8,uniform=True", "decode", 8, 8)
    rec.captured[full.descriptor] = {"path": "specialized", "reason": ""}  # what decide() stores while capturing
    run_steps(rec, [(full, None), (full, None)])
    assert rec.by_path == {"decode:specialized": 2} and rec.timeline[0]["source"] == "replay"
    unknown = StepInfo("FULL", "tokens=16,reqs=16,uniform=True", "decode", 16, 16)
    run_steps(rec, [(unknown, None)])
    assert rec.by_path["decode:unrecorded"] == 1  # never claimed specialized without evidence


def snap(steps: int, decode: int, specialized: int, probe: str | None = "toy:probe", at: float = 10.0) -> dict:
    return {
        "steps": steps,
        "written_at": at,
        "probe": probe,
        "probe_note": "" if probe else "no proof-of-path probe is registered for LlamaForCausalLM",
        "by_shape": {"decode": decode},
        "by_path": {"decode:specialized": specialized, "decode:stock": decode - specialized},
        "fallback_reasons": {"decode: batch 96 not prepared": decode - specialized} if decode > specialized else {},
    }


def test_coverage_passes_fails_or_says_why_it_cannot_judge():
    before = {"path-1": snap(5, 3, 3)}
    full = pathproof.cell_path(before, {"path-1": snap(15, 13, 13)}, 5.0)
    check, why = pathproof.coverage_check("cell", full, 1.0)
    assert why is None and check.passed and full.decode_steps == 10
    partial = pathproof.cell_path(before, {"path-1": snap(15, 13, 10)}, 5.0)
    check, _ = pathproof.coverage_check("cell", partial, 1.0)
    assert not check.passed and "batch 96 not prepared" in check.detail
    no_probe = pathproof.cell_path({}, {"path-1": snap(15, 13, 0, probe=None)}, 5.0)
    check, why = pathproof.coverage_check("cell", no_probe, 1.0)
    assert check is None and "no proof-of-path probe is registered for LlamaForCausalLM" in why
    stale = pathproof.cell_path(before, {"path-1": snap(15, 13, 13, at=1.0)}, 5.0)
    assert pathproof.coverage_check("cell", stale, 1.0)[0] is None
    assert pathproof.coverage_check("cell", pathproof.cell_path({}, {}, 5.0), 1.0)[0] is None
    idle = pathproof.cell_path(before, {"path-1": snap(6, 3, 3)}, 5.0)
    assert not pathproof.coverage_check("cell", idle, 1.0)[0].passed  # no decode step: proves nothing


def test_worst_rank_decides():
    after = {"path-1": snap(10, 10, 10), "path-2": snap(10, 10, 7)}
    assert pathproof.cell_path({}, after, 5.0).specialized_decode == 7


def test_probe_lookup_and_perturb_modes(monkeypatch):
    monkeypatch.setenv("K3GATE_PATH_PROBES", "ToyForCausalLM=tests.harness.vllm.toy_probe:install")
    assert probes.find("ToyForCausalLM") == "tests.harness.vllm.toy_probe:install"
    assert probes.find("LlamaForCausalLM") is None
    assert perturb.parse("nudge_logits:0.25") == ("nudge_logits", 0.25)
    try:
        perturb.parse("delete_weights")
    except ValueError as exc:
        assert "unknown mode" in str(exc)
    else:
        raise AssertionError("an unknown perturbation must be refused")
