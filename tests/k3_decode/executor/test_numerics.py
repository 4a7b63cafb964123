"""The executor's layers against the reference decoder's, layer by layer and teacher-forced, on the CPU at k3-mini dims.

Contexts are prefilled through the executor itself (the stock path, token by token), so the decode step reads KDA
states and MLA rows the executor wrote; the oracle gets copies of them as they were before the step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3_decode.executor import StepRequest, random_input
from k3_decode.executor.oracle import teacher_forced
from tests.k3_decode.executor.helpers import (
    build,
    decode_requests,
    layer_failures,
    oracle_failures,
    prefill,
    snapshot,
)


@pytest.mark.parametrize(
    ("stack", "tp"),
    [("k3-mini-kda3-mla", 1), ("k3-mini-kda3-mla", 2), ("k3-mini-dense-start", 1)],
    ids=["kda3-mla-tp1", "kda3-mla-tp2", "dense-start-tp1"],
)
def test_decode_step_matches_the_oracle_layer_by_layer(stack: str, tp: int) -> None:
    ex = build(stack, tp)
    prefill(ex, {0: 3, 1: 5, 3: 2})
    # Rows out of request order, and request 2 has no context: its first token attends to itself only.
    reqs = decode_requests(ex, [3, 0, 2, 1], seed=7)
    assert oracle_failures(ex, reqs) == []


def test_a_second_decode_step_reads_the_state_the_first_wrote() -> None:
    ex = build()
    prefill(ex, {0: 4, 1: 2})
    ex.step(decode_requests(ex, [0, 1], seed=1))
    assert ex.state.context_lens[:2] == [5, 3]
    assert oracle_failures(ex, decode_requests(ex, [1, 0], seed=2)) == []


def test_the_layer_check_fails_when_the_executor_reads_another_requests_state() -> None:
    """The comparison must be able to fail: give the oracle another request set's slots and pages."""
    ex = build()
    prefill(ex, {0: 4, 1: 6, 2: 3})
    reqs = decode_requests(ex, [0, 1], seed=3)
    other = snapshot(ex, decode_requests(ex, [1, 2], seed=3))
    wrong = dataclasses.replace(snapshot(ex, reqs), tables=other.tables)
    result = ex.step(reqs, trace=True)
    assert result.trace is not None
    failures = layer_failures(result.trace, teacher_forced(ex.dims, 1, ex.weights, result.trace, wrong))
    assert any("attn_output" in f for f in failures), failures


def test_the_layer_check_fails_on_a_swapped_layer_weight(monkeypatch) -> None:
    """A layer run with another layer's o_proj must be named by the check (weights are shared: restored after)."""
    ex = build()
    prefill(ex, {0: 2})
    w5, w6 = ex.weights[5].attention, ex.weights[6].attention
    monkeypatch.setattr(w5, "o_proj", w6.o_proj)
    reqs = decode_requests(ex, [0], seed=4)
    before = snapshot(ex, reqs)
    result = ex.step(reqs, trace=True)
    monkeypatch.undo()  # the oracle reads the real layer-5 weights
    assert result.trace is not None
    failures = layer_failures(result.trace, teacher_forced(ex.dims, 1, ex.weights, result.trace, before))
    assert any(f.startswith("layer 5 attn_output") for f in failures), failures


def test_prefill_outputs_equal_decoding_the_same_tokens_one_by_one() -> None:
    """A prefill step runs its tokens through the decode kernels in order: the same numbers as decode steps."""
    a, b = build(), build()
    first = a.config.layers[0]
    ctx = random_input(a.dims, first, 4, seed=11)
    pre = a.prefill({2: ctx}).outputs[2]
    steps = [b.step([StepRequest(2, ctx.rows(slice(t, t + 1)))]).outputs[2] for t in range(4)]
    assert torch.equal(pre, torch.cat(steps))
    for layer in a.config.kda_layers:
        assert torch.equal(a.state.kda[layer].recurrent, b.state.kda[layer].recurrent)
    for layer in a.config.mla_layers:
        assert torch.equal(a.state.mla[layer], b.state.mla[layer])
