"""Verify graphs of a speculative stack, the host side, on the CPU at k3-mini dims: capture and replay through a
stand-in for CUDA graphs (`EagerGraphs`, which re-runs the captured iteration on the graph's own buffers with the
capture's rows, split count and plan), so the tables, the NULL padding, the accepted counts of each step, the
ledger, the op log, the write sets and the one-line errors are checked without CUDA.

What the stand-in cannot show is that a real graph reads every per-step value from its buffers instead of a host
value baked in at capture (it re-runs Python at every replay); tests/k3_decode/executor/test_gpu.py does, on an H200.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor

from k3_decode.executor import StackExecutor, StepRequest, load_stack, plan_memory, random_input
from k3_decode.executor.audit import audit_capture, audit_step, op_log_mismatches
from k3_decode.isolation_redteam import RedTeamKdaProvider, private_scope, private_table
from k3_decode.runtime.backend import ProviderRegistry
from k3_decode.runtime.writeset import scratch_name
from k3_decode.stock import mla
from tests.k3_decode.executor.helpers import stack_weights

STACK = "k3-mini-kda3-mla"
K = 2  # speculative tokens: q = 3
Q = K + 1
LENGTHS = {0: 3, 1: 5, 2: 2, 3: 4}  # prefill lengths: max_context 48 leaves room for the steps below


class _Replay:
    def __init__(self, ex: StackExecutor, run: Callable[[], Tensor], output: Tensor) -> None:
        self.ex, self.run, self.output = ex, run, output

    def replay(self) -> None:
        # A CUDA graph's replay runs no Python, so it logs nothing: what the re-run logs is dropped. Its output lands
        # in the tensor the capture returned, which a graph rewrites.
        logged, where = len(self.ex.op_log), self.ex._where
        out = self.run()
        del self.ex.op_log[logged:]
        self.ex._where = where
        self.output.copy_(out)


@contextlib.contextmanager
def _no_context_attends_nothing() -> Iterator[None]:
    """The torch-cpu MLA attention cannot take an iteration in which no row has any context (its max over zero
    positions raises), which only a graph's all-NULL warm-up and capture run, and only here, as the CPU captures
    nothing for real. There it gives what the Triton kernels give a row of seq_len 0: zeros."""
    attend = mla._attend_torch

    def guarded(query: Tensor, cache: Tensor, paged: mla.PagedLatentCache, latent: int, *args: Any) -> Tensor:
        if int(paged.seq_lens.max()) == 0:
            return torch.zeros(*query.shape[:2], latent, dtype=mla.ACT_DTYPE, device=query.device)
        return attend(query, cache, paged, latent, *args)

    with mock.patch.object(mla, "_attend_torch", guarded):
        yield


class EagerGraphs:
    """CUDA graphs' stand-in (StackExecutor.graph_runtime): the warm-up runs the iteration, the capture runs it once
    more (a capture runs the Python, which is what the op log records) and keeps it for its replays."""

    def __init__(self, ex: StackExecutor) -> None:
        self.ex = ex

    def warm_up(self, run: Callable[[], Tensor]) -> None:
        with _no_context_attends_nothing():
            run()

    def capture(self, run: Callable[[], Tensor]) -> tuple[_Replay, Tensor]:
        with _no_context_attends_nothing():
            output = run()
        return _Replay(self.ex, run, output), output


def _start(k: int = K, graphs: bool = True, **kwargs: Any) -> StackExecutor:
    config = load_stack(STACK, 1, num_speculative_tokens=k)
    ex = StackExecutor.start(config, device="cpu", weights=stack_weights(STACK, 1), log=lambda line: None, **kwargs)
    if graphs:
        ex.graph_runtime = EagerGraphs(ex)
    first = ex.config.layers[0]
    ex.prefill({r: random_input(ex.dims, first, n, seed=10 + r) for r, n in LENGTHS.items()})
    return ex


def _honest() -> StackExecutor:
    registry = ProviderRegistry()
    registry.register(RedTeamKdaProvider("honest"))
    return _start(
        additional_config={"decode_backend": "latency_specialized"}, registry=registry, scope=private_scope(),
        table=private_table(),
    )  # fmt: skip


def _requests(ex: StackExecutor, accepted: Mapping[int, int | None], seed: int, tokens: int = Q) -> list[StepRequest]:
    first = ex.config.layers[0]
    return [
        StepRequest(r, random_input(ex.dims, first, tokens, seed=seed + r), num_accepted=a) for r, a in accepted.items()
    ]


def _state(ex: StackExecutor) -> list[Any]:
    kda = [t.clone() for c in ex.state.kda.values() for t in (c.conv, c.recurrent)]
    return [*kda, *(c.clone() for c in ex.state.mla.values()), list(ex.state.context_lens), list(ex.state.unconfirmed)]


def _same(a: list[Any], b: list[Any]) -> bool:
    return all(torch.equal(x, y) if isinstance(x, Tensor) else x == y for x, y in zip(a, b, strict=True))


def _rms_rel(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).square().mean().sqrt() / b.square().mean().sqrt())


def test_without_cuda_a_speculative_stack_refuses_capture_and_graph_steps() -> None:
    ex = _start(graphs=False)
    assert ex.graph_runtime is None
    before, records = _state(ex), len(ex.ledger.records())
    with pytest.raises(ValueError, match=r"^CUDA graphs need a CUDA device; this executor runs on cpu$"):
        ex.capture(2)
    with pytest.raises(ValueError, match=r"no captured graph holds 1 requests \(captured batches: \[\]\); call capt"):
        ex.step(_requests(ex, {0: 1}, seed=1), mode="graph")
    assert not ex.graphs and len(ex.ledger.records()) == records and _same(_state(ex), before)


def test_graph_verify_steps_are_the_eager_verify_steps_with_each_steps_accepted_counts() -> None:
    """Three replays of one B4 graph (every request live) against eager verify steps of the same requests from the
    same state: the same bits out and the same state after each, so every step's slot tables and accepted counts
    (1 after the prefill, then q, 1 and 2 mixed) reach the graph through its buffers and its output is sliced per
    request. The MLA split count is the same for both (one split at k3-mini's contexts), checked below."""
    graph, eager = _start(), _start()
    name = graph.capture(4)
    g = graph.graphs[name]
    assert name == "B4q3" and (g.batch, g.tokens_per_request, g.buffers.rows) == (4, Q, 4 * Q)
    assert _same(_state(graph), _state(eager))  # warm-up and capture ran on NULL padding only
    for i, accepted in enumerate(({0: 1, 1: 1, 2: 1, 3: 1}, {0: Q, 1: 1, 2: 2, 3: Q}, {0: 2, 1: Q, 2: 1, 3: 2})):
        reqs = _requests(graph, accepted, seed=100 + 10 * i)
        longest = max(graph.state.verify_context(r, a) for r, a in accepted.items()) + Q
        assert g.num_splits == eager.attention.mla_num_splits(4 * Q, longest)
        got = graph.step(reqs, mode="graph")
        want = eager.step(reqs)
        assert (got.graph, want.graph) == (name, None)
        assert got.plan.step.num_accepted == want.plan.step.num_accepted == tuple(accepted.values())
        assert all(torch.equal(got.outputs[r], want.outputs[r]) for r in accepted), f"step {i}"
        assert all(got.outputs[r].shape == (Q, graph.dims.hidden_size) for r in accepted)
        assert _same(_state(graph), _state(eager)), f"step {i}"
    assert graph.state.context_lens[:4] == [3 + Q + 2, 5 + 1 + Q, 2 + 2 + 1, 4 + Q + 2]


def test_a_padded_graph_verify_step_writes_only_its_requests_state() -> None:
    """Two live requests in the B4 graph after a step of four: rows of requests 2 and 3 become NULL padding, and
    the audit (every owned tensor outside the declared write set) sees no write to their slots or cache rows, nor to
    the NULL slot, even though the previous replay left their slots in the graph's tables. The live requests
    agree with an eager step of theirs (other row counts: within the stack's BF16 rounding level)."""
    ex, eager = _start(), _start()
    assert audit_capture(ex, 4, method="copy").passed  # the warm-up and capture on NULL padding write nothing
    name = ex.graph_name(4)
    full = _requests(ex, dict.fromkeys(range(4), 1), seed=20)
    ex.step(full, mode="graph")
    eager.step(full)
    for i, accepted in enumerate(({0: Q, 3: 2}, {0: 1, 3: Q})):
        reqs = _requests(ex, accepted, seed=30 + 10 * i)
        audited = audit_step(ex, reqs, mode="graph", method="copy")
        assert audited.passed, audited.summary()
        assert audited.result.graph == name and audited.result.plan.step.batch == 4
        scratch = {r.tensor for r in audited.declared.regions if r.tensor.startswith("scratch.")}
        assert scratch_name(f"graph.{name}.num_accepted") in scratch and not any(".eager." in t for t in scratch)
        b = ex.graphs[name].buffers
        assert b.num_accepted is not None and b.num_accepted[:4].tolist() == [*accepted.values(), 1, 1]
        assert b.kda_slots.tolist() == [*ex.state.kda_slots(0), *ex.state.kda_slots(3), *[0] * (2 * Q)]
        assert b.slot_mapping[2 * Q :].tolist() == [-1] * (2 * Q) and b.seq_lens[2 * Q :].tolist() == [0] * (2 * Q)
        want = eager.step(reqs)
        for r in accepted:
            assert _rms_rel(audited.result.outputs[r], want.outputs[r]) < 1e-2
    assert ex.state.context_lens[:4] == eager.state.context_lens[:4] == [3 + Q + 1, 5, 2, 4 + 2 + Q]
    assert ex.state.unconfirmed[:4] == [Q, Q, Q, Q]  # 1 and 2 wait for their next step since the full one


def test_the_ledger_records_a_verify_graph_once_and_counts_its_replays() -> None:
    """The warm-up (eager) and the capture (graph B2q3) are recorded as verify iterations of 2 x q rows; the op log
    holds the capture's calls, the stock verify pipeline on [2, q] in each KDA layer, and the op-log join maps them
    by ops.toml [verify]; replays add no record and no op-log entry, only replay counts, and each step's accepted
    counts are in its plan."""
    ex = _start()
    warm = ex._step
    name = ex.capture(2)
    cap = warm + 1
    records = ex.ledger.records()
    by_step = {s: [r for r in records if r.step == s] for s in (warm, cap)}
    assert {(r.mode, r.graph, r.batch, r.tokens_per_request) for r in by_step[warm]} == {("eager", None, 2, Q)}
    assert {(r.mode, r.graph, r.batch, r.tokens_per_request) for r in by_step[cap]} == {("graph", name, 2, Q)}
    warm_note = f"warm-up of {name}: every row is NULL padding, no request state is written"
    assert all(warm_note in r.reason for r in by_step[warm])
    note = f"verify of q={Q}: KDA states read from slot[b, a-1], num_accepted a copied into the graph's buffers"
    assert all(note in r.reason for r in by_step[cap])
    verify_calls = [(e.layer, e.graph, e.record.batch, e.record.tokens_per_request)
                    for e in ex.op_log if e.step == cap and e.record.op == "kda_verify"]  # fmt: skip
    assert verify_calls == [(i, name, 2, Q) for i in ex.config.kda_layers]
    logged = len(ex.op_log)
    steps = []
    for i, accepted in enumerate(({0: 1, 1: 1}, {0: Q, 1: 2}, {1: 1})):
        result = ex.step(_requests(ex, accepted, seed=40 + 10 * i), mode="graph")
        assert (result.graph, result.plan.step.mode, result.plan.step.batch) == (name, "graph", 2)
        assert result.plan.step.num_accepted == tuple(accepted.values())
        steps.append(result.step)
    assert len(ex.ledger.records()) == len(records) and len(ex.op_log) == logged
    assert ex.ledger.summary()["graphs"][name] == {"captured": len(by_step[cap]), "replays": 3}
    assert {s: ex._verify_steps.get(s) for s in (warm, cap, *steps)} == dict.fromkeys((warm, cap, *steps), Q)
    assert [ex.stock_ops(s, "kda", "kda") for s in (warm, cap)] == [("kda_f_b", "kda_verify")] * 2
    assert op_log_mismatches(ex) == []
    assert ex.state.context_lens[:2] == [3 + Q, 5 + 2 + 1]


def test_a_specialized_verify_graph_captures_the_providers_verify_call() -> None:
    """On the specialized path the capture routes each KDA layer's kda_verify call to the provider (the plan of a
    prepared B2 x q = 6 rows), and a replay is the eager specialized verify step, bit for bit."""
    ex, eager = _honest(), _honest()
    name = ex.capture(2)
    cap = ex._step - 1
    kda = [r for r in ex.ledger.records() if r.graph == name and r.op == "kda"]
    assert len(kda) == 3 and all(r.path == "specialized" for r in kda)
    called = [(e.layer, e.record.op, e.record.batch, e.record.tokens_per_request)
              for e in ex.op_log if e.step == cap and e.source == "provider"]  # fmt: skip
    assert called == [(i, "redteam-kda-honest", 2, Q) for i in ex.config.kda_layers]
    for i, accepted in enumerate(({0: 1, 2: 1}, {0: 2, 2: Q})):
        reqs = _requests(ex, accepted, seed=50 + 10 * i)
        got, want = ex.step(reqs, mode="graph"), eager.step(reqs)
        assert got.plan.path == want.plan.path == "specialized"
        assert all(torch.equal(got.outputs[r], want.outputs[r]) for r in accepted)
        assert _same(_state(ex), _state(eager))
    assert op_log_mismatches(ex) == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda ex: _requests(ex, {0: 1, 1: 1, 2: 1}, seed=1),
            r"no captured graph holds 3 requests \(captured batches: \[2\]\); call capture\(3\) first or run the step "
            "with mode='eager'",
        ),
        (
            lambda ex: [StepRequest(0, random_input(ex.dims, ex.config.layers[0], 2, seed=1), prefill=True)],
            r"a CUDA-graph step of this speculative stack is a verify step \(q = 3 tokens per request, each with "
            r"num_accepted\); run prefill steps with mode='eager'",
        ),
        (lambda ex: _requests(ex, {0: None}, seed=1), r"verify requests \[0\] give no num_accepted"),
        (lambda ex: _requests(ex, {0: 1}, seed=1, tokens=1), r"this stack verifies q = 3 tokens per request"),
        (lambda ex: [*_requests(ex, {0: 1}, 1), *_requests(ex, {1: 1}, 2, 2)], r"verify steps are uniform"),
        (lambda ex: _requests(ex, {0: 2}, seed=1), r"ran no verify step since their prefill, .* num_accepted=1"),
        (lambda ex: _requests(ex, {0: Q + 1}, seed=1), r"num_accepted must be in 1\.\.3"),
    ],
    ids=["too-many-live", "prefill", "no-accepted", "decode", "non-uniform", "fresh-accepted", "accepted-range"],
)
def test_a_bad_graph_verify_step_is_a_one_line_error_before_anything_runs(make, message: str) -> None:
    ex = _start()
    name = ex.capture(2)
    buffers = {k: t.clone() for k, t in ex.graphs[name].buffers.tensors().items()}
    before = (_state(ex), len(ex.ledger.records()), len(ex.op_log), ex._step, dict(ex._verify_steps))
    with pytest.raises(ValueError, match=message) as err:
        ex.step(make(ex), mode="graph")
    assert "\n" not in str(err.value)
    after = (_state(ex), len(ex.ledger.records()), len(ex.op_log), ex._step, dict(ex._verify_steps))
    assert _same(after[0], before[0]) and after[1:] == before[1:]
    assert ex.ledger.summary()["graphs"][name]["replays"] == 0
    assert all(torch.equal(t, buffers[k]) for k, t in ex.graphs[name].buffers.tensors().items())


def test_a_graph_verify_step_keeps_no_trace_and_declares_only_with_a_graph() -> None:
    ex = _start()
    reqs = _requests(ex, {0: 1}, seed=1)
    with pytest.raises(ValueError, match=r"no captured graph holds 1 requests"):
        ex.declare(reqs, "graph")
    ex.capture(1)
    with pytest.raises(ValueError, match=r"a CUDA-graph step keeps no per-layer trace; run it eagerly"):
        ex.step(reqs, mode="graph", trace=True)
    assert ex.state.unconfirmed[0] == 0 and ex.ledger.summary()["graphs"]["B1q3"]["replays"] == 0


def test_benchmarks_load_a_verify_graph_and_replay_it_without_advancing() -> None:
    """load_graph_inputs puts a verify step's tables (the requests' q slots, their accepted counts, NULL padding)
    into a graph of all layers or of some of them; replay() counts replays and advances no request."""
    ex = _start()
    whole, part = ex.capture(2), ex.capture(2, (4, 5))
    assert (whole, part) == ("B2q3", "B2q3.L4-5")
    reqs = _requests(ex, {3: 1}, seed=2)
    for name in (whole, part):
        ex.load_graph_inputs(name, reqs)
        b = ex.graphs[name].buffers
        assert b.kda_slots.tolist() == [*ex.state.kda_slots(3), 0, 0, 0]
        assert b.num_accepted is not None and b.num_accepted[:2].tolist() == [1, 1]
        assert torch.equal(b.entry_prefix[:Q], reqs[0].inputs.prefix)
        ex.replay(name, times=2)
        assert ex.ledger.summary()["graphs"][name]["replays"] == 2
    assert ex.state.context_lens[3] == LENGTHS[3] and ex.state.unconfirmed[3] == 0
    prefill = [StepRequest(3, random_input(ex.dims, 4, 2, seed=3), prefill=True)]
    with pytest.raises(ValueError, match=r"graph B2q3 is a verify graph of q = 3; give it verify requests"):
        ex.load_graph_inputs(whole, prefill)
    with pytest.raises(ValueError, match=r"3 requests do not fit a verify batch of 2; use a larger graph batch"):
        ex.load_graph_inputs(whole, _requests(ex, {0: 1, 1: 1, 2: 1}, seed=4))


def test_the_memory_plan_gives_every_step_buffer_q_rows_per_request() -> None:
    """The eager buffers and every verify graph's hold q rows per request, so the scratch a speculative stack plans
    is q times the plain stack's, and covers what the executor holds once every graph batch is captured."""
    configs = [load_stack(STACK, 1, num_speculative_tokens=k) for k in (0, K)]
    scratch = [next(line.bytes for line in plan_memory(c).lines if line.part == "scratch") for c in configs]
    assert scratch[1] == Q * scratch[0]
    spec = _start()
    for batch in spec.config.graph_batches:
        spec.capture(batch)
    held = [spec.eager, *(g.buffers for g in spec.graphs.values())]
    assert sum(b.rows for b in held) == (spec.config.max_requests + sum(spec.config.graph_batches)) * Q
    assert scratch[1] >= sum(t.nbytes for b in held for t in b.tensors().values())
