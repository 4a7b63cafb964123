"""decode_backend parsing, the provider registry, and the refusal of latency_specialized without kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3_decode.config import K3
from k3_decode.executor.executor import ProviderTarget
from k3_decode.kernels import providers
from k3_decode.kernels.providers import not_built_reason
from k3_decode.runtime.backend import PROVIDERS, ProviderRegistry, RowLimit, read_decode_backend, select_backend
from k3_decode.runtime.errors import BackendError, StartupError
from k3_decode.runtime.optable import load_op_table, parse_op_table
from k3_decode.runtime.startup import start

from .helpers import SPECIALIZED, FakeProvider, built_registry, deployment

TABLE = load_op_table()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, "auto"),
        ({}, "auto"),
        ({"mla_core": "auto"}, "auto"),
        ({"decode_backend": "auto"}, "auto"),
        (SPECIALIZED, "latency_specialized"),
    ],
)
def test_reads_backend_like_vllm(config, expected):
    assert read_decode_backend(config) == expected


@pytest.mark.parametrize("value", ["fast", "Auto", "", None, 1, "latency-specialized"])
def test_unknown_backend_is_one_line_error_naming_the_choices(value):
    with pytest.raises(BackendError) as err:
        read_decode_backend({"decode_backend": value})
    msg = str(err.value)
    assert "\n" not in msg
    assert repr(value) in msg and "'auto', 'latency_specialized'" in msg


def test_non_mapping_config_is_an_error():
    with pytest.raises(BackendError, match="must be a mapping"):
        read_decode_backend("latency_specialized")  # type: ignore[arg-type]


@pytest.mark.skipif(not_built_reason() is None, reason="the CuTe DSL kernels can run here (an sm_90 GPU)")
def test_without_a_hopper_gpu_the_specialized_kernels_are_not_built():
    # Where the kernels cannot run, nothing registers and the specialized name must not start (it would run stock).
    with pytest.raises(BackendError) as err:
        start(SPECIALIZED, deployment())
    msg = str(err.value)
    assert PROVIDERS.ops() == frozenset()
    assert "specialized kernels are not built" in msg and "\n" not in msg
    assert f"no provider for attn_res, in_proj, kda, o_proj: {not_built_reason()}" in msg
    assert isinstance(err.value, StartupError) and isinstance(err.value, ValueError)


def test_the_kernels_register_where_they_can_run_and_only_once(monkeypatch):
    reg = ProviderRegistry()
    monkeypatch.setattr(providers, "not_built_reason", lambda: "no CUDA device (test)")
    assert providers.register_built(reg) == "no CUDA device (test)" and reg.ops() == frozenset()
    monkeypatch.setattr(providers, "not_built_reason", lambda: None)
    assert providers.register_built(reg) is None and providers.register_built(reg) is None
    assert reg.ops() == TABLE.specialized_ops() == {"attn_res", "in_proj", "kda", "o_proj"}
    assert {p.name for p in reg} == {"cute-attn-res", "cute-kda-in-proj", "cute-kda-step", "cute-kda-o-proj"}
    assert select_backend(SPECIALIZED, TABLE, reg) == "latency_specialized"


def test_a_provider_refuses_to_bind_off_its_gpu():
    target = ProviderTarget(K3, 8, 0, torch.device("cpu"))
    for provider in providers.PROVIDERS:
        with pytest.raises(providers.ProviderBindError, match="runs on a CUDA device, the stack is on cpu"):
            provider.bind(target)


def test_auto_starts_without_kernels():
    assert start({}, deployment()).backend == "auto"


def test_missing_providers_are_named():
    reg = ProviderRegistry()
    reg.register(FakeProvider("in_proj", "InProj", {"InProj": 1}))
    reg.register(FakeProvider("kda", "Kda", {"Kda": 1}))
    with pytest.raises(BackendError, match=r"no provider for attn_res, o_proj\)"):
        select_backend(SPECIALIZED, TABLE, reg)


def test_full_registry_selects_specialized():
    assert select_backend(SPECIALIZED, TABLE, built_registry()) == "latency_specialized"


def test_table_without_specialized_ops_cannot_select_specialized():
    # Vacuously "built" would mean every step runs stock under the specialized name.
    raw = {p: {"ops": ["x"], "specialized": [], "stock_reason": "not yet"} for p in ("kda", "mla", "dense", "moe")}
    with pytest.raises(BackendError, match="routes no op to the specialized path"):
        select_backend(SPECIALIZED, parse_op_table(raw), built_registry())


def test_registry_rejects_duplicates_and_empty_launches():
    reg = ProviderRegistry()
    reg.register(FakeProvider("kda", "A", {"KdaSplit": 1}))
    with pytest.raises(ValueError, match="already has provider 'A'"):
        reg.register(FakeProvider("kda", "B", {"KdaSplit": 1}))
    with pytest.raises(ValueError, match="must declare each kernel"):
        reg.register(FakeProvider("o_proj", "C", {}))
    with pytest.raises(ValueError, match="must declare each kernel"):
        reg.register(FakeProvider("o_proj", "C", {"Oproj": 0}))


def test_a_row_limit_serves_its_ranges_and_says_why_not_elsewhere():
    up_to = RowLimit.up_to(8, "rows p serves at TP8 (measured)")
    assert [r for r in range(1, 66) if up_to.serves(r)] == list(range(1, 9))
    # the words a 1..N limit always put in the ledger (tests and readers of older ledgers match them)
    assert up_to.stock_reason(16) == "16 rows above the 8 rows p serves at TP8 (measured)"
    gaps = RowLimit(((1, 8), (16, 16), (33, 64)), "rows p serves at TP8 (measured)")
    assert [r for r in range(1, 66) if gaps.serves(r)] == [*range(1, 9), 16, *range(33, 65)]
    assert gaps.describe() == "1-8, 16, 33-64" and gaps.most == 64
    assert gaps.stock_reason(12) == "12 rows outside the 1-8, 16, 33-64 rows p serves at TP8 (measured)"
    assert RowLimit(((4, 8),), "rows w").stock_reason(2) == "2 rows outside the 4-8 rows w"  # below a range too
    assert RowLimit.of((4, "w")) == RowLimit.up_to(4, "w") and RowLimit.of(gaps) is gaps
    assert RowLimit([[1, 2], [4, 4]], "w").ranges == ((1, 2), (4, 4))  # lists, as TOML gives them, become pairs


@pytest.mark.parametrize(
    ("ranges", "says"),
    [
        ((), "1 <= first <= last"),  # serves nothing: keep the op stock in the op table instead
        (((0, 4),), "1 <= first <= last"),
        (((5, 4),), "1 <= first <= last"),
        (((1, 2, 3),), "1 <= first <= last"),
        (((1, True),), "1 <= first <= last"),
        ((4,), "1 <= first <= last"),
        (((1, 8), (8, 9)), "sorted and disjoint"),
        (((16, 16), (1, 8)), "sorted and disjoint"),
    ],
)
def test_a_row_limit_refuses_ranges_the_plan_would_misread(ranges, says):
    with pytest.raises(ValueError, match=says):
        RowLimit(ranges, "w")


def test_the_o_proj_provider_is_registered_and_binds_both_of_its_calls_only_on_a_gpu():
    """It passed its GPU run: in PROVIDERS and the op table specializes o_proj; off a GPU it refuses to bind, naming
    why."""
    pending = next(p for p in providers.PROVIDERS if p.op == "o_proj")
    assert isinstance(pending, providers.CuteKdaOProjProvider) and not providers.PENDING
    assert "o_proj" in TABLE.specialized_ops()
    assert dict(pending.launches) == {"KdaOProjKernel": 1}  # o_proj and the AttnRes after attention: one launch
    # 64 rows at both sizes: above 32 the wgmma build (kda_o_proj_choice.toml wgmma_batches) saved layer time at one
    # block, where the mma.sync build had lost to cuBLAS + AttnRes at TP8 ...
    assert (pending.max_rows(8)[0], pending.max_rows(16)[0]) == (64, 64)
    # ... and the [mixing] limit from two blocks on (the stock AttnRes grows with them) says 64 as well.
    assert pending.layer_max_rows(8, K3, 6)[0] == 64 and pending.layer_max_rows(8, K3, 86)[0] == 64
    assert "wgmma" in pending.layer_max_rows(8, K3, 6)[1] and "mixes 2 or more" in pending.layer_max_rows(8, K3, 86)[1]
    assert {pending.layer_max_rows(8, K3, layer)[0] for layer in range(12, 91)} == {64}
    # What the runtime asks (served_rows, layer_served_rows) names the same rows and reasons.
    assert pending.served_rows(8) == RowLimit.of(pending.max_rows(8))
    assert pending.layer_served_rows(8, K3, 86) == RowLimit.of(pending.layer_max_rows(8, K3, 86))
    with pytest.raises(providers.ProviderBindError, match="runs on a CUDA device"):
        pending.bind(ProviderTarget(K3, 8, 0, torch.device("cpu")))


def test_one_launch_hands_the_deferred_o_proj_output_to_the_attn_res_call_only():
    one = providers.OneLaunch()
    o, weight = torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(32, 16, dtype=torch.bfloat16)
    partial = one.defer(o, weight)
    assert partial.shape == (2, 32) and partial.dtype == torch.bfloat16
    got = one.take(partial)
    assert got[0] is o and got[1] is weight and got[2] is partial
    with pytest.raises(providers.FusedCallError, match="got no deferred o_proj call"):
        one.take(partial)  # consumed once
    partial = one.defer(o, weight)
    with pytest.raises(providers.FusedCallError, match="got another tensor"):
        one.take(partial.clone())  # e.g. an all-reduce's result: not the buffer the launch writes
    one.defer(o, weight)
    with pytest.raises(providers.FusedCallError, match="called again before"):
        one.defer(o, weight)
    one.defer(o, weight)  # a refused order leaves nothing behind


def test_the_o_proj_provider_defers_o_proj_to_its_attn_res_call_and_refuses_combined_partials(monkeypatch):
    """Its two calls as the executor makes them (off a GPU, so nothing launches): o_proj hands back a buffer, the
    AttnRes call refuses any other tensor, and a stack that all-reduces the partials is refused at the o_proj call."""
    pending = next(p for p in providers.PROVIDERS if p.op == "o_proj")
    monkeypatch.setattr(providers, "_check_target", lambda target, what: None)
    combined = {"now": False}
    fns = pending.bind(ProviderTarget(K3, 8, 0, torch.device("cpu"), lambda: combined["now"]))
    assert sorted(fns) == ["attn_res_after", "kda_o_proj"]
    weights = SimpleNamespace(o_proj=torch.ones(K3.hidden_size, 1536, dtype=torch.bfloat16))
    partial = fns["kda_o_proj"](torch.ones(2, 1536, dtype=torch.bfloat16), weights)
    assert partial.shape == (2, K3.hidden_size)
    with pytest.raises(providers.FusedCallError, match="another tensor"):
        fns["attn_res_after"](None, 6, partial.clone(), None)
    combined["now"] = True
    with pytest.raises(providers.ProviderBindError, match="combines o_proj's partials across ranks"):
        fns["kda_o_proj"](torch.ones(2, 1536, dtype=torch.bfloat16), weights)
