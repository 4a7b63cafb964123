"""The perf stage on served subjects, against fake streaming servers: the honest sweep passes with its metrics by
axis, and each lie (short answers, a stock path, a slower candidate, no path probe) ends where it must."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from harness.config.loader import GateConfig, load_config
from harness.hardware import Hardware
from harness.perf import serving
from harness.stages.base import StageContext
from harness.stages.perf import PerfStage
from harness.verdicts import Verdict, derive_verdict
from tests.harness.perf import fake_openai

HONEST = {"decode_backend": "latency_specialized"}


def _config(edit=None) -> GateConfig:
    base = load_config("cpu-vllm")
    data = copy.deepcopy(base.data)
    if edit:
        edit(data)
    return GateConfig(base.name, base.source, base.text, data, "smoke")


def _gpus(count: int):
    def edit(data: dict) -> None:
        data["hardware"] = {"gpu": "h200", "gpu_count": count}

    return edit


def _run(tmp_path: Path, candidate: dict, config: GateConfig | None = None, baseline: dict | None = None):
    models = {
        "baseline": fake_openai.FakeModel(**(baseline or {})),
        "candidate": fake_openai.FakeModel(**{**HONEST, **candidate}),
    }
    ctx = StageContext(config or _config(), Hardware("none", 0), tmp_path, lambda what, frac: None)
    records = PerfStage(provider=fake_openai.provider(models, tmp_path / "servers")).run(ctx)
    raw = json.loads(json.dumps(records.to_json(), default=str))
    return raw, derive_verdict(raw)


def _failed(raw: dict) -> list[str]:
    return [c["name"] for c in raw["checks"] if not c["passed"]]


def test_an_honest_sweep_passes_with_metrics_by_axis_and_its_evidence(tmp_path):
    raw, verdict = _run(tmp_path, {})
    assert verdict.verdict is Verdict.PASSED, verdict.reason
    m = raw["metrics"]
    assert [c["cell"] for c in m["cells"]] == [
        "decode/tp1/dcp1/b1/ctx256/q1",
        "decode/tp1/dcp1/b4/ctx256/q1",
        "mixed/tp1/dcp1/b4/ctx256/q1",
    ]
    axes = m["cells"][0]["metrics"]["candidate"]
    for key in ("itl_median_s", "decode_tok_s", "tok_s_per_user_p90", "ttft_median_s", "output_tok_s_per_gpu"):
        assert axes[key] > 0, key
    assert m["cells"][2]["metrics"]["baseline"]["prefill_requests"] > 0  # the mixed cell carried prefills
    assert not m["numbers_meaningful"] and "mean nothing" in m["notes"][0]
    assert not any("budget" in c["name"] for c in raw["checks"])  # recorded, not judged, on the CPU
    assert sum("decode steps on the specialized path" in c["name"] for c in raw["checks"]) == 3
    assert raw["evidence"][:2] == ["stages/perf/cells.jsonl", "stages/perf/pareto.png"]
    cells = [json.loads(x) for x in (tmp_path / "stages/perf/cells.jsonl").read_text().splitlines()]
    rounds = cells[0]["arms"]["baseline"]["rounds"]
    assert len(rounds) == 4 and rounds[0]["requests"][0]["tokens"] == 16  # warm-up rounds are not kept
    assert cells[0]["timing"]["order"].startswith("ABBA") and cells[0]["mode"] == "interleaved"


def test_a_candidate_that_stops_early_fails_instead_of_looking_faster(tmp_path):
    raw, verdict = _run(tmp_path, {"short": 4})
    assert verdict.verdict is Verdict.FAILED
    failed = _failed(raw)
    assert failed and all("candidate: every request produced its 16 tokens" in n for n in failed), failed
    detail = next(c["detail"] for c in raw["checks"] if c["name"] == failed[0])
    assert "12 tokens, not 16" in detail


def test_a_candidate_whose_decode_steps_ran_stock_fails_its_path(tmp_path):
    raw, verdict = _run(tmp_path, {"path": "stock"})
    assert verdict.verdict is Verdict.FAILED
    failed = _failed(raw)
    assert len(failed) == 3 and all("candidate: decode steps on the specialized path" in n for n in failed)


def test_a_model_without_a_path_probe_is_not_run_never_passed(tmp_path):
    raw, verdict = _run(tmp_path, {"probe": None})
    assert verdict.verdict is Verdict.NOT_RUN and "no path probe for FakeForCausalLM" in verdict.reason
    assert _failed(raw) == []


def test_on_gpus_the_budget_is_judged_and_a_slower_candidate_fails_it(tmp_path):
    raw, verdict = _run(tmp_path, {"token_s": 0.006}, _config(_gpus(2)), {"token_s": 0.002})
    assert verdict.verdict is Verdict.FAILED and raw["metrics"]["numbers_meaningful"]
    failed = _failed(raw)
    assert failed and all("decode ITL ratio (candidate/baseline) upper bound within the budget" in n for n in failed)
    assert all(c["itl_ratio"]["low"] > 1.1 for c in raw["metrics"]["cells"])  # 3x by its sleeps, less under load


def test_arms_that_cannot_share_the_gpus_run_one_after_the_other_and_say_so(tmp_path):
    raw, _ = _run(tmp_path, {"token_s": 0.006}, _config(_gpus(1)), {"token_s": 0.002})
    assert all(c["mode"] == serving.SEQUENTIAL for c in raw["metrics"]["cells"])
    budget = [c for c in raw["checks"] if "budget" in c["name"]]
    assert len(budget) == 3 and all(not c["passed"] and "not cancelled" in c["detail"] for c in budget)


def _verify_sweep(data: dict) -> None:
    data["workload"]["tokens_per_request"] = [1, 2]
    data["perf"]["sweeps"][0].update(tokens_per_request=[2], acceptance_rate=0.5)
    data["perf"]["sweeps"][1]["tokens_per_request"] = [1]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d["perf"]["sweeps"][0].update(routing="real"), ["real-prompt routing", "routing = 'synthetic'"]),
        (_verify_sweep, ["speculative-decoding", "tokens_per_request = [1]"]),
    ],
)
def test_cells_a_served_subject_cannot_measure_are_not_run_with_the_fix(tmp_path, edit, words):
    _, verdict = _run(tmp_path, {}, _config(edit))
    assert verdict.verdict is Verdict.NOT_RUN
    for w in words:
        assert w in verdict.reason


def test_a_served_config_without_a_perf_table_is_not_run(tmp_path):
    _, verdict = _run(tmp_path, {}, _config(lambda d: d.pop("perf")))
    assert verdict.verdict is Verdict.NOT_RUN and "no [perf] table" in verdict.reason


def test_sequential_timing_pairs_rounds_by_index():
    settings = serving.parse(load_config("cpu-vllm").data, "smoke").settings
    t = serving.sequential_timing([1.0, 1.0, 1.0, 1.0, 1.0], [1.1, 1.1, 1.1, 1.1], settings)
    assert t.interval is not None and t.interval.ratio == pytest.approx(1.1) and len(t.baseline) == 4
    broken = serving.sequential_timing([1.0] * 4, [1.0, float("nan"), 1.0, 1.0], settings)
    assert broken.interval is None and broken.broken
