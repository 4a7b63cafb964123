"""The isolation audit on fake caches driven by the oracles: declared writes pass, every stray write is named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3_decode.config import K3_MINI
from k3_decode.reference.kda import KdaCache, KdaSpec, KdaWeights, kda_decode_step, kda_verify_step
from k3_decode.reference.mla import insert_kv
from k3_decode.runtime.audit import Change, changes_outside, digest, digest_changes
from k3_decode.runtime.writeset import Region, WriteSet, declare_step, kda_state_name, mla_cache_name

SPEC = KdaSpec.for_rank(K3_MINI, tp=2)
PAGE = 4
SLOTS = 8


def weights(seed: int = 0) -> KdaWeights:
    gen = torch.Generator().manual_seed(seed)
    return KdaWeights(
        f_b=torch.randn(SPEC.proj, SPEC.gate_rank, generator=gen, dtype=torch.float64) * 0.1,
        conv=torch.randn(SPEC.conv_channels, SPEC.conv_width, generator=gen, dtype=torch.float64) * 0.5,
        a_log=torch.rand(SPEC.heads, generator=gen, dtype=torch.float64),
        dt_bias=torch.randn(SPEC.proj, generator=gen, dtype=torch.float64) * 0.5,
        o_norm=torch.ones(SPEC.head_dim, dtype=torch.float64),
    )


class FakeStack:
    """Two KDA layers (1, 2) and one MLA layer (3) with caches for 8 requests, one weight and one scratch buffer."""

    def __init__(self, num_spec: int = 0) -> None:
        gen = torch.Generator().manual_seed(1)
        self.w = weights()
        self.kda = {}
        for layer in (1, 2):
            cache = KdaCache.zeros(SPEC, SLOTS, num_spec=num_spec)
            cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
            cache.recurrent.copy_(torch.randn(cache.recurrent.shape, generator=gen))
            self.kda[layer] = cache
        self.mla = torch.randint(0, 255, (SLOTS, PAGE, K3_MINI.mla.cache_row), generator=gen, dtype=torch.uint8)
        self.o_proj = torch.randn(16, SPEC.proj, generator=gen).to(torch.bfloat16)
        self.hidden = torch.zeros(4, 16)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"layers.1.kda.o_proj.weight": self.o_proj, "layers.1.kda.f_b": self.w.f_b, "scratch.hidden": self.hidden}
        for layer, cache in self.kda.items():
            out[kda_state_name(layer, "conv")] = cache.conv
            out[kda_state_name(layer, "recurrent")] = cache.recurrent
        out[mla_cache_name(3)] = self.mla
        return out

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.tensors().items()}


def run_decode(stack: FakeStack, slots: torch.Tensor, slot_mapping: torch.Tensor) -> WriteSet:
    """One step through the oracles; returns the write set the step declares."""
    gen = torch.Generator().manual_seed(2)
    for cache in stack.kda.values():
        packed = torch.randn(len(slots), SPEC.in_proj_rows, generator=gen, dtype=torch.float64)
        kda_decode_step(SPEC, stack.w, packed, cache, slots)
    rows = torch.randn(len(slot_mapping), K3_MINI.mla.cache_row, generator=gen)
    insert_kv(stack.mla, rows, slot_mapping, k_scale=0.05)
    stack.hidden.normal_(generator=gen)
    return declare_step(
        kda_layers=[1, 2],
        kda_slots=slots,
        conv_width=SPEC.conv_width,
        mla_layers=[3],
        slot_mapping=slot_mapping,
        page_size=PAGE,
        scratch=["hidden"],
    )


SLOTS_B3 = torch.tensor([2, 0, 5])  # the second request is graph padding (NULL)
MAPPING_B3 = torch.tensor([9, -1, 22])


def test_a_correct_step_changes_nothing_outside_its_write_set():
    stack = FakeStack()
    before = stack.snapshot()
    declared = run_decode(stack, SLOTS_B3, MAPPING_B3)
    after = stack.tensors()
    assert changes_outside(before, after, declared) == []
    # The step did write: the declared set is not vacuous.
    assert not torch.equal(before["layers.1.kda.recurrent"][2], after["layers.1.kda.recurrent"][2])
    assert not torch.equal(before[mla_cache_name(3)][2, 1], after[mla_cache_name(3)][2, 1])


def test_verify_step_with_spec_columns_is_clean():
    stack = FakeStack(num_spec=2)
    before = stack.snapshot()
    slots = torch.tensor([[2, 3, 4], [6, 7, -1]])
    packed = torch.randn(2, 3, SPEC.in_proj_rows, dtype=torch.float64)
    kda_verify_step(SPEC, stack.w, packed, stack.kda[1], slots, torch.tensor([2, 1]))
    declared = declare_step(
        kda_layers=[1], kda_slots=slots, conv_width=SPEC.conv_width, mla_layers=[], slot_mapping={}, page_size=PAGE
    )
    assert changes_outside(before, stack.tensors(), declared) == []


def test_write_to_another_requests_state_slot_is_named():
    stack = FakeStack()
    before = stack.snapshot()
    declared = run_decode(stack, SLOTS_B3, MAPPING_B3)
    stack.kda[2].recurrent[7, 1] += 1.0  # a kernel that indexed the wrong request
    (change,) = changes_outside(before, stack.tensors(), declared)
    assert change == Change("layers.2.kda.recurrent", ((7, 8), (1, 2), (0, 32), (0, 32)), 32 * 32)
    assert str(change) == (
        "layers.2.kda.recurrent[7:8, 1:2, 0:32, 0:32]: 1024 elements changed outside the declared write set"
    )


def test_write_to_a_null_slot_is_named():
    # Padding rows write nothing, not even slot 0 (the NULL block).
    stack = FakeStack()
    before = stack.snapshot()
    declared = run_decode(stack, SLOTS_B3, MAPPING_B3)
    stack.kda[1].conv[0, 5, 1] = 3.0
    assert [str(c) for c in changes_outside(before, stack.tensors(), declared)] == [
        "layers.1.kda.conv[0:1, 5:6, 1:2]: 1 elements changed outside the declared write set"
    ]


def test_write_past_the_decode_conv_taps_is_named():
    stack = FakeStack(num_spec=2)
    before = stack.snapshot()
    declared = run_decode(stack, SLOTS_B3, MAPPING_B3)
    stack.kda[1].conv[2, :, 3] = 7.0  # a decode step owns columns 0..W-2 of its conv row, not the speculative ones
    (change,) = changes_outside(before, stack.tensors(), declared)
    assert (change.tensor, change.index) == ("layers.1.kda.conv", ((2, 3), (0, SPEC.conv_channels), (3, 4)))


def test_write_to_a_weight_is_named():
    stack = FakeStack()
    before = stack.snapshot()
    declared = run_decode(stack, SLOTS_B3, MAPPING_B3)
    stack.o_proj[3, 5:9] = 0
    stack.w.f_b.mul_(1.0000001)
    changes = {c.tensor: c for c in changes_outside(before, stack.tensors(), declared)}
    assert changes["layers.1.kda.o_proj.weight"].index == ((3, 4), (5, 9))
    assert changes["layers.1.kda.f_b"].index == ((0, SPEC.proj), (0, SPEC.gate_rank))


def test_write_to_another_requests_mla_slot_is_named():
    stack = FakeStack()
    before = stack.snapshot()
    declared = run_decode(stack, SLOTS_B3, MAPPING_B3)
    stack.mla[2, 2] ^= 1  # slot 10: the neighbour of this step's slot 9
    (change,) = changes_outside(before, stack.tensors(), declared)
    assert (change.tensor, change.index) == (mla_cache_name(3), ((2, 3), (2, 3), (0, K3_MINI.mla.cache_row)))


def test_comparison_is_bitwise():
    t = torch.tensor([float("nan"), 0.0, 1.0])
    after = torch.tensor([float("nan"), -0.0, 1.0])
    (change,) = changes_outside({"t": t}, {"t": after}, WriteSet())
    assert change.index == ((1, 2),)


def test_replaced_missing_and_undeclared_tensors():
    a = {"x": torch.zeros(2, 2), "y": torch.zeros(3)}
    b = {"x": torch.zeros(2, 3), "z": torch.zeros(1)}
    notes = sorted(str(c) for c in changes_outside(a, b, WriteSet()))
    assert notes == [
        "x[0:2, 0:2]: was replaced: torch.float32 (2, 2) became torch.float32 (2, 3)",
        "y[]: is missing after the step",
        "z[]: appeared after the step (not in the audit before it)",
    ]
    with pytest.raises(ValueError, match=r"declares tensors \['w'\] that the audit was not given"):
        changes_outside(a, a, WriteSet(frozenset({Region("w")})))


# -- the hash form ----------------------------------------------------------------------------------------------


def test_digests_name_the_changed_rows_and_ignore_declared_writes():
    stack = FakeStack()
    stack2 = FakeStack()
    declared = declare_step(
        kda_layers=[1, 2],
        kda_slots=SLOTS_B3,
        conv_width=SPEC.conv_width,
        mla_layers=[3],
        slot_mapping=MAPPING_B3,
        page_size=PAGE,
        scratch=["hidden"],
    )
    before = digest(stack.tensors(), declared)
    assert run_decode(stack2, SLOTS_B3, MAPPING_B3) == declared
    assert digest_changes(before, digest(stack2.tensors(), declared)) == []
    stack2.kda[1].recurrent[6, 0, 0, 0] += 1
    stack2.o_proj[10:12] = 1
    assert [str(c) for c in digest_changes(before, digest(stack2.tensors(), declared))] == [
        "layers.1.kda.o_proj.weight[10:12, 0:128]: changed outside the declared write set",
        "layers.1.kda.recurrent[6:7, 0:4, 0:32, 0:32]: changed outside the declared write set",
    ]


def test_digests_of_different_write_sets_do_not_compare():
    t = {"x": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="different write sets"):
        digest_changes(digest(t, WriteSet()), digest(t, WriteSet(frozenset({Region("x", ((0, 1),))}))))


# -- property: a write is flagged exactly when it falls outside the declared set -----------------------------------


@settings(max_examples=120, deadline=None)
@given(
    declared_slots=st.sets(st.integers(1, 7), max_size=4),
    write_slot=st.integers(0, 7),
    channel=st.integers(0, SPEC.conv_channels - 1),
    column=st.integers(0, 2 + 2),
)
def test_conv_write_flagged_iff_outside_declared(declared_slots, write_slot, channel, column):
    conv = torch.zeros(SLOTS, SPEC.conv_channels, SPEC.conv_width - 1 + 2, dtype=torch.bfloat16)
    slots = torch.tensor(sorted(declared_slots), dtype=torch.long)
    declared = declare_step(
        kda_layers=[0], kda_slots=slots, conv_width=SPEC.conv_width, mla_layers=[], slot_mapping={}, page_size=PAGE
    )
    after = conv.clone()
    after[write_slot, channel, column] = 1.0
    name, rec = kda_state_name(0, "conv"), kda_state_name(0, "recurrent")
    state = torch.zeros(SLOTS, 1)
    changes = changes_outside({name: conv, rec: state}, {name: after, rec: state}, declared)
    inside = write_slot in declared_slots and column < SPEC.conv_width - 1
    assert (changes == []) == inside
    if not inside:
        assert changes[0].index == ((write_slot, write_slot + 1), (channel, channel + 1), (column, column + 1))
