from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace

from harness.config.loader import GateConfig, load_config
from harness.hardware import Hardware
from harness.perf import plot
from harness.perf.plan import Cell
from harness.stages import perf as perf_stage
from harness.stages.base import StageContext
from harness.verdicts import derive_verdict
from tests.harness.perf.fakes import FakeArm, FakeSuite, constant, honest


def _config(edit=None, tier: str = "smoke", name: str = "cpu-smoke") -> GateConfig:
    base = load_config(name)
    data = copy.deepcopy(base.data)
    if edit:
        edit(data)
    return GateConfig(base.name, base.source, base.text, data, tier)


def _ctx(tmp_path, config: GateConfig) -> StageContext:
    return StageContext(config, Hardware("none", 0), tmp_path, lambda what, frac: None)


@dataclass
class FakeSubject:
    suite: FakeSuite | None

    def perf_suite(self, config):
        return self.suite


def _run(tmp_path, monkeypatch, subject, config: GateConfig | None = None):
    monkeypatch.setattr(perf_stage, "load_subject", lambda name: subject)
    records = perf_stage.PerfStage().run(_ctx(tmp_path, config or _config()))
    return records, derive_verdict(json.loads(json.dumps(records.to_json(), default=str)))


def test_an_honest_sweep_passes_with_its_figure_and_cells(tmp_path, monkeypatch):
    suite = FakeSuite(honest)
    records, verdict = _run(tmp_path, monkeypatch, FakeSubject(suite))
    assert verdict.verdict == "PASSED", verdict.reason
    assert suite.closed
    assert records.evidence == ["stages/perf/cells.jsonl", "stages/perf/pareto.png"]
    assert (tmp_path / "stages/perf/pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (tmp_path / "stages/perf/cells.jsonl").read_text().splitlines()
    assert len(lines) == len(records.metrics["cells"]) == 4
    first = json.loads(lines[0])
    assert set(first["arms"]) == {"baseline", "candidate"} and first["timing"]["baseline_s"]
    m = records.metrics
    assert m["figures"] == [{"path": "stages/perf/pareto.png", "caption": m["figures"][0]["caption"]}]
    assert "fake numbers" in m["figures"][0]["caption"] and m["numbers_meaningful"] is True
    assert set(m["pareto_frontiers"]) == {"decode, context 17", "mixed, context 17"}
    # metrics stay apart by axis
    axes = m["cells"][0]["metrics"]["baseline"]
    assert {"itl_s", "tok_s_per_user", "output_tok_s", "output_tok_s_per_gpu", "ttft_s"} <= set(axes)


def test_a_candidate_slower_than_its_region_budget_fails_the_stage(tmp_path, monkeypatch):
    def slow(c: Cell):
        return FakeArm("baseline", constant(0.010)), FakeArm("candidate", constant(0.013))

    _, verdict = _run(tmp_path, monkeypatch, FakeSubject(FakeSuite(slow)))
    assert verdict.verdict == "FAILED" and "budget" in verdict.reason


def test_a_subject_without_a_perf_suite_is_not_run(tmp_path, monkeypatch):
    _, verdict = _run(tmp_path, monkeypatch, object())
    assert verdict.verdict == "NOT_RUN" and "has no perf suite" in verdict.reason
    _, verdict = _run(tmp_path, monkeypatch, FakeSubject(None))
    assert verdict.verdict == "NOT_RUN" and "has no perf suite" in verdict.reason


def test_a_served_subject_goes_to_the_serving_benchmark_not_to_a_subject_suite(tmp_path, monkeypatch):
    """A config with a [vllm] table never asks its subject for an in-process suite (the vLLM subjects have none):
    tp8-gb300 has no [perf] table, so the serving path says that, not "no perf suite"."""

    def no_suite(name):
        raise AssertionError("a served subject's perf must not load an in-process suite")

    monkeypatch.setattr(perf_stage, "load_subject", no_suite)
    records = perf_stage.PerfStage().run(_ctx(tmp_path, _config(name="tp8-gb300", tier="standard")))
    assert records.status == "not_run" and "has no [perf] table" in records.reason


def test_no_perf_table_is_not_run_and_a_bad_one_is_an_error(tmp_path, monkeypatch):
    suite = FakeSuite(honest)
    _, verdict = _run(tmp_path, monkeypatch, FakeSubject(suite), _config(lambda d: d.pop("perf")))
    assert verdict.verdict == "NOT_RUN" and "no [perf] table" in verdict.reason and suite.closed

    def bad(d):
        d["perf"]["sweeps"][0]["batches"] = [1, 8]

    _, verdict = _run(tmp_path, monkeypatch, FakeSubject(FakeSuite(honest)), _config(bad))
    assert verdict.verdict == "ERROR" and "perf.sweeps[0].batches: 8 is not in workload.batches" in verdict.reason


def test_cells_the_suite_cannot_measure_make_the_stage_not_run(tmp_path, monkeypatch):
    suite = FakeSuite(honest, blocked={"verify/tp2/dcp1/b2/ctx17/q2": "no TP2 here — drop it"})
    _, verdict = _run(tmp_path, monkeypatch, FakeSubject(suite))
    assert verdict.verdict == "NOT_RUN" and suite.closed
    assert "cannot measure 1 of 4 perf cells; first: verify/tp2/dcp1/b2/ctx17/q2: no TP2 here" in verdict.reason


def test_a_tier_without_cells_is_not_run(tmp_path, monkeypatch):
    def full_only(d):
        for s in d["perf"]["sweeps"]:
            s["tiers"] = ["full"]

    _, verdict = _run(tmp_path, monkeypatch, FakeSubject(FakeSuite(honest)), _config(full_only))
    assert verdict.verdict == "NOT_RUN" and "tier smoke" in verdict.reason


def test_without_matplotlib_the_stage_is_not_run_before_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(plot, "available", lambda: "matplotlib is not installed — install k3gate[plots]")
    suite = FakeSuite(honest)
    _, verdict = _run(tmp_path, monkeypatch, FakeSubject(suite))
    assert verdict.verdict == "NOT_RUN" and "k3gate[plots]" in verdict.reason


def test_progress_names_every_cell(tmp_path, monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(perf_stage, "load_subject", lambda name: FakeSubject(FakeSuite(honest)))
    ctx = replace(_ctx(tmp_path, _config()), progress=lambda what, frac: seen.append(what))
    perf_stage.PerfStage().run(ctx)
    assert len(seen) == 4 and seen[0].startswith("decode/")


def test_numbers_that_mean_nothing_record_budgets_without_judging_them(tmp_path, monkeypatch):
    from tests.harness.perf.fakes import PLUMBING_INFO

    def slow(c: Cell):
        return FakeArm("baseline", constant(0.010)), FakeArm("candidate", constant(0.013))

    records, verdict = _run(tmp_path, monkeypatch, FakeSubject(FakeSuite(slow, info=PLUMBING_INFO)))
    assert verdict.verdict == "PASSED" and records.metrics["timing_judged"] is False
    assert not any("budget" in c.name or "Amdahl" in c.name for c in records.checks)
