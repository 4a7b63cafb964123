from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.config.loader import load_config
from harness.errors import ConfigError
from harness.perf.plan import Cell, PerfConfigError, Settings, config_issues, parse
from tests.harness.test_config import write_variant


def smoke() -> dict:
    return copy.deepcopy(load_config("cpu-smoke").data)


def test_cpu_smoke_plan_cells_regions_and_order():
    plan = parse(smoke(), "smoke")
    ids = [c.id for c in plan.cells]
    assert ids == [
        "decode/tp1/dcp1/b1/ctx17/q1",
        "decode/tp1/dcp1/b4/ctx17/q1",
        "mixed/tp1/dcp1/b1/ctx17/q1",
        "verify/tp2/dcp1/b2/ctx17/q2",  # grouped by TP, so a subject builds each TP's executors once
    ]
    regions = [plan.region_of(c).name for c in plan.cells]
    assert regions == ["small batches", "larger batches", "small batches", "small batches"]
    mixed = plan.cells[2]
    assert mixed.workload == "mixed" and mixed.prefill_tokens == 2
    verify = plan.cells[3]
    assert verify.acceptance_rate == 0.7 and verify.tokens_per_step == pytest.approx(1.7)
    assert any("acceptance" in s for s in verify.synthetic) and any("routing" in s for s in verify.synthetic)
    assert plan.settings.ci_method == "bootstrap" and plan.settings.l2_flush is False


def test_axes_default_to_the_configs_lists():
    data = smoke()
    sweep = {"name": "all", "workload": "decode", "routing": "synthetic", "tokens_per_request": [1]}
    data["perf"]["sweeps"] = [sweep]
    plan = parse(data, "smoke")
    assert {c.batch for c in plan.cells} == {1, 2, 4} and {c.context for c in plan.cells} == {1, 17, 64}
    assert {c.tp for c in plan.cells} == {1, 2} and len(plan.cells) == 3 * 3 * 2


def test_tiers_select_sweeps():
    data = smoke()
    data["perf"]["sweeps"][0]["tiers"] = ["full"]
    assert not any(c.sweep == "decode" for c in parse(data, "smoke").cells)
    assert any(c.sweep == "decode" for c in parse(data, "full").cells)


def _edit(path: str, value):
    def apply(data: dict) -> None:
        *keys, last = path.split(".")
        node = data
        for k in keys:
            node = node[int(k)] if k.isdigit() else node[k]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value

    return apply


DELETE = object()


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (_edit("perf.sweeps.0.batches", [1, 8]), ["perf.sweeps[0].batches", "8", "workload.batches", "add it there"]),
        (_edit("perf.sweeps.0.tp", [4]), ["perf.sweeps[0].tp", "parallel.tp"]),
        (_edit("perf.sweeps.2.prefill_tokens", DELETE), ["perf.sweeps[2]", "mixed", "prefill_tokens"]),
        (_edit("perf.sweeps.0.prefill_tokens", 4), ["perf.sweeps[0]", "prefill_tokens", "pure decode"]),
        (_edit("perf.sweeps.1.acceptance_rate", DELETE), ["perf.sweeps[1]", "acceptance_rate", "add"]),
        (_edit("perf.sweeps.0.acceptance_rate", 0.5), ["perf.sweeps[0]", "acceptance_rate", "drop it"]),
        (_edit("perf.sweeps.1.name", "decode"), ["perf.sweeps", "'decode'", "twice"]),
        (_edit("perf.budgets.1.region", "small batches"), ["perf.budgets[1].region", "twice"]),
        (_edit("perf.budgets.0.batches", [2, 1]), ["perf.budgets[0].batches", "empty", "low <= high"]),
        (_edit("perf.budgets.1.batches", [5, 64]), ["perf.budgets", "b4", "no region", "cover 4"]),
        (_edit("perf.budgets.1.batches", [2, 64]), ["perf.budgets", "b2", "small batches, larger batches", "disjoint"]),
        (_edit("perf.min_repeats", 10), ["perf.max_repeats", "min_repeats 10", "raise"]),
        (_edit("perf.max_repeats", 3), ["perf.max_repeats", "3 rounds", "two of each order", "raise"]),
    ],
)
def test_rules_the_schema_cannot_say_are_one_line_errors(edit, words):
    data = smoke()
    edit(data)
    with pytest.raises(PerfConfigError) as info:
        parse(data, "smoke")
    msg = str(info.value)
    assert "\n" not in msg and "—" in msg
    for w in words:
        assert w in msg
    assert config_issues(data) == [msg]


def test_a_config_without_a_perf_table():
    data = smoke()
    del data["perf"]
    assert config_issues(data) == []
    with pytest.raises(PerfConfigError, match=r"has no \[perf\] table — add one"):
        parse(data, "smoke")


def test_region_coverage_counts_cells_of_every_tier():
    data = smoke()
    data["perf"]["sweeps"][0]["tiers"] = ["full"]
    data["perf"]["budgets"][1]["batches"] = [5, 64]  # b4 runs only in the full tier, and no region holds it
    with pytest.raises(PerfConfigError, match="b4"):
        parse(data, "smoke")


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        ('name = "mixed"\nworkload = "mixed"', 'name = "mixed"\nworkload = "prefill"', ["workload", "'decode'"]),
        ('routing = "synthetic"\nbatches = [1, 4]', 'routin = "synthetic"\nbatches = [1, 4]', ["routin", "allowed"]),
        ('ci_method = "bootstrap"', 'ci_method = "jackknife"', ["perf.ci_method", "'bootstrap'"]),
        ("min_repeats = 3", "min_repeats = 2", ["perf.min_repeats", "minimum"]),
        ("l2_flush = false", "l2_flush = false\nmin_sample_s = -1", ["perf.min_sample_s", "minimum"]),
        ("l2_flush = false", "l2_flush = false\nlead_in_steps = 0.5", ["perf.lead_in_steps", "integer"]),
        ("max_itl_regression = 0.25", "max_itl_regression = -0.1", ["max_itl_regression", "minimum"]),
    ],
)
def test_schema_rejects_bad_perf_tables_with_one_line(tmp_path, old, new, words):
    with pytest.raises(ConfigError) as info:
        load_config(str(write_variant(tmp_path, old, new)))
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


@given(q=st.integers(1, 8), a=st.floats(0, 1), b=st.floats(0, 1))
def test_tokens_per_step_is_between_one_and_q_and_grows_with_acceptance(q, a, b):
    lo, hi = sorted((a, b))

    def tokens(rate: float) -> float:
        return Cell("s", "decode", "synthetic", 1, 1, 1, 1, q, None, rate if q > 1 else None).tokens_per_step

    assert 1.0 <= tokens(lo) <= tokens(hi) <= q + 1e-9
    if q > 1:
        assert tokens(1.0) == pytest.approx(q)


def test_settings_defaults_are_valid():
    s = Settings()
    assert s.min_repeats <= s.max_repeats and s.ci_method in ("bootstrap", "t")


def test_regions_select_by_tokens_per_request_and_the_h200_budgets_say_why():
    data = load_config("h200").data
    for tier in ("smoke", "full"):
        plan = parse(data, tier)
        regions = {c.id: plan.region_of(c).name for c in plan.cells}
        assert regions["verify/tp8/dcp1/b8/ctx4096/q4"] == "verify steps"
        assert regions["mixed/tp8/dcp1/b8/ctx4096/q1"] == "mixed steps"
        assert regions["decode/tp8/dcp1/b8/ctx4096/q1"] == "small batches"
        assert regions["decode/tp16/dcp1/b64/ctx4096/q1"] == "large batches"
        assert all(r.why for r in plan.regions)
    # A verify cell no region's token range holds is refused at parse time, not left unjudged.
    narrow = copy.deepcopy(data)
    for budget in narrow["perf"]["budgets"]:
        if budget["region"] == "verify steps":
            budget["tokens_per_request"] = [2, 3]
    with pytest.raises(PerfConfigError, match=r"cell verify/tp8/dcp1/b1/ctx4096/q4 \(decode\) lies in no region"):
        parse(narrow, "smoke")
