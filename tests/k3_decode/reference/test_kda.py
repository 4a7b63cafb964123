"""Tests for the KDA decode/verify oracle (k3_decode.reference.kda).

The oracle is checked against formulations written independently here (a full-sequence conv through
F.conv1d and a recurrence on the transposed [k, v] state) and against fla-core's naive recurrent KDA.
Verify steps are checked against chains of decode steps over the accepted tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from k3_decode.config import K3, K3_MINI
from k3_decode.reference.kda import (
    KdaCache,
    KdaSpec,
    KdaWeights,
    StateWrite,
    decay_log_gate,
    decode_write_set,
    delta_rule_update,
    gated_rms_norm,
    kda_decode_step,
    kda_verify_step,
    l2_normalize,
    state_readout,
    verify_write_set,
)

SPEC = KdaSpec.for_rank(K3_MINI, tp=2)  # 4 heads of 32: several heads, like a real rank
F64 = torch.float64
# Same arithmetic on differently shaped batches may round an FP32 state differently by one ulp.
SAME_MATH = {"rtol": 1e-6, "atol": 1e-6}
# FP64 references without the FP32 state rounding, or fla in FP32.
INDEPENDENT = {"rtol": 1e-5, "atol": 1e-5}


# ---------------------------------------------------------------------------------------------------------
# Builders


def make_weights(spec: KdaSpec, seed: int = 0) -> KdaWeights:
    gen = torch.Generator().manual_seed(seed)
    return KdaWeights(
        f_b=torch.randn(spec.proj, spec.gate_rank, generator=gen, dtype=F64) * spec.gate_rank**-0.5,
        conv=torch.randn(spec.conv_channels, spec.conv_width, generator=gen, dtype=F64) * 0.6,
        a_log=torch.empty(spec.heads, dtype=F64).uniform_(0.0, 2.8, generator=gen),  # A in [1, 16]
        dt_bias=torch.randn(spec.proj, generator=gen, dtype=F64) * 0.5,
        o_norm=1.0 + 0.2 * torch.randn(spec.head_dim, generator=gen, dtype=F64),
    )


def make_packed(spec: KdaSpec, *lead: int, seed: int = 1) -> Tensor:
    """Random packed rows, BF16-representable like the real in_proj output."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, spec.in_proj_rows, generator=gen, dtype=F64).to(torch.bfloat16).to(F64)


def make_cache(spec: KdaSpec, num_slots: int, num_spec: int = 0, seed: int = 2) -> KdaCache:
    """A cache full of random data, so that any stray or missing write changes some slot."""
    gen = torch.Generator().manual_seed(seed)
    cache = KdaCache.zeros(spec, num_slots, num_spec)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
    cache.recurrent.copy_(torch.randn(cache.recurrent.shape, generator=gen) * 0.1)
    return cache


def clone(cache: KdaCache) -> KdaCache:
    return KdaCache(conv=cache.conv.clone(), recurrent=cache.recurrent.clone())


def digests(cache: KdaCache) -> dict[StateWrite, str]:
    out = {}
    for name in ("conv", "recurrent"):
        tensor: Tensor = getattr(cache, name)
        for slot in range(cache.num_slots):
            raw = tensor[slot].contiguous().view(torch.uint8).numpy().tobytes()
            out[StateWrite(name, slot)] = hashlib.sha256(raw).hexdigest()
    return out


def changed(before: dict[StateWrite, str], after: dict[StateWrite, str]) -> set[StateWrite]:
    return {key for key in before if before[key] != after[key]}


# ---------------------------------------------------------------------------------------------------------
# Independent formulations


def reference_features(spec: KdaSpec, w: KdaWeights, packed: Tensor, history: Tensor) -> dict[str, Tensor]:
    """One request: packed [T, rows], conv taps before the first token [3P, W-1]. FP64, [T, H, D] each."""
    t, heads, dim, sec = packed.shape[0], spec.heads, spec.head_dim, spec.sections
    x = torch.cat([packed[:, sec["q"]], packed[:, sec["k"]], packed[:, sec["v"]]], dim=1)  # [T, 3P]
    seq = torch.cat([history.to(F64), x.T], dim=1)  # [3P, W-1+T]
    conv = F.conv1d(seq[None], w.conv[:, None, :], groups=spec.conv_channels)[0].T  # [T, 3P]
    q, k, v = (F.silu(part).reshape(t, heads, dim) for part in conv.split(spec.proj, dim=1))

    def unit(a: Tensor) -> Tensor:
        return a / torch.sqrt((a * a).sum(-1, keepdim=True) + spec.l2_eps)

    logit = (packed[:, sec["f_a"]] @ w.f_b.T + w.dt_bias).reshape(t, heads, dim)
    g = spec.gate_lower_bound * torch.sigmoid(logit * torch.exp(w.a_log)[None, :, None])
    return {
        "q": unit(q) / dim**0.5,
        "k": unit(k),
        "v": v,
        "g": g,
        "beta": torch.sigmoid(packed[:, sec["beta"]]),
        "gate": packed[:, sec["g"]].reshape(t, heads, dim),
        "seq": seq,
    }


def reference_recurrence(f: dict[str, Tensor], state_vk: Tensor) -> tuple[Tensor, Tensor]:
    """The delta rule on M = S^T [H, k, v], token by token; returns outputs [T, H, D] and final S[v, k]."""
    m = state_vk.to(F64).transpose(-1, -2).clone()
    outs = []
    for i in range(f["q"].shape[0]):
        q, k, v, g, beta = (f[name][i] for name in ("q", "k", "v", "g", "beta"))
        m = m * torch.exp(g)[:, :, None]
        recalled = torch.einsum("hk,hkv->hv", k, m)
        m = m + beta[:, None, None] * k[:, :, None] * (v - recalled)[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q, m))
    return torch.stack(outs), m.transpose(-1, -2)


def reference_output(spec: KdaSpec, w: KdaWeights, o: Tensor, gate: Tensor) -> Tensor:
    """[T, H, D] -> [T, P]: per-head RMSNorm, weight, sigmoid gate."""
    rms = torch.sqrt((o * o).mean(-1, keepdim=True) + spec.norm_eps)
    return (o / rms * w.o_norm * torch.sigmoid(gate)).reshape(o.shape[0], spec.proj)


def load_fla_naive() -> Callable | None:
    """fla-core's naive_recurrent_kda. `import fla.ops` pulls in triton, which a CPU box lacks; the naive
    file itself is plain torch, so load that file on its own."""
    found = importlib.util.find_spec("fla")
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(next(iter(found.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    if not path.is_file():
        return None
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.naive_recurrent_kda


@pytest.fixture(scope="module")
def fla_naive() -> Callable:
    fn = load_fla_naive()
    if fn is None:
        pytest.skip("fla-core is not installed")
    return fn


def decode_chain(
    spec: KdaSpec, w: KdaWeights, packed: Tensor, cache: KdaCache, slots: Tensor
) -> tuple[Tensor, list[KdaCache]]:
    """Decode packed [B, T, rows] token by token; returns outputs [B, T, P] and the cache after each token."""
    outs, snaps = [], []
    for t in range(packed.shape[1]):
        outs.append(kda_decode_step(spec, w, packed[:, t], cache, slots))
        snaps.append(clone(cache))
    return torch.stack(outs, dim=1), snaps


# ---------------------------------------------------------------------------------------------------------
# Recurrence and decode against independent formulations


@pytest.mark.parametrize("steps", [1, 5])
def test_recurrence_matches_fla_naive(fla_naive: Callable, steps: int) -> None:
    gen = torch.Generator().manual_seed(7)
    b, h, d = 2, 3, 16
    q = l2_normalize(torch.randn(b, steps, h, d, generator=gen, dtype=F64), 1e-6)
    k = l2_normalize(torch.randn(b, steps, h, d, generator=gen, dtype=F64), 1e-6)
    v = torch.randn(b, steps, h, d, generator=gen, dtype=F64)
    g = -5.0 * torch.rand(b, steps, h, d, generator=gen, dtype=F64)
    beta = torch.rand(b, steps, h, generator=gen, dtype=F64)
    s0 = torch.randn(b, h, d, d, generator=gen, dtype=F64)  # ours: S[v, k]

    s_kv0 = s0.transpose(-1, -2)
    want, s_kv = fla_naive(q, k, v, g, beta, scale=d**-0.5, initial_state=s_kv0, output_final_state=True)
    state, outs = s0, []
    for i in range(steps):
        state = delta_rule_update(state, k[:, i], v[:, i], g[:, i], beta[:, i])
        outs.append(state_readout(state, q[:, i] * d**-0.5))
    torch.testing.assert_close(torch.stack(outs, 1), want.to(F64), **INDEPENDENT)
    torch.testing.assert_close(state, s_kv.transpose(-1, -2).to(F64), **INDEPENDENT)


def _decode_vs_reference(spec: KdaSpec, steps: int, recurrence: Callable, packed_scale: float = 1.0) -> None:
    w = make_weights(spec)
    cache = make_cache(spec, num_slots=6)
    slots = torch.tensor([3, 1, 5])
    packed = make_packed(spec, 3, steps) * packed_scale
    start = clone(cache)
    outs, _ = decode_chain(spec, w, packed, cache, slots)
    for b, slot in enumerate(slots.tolist()):
        f = reference_features(spec, w, packed[b], start.conv[slot, :, : spec.conv_width - 1])
        o, final = recurrence(f, start.recurrent[slot])
        torch.testing.assert_close(outs[b], reference_output(spec, w, o, f["gate"]), **INDEPENDENT)
        torch.testing.assert_close(cache.recurrent[slot].to(F64), final, **INDEPENDENT)
        taps = f["seq"][:, -(spec.conv_width - 1) :].to(torch.bfloat16)
        assert torch.equal(cache.conv[slot], taps)


def test_decode_chain_matches_full_sequence_reference() -> None:
    _decode_vs_reference(SPEC, steps=6, recurrence=reference_recurrence)


def test_decode_chain_matches_fla_naive(fla_naive: Callable) -> None:
    def fla(f: dict[str, Tensor], state_vk: Tensor) -> tuple[Tensor, Tensor]:
        args = [f[name][None] for name in ("q", "k", "v", "g", "beta")]
        s_kv0 = state_vk.transpose(-1, -2)[None]
        o, s_kv = fla_naive(*args, scale=1.0, initial_state=s_kv0, output_final_state=True)
        return o[0].to(F64), s_kv[0].transpose(-1, -2).to(F64)

    _decode_vs_reference(SPEC, steps=5, recurrence=fla)


def test_small_qk_norms_use_eps_inside_the_root() -> None:
    # Inputs of ~1e-4 put sum(x^2) near eps, where x/sqrt(sum+eps) and x/(|x|+eps) disagree by far more
    # than the tolerance; the random cache taps would swamp them, so start from zero taps.
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=4)
    cache.conv.zero_()
    start = clone(cache)
    packed = make_packed(SPEC, 1, seed=5) * 1e-4
    out = kda_decode_step(SPEC, w, packed, cache, torch.tensor([2]))
    f = reference_features(SPEC, w, packed, start.conv[2])
    assert f["k"].norm(dim=-1).max() < 0.9  # the regime where eps matters
    o, _ = reference_recurrence(f, start.recurrent[2])
    torch.testing.assert_close(out, reference_output(SPEC, w, o, f["gate"]), **INDEPENDENT)


def test_real_k3_tp16_shapes() -> None:
    spec = KdaSpec.for_rank(K3, tp=16)
    assert (spec.heads, spec.head_dim, spec.proj, spec.in_proj_rows) == (6, 128, 768, 3216)
    _decode_vs_reference_b1(spec)
    w = make_weights(spec)
    cache = make_cache(spec, num_slots=10, num_spec=7)
    slots = torch.arange(1, 9)[None]
    out = kda_verify_step(spec, w, make_packed(spec, 1, 8), cache, slots, torch.tensor([1]))
    assert out.shape == (1, 8, 768) and torch.isfinite(out).all()


def _decode_vs_reference_b1(spec: KdaSpec) -> None:
    w = make_weights(spec)
    cache = make_cache(spec, num_slots=3)
    start = clone(cache)
    packed = make_packed(spec, 1)
    out = kda_decode_step(spec, w, packed, cache, torch.tensor([2]))
    f = reference_features(spec, w, packed, start.conv[2])
    o, final = reference_recurrence(f, start.recurrent[2])
    torch.testing.assert_close(out, reference_output(spec, w, o, f["gate"]), **INDEPENDENT)
    torch.testing.assert_close(cache.recurrent[2].to(F64), final, **INDEPENDENT)


# ---------------------------------------------------------------------------------------------------------
# Verify semantics


@pytest.mark.parametrize("q", range(1, 9))
def test_verify_equals_sequential_decode(q: int) -> None:
    w = make_weights(SPEC)
    num_spec = 7  # the widest deployment: columns past W-2+q must survive
    cache = make_cache(SPEC, num_slots=30, num_spec=num_spec, seed=q)
    gen = torch.Generator().manual_seed(100 + q)
    slots = (torch.randperm(29, generator=gen)[: 3 * q] + 1).reshape(3, q)
    packed = make_packed(SPEC, 3, q, seed=q)
    start = clone(cache)

    dec = clone(cache)
    want, snaps = decode_chain(SPEC, w, packed, dec, slots[:, 0])
    got = kda_verify_step(SPEC, w, packed, cache, slots, torch.ones(3, dtype=torch.long))
    torch.testing.assert_close(got, want, **SAME_MATH)

    taps = SPEC.conv_taps(q)
    for b in range(3):
        for t in range(q):
            want_state = snaps[t].recurrent[slots[b, 0]]
            torch.testing.assert_close(cache.recurrent[slots[b, t]], want_state, **SAME_MATH)
        row = cache.conv[slots[b, 0]]
        x = torch.cat([packed[b, :, SPEC.sections[n]] for n in ("q", "k", "v")], dim=1).T.to(torch.bfloat16)
        expected = torch.cat([start.conv[slots[b, 0], :, : SPEC.conv_width - 1], x], dim=1)[:, 1:]
        assert torch.equal(row[:, :taps], expected)
        assert torch.equal(row[:, taps:], start.conv[slots[b, 0], :, taps:])
        width = SPEC.conv_width - 1  # after q decode steps, the decode taps are the verify row's last ones
        assert torch.equal(row[:, taps - width : taps], dec.conv[slots[b, 0], :, :width])


def test_verify_one_token_is_the_decode_step() -> None:
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=8, num_spec=3)
    slots = torch.tensor([4, 0, 7, -1, 2])
    packed = make_packed(SPEC, 5)
    dec = clone(cache)
    want = kda_decode_step(SPEC, w, packed, dec, slots)
    got = kda_verify_step(SPEC, w, packed[:, None], cache, slots[:, None], torch.ones(5, dtype=torch.long))
    assert torch.equal(got[:, 0], want)
    assert torch.equal(cache.conv, dec.conv) and torch.equal(cache.recurrent, dec.recurrent)
    assert verify_write_set(slots[:, None]) == decode_write_set(slots)


def _accepted_chain(q: int, acceptance: list[list[int]], null_rows: set[int], seed: int) -> None:
    """Verify rounds with the given per-round, per-request acceptance, against decode over the accepted
    tokens. NULL rows must stay zero and unwritten throughout."""
    batch = len(acceptance[0])
    w = make_weights(SPEC, seed=seed)
    cache = make_cache(SPEC, num_slots=batch * q + 2, num_spec=q - 1, seed=seed)
    slots = (torch.randperm(batch * q, generator=torch.Generator().manual_seed(seed)) + 1).reshape(batch, q)
    for b in null_rows:
        slots[b] = torch.where(torch.arange(q) % 2 == 0, 0, -1)
    # One decode slot per request holds the state after all accepted tokens so far.
    ref = KdaCache.zeros(SPEC, batch + 1)
    ref_slots = torch.arange(1, batch + 1)
    for b in range(batch):
        if b not in null_rows:
            ref.conv[b + 1] = cache.conv[slots[b, 0], :, : SPEC.conv_width - 1]
            ref.recurrent[b + 1] = cache.recurrent[slots[b, 0]]
    writes = verify_write_set(slots)
    accepted = torch.ones(batch, dtype=torch.long)
    for r, acc in enumerate(acceptance):
        packed = make_packed(SPEC, batch, q, seed=seed * 31 + r)
        before = digests(cache)
        got = kda_verify_step(SPEC, w, packed, cache, slots, accepted)
        assert changed(before, digests(cache)) == writes

        want, snaps = decode_chain(SPEC, w, packed, clone(ref), ref_slots)
        for b in range(batch):
            if b in null_rows:
                assert torch.equal(got[b], torch.zeros_like(got[b]))
                continue
            torch.testing.assert_close(got[b], want[b], **SAME_MATH)
            for t in range(q):
                want_state = snaps[t].recurrent[b + 1]
                torch.testing.assert_close(cache.recurrent[slots[b, t]], want_state, **SAME_MATH)
            ref.conv[b + 1] = snaps[acc[b] - 1].conv[b + 1]
            ref.recurrent[b + 1] = snaps[acc[b] - 1].recurrent[b + 1]
        accepted = torch.tensor(acc)


@pytest.mark.parametrize(
    ("q", "acceptance"),
    [
        (4, [[1, 4, 2], [3, 1, 4], [2, 2, 1]]),
        (8, [[8, 1], [5, 7], [1, 8]]),
        (2, [[2, 1], [1, 2], [2, 2], [1, 1]]),
    ],
)
def test_verify_partial_acceptance_matches_decode_of_accepted_tokens(
    q: int,
    acceptance: list[list[int]],
) -> None:
    _accepted_chain(q, acceptance, null_rows=set(), seed=q)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_verify_acceptance_property(data: st.DataObject) -> None:
    q = data.draw(st.integers(1, 8), label="q")
    batch = data.draw(st.integers(1, 3), label="batch")
    rounds = data.draw(st.integers(1, 3), label="rounds")
    acceptance = data.draw(
        st.lists(
            st.lists(st.integers(1, q), min_size=batch, max_size=batch),
            min_size=rounds,
            max_size=rounds,
        ),
        label="acceptance",
    )
    null_rows = data.draw(st.sets(st.integers(0, batch - 1), max_size=batch - 1), label="null_rows")
    _accepted_chain(q, acceptance, null_rows, seed=data.draw(st.integers(0, 2**16), label="seed"))


# ---------------------------------------------------------------------------------------------------------
# NULL slots, write sets, untouched slots


def test_decode_null_slots_zero_and_unwritten() -> None:
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=9)
    slots = torch.tensor([0, 5, -1, 8, 0, 1])
    packed = make_packed(SPEC, 6)
    before = digests(cache)
    out = kda_decode_step(SPEC, w, packed, cache, slots)
    for b in (0, 2, 4):
        assert torch.equal(out[b], torch.zeros_like(out[b]))
    assert (out[[1, 3, 5]].abs().sum(-1) > 0).all()
    expected = {StateWrite(n, s) for s in (5, 8, 1) for n in ("conv", "recurrent")}
    assert decode_write_set(slots) == expected
    assert changed(before, digests(cache)) == expected


def test_decode_leaves_speculative_conv_columns_alone() -> None:
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=3, num_spec=4)
    start = clone(cache)
    kda_decode_step(SPEC, w, make_packed(SPEC, 1), cache, torch.tensor([1]))
    width = SPEC.conv_width - 1
    assert torch.equal(cache.conv[1, :, width:], start.conv[1, :, width:])
    assert torch.equal(cache.conv[1, :, : width - 1], start.conv[1, :, 1:width])


def test_verify_skips_token_states_with_null_slots() -> None:
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=12, num_spec=3)
    full = torch.tensor([[3, 9, 4, 11], [0, 5, 6, 7], [2, 1, 10, 8]])  # row 1: NULL request
    holes = full.clone()
    holes[0, 2] = 0
    holes[2, 3] = -1
    packed = make_packed(SPEC, 3, 4)
    accepted = torch.tensor([1, 3, 1])
    want = kda_verify_step(SPEC, w, packed, clone(cache), full, accepted)
    before = digests(cache)
    got = kda_verify_step(SPEC, w, packed, cache, holes, accepted)
    assert torch.equal(got, want)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    writes = verify_write_set(holes)
    assert writes == {StateWrite("conv", s) for s in (3, 2)} | {
        StateWrite("recurrent", s) for s in (3, 9, 11, 2, 1, 10)
    }
    assert changed(before, digests(cache)) == writes


@settings(max_examples=25, deadline=None)
@given(
    table=st.lists(st.integers(-2, 9), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_decode_writes_exactly_its_write_set(table: list[int], seed: int) -> None:
    slots = torch.tensor(table)
    cache = make_cache(SPEC, num_slots=10, seed=seed)
    live = [s for s in table if s > 0]
    if len(set(live)) != len(live):
        with pytest.raises(ValueError, match="same state twice"):
            kda_decode_step(SPEC, make_weights(SPEC), make_packed(SPEC, len(table), seed=seed), cache, slots)
        return
    before = digests(cache)
    out = kda_decode_step(SPEC, make_weights(SPEC), make_packed(SPEC, len(table), seed=seed), cache, slots)
    assert changed(before, digests(cache)) == decode_write_set(slots)
    assert all(torch.equal(out[b], torch.zeros_like(out[b])) for b, s in enumerate(table) if s <= 0)


# ---------------------------------------------------------------------------------------------------------
# Numerics of the pieces


def test_l2_normalize_eps_inside_the_root() -> None:
    zero = l2_normalize(torch.zeros(3, 8, dtype=F64), 1e-6)
    assert torch.equal(zero, torch.zeros_like(zero))
    tiny = l2_normalize(torch.tensor([1e-3, 0.0], dtype=F64), 1e-6)
    # eps inside: 1e-3 / sqrt(1e-6 + 1e-6); eps outside the root would give 1e-3 / (1e-3 + 1e-6) ~ 0.999.
    torch.testing.assert_close(tiny, torch.tensor([2**-0.5, 0.0], dtype=F64), rtol=1e-12, atol=0)


def test_zero_inputs_give_zero_output_not_nan() -> None:
    w = make_weights(SPEC)
    cache = KdaCache.zeros(SPEC, 2)
    out = kda_decode_step(SPEC, w, torch.zeros(1, SPEC.in_proj_rows, dtype=F64), cache, torch.tensor([1]))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isfinite(cache.recurrent).all()


@settings(max_examples=50, deadline=None)
@given(
    f_a=st.lists(st.floats(-1e6, 1e6), min_size=4, max_size=4),
    a_log=st.lists(st.floats(-8, 8), min_size=2, max_size=2),
    dt_bias=st.floats(-1e3, 1e3),
)
def test_gate_stays_within_bounds(f_a: list[float], a_log: list[float], dt_bias: float) -> None:
    f_b = torch.linspace(-3, 3, 6 * 4, dtype=F64).reshape(6, 4)
    g = decay_log_gate(
        torch.tensor(f_a, dtype=F64),
        f_b,
        torch.tensor(a_log, dtype=F64),
        torch.full((6,), dt_bias, dtype=F64),
        -5.0,
    )
    assert ((g >= -5.0) & (g <= 0.0)).all()


def test_gate_applies_each_heads_decay_rate_to_its_own_channels() -> None:
    a_log = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    dt_bias = torch.linspace(-2, 2, 6, dtype=F64)
    g = decay_log_gate(torch.zeros(5, dtype=F64), torch.ones(6, 5, dtype=F64), a_log, dt_bias, -5.0)
    heads = torch.tensor([0, 0, 1, 1, 2, 2])
    want = -5.0 * torch.sigmoid(torch.exp(a_log[heads]) * dt_bias)
    torch.testing.assert_close(g, want, rtol=1e-14, atol=0)


def test_decay_acts_along_k() -> None:
    # With k = 0 the update is a pure decay; g on key channel 0 must scale column 0 of S[v, k] only.
    state = torch.ones(1, 3, 3, dtype=F64)
    g = torch.tensor([[-1.0, 0.0, 0.0]], dtype=F64)
    new = delta_rule_update(
        state, torch.zeros(1, 3, dtype=F64), torch.zeros(1, 3, dtype=F64), g, torch.ones(1, dtype=F64)
    )
    assert torch.allclose(new[0, :, 0], torch.full((3,), torch.e**-1, dtype=F64))
    assert torch.equal(new[0, :, 1:], torch.ones(3, 2, dtype=F64))


def test_gated_rms_norm_is_per_head() -> None:
    o = torch.stack([torch.full((4,), 2.0), torch.full((4,), 0.5)]).to(F64)  # heads of different scale
    got = gated_rms_norm(o, torch.ones(4, dtype=F64), torch.zeros(2, 4, dtype=F64), eps=0.0)
    torch.testing.assert_close(got, torch.full((2, 4), 0.5, dtype=F64), rtol=1e-14, atol=0)


def test_states_are_rounded_to_their_storage_dtypes() -> None:
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=2)
    gen = torch.Generator().manual_seed(3)
    packed = torch.randn(1, SPEC.in_proj_rows, generator=gen, dtype=F64)  # not BF16-representable
    kda_decode_step(SPEC, w, packed, cache, torch.tensor([1]))
    assert cache.conv.dtype == torch.bfloat16 and cache.recurrent.dtype == torch.float32
    x = torch.cat([packed[0, SPEC.sections[n]] for n in ("q", "k", "v")])
    assert torch.equal(cache.conv[1, :, -1], x.to(torch.bfloat16))
    assert not torch.equal(cache.conv[1, :, -1].to(F64), x)


def test_readout_uses_the_state_as_stored() -> None:
    # vLLM also allows a BF16 recurrent state; its coarse rounding makes the carried-state rule visible.
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=2, num_spec=1)
    cache = KdaCache(conv=cache.conv, recurrent=cache.recurrent.to(torch.bfloat16))
    start = clone(cache)
    packed = make_packed(SPEC, 1, 2)
    out = kda_verify_step(SPEC, w, packed, cache, torch.tensor([[1, 0]]), torch.tensor([1]))
    f = reference_features(SPEC, w, packed[0], start.conv[1, :, : SPEC.conv_width - 1])
    state, stored = start.recurrent[1].to(F64), []
    for t in range(2):
        k, v, g, beta = (f[name][t] for name in ("k", "v", "g", "beta"))
        state = delta_rule_update(state, k, v, g, beta).to(torch.bfloat16).to(F64)
        stored.append(state)
        o = torch.einsum("hvk,hk->hv", state, f["q"][t])
        want = reference_output(SPEC, w, o[None], f["gate"][t : t + 1])[0]
        torch.testing.assert_close(out[0, t], want, rtol=1e-9, atol=1e-9)
    assert torch.equal(cache.recurrent[1].to(F64), stored[0])  # token 1's slot is NULL: not stored


# ---------------------------------------------------------------------------------------------------------
# Validation


BAD_TABLES = [
    # (error, slot table, num_accepted (None: a decode step), speculative conv columns of the cache)
    ("same state twice", [3, 3], None, 2),
    ("same state twice", [[1, 2, 3], [4, 5, 2]], [1, 1], 2),  # across requests
    ("same state twice", [[1, 2, 1], [4, 5, 0]], [1, 1], 2),  # within a request
    ("outside 1..3", [[1, 2, 3], [4, 5, 0]], [4, 1], 2),
    ("is NULL", [[1, 2, 3], [4, 0, 5]], [1, 2], 2),
    ("out of range", [1, 12], None, 2),
    ("integer", [1.0, 2.0], None, 2),
    ("needs 5", [[1, 2, 3], [4, 5, 0]], [1, 1], 1),
    ("1..8 tokens", [list(range(1, 10))], [1], 8),
]


@pytest.mark.parametrize(("message", "table", "accepted", "num_spec"), BAD_TABLES)
def test_rejects_bad_tables(message: str, table: list, accepted: list[int] | None, num_spec: int) -> None:
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=12, num_spec=num_spec)
    slots = torch.tensor(table)
    snapshot = digests(cache)
    with pytest.raises(ValueError, match=message):
        if accepted is None:
            kda_decode_step(SPEC, w, make_packed(SPEC, len(table)), cache, slots)
        else:
            kda_verify_step(SPEC, w, make_packed(SPEC, *slots.shape), cache, slots, torch.tensor(accepted))
    assert digests(cache) == snapshot  # a rejected step writes nothing


def test_rejects_bad_shapes() -> None:
    w = make_weights(SPEC)
    cache = make_cache(SPEC, num_slots=4)
    with pytest.raises(ValueError, match="packed projection"):
        kda_decode_step(SPEC, w, make_packed(SPEC, 2, 1), cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="KDA weight a_log"):
        bad = KdaWeights(w.f_b, w.conv, torch.zeros(SPEC.heads + 1), w.dt_bias, w.o_norm)
        kda_decode_step(SPEC, bad, make_packed(SPEC, 1), cache, torch.tensor([1]))
