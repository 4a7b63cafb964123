"""Paired eval decisions, the teacher-forced comparison and the findings rule: each must fail on a real bug."""

from __future__ import annotations

import math

import pytest

from harness.runners import paired, teacher_forcing
from harness.runners.eval_tasks import evals_data, task_specs
from harness.runners.findings import Findings
from harness.runners.lmeval import Item
from harness.verdicts import Check, Verdict, derive_verdict

DECISION = evals_data()["decision"]
LIMITS = evals_data()["teacher_forcing"]


def items(scores: list[float], prompt: str = "p") -> dict[int, Item]:
    return {i: Item(i, s, f"{prompt}{i}", f"d{i}", str(s)) for i, s in enumerate(scores)}


def failed(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if not c.passed]


def test_identical_arms_pass_the_paired_decision():
    spec = task_specs()["gsm8k"]
    scores = [1.0, 0.0] * 50
    result = paired.compare(spec, items(scores), items(scores), DECISION)
    assert failed(paired.checks(result, "gsm8k", 100)) == []
    assert result.same_response == 100 and result.mcnemar_p == 1.0


def test_a_candidate_that_loses_items_fails_non_inferiority():
    spec = task_specs()["gsm8k"]
    base = [1.0] * 80 + [0.0] * 20
    cand = [0.0] * 6 + [1.0] * 74 + [0.0] * 20  # six items lost: 6 points, three times the 2-point margin
    result = paired.compare(spec, items(base), items(cand), DECISION)
    names = failed(paired.checks(result, "gsm8k", 100))
    assert names == ["gsm8k: lower bound of candidate - baseline (paired bootstrap)"]
    assert result.mcnemar_p < 0.05


def test_different_prompts_or_missing_items_fail():
    spec = task_specs()["gsm8k"]
    base = items([1.0] * 10)
    cand = {k: v for k, v in items([1.0] * 10, prompt="other").items() if k < 9}
    names = failed(paired.checks(paired.compare(spec, base, cand, DECISION), "t", 10))
    assert "t: items whose prompt differs between arms" in names and "t: items scored on one arm only" in names
    assert "t: items scored on both arms" in names


def forced(top_shift: float = 0.0, follow: bool = True) -> list[teacher_forcing.Forced]:
    steps = 50
    base = {t: math.log(w) for t, w in zip(range(5), (0.4, 0.3, 0.15, 0.1, 0.05), strict=True)}
    top = []
    for s in range(steps):
        # a logit nudge on one token, then log-softmax again: what a server would report
        logits = {t: v + (top_shift if t == (s % 5) else 0.0) for t, v in base.items()}
        norm = math.log(sum(math.exp(v) for v in logits.values()))
        top.append({t: v - norm for t, v in logits.items()})
    targets = [s % 5 for s in range(steps)]
    followed = targets if follow else [0] * steps
    return [teacher_forcing.Forced(0, targets, followed, top, [top[s][targets[s]] for s in range(steps)])]


def test_teacher_forcing_passes_identical_arms_and_fails_a_nudge_or_broken_forcing():
    same = teacher_forcing.compare(forced(), forced())
    assert failed(teacher_forcing.checks(same, "tf", LIMITS)) == []
    nudged = teacher_forcing.compare(forced(), forced(top_shift=0.3))
    names = failed(teacher_forcing.checks(nudged, "tf", LIMITS))
    assert "tf: mean KL(baseline || candidate) per step (nats)" in names
    broken = teacher_forcing.compare(forced(), forced(follow=False))
    assert "tf: steps that left the forced sequence" in failed(teacher_forcing.checks(broken, "tf", LIMITS))
    empty = teacher_forcing.compare([], [])
    assert "tf: forced steps compared" in failed(teacher_forcing.checks(empty, "tf", LIMITS))


def test_teacher_forcing_checks_carry_each_limits_reason():
    result = teacher_forcing.compare(forced(), forced(top_shift=0.3))
    by_name = {c.name.removeprefix("tf: "): c for c in teacher_forcing.checks(result, "tf", LIMITS)}
    reasons = {
        "mean KL(baseline || candidate) per step (nats)": "max_mean_kl",
        "p99 KL per step (nats)": "max_p99_kl",
        "mean top-5 overlap": "min_mean_top5_overlap",
        "worst |forced-token logprob difference| (nats)": "max_abs_target_logprob_diff",
    }
    for name, key in reasons.items():
        assert by_name[name].limit == LIMITS[key]
        assert by_name[name].detail.endswith(f"limit: {LIMITS['why'][key]}")
        assert "CPU-calibrated placeholder" in by_name[name].detail
    assert "worst step" in by_name["p99 KL per step (nats)"].detail  # where it went wrong stays in front
    # Broken case: a limit whose reason is missing (or blank) is refused, naming the key and the fix.
    no_reason = {**LIMITS, "why": {k: v for k, v in LIMITS["why"].items() if k != "max_p99_kl"}}
    with pytest.raises(ValueError, match=r"no reason for max_p99_kl: add one line per limit"):
        teacher_forcing.checks(result, "tf", no_reason)
    blank = {**LIMITS, "why": {**LIMITS["why"], "max_mean_kl": " "}}
    with pytest.raises(ValueError, match="max_mean_kl"):
        teacher_forcing.limits_record(blank)


def test_findings_rule():
    ok, bad = Check("a", 1, "==", 1), Check("b", 0, "==", 1)
    f = Findings("scope", checks=[ok])
    assert derive_verdict(f.records().to_json()).verdict is Verdict.PASSED
    f.cannot("coverage: no probe")
    rec = f.records().to_json()
    assert derive_verdict(rec).verdict is Verdict.NOT_RUN and "coverage: no probe" in rec["reason"]
    assert rec["checks"] and rec["metrics"]["not_run_checks"] == ["coverage: no probe"]
    f.checks.append(bad)
    assert derive_verdict(f.records().to_json()).verdict is Verdict.FAILED  # a failure outranks a gap
