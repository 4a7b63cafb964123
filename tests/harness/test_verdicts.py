from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from harness.verdicts import (
    Check,
    ExitCode,
    Outcome,
    StageRecords,
    StageVerdict,
    Verdict,
    derive_outcome,
    derive_verdict,
    stored_flag_mismatches,
)


def records(*checks: Check, status: str = "ran", reason: str = "") -> dict:
    return StageRecords(stage="s", status=status, reason=reason, checks=list(checks)).to_json()


def test_all_checks_passing_is_passed():
    v = derive_verdict(records(Check("a", 1.0, "<=", 2.0), Check("b", "x", "in", ["x", "y"])))
    assert v.verdict is Verdict.PASSED


def test_one_failing_check_fails_and_is_named():
    v = derive_verdict(records(Check("ok", 1, "==", 1), Check("max error", 3.5, "<=", 1e-3)))
    assert v.verdict is Verdict.FAILED
    assert "max error" in v.reason and "1 of 2" in v.reason


def test_no_checks_is_never_passed():
    assert derive_verdict(records()).verdict is Verdict.ERROR


def test_not_run_and_error_keep_their_reason():
    assert derive_verdict(records(status="not_run", reason="no GPU")) == StageVerdict("s", Verdict.NOT_RUN, "no GPU")
    assert derive_verdict(records(status="error", reason="boom")).verdict is Verdict.ERROR


def test_missing_or_nan_values_never_pass():
    assert not Check("x", None, "<=", 1).passed
    assert not Check("x", math.nan, "<=", 1).passed
    assert not Check("x", "text", "<", 1).passed  # incomparable types fail instead of raising


def test_stored_flag_is_not_trusted():
    rec = records(Check("err", 5.0, "<=", 1.0))
    rec["checks"][0]["passed"] = True  # an edited record
    assert stored_flag_mismatches(rec) == ["err"]
    assert derive_verdict(rec).verdict is Verdict.FAILED


def sv(stage: str, verdict: Verdict) -> StageVerdict:
    return StageVerdict(stage, verdict, "")


def test_incomplete_never_exits_zero():
    result = derive_outcome([sv("a", Verdict.PASSED), sv("b", Verdict.NOT_RUN)], ["a", "b"])
    assert result.outcome is Outcome.INCOMPLETE and result.exit_code == ExitCode.INCOMPLETE != 0


def test_required_stage_without_verdict_is_incomplete():
    assert derive_outcome([sv("a", Verdict.PASSED)], ["a", "b"]).outcome is Outcome.INCOMPLETE


def test_failure_anywhere_fails_even_if_optional():
    assert derive_outcome([sv("a", Verdict.PASSED), sv("x", Verdict.FAILED)], ["a"]).exit_code == ExitCode.FAILED


def test_nothing_required_proves_nothing():
    assert derive_outcome([sv("a", Verdict.PASSED)], []).outcome is Outcome.INCOMPLETE


@given(
    st.dictionaries(st.sampled_from("abcdef"), st.sampled_from(list(Verdict)), min_size=1),
    st.sets(st.sampled_from("abcdef"), min_size=1),
)
def test_outcome_rule(verdicts, required):
    result = derive_outcome([sv(s, v) for s, v in verdicts.items()], sorted(required))
    all_required_passed = all(verdicts.get(s) is Verdict.PASSED for s in required)
    any_failed = Verdict.FAILED in verdicts.values()
    assert (result.exit_code == 0) == (all_required_passed and not any_failed)
    assert (result.exit_code == ExitCode.FAILED) == any_failed
