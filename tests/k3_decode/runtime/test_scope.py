"""Start-up scope checks: one rule at a time with its reason, their order, limits read from data, rank agreement."""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3_decode.runtime.errors import DataFileError, RankDisagreementError, ScopeError
from k3_decode.runtime.scope import CHECKS, ScopeVerdict, agreed_verdict, check_scope, local_device, scope_verdict
from k3_decode.runtime.scopefile import CHECK_NAMES, load_scope, parse_scope
from k3_decode.runtime.startup import start

from .helpers import SPECIALIZED, built_registry, deployment

SCOPE = load_scope("k3-hopper")
SPEC = "latency_specialized"


def test_check_names_in_data_and_code_agree():
    assert set(CHECKS) == set(CHECK_NAMES)


def test_local_device_reports_what_torch_sees():
    device, capability = local_device()
    assert (device == "cuda") == torch.cuda.is_available()
    deployment(device=device, capability=capability)  # a valid Deployment either way


def test_in_scope_deployment_is_accepted():
    assert check_scope(deployment(), SCOPE, SPEC).ok
    assert check_scope(deployment(tp=16, dcp=16, num_speculative_tokens=7, spec_method="dspark"), SCOPE, SPEC).ok


# One deployment per rule, each out of scope for exactly that rule.
SPECIALIZED_CASES = [
    ("model", {"model": "k2"}, "model 'k2' (scope k3-hopper covers k3, k3-mini)"),
    ("device", {"device": "cpu", "capability": None}, "the CPU (the specialized kernels need a sm_90 GPU)"),
    ("device", {"capability": (10, 0)}, "this GPU (sm_100; the specialized kernels are built for sm_90)"),
    ("device", {"capability": (8, 9)}, "this GPU (sm_89;"),
    ("tp", {"tp": 3, "dcp": 1}, "TP=3 (scope k3-hopper allows TP 1, 2, 4, 8, 16)"),
    ("dcp", {"dcp": 2}, "DCP=2 at TP=8 (decode context parallel must be 1 or TP)"),
    ("batch", {"max_batch": 65}, "batches of 65 requests (the specialized path prepares at most 64)"),
    ("cudagraph_mode", {"cudagraph_mode": "piecewise"}, "CUDA-graph mode 'piecewise' (deployments without FULL"),
    ("cudagraph_mode", {"cudagraph_mode": "none"}, "CUDA-graph mode 'none'"),
    (
        "spec_method",
        {"num_speculative_tokens": 3, "spec_method": "eagle"},
        "speculative method 'eagle' (the verify kernels need uniform q",
    ),
    ("kda_state_dtypes", {"kda_conv_state_dtype": "float32"}, "KDA cache dtypes conv float32, recurrent float32"),
    ("kda_state_dtypes", {"kda_recurrent_state_dtype": "bfloat16"}, "recurrent bfloat16 (the kernels update"),
    ("mla_cache_dtype", {"mla_cache_dtype": "bfloat16"}, "MLA cache dtype bfloat16 (the kernels read and insert"),
    (
        "tokens_per_request",
        {"num_speculative_tokens": 8, "spec_method": "dspark"},
        "9 tokens per request (8 speculative; at most 8)",
    ),
]


@pytest.mark.parametrize(("check", "overrides", "reason"), SPECIALIZED_CASES)
def test_each_specialized_rule_raises_its_reason(check, overrides, reason):
    dep = deployment(**overrides)
    verdict = scope_verdict(dep, SCOPE, SPEC)
    assert verdict.check == check
    with pytest.raises(ScopeError) as err:
        check_scope(dep, SCOPE, SPEC)
    msg = str(err.value)
    assert msg.startswith("k3-hopper: decode_backend 'latency_specialized' does not support ")
    assert reason in msg
    assert "\n" not in msg and "; " in msg  # one line: the reason, then the fix


@pytest.mark.parametrize(("check", "overrides", "reason"), SPECIALIZED_CASES)
def test_every_specialized_rule_is_reached_through_start(check, overrides, reason):
    with pytest.raises(ScopeError, match="does not support"):
        start(SPECIALIZED, deployment(**overrides), registry=built_registry())


def test_stock_path_allows_cpu_only_for_cpu_models():
    cpu = {"device": "cpu", "capability": None}
    assert check_scope(deployment(model="k3-mini", **cpu), SCOPE, "auto").ok
    with pytest.raises(ScopeError, match=r"model 'k3' on the CPU \(too large for it\); use model k3-mini on the CPU"):
        check_scope(deployment(**cpu), SCOPE, "auto")


def test_stock_path_has_no_specialized_limits():
    dep = deployment(
        capability=(10, 0),
        max_batch=512,
        num_speculative_tokens=12,
        spec_method="eagle",
        mla_cache_dtype="bfloat16",
        kda_conv_state_dtype="float32",
        cudagraph_mode="none",
    )
    assert check_scope(dep, SCOPE, "auto").ok
    assert scope_verdict(dep, SCOPE, SPEC).check == "device"


@pytest.mark.parametrize(
    ("overrides", "check"), [({"tp": 3, "dcp": 1}, "tp"), ({"dcp": 4}, "dcp"), ({"model": "x"}, "model")]
)
def test_stock_path_still_needs_a_shardable_model(overrides, check):
    assert scope_verdict(deployment(**overrides), SCOPE, "auto").check == check


def test_first_failure_wins_in_the_order_the_scope_file_gives():
    dep = deployment(capability=(10, 0), tp=3, mla_cache_dtype="bfloat16")
    assert scope_verdict(dep, SCOPE, SPEC).check == "device"
    reordered = dataclasses.replace(SCOPE, specialized_checks=("mla_cache_dtype", "tp", "device"))
    assert scope_verdict(dep, reordered, SPEC).check == "mla_cache_dtype"


def test_limits_come_from_the_scope_data():
    tight = dataclasses.replace(SCOPE, max_batch=32, tp=(8,), specialized_sm_families=(100,), max_tokens_per_request=4)
    assert scope_verdict(deployment(), tight, SPEC).check == "device"
    sm100 = deployment(capability=(10, 3), max_batch=32)
    assert scope_verdict(sm100, tight, SPEC).ok
    assert scope_verdict(dataclasses.replace(sm100, max_batch=33), tight, SPEC).check == "batch"
    assert scope_verdict(dataclasses.replace(sm100, tp=16), tight, SPEC).check == "tp"
    four = dataclasses.replace(sm100, num_speculative_tokens=4, spec_method="dspark")
    assert "5 tokens per request (4 speculative; at most 4)" in scope_verdict(four, tight, SPEC).reason


def test_scope_without_runtime_table_is_a_data_error():
    raw = tomllib.loads(resources.files("k3_decode.scope").joinpath("k3-hopper.toml").read_text())
    del raw["runtime"]
    with pytest.raises(DataFileError, match=r"s.toml: needs \[deployment\] and \[runtime\] tables"):
        parse_scope(raw, "s.toml")


@pytest.mark.parametrize(
    ("table", "key", "value", "message"),
    [
        ("runtime", "specialized_sm_families", [], "specialized_sm_families must be a non-empty list"),
        ("runtime", "mla_cache_dtype", 8, "mla_cache_dtype must be a string"),
        ("deployment", "max_batch", True, "max_batch must be an integer"),
        ("deployment", "prepared_batches", [1, 128], r"prepared_batches \[128\] outside 1..max_batch"),
        ("deployment", "dcp", ["2"], "dcp entries"),
        ("runtime", "specialized_step_modes", ["replay"], "specialized_step_modes"),
        ("runtime", "specialized_checks", ["tp", "tp"], "lists a check twice"),
    ],
)
def test_malformed_scope_data_is_one_line_error(table, key, value, message):
    raw = tomllib.loads(resources.files("k3_decode.scope").joinpath("k3-hopper.toml").read_text())
    raw[table][key] = value
    with pytest.raises(DataFileError, match=message):
        parse_scope(raw, "s.toml")
    del raw[table][key]
    with pytest.raises(DataFileError, match=f"missing key '{key}'"):
        parse_scope(raw, "s.toml")


def test_unknown_scope_name_is_an_error():
    with pytest.raises(DataFileError, match="unknown scope 'k4'"):
        load_scope("k4")


def test_unknown_check_name_in_data_is_an_error(tmp_path):
    src = tmp_path / "s.toml"
    shipped = resources.files("k3_decode.scope").joinpath("k3-hopper.toml").read_text()
    src.write_text(shipped.replace('"model", "cpu_model", "tp", "dcp"', '"model", "gpu", "tp", "dcp"'))
    with pytest.raises(DataFileError, match=r"stock_checks names unknown checks \['gpu'\]"):
        load_scope(src)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"device": "tpu"}, "device 'tpu' is not 'cpu' or 'cuda'"),
        ({"device": "cpu"}, "capability must be"),
        ({"tp": 0}, "tp must be >= 1"),
        ({"num_speculative_tokens": 2}, "spec_method and num_speculative_tokens disagree"),
        ({"spec_method": "dspark"}, "spec_method and num_speculative_tokens disagree"),
        ({"cudagraph_mode": "FULL"}, "cudagraph_mode 'FULL' is not one of"),
        ({"capture_sizes": (0, 8)}, "capture_sizes must be positive"),
    ],
)
def test_malformed_deployment_is_one_line_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        deployment(**overrides)


# -- agreement across ranks ------------------------------------------------------------------------------------

OK = ScopeVerdict("k3-hopper", SPEC)
BAD = scope_verdict(deployment(capability=(10, 0)), SCOPE, SPEC)


def test_agreeing_ranks_give_the_common_verdict():
    assert agreed_verdict([OK] * 8, tp=8) is OK
    assert agreed_verdict([BAD] * 2) == BAD


def test_disagreeing_ranks_are_named_in_one_line():
    with pytest.raises(RankDisagreementError) as err:
        agreed_verdict([OK, OK, BAD, OK, OK, OK, OK, OK], tp=8)
    msg = str(err.value)
    assert "\n" not in msg
    assert "ranks 0, 1, 3-7 accept" in msg
    assert "rank 2 reject: this GPU (sm_100" in msg
    assert msg.endswith("give every rank the same deployment")


def test_different_rejections_also_disagree():
    other = scope_verdict(deployment(mla_cache_dtype="bfloat16"), SCOPE, SPEC)
    with pytest.raises(RankDisagreementError, match=r"rank 0 reject: this GPU.*rank 1 reject: MLA cache dtype"):
        agreed_verdict([BAD, other])


def test_missing_verdicts_are_an_error():
    with pytest.raises(ValueError, match="each of the 8 TP ranks, got 7"):
        agreed_verdict([OK] * 7, tp=8)
    with pytest.raises(ValueError, match="got none"):
        agreed_verdict([])


def test_start_gathers_before_raising():
    # Rank 0 alone is out of scope: through gather every rank raises the same disagreement, none raises alone.
    calls = []

    def gather(v: ScopeVerdict) -> list[ScopeVerdict]:
        calls.append(v)
        return [v] + [OK] * 7

    with pytest.raises(RankDisagreementError, match="rank 0 reject: batches of 65"):
        start(SPECIALIZED, deployment(max_batch=65), registry=built_registry(), gather=gather)
    assert calls and not calls[0].ok
    assert start(SPECIALIZED, deployment(), registry=built_registry(), gather=gather).verdict.ok


# -- property: the verdict equals an independent statement of the scope ------------------------------------------

deployments = st.builds(
    lambda cap, tp, dcp_is_tp, batch, spec, method, conv, mla, mode: deployment(
        device="cpu" if cap is None else "cuda",
        capability=cap,
        model="k3-mini" if cap is None else "k3",
        tp=tp,
        dcp=tp if dcp_is_tp else (1 if dcp_is_tp is False else 2),
        max_batch=batch,
        num_speculative_tokens=spec,
        spec_method=method if spec else None,
        kda_conv_state_dtype=conv,
        mla_cache_dtype=mla,
        cudagraph_mode=mode,
    ),
    st.sampled_from([None, (9, 0), (10, 0), (8, 0)]),
    st.sampled_from([1, 2, 3, 4, 8, 16, 32]),
    st.sampled_from([True, False, None]),
    st.integers(1, 128),
    st.integers(0, 9),
    st.sampled_from(["dspark", "synthetic", "eagle"]),
    st.sampled_from(["bfloat16", "float32"]),
    st.sampled_from(["float8_e4m3fn", "bfloat16"]),
    st.sampled_from(["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]),
)


@settings(max_examples=150, deadline=None)
@given(deployments)
def test_specialized_verdict_matches_independent_statement(dep):
    in_scope = (
        dep.capability is not None
        and dep.capability[0] == 9
        and dep.tp in (1, 2, 4, 8, 16)
        and dep.dcp in (1, dep.tp)
        and dep.max_batch <= 64
        and dep.num_speculative_tokens <= 7
        and dep.spec_method in (None, "dspark", "synthetic")
        and dep.kda_conv_state_dtype == "bfloat16"
        and dep.mla_cache_dtype == "float8_e4m3fn"
        and dep.cudagraph_mode != "none"
        and dep.cudagraph_mode != "piecewise"
    )
    verdict = scope_verdict(dep, SCOPE, SPEC)
    assert verdict.ok == in_scope
    assert "\n" not in verdict.message()
