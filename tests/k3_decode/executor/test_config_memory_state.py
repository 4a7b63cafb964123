"""Stack configs, the memory plan (numbers, printing, refusal) and the per-request slot tables."""

from __future__ import annotations

import pytest
import torch

from k3_decode.config import ShardError
from k3_decode.executor import (
    DeviceBudget,
    MemoryPlanError,
    StackConfigError,
    StackExecutor,
    load_stack,
    plan_memory,
    stack_names,
)
from k3_decode.executor.state import RequestState
from k3_decode.weights import memory_bytes
from tests.k3_decode.executor.helpers import build, stack_weights

# --- configs ---------------------------------------------------------------------------------------------------


def test_every_shipped_stack_loads_at_each_tp_it_is_meant_for() -> None:
    for name in stack_names():
        for tp in (8, 16) if name.startswith("k3-") and "mini" not in name else (1, 2):
            config = load_stack(name, tp)
            assert config.layers == tuple(range(config.layers[0], config.layers[-1] + 1))
    kinds = [load_stack("k3-kda3-mla", 8).dims.layer_kind(i) for i in load_stack("k3-kda3-mla", 8).layers]
    assert kinds == ["kda", "kda", "kda", "mla"]


@pytest.mark.parametrize(
    ("name", "tp", "overrides", "error", "match"),
    [
        ("nope", 8, {}, StackConfigError, "unknown stack 'nope'"),
        ("k3-kda3-mla", 8, {"layers": [4, 6]}, StackConfigError, "not consecutive"),
        ("k3-kda3-mla", 8, {"layers": [92, 93]}, StackConfigError, "outside k3's 0..92"),
        ("k3-kda3-mla", 8, {"graph_batches": [1, 128]}, StackConfigError, "exceeds max_requests 64"),
        ("k3-kda3-mla", 8, {"max_context": 0}, StackConfigError, "max_context must be >= 1"),
        ("k3-kda3-mla", 8, {"rank": 8}, StackConfigError, "rank 8 is outside 0..7"),
        ("k3-kda3-mla", 8, {"colour": 1}, StackConfigError, "unknown stack field 'colour'"),
        ("k3-mini-kda3-mla", 16, {}, ShardError, "TP=16 is not supported"),
    ],
)
def test_bad_stacks_get_one_line_errors(name, tp, overrides, error, match) -> None:
    with pytest.raises(error, match=match) as info:
        load_stack(name, tp, **overrides)
    assert "\n" not in str(info.value)


# --- memory plan -----------------------------------------------------------------------------------------------


def test_the_plan_counts_what_the_executor_allocates() -> None:
    lines: list[str] = []
    ex = build(log=lines.append)
    plan = ex.memory
    assert lines and lines[0].startswith("memory plan: k3-mini TP1") and lines[0].rstrip().endswith(": fits")
    for line in plan.lines:
        if line.part == "kda_state":
            cache = ex.state.kda[line.layer]
            assert line.bytes == cache.conv.nbytes + cache.recurrent.nbytes
        elif line.part == "mla_cache":
            assert line.bytes == ex.state.mla[line.layer].nbytes
        elif line.part in ("weights", "experts"):
            held = ex.weights[line.layer].tensors()
            is_expert = {n: n.startswith(("mlp.w13", "mlp.w2")) for n in held}
            want = sum(t.nbytes for n, t in held.items() if is_expert[n] == (line.part == "experts"))
            assert line.bytes == want, line
    scratch = next(line for line in plan.lines if line.part == "scratch")
    assert scratch.bytes >= sum(t.nbytes for t in ex.eager.tensors().values())


def test_real_k3_stacks_fit_one_h200_with_the_expected_weight_bytes() -> None:
    for tp in (8, 16):
        plan = plan_memory(load_stack("k3-kda3-mla", tp))
        assert plan.fits
        layer = memory_bytes(plan.config.dims, tp, "kda", "moe")
        assert sum(line.bytes for line in plan.lines if line.layer == 4 and line.part != "kda_state") == layer.total
    # k3_facts 1.3: one routed expert is 2.19 MB at TP8, the KDA attention about 112.6 MB.
    experts = next(line for line in plan_memory(load_stack("k3-kda3-mla", 8)).lines if line.part == "experts")
    assert abs(experts.bytes / 896 - 2.19e6) < 0.01e6


def test_the_whole_k3_model_at_tp8_is_refused_in_one_line() -> None:
    config = load_stack("k3-kda3-mla", 8, layers=tuple(range(93)))
    plan = plan_memory(config)
    assert not plan.fits
    with pytest.raises(MemoryPlanError, match=r"needs 2\d\d\.\d\d GB .* but one H200 has 150.75 GB; use fewer") as e:
        plan.check()
    assert "\n" not in str(e.value)


def test_the_executor_refuses_a_stack_that_does_not_fit_after_printing_the_plan() -> None:
    lines: list[str] = []
    with pytest.raises(MemoryPlanError, match=r"but one tiny has 1\.00 MB"):
        StackExecutor.start(
            load_stack("k3-mini-kda3-mla", 1),
            budget=DeviceBudget("tiny", 1_000_000, 0),
            weights=stack_weights("k3-mini-kda3-mla", 1),
            log=lines.append,
        )
    assert "DOES NOT FIT" in lines[0]


# --- request state ---------------------------------------------------------------------------------------------


def state(**overrides) -> RequestState:
    return RequestState(load_stack("k3-mini-kda3-mla", 1, **overrides), torch.device("cpu"))


def test_tables_give_each_request_its_slot_and_pages_and_pad_with_null_rows() -> None:
    s = state()  # 6 requests, page size 4, 12 pages each
    s.context_lens[3] = 9  # the new token is position 9: page index 2, offset 1
    t = s.tables([3, 0], rows=4)
    assert t.kda_slots.tolist() == [4, 1, 0, 0]
    assert t.seq_lens.tolist() == [10, 1, 0, 0]
    assert t.slot_mapping.tolist() == [(2 * 6 + 3) * 4 + 1, 0, -1, -1]
    assert t.block_table[0].tolist() == [j * 6 + 3 for j in range(12)]
    assert t.block_table[2:].abs().sum() == 0
    assert t.max_seq_len == 10


@pytest.mark.parametrize(
    ("requests", "rows", "match"),
    [([1, 1], None, "twice"), ([6], None, "outside 0..5"), ([0, 1, 2], 2, "do not fit 2 rows")],
)
def test_bad_tables_are_refused(requests, rows, match) -> None:
    with pytest.raises(ValueError, match=match):
        state().tables(requests, rows)


def test_a_request_cannot_pass_max_context() -> None:
    s = state()
    s.context_lens[2] = s.config.max_context
    with pytest.raises(ValueError, match="beyond max_context 48"):
        s.tables([2])


def test_a_synthetic_context_writes_only_its_requests_pages_and_slots() -> None:
    s = state()
    s.fill_synthetic([1, 4], length=10, seed=3)
    assert s.context_lens == [0, 10, 0, 0, 10, 0]
    for cache in s.kda.values():
        written = (cache.recurrent.flatten(1).abs().sum(1) > 0).nonzero().flatten().tolist()
        assert written == [2, 5]
    for cache in s.mla.values():
        used = (cache.flatten(1) != 0).any(1).nonzero().flatten().tolist()
        assert used == sorted(j * 6 + r for r in (1, 4) for j in range(3))
        assert not bool(torch.isnan(cache.view(torch.float8_e4m3fn).float()).any())
