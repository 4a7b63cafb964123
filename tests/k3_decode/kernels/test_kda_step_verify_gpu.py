"""The CuTe DSL fused KDA verify step (KdaStepKernel.verify, k3_decode/kernels/kda_step.py) on an H200, at real K3
per-rank shapes (TP8: 12 heads, TP16: 6) with q = 1..8 tokens per request, against the FP64 oracle's
`kda_verify_step` (k3_decode/reference/kda.py), the stock verify pipeline (cuBLAS f_b + conv + fla-core's
recurrence + scatter + gated norm, k3_decode/stock/kda.py; skipped where fla-core is absent) and the fused decode
kernel it shares its arithmetic with.

The provider (providers.py, CuteKdaStepProvider) was registered after this passed on an H200, with
test_kda_step_gpu.py.

Tolerances, both styles applied and printed: suites/tolerances.toml `kda_verify.bfloat16` / `kda_verify.state.bfloat16`
(element-wise, matched fraction, max_abs, a non-trivial reference) and tests/k3_decode/stock/attention_tolerances.toml
`kda_verify` / `kda_verify_state` (rms_rel and peak_rel with the not-trivial guard). Both were set for stock, which
rounds q, k, v and o to BF16 between its kernels and the f_b product to BF16; the kernel keeps all of it FP32, so it
should sit well inside them and its states must be at least as close to the oracle as stock's. Exact: the conv state
(BF16 copies of BF16 inputs) equals the oracle's, NULL requests are zero for every token, and every slot outside the
step's write set (canary slots, slot 0, a NULL request's and a NULL token's slots) is bit-identical after the step.

Every test prints what it measured (METRIC lines): run with -s to see them.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import Tensor

from k3_decode.kernels import kda_step_op
from k3_decode.kernels.builds import K3_KERNEL_BUILDS, KdaStepVerifyBuild
from k3_decode.kernels.providers import not_built_reason
from k3_decode.reference import kda as rk
from k3_decode.stock import kda as sk
from tests.k3_decode.kernels.test_kda_step_gpu import (
    _graph_seconds_per_call,
    check_rms,
    check_suite,
    kda_weights,
    spec_for,
    weight_copy,
)
from tests.k3_decode.stock.attention_helpers import (
    clone_cache,
    error_metrics,
    projected_rows,
    random_kda_cache,
    reference_kda_weights,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not_built_reason() is not None, reason=f"the CuTe DSL kernels cannot run: {not_built_reason()}"),
]

DEV = "cuda"
HAS_FLA = importlib.util.find_spec("fla") is not None
BUILDS = [b for b in K3_KERNEL_BUILDS.builds("sm_90a") if isinstance(b, KdaStepVerifyBuild)]  # what CI compiles
# Every built shape (tp, requests, q), and unbuilt ones: odd requests and token counts, q = 1, the largest q.
CASES = [(b.tp, b.plan.batch, b.plan.tokens) for b in BUILDS] + [(8, 3, 3), (16, 5, 7), (8, 2, 1), (16, 2, 8)]


def verify_tables(batch: int, q: int, gen: torch.Generator, dtype: torch.dtype = torch.int32) -> tuple[Tensor, Tensor]:
    """(slots [B, q], num_accepted [B]) the oracle accepts: live tokens on distinct odd slots in a shuffled order;
    even slots and slot 0 belong to nobody (canaries). From two requests one is NULL (slot[b, 0] = 0, its other
    slots real ones that must stay untouched) and, at q >= 2, a live request has no slot for its last token (-1),
    and at q >= 3 another none for its second (0); accepted counts cover 1 and q, never a NULL token. The cache has
    2 * B * q + 2 slots."""
    slots = (torch.randperm(batch * q, generator=gen) * 2 + 1).view(batch, q)
    accepted = torch.randint(1, q + 1, (batch,), generator=gen)
    accepted[0] = q
    if batch >= 2:
        accepted[-1] = 1
        slots[batch // 2, 0] = 0
    if q >= 2:
        slots[0, -1] = -1
        accepted[0] = q - 1
    if q >= 3 and batch >= 2:
        slots[-1, 1] = 0  # accepted[-1] == 1 reads slot[-1, 0]
    if batch >= 4:
        accepted[1] = q  # a live request (batch // 2 >= 2) that accepted every token
    return slots.to(dtype).to(DEV), accepted.to(dtype).to(DEV)


def written(slots: Tensor) -> tuple[Tensor, Tensor]:
    """(recurrent slots, conv slots) a verify step with this table writes (the oracle's write set)."""
    writes = rk.verify_write_set(slots.cpu())
    recurrent = sorted(w.slot for w in writes if w.tensor == "recurrent")
    conv = sorted(w.slot for w in writes if w.tensor == "conv")
    return torch.tensor(recurrent, device=DEV), torch.tensor(conv, device=DEV)


def untouched(before: Tensor, after: Tensor, owned: Tensor, what: str) -> None:
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[owned.long()] = False
    assert torch.equal(before[keep], after[keep]), f"{what}: a slot outside the write set changed"


class Verify:
    """One verify step's inputs at (tp, requests, q): weights, q packed rows per request, a cache with 2 + q conv
    columns, slot and accepted tables, and the starting cache."""

    def __init__(self, tp: int, batch: int, q: int, seed: int, dtype: torch.dtype = torch.int32) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tp, self.batch, self.q = tp, batch, q
        self.spec, self.weights = spec_for(tp), kda_weights(tp)
        self.cache = random_kda_cache(self.spec, 2 * batch * q + 2, q - 1, gen, DEV)
        self.start = clone_cache(self.cache)
        self.slots, self.accepted = verify_tables(batch, q, gen, dtype)
        self.packed = projected_rows(self.weights.in_proj, (batch, q), gen)
        self.live = self.slots[:, 0] > 0

    def kernel(self, cache: rk.KdaCache | None = None, packed: Tensor | None = None, out: Tensor | None = None):
        packed = self.packed if packed is None else packed
        cache = self.cache if cache is None else cache
        return kda_step_op.verify_step(self.spec, self.weights, packed, cache, self.slots, self.accepted, out)

    def oracle(self, cache: rk.KdaCache, packed: Tensor | None = None) -> Tensor:
        packed = self.packed if packed is None else packed
        weights = reference_kda_weights(self.weights)
        return rk.kda_verify_step(self.spec, weights, packed, cache, self.slots, self.accepted)

    def stock(self, cache: rk.KdaCache) -> Tensor:
        return sk.kda_verify_step(self.spec, self.weights, self.packed, cache, self.slots, self.accepted)

    @property
    def name(self) -> str:
        plan = kda_step_op.verify_plan_for(self.spec, self.packed, self.slots, self.accepted)
        return f"KDA verify TP{self.tp} B{self.batch} q{self.q} (cluster {plan.cluster})"


# --- against the oracle and the stock verify ------------------------------------------------------------------------


@pytest.mark.parametrize("tp, batch, q", CASES, ids=[f"tp{t}-b{b}-q{q}" for t, b, q in CASES])
def test_verify_matches_the_oracle_and_the_stock_verify(tp: int, batch: int, q: int):
    step = Verify(tp, batch, q, seed=tp * 1000 + batch * 10 + q)
    ref_cache = clone_cache(step.cache)
    got = step.kernel()
    ref = step.oracle(ref_cache)
    torch.cuda.synchronize()
    name, live = step.name, step.live
    states, rows = written(step.slots)

    assert got.dtype == torch.bfloat16 and got.shape == (batch, q, step.spec.proj)
    assert torch.isfinite(got).all(), f"{name}: non-finite output"
    assert not got[~live].any(), f"{name}: a NULL request's output is not zero"
    check_suite(got[live], ref[live], "kda_verify", f"{name} out vs oracle")
    out_rms, _ = check_rms(got[live], ref[live], "kda_verify", f"{name} out vs oracle")
    state, ref_state = step.cache.recurrent[states], ref_cache.recurrent[states]
    check_suite(state, ref_state, "kda_verify.state", f"{name} states vs oracle")
    state_rms, _ = check_rms(state, ref_state, "kda_verify_state", f"{name} states vs oracle")
    assert torch.equal(step.cache.conv, ref_cache.conv), f"{name}: the conv state differs from the oracle's"
    untouched(step.start.recurrent, step.cache.recurrent, states, f"{name} recurrent state")
    untouched(step.start.conv, step.cache.conv, rows, f"{name} conv state")
    per_token = [error_metrics(got[live, t], ref[live, t])[0] for t in range(q)]
    print(f"METRIC {name}: out rms_rel per token " + " ".join(f"{e:.2e}" for e in per_token))

    if not HAS_FLA:
        print(f"METRIC {name}: fla-core absent, the stock verify not compared")
        return
    stock_cache = clone_cache(step.start)
    stock = step.stock(stock_cache)
    torch.cuda.synchronize()
    stock_out_rms, _ = error_metrics(stock[live], ref[live])
    stock_state_rms, _ = error_metrics(stock_cache.recurrent[states], ref_state)
    vs_stock_out, vs_stock_peak = error_metrics(got[live], stock[live])
    print(
        f"METRIC {name}: stock vs oracle out rms_rel {stock_out_rms:.2e} state rms_rel {stock_state_rms:.2e}; kernel "
        f"vs oracle out {out_rms:.2e} state {state_rms:.2e}; kernel vs stock out rms_rel {vs_stock_out:.2e} "
        f"(peak {vs_stock_peak:.2e})"
    )
    assert torch.equal(step.cache.conv, stock_cache.conv), f"{name}: the conv state differs from stock's"
    assert not stock[~live].any()
    assert state_rms <= stock_state_rms + 1e-6, f"{name}: states farther from the oracle than stock's"
    assert out_rms <= max(2 * stock_out_rms, 2e-3), f"{name}: output much farther from the oracle than stock's"


def test_a_batch_of_null_requests_writes_zeros_and_touches_nothing():
    step = Verify(8, 4, 4, seed=5)
    step.slots[:, 0] = torch.tensor([0, -1, 0, -7], dtype=torch.int32, device=DEV)
    out = torch.full((4, 4, step.spec.proj), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = step.kernel(out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and not got.any(), "NULL requests must be written, with zeros"
    assert torch.equal(step.cache.conv, step.start.conv) and torch.equal(step.cache.recurrent, step.start.recurrent)
    print("METRIC KDA verify NULL batch TP8 B4 q4: zero output, caches bit-identical")


def test_int64_tables_give_the_same_bits_as_int32():
    """The numerics suite passes int64 slot and accepted tables, vLLM int32: one compile each, the same results."""
    a, b = Verify(16, 8, 4, seed=21), Verify(16, 8, 4, seed=21, dtype=torch.int64)
    assert torch.equal(a.slots.long(), b.slots) and torch.equal(a.accepted.long(), b.accepted)
    out_a, out_b = a.kernel(), b.kernel()
    torch.cuda.synchronize()
    assert torch.equal(out_a, out_b), "int32 and int64 tables give different outputs"
    assert torch.equal(a.cache.recurrent, b.cache.recurrent) and torch.equal(a.cache.conv, b.cache.conv)
    mixed = Verify(16, 8, 4, seed=21)
    mixed.accepted = mixed.accepted.long()  # int32 slots, int64 accepted counts: a compile of its own
    assert torch.equal(mixed.kernel(), out_a) and torch.equal(mixed.cache.recurrent, a.cache.recurrent)
    print("METRIC KDA verify int64 tables TP16 B8 q4: bit-equal to int32")


# --- the decode kernel's arithmetic -------------------------------------------------------------------------------


@pytest.mark.parametrize("tp, batch", [(8, 4), (16, 3)], ids=["tp8-b4", "tp16-b3"])
def test_a_one_token_verify_is_the_decode_step_bit_for_bit(tp: int, batch: int):
    """q = 1, one accepted token: the verify kernel runs the decode kernel's per-token arithmetic in the same order
    (kda_step.py, "Verify"), so the same inputs give the same bits: outputs, states and conv taps."""
    step = Verify(tp, batch, 1, seed=tp + batch)
    decode_cache = clone_cache(step.cache)
    got = step.kernel()
    dec = kda_step_op.decode_step(step.spec, step.weights, step.packed[:, 0], decode_cache, step.slots[:, 0])
    torch.cuda.synchronize()
    diff = (got[:, 0].float() - dec.float()).abs().max().item()
    state_diff = (step.cache.recurrent - decode_cache.recurrent).abs().max().item()
    print(
        f"METRIC KDA verify q1 vs decode TP{tp} B{batch}: max |out diff| {diff:.3e}, max |state diff| {state_diff:.3e}"
    )
    assert torch.equal(got[:, 0], dec), "a one-token verify's output differs from the decode kernel's"
    assert torch.equal(step.cache.recurrent, decode_cache.recurrent), "its state differs from the decode kernel's"
    assert torch.equal(step.cache.conv, decode_cache.conv), "its conv taps differ from the decode kernel's"


@pytest.mark.parametrize("tp, batch, q", [(8, 2, 8), (16, 4, 4)], ids=["tp8-b2-q8", "tp16-b4-q4"])
def test_a_verify_step_is_q_chained_decode_steps(tp: int, batch: int, q: int):
    """Token t of a verify step sees what the t-th of q decode steps sees (the taps s[t .. t + 2], the state after the
    tokens before it), so the decode kernel run q times on a copy of the accepted state and conv window is a second,
    independently tested reference: the same arithmetic per token, so the outputs and states should be bit-equal;
    asserted within one BF16 unit and FP32 rounding, with bit-equality printed."""
    step = Verify(tp, batch, q, seed=77 + q)
    live = step.live.nonzero().squeeze(-1).tolist()
    slots, accepted = step.slots.cpu(), step.accepted.cpu()
    # The decode steps' cache: per live request one slot (its verify read slot) holding the accepted state and the
    # three conv columns a - 1 .. a + 1 of its verify row; NULL requests run NULL.
    decode = rk.KdaCache(
        torch.zeros(step.cache.conv.shape[0], step.spec.conv_channels, 3, dtype=torch.bfloat16, device=DEV),
        torch.zeros_like(step.cache.recurrent),
    )
    decode_slots = torch.zeros(batch, dtype=torch.int32)
    for b in live:
        a = int(accepted[b])
        read = int(slots[b, a - 1])
        decode_slots[b] = read
        decode.recurrent[read] = step.start.recurrent[read]
        decode.conv[read] = step.start.conv[int(slots[b, 0]), :, a - 1 : a + 2]
    decode_slots = decode_slots.to(DEV)
    got = step.kernel()
    outs, states = [], []
    for t in range(q):
        packed = step.packed[:, t].contiguous()
        outs.append(kda_step_op.decode_step(step.spec, step.weights, packed, decode, decode_slots))
        states.append(decode.recurrent[decode_slots.long()].clone())
    torch.cuda.synchronize()
    name = f"KDA verify TP{tp} B{batch} q{q} vs {q} decode steps"
    exact = True
    for t in range(q):
        for b in live:
            out_diff = (got[b, t].float() - outs[t][b].float()).abs()
            ulp = torch.finfo(torch.bfloat16).eps * outs[t][b].float().abs().clamp(min=1e-30)
            assert bool((out_diff <= ulp).all()), f"{name}: token {t} request {b} output off by more than 1 BF16 unit"
            exact &= torch.equal(got[b, t], outs[t][b])
            dst = int(slots[b, t])
            if dst > 0:
                rel, _ = error_metrics(step.cache.recurrent[dst], states[t][b])
                assert rel <= 1e-6, f"{name}: token {t} request {b} state rms_rel {rel:.2e}"
                exact &= torch.equal(step.cache.recurrent[dst], states[t][b])
    for b in live:  # the decode row's taps are the verify row's last three columns
        assert torch.equal(decode.conv[int(decode_slots[b])], step.cache.conv[int(slots[b, 0]), :, -3:]), name
    print(f"METRIC {name}: bit-identical {exact}")


# --- chained steps, CUDA graphs, the device counter -----------------------------------------------------------------


@pytest.mark.parametrize(
    "tp, batch, q", [(8, 4, 4), (16, 2, 8), (8, 16, 2)], ids=["tp8-b4-q4", "tp16-b2-q8", "tp8-b16-q2"]
)
def test_chained_verify_steps_accumulate_state_like_the_oracle(tp: int, batch: int, q: int):
    """Several verify steps back to back on one cache, each accepting a different number of the previous step's
    tokens (each reads the state a previous step wrote): with PDL each may start while the previous runs, so this
    also checks that no state or conv column is read before griddepcontrol.wait."""
    steps = 5
    step = Verify(tp, batch, q, seed=tp * 7 + batch + q)
    gen = torch.Generator().manual_seed(123)
    inputs = [projected_rows(step.weights.in_proj, (batch, q), gen) for _ in range(steps)]
    tables = []
    for _ in range(steps):  # accepted counts the slot tables allow: a real accepted slot, 1..q
        accepted = torch.randint(1, q + 1, (batch,), generator=gen)
        for b in range(batch):
            while step.live[b] and int(step.slots[b, int(accepted[b]) - 1]) <= 0:
                accepted[b] -= 1
        tables.append(accepted.to(torch.int32).to(DEV))
    ref_cache = clone_cache(step.cache)
    outs = []
    for x, accepted in zip(inputs, tables, strict=True):  # back to back in one stream
        step.accepted = accepted
        outs.append(step.kernel(packed=x))
    refs = []
    for x, accepted in zip(inputs, tables, strict=True):
        step.accepted = accepted
        refs.append(step.oracle(ref_cache, packed=x))
    torch.cuda.synchronize()
    name = f"KDA verify chain of {steps} TP{tp} B{batch} q{q}"
    live = step.live
    states, rows = written(step.slots)
    for i, (got, ref) in enumerate(zip(outs, refs, strict=True)):
        check_rms(got[live], ref[live], "kda_verify", f"{name} out {i}")
    check_suite(outs[-1][live], refs[-1][live], "kda_verify", f"{name} last out vs oracle")
    check_suite(step.cache.recurrent[states], ref_cache.recurrent[states], "kda_verify.state", f"{name} states")
    assert torch.equal(step.cache.conv, ref_cache.conv), f"{name}: the conv state differs from the oracle's"
    untouched(step.start.recurrent, step.cache.recurrent, states, f"{name} recurrent state")
    untouched(step.start.conv, step.cache.conv, rows, f"{name} conv state")


def test_graph_replay_equals_the_eager_step_and_the_counter_counts_every_launch():
    step = Verify(16, 2, 4, seed=9)
    out = torch.empty(2, 4, step.spec.proj, dtype=torch.bfloat16, device=DEV)

    def run() -> Tensor:
        return step.kernel(out=out)

    def restore() -> None:
        step.cache.conv.copy_(step.start.conv)
        step.cache.recurrent.copy_(step.start.recurrent)

    run()  # compiles
    restore()
    before = kda_step_op.launch_count()
    eager = run().clone()
    eager_state, eager_conv = step.cache.recurrent.clone(), step.cache.conv.clone()
    restore()
    again = run().clone()
    assert torch.equal(eager, again) and torch.equal(step.cache.recurrent, eager_state), "two eager runs differ"
    assert kda_step_op.launch_count() == before + 2, "the device counter missed an eager verify launch"

    graph = torch.cuda.CUDAGraph()
    restore()
    with torch.cuda.graph(graph):
        run()
    counted = kda_step_op.launch_count()
    for _ in range(2):
        restore()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "the graph replay's output differs from the eager step"
        assert torch.equal(step.cache.recurrent, eager_state) and torch.equal(step.cache.conv, eager_conv)
    assert kda_step_op.launch_count() == counted + 2, "the device counter missed a verify launch inside a replay"
    print(f"METRIC KDA verify graph TP16 B2 q4: replays bit-equal to eager; device counter {before} -> {counted + 2}")


# --- timing (measured and printed; speed targets belong in benchmarks) ----------------------------------------------


def time_verify(tp: int, batch: int, q: int) -> tuple[float, float | None, int, int, float]:
    """(CuTe s per call, stock s per call or None without fla-core, cluster, rotating copies, bytes per call)."""
    spec, weights = spec_for(tp), kda_weights(tp)
    gen = torch.Generator().manual_seed(batch * 10 + q)
    head_state = spec.heads * 128 * 128 * 4
    state_bytes = batch * head_state * (1 + q)  # the accepted state read, every token's written
    copies = max(2, math.ceil(3 * torch.cuda.get_device_properties(DEV).L2_cache_size / state_bytes))
    caches = [random_kda_cache(spec, batch * q + 1, q - 1, gen, DEV) for _ in range(copies)]
    small = [weight_copy(weights) for _ in range(copies)]
    slots = torch.arange(1, batch * q + 1, dtype=torch.int32, device=DEV).view(batch, q)
    accepted = torch.full((batch,), q, dtype=torch.int32, device=DEV)
    packed = projected_rows(weights.in_proj, (batch, q), gen)
    out = torch.empty(batch, q, spec.proj, dtype=torch.bfloat16, device=DEV)

    def cute(i: int) -> None:
        kda_step_op.verify_step(spec, small[i % copies], packed, caches[i % copies], slots, accepted, out)

    def stock(i: int) -> None:
        sk.kda_verify_step(spec, small[i % copies], packed, caches[i % copies], slots, accepted, validate=False)

    calls = 2 * copies
    t_cute = _graph_seconds_per_call(cute, calls)
    t_stock = _graph_seconds_per_call(stock, calls) if HAS_FLA else None
    moved = state_bytes + batch * spec.conv_channels * (2 + q) * 2 * 2 + spec.proj * 128 * 2
    cluster = kda_step_op.verify_plan_for(spec, packed, slots, accepted).cluster
    return t_cute, t_stock, cluster, copies, moved


@pytest.mark.parametrize("tp", [8, 16])
def test_timing_against_the_stock_verify(tp: int):
    """Per call in CUDA-graph replays, each call on its own cache and weights copy (rotating so that the states come
    from HBM), every token's state written (accepted = q, all slots real). Stock is the f_b GEMM, the conv, fla-core's
    recurrence, the scatter and the gated norm on the same inputs."""
    slow = []
    for q, batch in sorted({(b.plan.tokens, b.plan.batch) for b in BUILDS if b.tp == tp}):
        t_cute, t_stock, cluster, copies, moved = time_verify(tp, batch, q)
        torch.cuda.empty_cache()
        line = f"METRIC KDA verify timing TP{tp} B{batch} q{q} (cluster {cluster}): CuTe {t_cute * 1e6:.2f} us "
        line += f"({moved / t_cute / 1e12:.2f} TB/s)"
        if t_stock is not None:
            line += f", stock {t_stock * 1e6:.2f} us (5 launches), CuTe / stock {t_cute / t_stock:.2f}"
            if t_cute > 2 * t_stock:
                slow.append(f"B{batch} q{q}: {t_cute * 1e6:.1f} vs {t_stock * 1e6:.1f} us")
        print(line + f", {copies} rotating caches")
    assert not slow, f"TP{tp}: the fused verify is more than twice as slow as stock at {', '.join(slow)}"
