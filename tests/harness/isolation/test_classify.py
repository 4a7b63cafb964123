from __future__ import annotations

from harness.isolation.classify import Area, classify, classify_path, co_change_breaches
from harness.isolation.gitdiff import Change
from harness.isolation.scope import for_subject, parse

VLLM = for_subject("vllm-k3")
HOPPER = for_subject("k3-hopper")


def area(path, scope=VLLM):
    a, component, _ = classify_path(path, scope)
    return f"{a.value}:{component}" if component else a.value


def test_vllm_k3_areas():
    assert area("vllm/models/kimi_k3/nvidia/specialized_decode/runtime/__init__.py") == "model"
    assert area("tests/models/kimi_k3/test_decode.py") == "allowed"
    assert area("vllm/v1/sample/sampler.py") == "review:sampling"
    assert area("vllm/v1/worker/gpu/sample/sampler.py") == "review:sampling"
    assert area("vllm/v1/worker/gpu/input_batch.py") == "review:input_preparation"
    assert area("vllm/v1/core/kv_cache_manager.py") == "review:kv_cache_management"
    assert area("vllm/v1/core/sched/scheduler.py") == "review:scheduler"
    assert area("vllm/engine/arg_utils.py") == "review:config_and_arguments"
    assert area("vllm/config/model.py") == "review:config_and_arguments"
    assert area("vllm/v1/worker/gpu/model_runner.py") == "review:model_runner"
    assert area("vllm/models/deepseek_v41/model.py") == "outside"
    assert area("vllm/models/kimi_k3.py") == "outside"


def test_self_scope_areas():
    assert area("k3_decode/kernels/kda.py", HOPPER) == "model"
    assert area("harness/cli.py", HOPPER) == "allowed"
    assert area("README.md", HOPPER) == "allowed"
    assert area("newtop/x.py", HOPPER) == "outside"  # the design fixes the top-level folders


def test_review_wins_over_model():
    s = parse({"model": ["m/**"], "review": {"scope file": ["m/scope.toml"]}}, "t")
    assert classify_path("m/scope.toml", s)[0] is Area.REVIEW
    assert classify_path("m/x.py", s)[0] is Area.MODEL


def test_rename_out_of_a_shared_component_fails_on_its_old_side():
    verdicts = classify([Change("R", "vllm/models/kimi_k3/sampler.py", "vllm/v1/sample/sampler.py")], VLLM)
    assert [(v.side, v.label, v.ok) for v in verdicts] == [("from", "review: sampling", False), ("to", "model", True)]
    assert "needs core-maintainer review" in verdicts[0].reason


def test_deleting_a_shared_file_is_a_change_to_it():
    (v,) = classify([Change("D", "vllm/v1/core/sched/scheduler.py")], VLLM)
    assert not v.ok and v.change == "deleted"


def test_co_change_rule():
    kernel, tol = Change("M", "k3_decode/kernels/kda.py"), Change("M", "suites/tolerances.toml")
    (breach,) = co_change_breaches([kernel, tol, Change("A", "harness/x.py")], HOPPER)
    assert breach.triggers == ("k3_decode/kernels/kda.py",)
    assert breach.forbidden == ("harness/x.py", "suites/tolerances.toml")
    assert co_change_breaches([kernel, Change("M", "suites/grids.toml")], HOPPER) == []
    assert co_change_breaches([Change("M", "k3_decode/reference/kda.py"), tol], HOPPER) == []
    assert co_change_breaches([tol, Change("M", "harness/cli.py")], HOPPER) == []
    # A rename that moves a kernel file still triggers the rule through its old path.
    moved = Change("R", "k3_decode/attic/kda.py", "k3_decode/kernels/kda.py")
    assert co_change_breaches([moved, tol], HOPPER)
