"""Audit mode: a correct step changes nothing outside its declared write set; a step that writes another request's
KDA slot, or a cache row it did not declare, is named with the tensor and the index range, by each method (full
copies, host hashes, on-device hashes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3_decode.executor import audit_step
from k3_decode.executor.audit import device_digest
from k3_decode.runtime.audit import digest, digest_changes
from k3_decode.runtime.writeset import Region, WriteSet, kda_state_name, mla_cache_name
from tests.k3_decode.executor.helpers import build, decode_requests, prefill


@pytest.fixture
def ex():
    ex = build()
    prefill(ex, {0: 3, 1: 5, 4: 2})
    return ex


@pytest.mark.parametrize("method", ["copy", "digest", "device"])
def test_a_correct_decode_step_passes(ex, method: str) -> None:
    audited = audit_step(ex, decode_requests(ex, [1, 0], seed=1), method=method)
    assert audited.passed, audited.summary()
    assert audited.tensors == len(ex.owned_tensors())
    assert "no change outside the declared write set" in audited.summary()


def test_a_correct_prefill_step_passes(ex) -> None:
    from k3_decode.executor import StepRequest, random_input

    x = random_input(ex.dims, ex.config.layers[0], 4, seed=2)
    audited = audit_step(ex, [StepRequest(2, x, prefill=True)], method="copy")
    assert audited.passed, audited.summary()


def test_the_declared_set_is_the_requests_slots_rows_and_step_buffers(ex) -> None:
    reqs = decode_requests(ex, [1, 0], seed=3)
    declared = ex.declare(reqs)
    page, per = ex.config.page_size, ex.config.max_requests
    rows = {(r, ex.state.context_lens[r]) for r in (0, 1)}
    want_mla = {((pos // page * per + r, pos // page * per + r + 1), (pos % page, pos % page + 1)) for r, pos in rows}
    for layer in ex.config.mla_layers:
        assert {reg.index for reg in declared.of(mla_cache_name(layer))} == want_mla
    for layer in ex.config.kda_layers:
        recurrent = {reg.index[0] for reg in declared.of(kda_state_name(layer, "recurrent"))}
        assert recurrent == {(1, 2), (2, 3)}  # requests 0 and 1 own slots 1 and 2; slot 0 is NULL
    scratch = {t for t in declared.tensors() if t.startswith("scratch.")}
    assert scratch == {f"scratch.eager.{k}" for k in ex.eager.tensors()}


@pytest.mark.parametrize("method", ["copy", "digest", "device"])
def test_a_step_that_writes_another_requests_kda_slot_is_caught(ex, monkeypatch, method: str) -> None:
    victim = ex.state.kda_slot(4)  # request 4 is not in the step
    mine = ex.state.kda_slot(0)
    real = ex.attention.kda_decode

    def rogue(packed, weights, cache, slots):
        return real(packed, weights, cache, torch.where(slots == mine, torch.full_like(slots, victim), slots))

    monkeypatch.setattr(ex.attention, "kda_decode", rogue)
    audited = audit_step(ex, decode_requests(ex, [0, 1], seed=4), method=method)
    assert not audited.passed
    named = {(c.tensor, c.index[0]) for c in audited.changes}
    for layer in ex.config.kda_layers:
        assert (kda_state_name(layer, "recurrent"), (victim, victim + 1)) in named
        assert (kda_state_name(layer, "conv"), (victim, victim + 1)) in named
    assert all(c.index[0] == (victim, victim + 1) for c in audited.changes), audited.summary()


def test_a_step_that_writes_an_undeclared_cache_row_is_caught(ex, monkeypatch) -> None:
    real = ex.attention.mla_attention

    def rogue(x, weights, paged, num_splits):
        return real(x, weights, dataclasses.replace(paged, slot_mapping=paged.slot_mapping + 1), num_splits)

    monkeypatch.setattr(ex.attention, "mla_attention", rogue)
    audited = audit_step(ex, decode_requests(ex, [1], seed=5), method="copy")
    assert [c.tensor for c in audited.changes] == [mla_cache_name(layer) for layer in ex.config.mla_layers]
    pos = ex.state.context_lens[1] - 1 + 1  # the row after the one request 1 declared (context already advanced)
    page = int(ex.state.block_table_host[1, pos // ex.config.page_size])
    assert audited.changes[0].index[:2] == (
        (page, page + 1),
        (pos % ex.config.page_size, pos % ex.config.page_size + 1),
    )


def test_an_unknown_audit_method_is_refused(ex) -> None:
    with pytest.raises(ValueError, match="audit method 'hash'"):
        audit_step(ex, decode_requests(ex, [0], seed=6), method="hash")  # type: ignore[arg-type]


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(5, 3, 7, generator=gen),
        "fp8": torch.randint(0, 255, (4, 16), dtype=torch.uint8, generator=gen),
        "half": torch.randn(4, 9, generator=gen).bfloat16(),
        "scalar": torch.tensor(1.0),
        "ids": torch.arange(6, dtype=torch.int64),
    }


@pytest.mark.parametrize("hash_of", [device_digest, digest], ids=["device", "host"])
def test_digests_name_the_changed_rows_and_ignore_declared_writes(hash_of) -> None:
    t = _tensors()
    declared = WriteSet(frozenset({Region("w", ((1, 2),))}))
    before = hash_of(t, declared)
    t["w"][1].fill_(3.0)  # inside the declared set
    assert digest_changes(before, hash_of(t, declared)) == []
    t["w"][3, 2, 6] = torch.nextafter(t["w"][3, 2, 6], torch.tensor(9.0))  # one ulp
    t["fp8"][2, 15] ^= 1  # one bit
    t["half"][0, 0] = -t["half"][0, 0]
    t["scalar"].zero_()
    named = [str(c).split(":")[0] for c in digest_changes(before, hash_of(t, declared))]
    assert named == ["fp8[2", "half[0", "scalar[]", "w[3"]


def test_device_digest_sees_a_sign_flip_of_zero_and_swapped_elements() -> None:
    z = {"z": torch.zeros(3, 4)}
    before = device_digest(z, WriteSet())
    z["z"][1, 2] = -0.0  # the same value, other bits
    assert [c.index[0] for c in digest_changes(before, device_digest(z, WriteSet()))] == [(1, 2)]
    s = {"s": torch.arange(8.0).reshape(2, 4)}
    before = device_digest(s, WriteSet())
    s["s"][0] = s["s"][0].flip(0)  # the same multiset of values in another order
    assert [c.index[0] for c in digest_changes(before, device_digest(s, WriteSet()))] == [(0, 1)]


def test_device_digest_agrees_with_itself_across_chunks(monkeypatch) -> None:
    """Rows hashed a few at a time give the hashes rows hashed at once give (the chunking bounds memory only)."""
    from k3_decode.executor import audit

    t = {"big": torch.randn(9, 5, generator=torch.Generator().manual_seed(1))}
    whole = device_digest(t, WriteSet())
    monkeypatch.setattr(audit, "_CHUNK", 10)  # two rows per chunk
    assert device_digest(t, WriteSet()) == whole
