"""Declared write sets: regions per KDA slot, MLA cache slot and scratch buffer, built from the oracles' slot rules."""

from __future__ import annotations

import pytest
import torch

from k3_decode.runtime.writeset import Region, WriteSet, declare_step, kda_regions, mla_regions, scratch_regions

W = 4  # K3's conv width


def strs(regions) -> list[str]:
    return sorted(str(r) for r in regions)


def test_decode_declares_live_slots_only_with_w_minus_1_conv_taps():
    assert strs(kda_regions(1, torch.tensor([3, 0, 5, -1]), W)) == [
        "layers.1.kda.conv[3:4, :, 0:3]",
        "layers.1.kda.conv[5:6, :, 0:3]",
        "layers.1.kda.recurrent[3:4]",
        "layers.1.kda.recurrent[5:6]",
    ]


def test_verify_declares_conv_row_and_every_real_token_slot():
    slots = torch.tensor([[3, 4, -1], [6, 7, 8], [0, 9, 10]])  # the third request is NULL (slot[b, 0] <= 0)
    assert strs(kda_regions(2, slots, W)) == [
        "layers.2.kda.conv[3:4, :, 0:5]",  # W-2+q columns
        "layers.2.kda.conv[6:7, :, 0:5]",
        *(f"layers.2.kda.recurrent[{s}:{s + 1}]" for s in (3, 4, 6, 7, 8)),
    ]


def test_duplicate_kda_slots_are_rejected():
    with pytest.raises(ValueError, match="writes the same state twice"):
        kda_regions(1, torch.tensor([3, 3]), W)
    with pytest.raises(ValueError, match=r"must be \[B\] \(decode\) or \[B, q\]"):
        kda_regions(1, torch.zeros(1, 1, 1, dtype=torch.long), W)


def test_mla_slots_map_to_page_and_offset():
    assert strs(mla_regions(3, torch.tensor([17, -1, 0, 31]), page_size=16)) == [
        "layers.3.mla.kv_cache[0:1, 0:1]",
        "layers.3.mla.kv_cache[1:2, 15:16]",
        "layers.3.mla.kv_cache[1:2, 1:2]",
    ]
    with pytest.raises(ValueError, match=r"writes cache slots \[5\] twice"):
        mla_regions(3, torch.tensor([5, 5]), 16)
    with pytest.raises(ValueError, match="expected an integer tensor"):
        mla_regions(3, torch.tensor([5.0]), 16)


def test_declare_step_composes_layers_and_scratch():
    ws = declare_step(
        kda_layers=[0, 1],
        kda_slots=torch.tensor([2, 5]),
        conv_width=W,
        mla_layers=[3],
        slot_mapping={3: torch.tensor([40, 41])},
        page_size=16,
        scratch=["hidden", "projected"],
    )
    assert ws.tensors() == {
        "layers.0.kda.conv",
        "layers.0.kda.recurrent",
        "layers.1.kda.conv",
        "layers.1.kda.recurrent",
        "layers.3.mla.kv_cache",
        "scratch.hidden",
        "scratch.projected",
    }
    assert "scratch.hidden[...]" in ws.describe()
    with pytest.raises(ValueError, match="no table for MLA layer 7"):
        declare_step(
            kda_layers=[], kda_slots=torch.tensor([1]), conv_width=W, mla_layers=[7], slot_mapping={}, page_size=16
        )


def test_mask_marks_exactly_the_declared_elements():
    ws = WriteSet(frozenset(kda_regions(0, torch.tensor([2]), W) + scratch_regions(["s"])))
    conv = ws.mask("layers.0.kda.conv", (4, 6, 5))
    assert conv.sum() == 6 * 3 and conv[2, :, :3].all() and not conv[2, :, 3:].any() and not conv[1].any()
    assert ws.mask("scratch.s", (3, 3)).all()
    assert ws.mask("layers.0.kda.recurrent", (3, 4)).sum() == 4
    with pytest.raises(ValueError, match="reaches past tensor shape"):
        ws.mask("layers.0.kda.recurrent", (2, 4))


def test_region_spans_must_be_ranges():
    with pytest.raises(ValueError, match="not half-open ranges"):
        Region("t", ((3, 3),))
