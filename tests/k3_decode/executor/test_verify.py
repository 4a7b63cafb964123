"""Verify steps of a speculative stack on the CPU at k3-mini dims: one iteration of B x q rows equals q decode steps
of the same tokens, layer by layer within the layer tolerances; the state after an acceptance is the state of
decoding exactly the accepted tokens; the ledger, op log and write set say so; bad input is a one-line error.

The equivalence tests run one-layer stacks (a KDA layer, an MLA layer): every step's entry state is fresh, so the
state a layer carries from step to step depends on its own attention inputs only. In a deeper stack a routed expert
that flips between the two paths (a discrete choice; k3_decode/executor/oracle.py) moves the next layer's inputs by
O(1), and comparing two stock paths end to end would judge that flip, not the verify step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest
import torch

from k3_decode.executor import StackConfigError, StackExecutor, StepRequest, load_stack, random_input
from k3_decode.executor.audit import audit_step, op_log_mismatches
from k3_decode.executor.inputs import StackInput
from k3_decode.executor.layer_check import tolerance
from k3_decode.executor.oracle import layer_errors
from k3_decode.isolation_redteam import RedTeamKdaProvider, private_scope, private_table
from k3_decode.reference.decoder import LayerTrace
from k3_decode.runtime.backend import ProviderRegistry
from k3_decode.runtime.writeset import kda_state_name, mla_cache_name
from tests.k3_decode.executor.helpers import stack_weights

STACK = "k3-mini-kda3-mla"
K = 2  # speculative tokens: q = 3
Q = K + 1


def _start(stack: str, k: int, layers: tuple[int, ...] | None = None, **kwargs) -> StackExecutor:
    config = load_stack(stack, 1, num_speculative_tokens=k)
    weights = stack_weights(stack, 1)
    if layers is not None:
        config = dataclasses.replace(config, layers=layers)
        weights = {i: weights[i] for i in layers}
    return StackExecutor.start(config, device="cpu", weights=weights, log=lambda line: None, **kwargs)


def _attention_failures(got: Sequence[LayerTrace], want: Sequence[LayerTrace]) -> list[str]:
    """Each layer's AttnRes and attention outputs outside the layer tolerances (layer_tolerances.toml), or trivial.
    The MLP output is left out: a routed expert may flip between the two paths, which is not the verify's doing."""
    by_layer = {t.layer: t for t in got}
    out = []
    for e in layer_errors(got, want):
        if e.field == "mlp_output":
            continue
        tol = tolerance(e.field, by_layer[e.layer])
        if e.constant or not 0.5 < e.rms_ratio < 2.0 or e.rms_rel > tol.rms_rel or e.peak_rel > tol.peak_rel:
            out.append(f"layer {e.layer} {e.field}: rms_rel {e.rms_rel:.3g} (tol {tol.rms_rel}), peak {e.peak_rel:.3g}")
    return out


def _contexts(ex: StackExecutor, lengths: Mapping[int, int]) -> dict[int, StackInput]:
    first = ex.config.layers[0]
    return {r: random_input(ex.dims, first, n, seed=10 + r) for r, n in lengths.items()}


def _tokens(ex: StackExecutor, requests: Sequence[int], seed: int) -> dict[int, StackInput]:
    first = ex.config.layers[0]
    return {r: random_input(ex.dims, first, Q, seed=seed + r) for r in requests}


def _verify(ex: StackExecutor, tokens: Mapping[int, StackInput], accepted: Mapping[int, int], trace: bool = True):
    return ex.step([StepRequest(r, x, num_accepted=accepted[r]) for r, x in tokens.items()], trace=trace)


def _decode(ex: StackExecutor, tokens: Mapping[int, StackInput], count: Mapping[int, int] | None = None):
    """Decode the first count[r] (default all) tokens of each request one step per token; returns per token step
    (outputs, trace) with the requests in `tokens` order."""
    steps = []
    for t in range(max(count.values()) if count else Q):
        live = [r for r in tokens if count is None or t < count[r]]
        res = ex.step([StepRequest(r, tokens[r].rows(slice(t, t + 1))) for r in live], trace=True)
        steps.append(res)
    return steps


def _request_major(steps: Sequence, requests: Sequence[int]) -> tuple[LayerTrace, ...]:
    """q one-token steps of the same requests, as one trace of request-major (b, t) rows (a verify step's order)."""
    out = []
    for per_layer in zip(*(s.trace for s in steps), strict=True):
        fields = {}
        for name in ("attn_input", "attn_output", "mlp_input", "mlp_output", "expert_ids"):
            parts = [getattr(tr, name) for tr in per_layer]
            fields[name] = None if parts[0] is None else torch.stack(parts, dim=1).flatten(0, 1)
        out.append(dataclasses.replace(per_layer[0], **fields))
    return tuple(out)


def _output_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize(
    ("stack", "layers"),
    [(STACK, (4,)), (STACK, (7,)), ("k3-mini-dense-start", (1,)), ("k3-mini-dense-start", (3,))],
    ids=["kda4", "mla7", "dense-start-kda1", "dense-start-mla3"],
)
def test_a_verify_step_equals_q_decode_steps_layer_by_layer(stack: str, layers: tuple[int, ...]) -> None:
    """After a prefill (num_accepted 1) and after mixed acceptances, each verify step's per-token layer outputs are
    those of decoding the same tokens one by one from the same state, within the layer tolerances: the KDA layers
    through kda_verify, the MLA layer through row expansion (row t sees tokens 0..t of its request)."""
    spec = _start(stack, K, layers)
    lengths = {0: 3, 1: 5, 3: 2} if stack == STACK else {0: 3, 1: 5, 2: 2}
    requests = list(lengths)
    contexts = _contexts(spec, lengths)
    spec.prefill(contexts)
    x1 = _tokens(spec, requests, seed=100)
    got1 = _verify(spec, x1, dict.fromkeys(requests, 1))

    plain = _start(stack, 0, layers)
    plain.prefill(contexts)
    want1 = _decode(plain, x1)
    assert got1.trace is not None
    assert _attention_failures(got1.trace, _request_major(want1, requests)) == []

    # Mixed acceptance: all q, one, two. A second plain executor decodes exactly the accepted tokens, then the new
    # ones: the verify step must read the state after the accepted tokens (slot[b, a-1], context + a).
    accepted = dict(zip(requests, (Q, 1, 2), strict=True))
    x2 = _tokens(spec, requests, seed=200)
    got2 = _verify(spec, x2, accepted)
    ref = _start(stack, 0, layers)
    ref.prefill(contexts)
    _decode(ref, x1, accepted)
    want2 = _decode(ref, x2)
    assert got2.trace is not None
    assert _attention_failures(got2.trace, _request_major(want2, requests)) == []
    for r in requests:
        assert spec.state.context_lens[r] == lengths[r] + accepted[r]


def test_the_state_after_a_chain_of_acceptances_is_that_of_decoding_the_accepted_tokens() -> None:
    """Three verify steps with varied counts (q, then 1, then 2 for one request; 2, q, 1 for the other): the last
    step's outputs match decode-only execution of exactly the accepted tokens. Reading slot a instead of a - 1, or
    advancing the context by the wrong count, moves them by O(1)."""
    spec = _start(STACK, K, (4,))
    lengths = {2: 4, 4: 1}
    contexts = _contexts(spec, lengths)
    spec.prefill(contexts)
    ref = _start(STACK, 0, (4,))
    ref.prefill(contexts)
    counts = [{2: 1, 4: 1}, {2: Q, 4: 2}, {2: 1, 4: Q}, {2: 2, 4: 1}]  # counts[i]: what step i reports of step i-1
    previous: dict[int, StackInput] | None = None
    last = None
    for i, accepted in enumerate(counts):
        x = _tokens(spec, list(lengths), seed=300 + 10 * i)
        if previous is not None:
            _decode(ref, previous, accepted)
        last = _verify(spec, x, accepted)
        previous = x
    assert previous is not None and last is not None and last.trace is not None
    want = _decode(ref, previous)
    assert _attention_failures(last.trace, _request_major(want, list(lengths))) == []
    # The committed contexts: the prefill, plus what each later step accepted of its predecessor.
    assert [spec.state.context_lens[r] for r in lengths] == [4 + Q + 1 + 2, 1 + 2 + Q + 1]
    assert [spec.state.unconfirmed[r] for r in lengths] == [Q, Q]


def _honest(k: int = K) -> StackExecutor:
    registry = ProviderRegistry()
    registry.register(RedTeamKdaProvider("honest"))
    return _start(
        STACK, k, additional_config={"decode_backend": "latency_specialized"}, registry=registry,
        scope=private_scope(), table=private_table(),
    )  # fmt: skip


def test_the_ledger_records_a_uniform_verify_and_the_provider_runs_its_verify_call() -> None:
    ex = _honest()
    ex.prefill(_contexts(ex, {0: 3, 1: 2}))
    step = ex._step
    result = _verify(ex, _tokens(ex, [0, 1], seed=5), {0: 1, 1: 1}, trace=False)
    assert result.plan.path == "specialized" and result.plan.tokens_per_request == Q
    records = [r for r in ex.ledger.records() if r.step == step]
    assert {(r.batch, r.tokens_per_request, r.mode) for r in records} == {(2, Q, "eager")}
    kda = [r for r in records if r.op == "kda"]
    assert len(kda) == 3 and all(r.path == "specialized" for r in kda)
    assert all(r.reason.startswith(f"uniform verify, batch 2 x q {Q} = {2 * Q} rows prepared") for r in kda)
    assert all("num_accepted a = [1, 1]" in r.reason for r in records)
    called = [(e.layer, e.record.op, e.record.batch, e.record.tokens_per_request) for e in ex.op_log if e.step == step]
    assert [c for c in called if c[1] == "redteam-kda-honest"] == [(i, "redteam-kda-honest", 2, Q) for i in (4, 5, 6)]
    assert op_log_mismatches(ex) == []
    # The provider's verify against the stock verify of the same state: the reference math in FP32.
    stock = _start(STACK, K)
    stock.prefill(_contexts(stock, {0: 3, 1: 2}))
    want = _verify(stock, _tokens(stock, [0, 1], seed=5), {0: 1, 1: 1}, trace=False)
    assert 0 < _output_rel(result.outputs[1], want.outputs[1]) < 3e-2
    # On the stock executor the op log shows the stock verify pipeline, joined with the ledger by ops.toml [verify].
    stock_ops = {e.record.op for e in stock.op_log if e.step == want.step and e.ops == ("kda",)}
    assert stock_ops == {"kda_f_b", "kda_verify"} and op_log_mismatches(stock) == []


def test_the_write_set_names_each_requests_q_slots_and_q_cache_rows() -> None:
    ex = _start(STACK, K)
    ex.prefill(_contexts(ex, {0: 3, 1: 5, 2: 2}))
    _verify(ex, _tokens(ex, [0, 1], seed=1), {0: 1, 1: 1}, trace=False)
    reqs = [StepRequest(r, x, num_accepted=a) for (r, x), a in zip(_tokens(ex, [1, 0], 2).items(), (2, Q), strict=True)]
    declared = ex.declare(reqs)
    conv, rec = kda_state_name(4, "conv"), kda_state_name(4, "recurrent")
    width = ex.dims.kda.conv_width
    # Request r owns slots 1 + r q + t; the conv row lives in its first slot and W - 2 + q columns are rewritten.
    assert [str(r) for r in declared.of(conv)] == [f"{conv}[{s}:{s + 1}, :, 0:{width - 2 + Q}]" for s in (1, 4)]
    assert [r.index[0] for r in declared.of(rec)] == [(s, s + 1) for s in (1, 2, 3, 4, 5, 6)]
    # MLA rows: positions ctx + a .. ctx + a + q - 1 of each request (request 1: 5 + 2, request 0: 3 + q).
    page_size, pages = ex.config.page_size, ex.config.max_requests
    want = set()
    for r, start in ((1, 5 + 2), (0, 3 + Q)):
        for pos in range(start, start + Q):
            page = (pos // page_size) * pages + r
            want.add(((page, page + 1), (pos % page_size, pos % page_size + 1)))
    assert {r.index for r in declared.of(mla_cache_name(7))} == want
    audited = audit_step(ex, reqs, method="copy")
    assert audited.passed, audited.summary()  # nothing outside it changed: other requests' slots, request 2's
    assert audited.declared == declared


def _one(ex: StackExecutor, tokens: int = Q, accepted: int | None = 1, request: int = 0, **kw) -> StepRequest:
    return StepRequest(request, random_input(ex.dims, ex.config.layers[0], tokens, seed=9), num_accepted=accepted, **kw)


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        (lambda ex: [_one(ex), _one(ex, Q - 1, request=1)], r"verify steps are uniform, but this one has 2, 3"),
        (lambda ex: [_one(ex, accepted=0)], r"num_accepted must be in 1\.\.3 \(q of this stack\)"),
        (lambda ex: [_one(ex, accepted=Q + 1)], r"num_accepted must be in 1\.\.3"),
        (lambda ex: [_one(ex, accepted=None)], r"verify requests \[0\] give no num_accepted; pass, per request"),
        (lambda ex: [_one(ex, Q + 1)], r"exceeds this stack's q = 3 .* num_speculative_tokens=3"),
        (lambda ex: [_one(ex, 1)], r"this stack verifies q = 3 tokens per request .* num_speculative_tokens=0"),
        (lambda ex: [_one(ex, accepted=2)], r"ran no verify step since their prefill, .* pass num_accepted=1"),
        (lambda ex: [_one(ex), _one(ex, 2, None, 3, prefill=True)], "prefill and verify requests in separate steps"),
    ],
)
def test_bad_verify_input_is_a_one_line_error_before_anything_runs(requests, message) -> None:
    ex = _start(STACK, K)
    ex.prefill(_contexts(ex, {0: 3, 1: 2}))
    before = (list(ex.state.context_lens), len(ex.ledger.records()), ex.state.kda[4].recurrent.clone())
    with pytest.raises(ValueError, match=message) as err:
        ex.step(requests(ex))
    assert "\n" not in str(err.value)
    assert (list(ex.state.context_lens), len(ex.ledger.records())) == before[:2]
    assert torch.equal(ex.state.kda[4].recurrent, before[2])


def test_a_stack_without_speculative_tokens_refuses_verify_steps_and_k_is_bounded_by_the_scope() -> None:
    plain = _start(STACK, 0)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=0 \(no verify steps\)"):
        plain.step([_one(plain, 1)])
    with pytest.raises(StackConfigError, match=r"num_speculative_tokens 8 outside 0\.\.7: the scope's max_tokens"):
        load_stack(STACK, 1, num_speculative_tokens=8)


def test_a_speculative_stack_gives_each_request_q_slots_and_the_deployment_its_q() -> None:
    ex = _start(STACK, K)
    assert ex.state.kda[4].num_slots == 1 + ex.config.max_requests * Q
    assert ex.state.kda[4].conv.shape[2] == ex.dims.kda.conv_width - 2 + Q
    assert ex.state.kda_slots(2) == (7, 8, 9) and ex.state.kda_slot(2) == 7
    assert ex.planner.prepared.q == Q
    assert _start(STACK, 0).state.kda_slot(2) == 3  # the q = 1 layout: 1 + r
