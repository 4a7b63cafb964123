"""Stock KDA decode and verify steps (torch-cpu path) against the oracle at k3-mini dims: outputs, states, conv
rows, NULL slots, write sets, and the errors on bad input. The Triton kernels are checked under the interpreter
(test_attention_interpreted.py) and on the GPU."""

from __future__ import annotations

import pytest
import torch

from k3_decode.config import K3_MINI
from k3_decode.reference import kda as rk
from k3_decode.stock import kda as sk
from tests.k3_decode.stock.attention_helpers import (
    assert_close,
    clone_cache,
    kda_layer,
    load_tolerances,
    projected_rows,
    random_kda_cache,
    reference_kda_weights,
    weights_for,
)

TOL = load_tolerances()
TP = 2  # 4 heads of 32 per rank
SPEC = rk.KdaSpec.for_rank(K3_MINI, TP)
WEIGHTS = weights_for(K3_MINI, TP, "cpu").attention(kda_layer(K3_MINI))


def untouched(before: rk.KdaCache, after: rk.KdaCache, conv_slots: set[int], state_slots: set[int]) -> None:
    """Every slot outside the write set is bit-identical."""
    for s in range(before.num_slots):
        if s not in conv_slots:
            assert torch.equal(before.conv[s], after.conv[s]), f"conv slot {s} changed"
        if s not in state_slots:
            assert torch.equal(before.recurrent[s], after.recurrent[s]), f"recurrent slot {s} changed"


def test_decode_matches_the_oracle_and_writes_only_live_slots():
    gen = torch.Generator().manual_seed(0)
    cache = random_kda_cache(SPEC, 12, 0, gen, "cpu")
    slots = torch.tensor([5, 0, 2, 11, -1, 7, 1])  # 0 and -1 are NULL (CUDA-graph padding)
    packed = projected_rows(WEIGHTS.in_proj, (len(slots),), gen)
    ref_cache, start = clone_cache(cache), clone_cache(cache)
    ref = rk.kda_decode_step(SPEC, reference_kda_weights(WEIGHTS), packed, ref_cache, slots)
    got = sk.kda_decode_step(SPEC, WEIGHTS, packed, cache, slots)

    assert got.dtype == torch.bfloat16
    live = slots > 0
    assert_close(got[live], ref[live], TOL["kda_decode"], "decode output")
    assert not got[~live].any(), "NULL rows must output zeros"
    written = set(slots[live].tolist())
    assert_close(cache.recurrent[slots[live]], ref_cache.recurrent[slots[live]], TOL["kda_decode_state"], "state")
    assert torch.equal(cache.conv, ref_cache.conv), "conv rows are copies of BF16 inputs: exact"
    untouched(start, cache, written, written)


def test_decode_of_a_batch_of_padding_changes_nothing():
    gen = torch.Generator().manual_seed(1)
    cache = random_kda_cache(SPEC, 4, 0, gen, "cpu")
    start = clone_cache(cache)
    slots = torch.tensor([0, -1, 0])
    got = sk.kda_decode_step(SPEC, WEIGHTS, projected_rows(WEIGHTS.in_proj, (3,), gen), cache, slots)
    assert not got.any()
    untouched(start, cache, set(), set())


@pytest.mark.parametrize("q", [2, 4, 8])
def test_verify_matches_the_oracle(q: int):
    gen = torch.Generator().manual_seed(q)
    batch, num_slots = 5, 48
    cache = random_kda_cache(SPEC, num_slots, q - 1, gen, "cpu")
    slots = (torch.randperm(num_slots - 1, generator=gen)[: batch * q] + 1).view(batch, q)
    accepted = torch.randint(1, q + 1, (batch,), generator=gen)
    slots[1, 0] = 0  # a NULL request: its later (positive) slots must stay untouched too
    slots[2, -1] = -1  # live requests whose last token has no state slot (-1 or the NULL slot 0)
    slots[3, -1] = 0
    accepted[2:4] = accepted[2:4].clamp(max=q - 1)
    packed = projected_rows(WEIGHTS.in_proj, (batch, q), gen)
    ref_cache, start = clone_cache(cache), clone_cache(cache)
    ref = rk.kda_verify_step(SPEC, reference_kda_weights(WEIGHTS), packed, ref_cache, slots, accepted)
    got = sk.kda_verify_step(SPEC, WEIGHTS, packed, cache, slots, accepted)

    live = slots[:, 0] > 0
    assert_close(got[live], ref[live], TOL["kda_verify"], f"verify output q={q}")
    assert not got[~live].any()
    written = rk.verify_write_set(slots)
    states = sorted(w.slot for w in written if w.tensor == "recurrent")
    assert_close(cache.recurrent[states], ref_cache.recurrent[states], TOL["kda_verify_state"], "verify states")
    assert torch.equal(cache.conv, ref_cache.conv)
    untouched(start, cache, {w.slot for w in written if w.tensor == "conv"}, set(states))


def test_one_token_verify_equals_decode():
    gen = torch.Generator().manual_seed(3)
    cache = random_kda_cache(SPEC, 8, 0, gen, "cpu")
    other = clone_cache(cache)
    slots = torch.tensor([3, 6, 1])
    packed = projected_rows(WEIGHTS.in_proj, (3,), gen)
    dec = sk.kda_decode_step(SPEC, WEIGHTS, packed, cache, slots)
    one = torch.ones(3, dtype=torch.long)
    ver = sk.kda_verify_step(SPEC, WEIGHTS, packed.unsqueeze(1), other, slots.unsqueeze(1), one)
    # The verify pipeline rounds q, k, v and o to BF16 where the fused decode does not: close, not equal.
    assert_close(ver[:, 0], dec.float(), TOL["kda_verify"], "one-token verify vs decode")
    assert torch.equal(cache.conv, other.conv)


def test_bad_input_is_rejected_with_the_reason():
    gen = torch.Generator().manual_seed(4)
    cache = random_kda_cache(SPEC, 6, 1, gen, "cpu")
    packed = projected_rows(WEIGHTS.in_proj, (2,), gen)
    with pytest.raises(ValueError, match="writes the same state twice"):
        sk.kda_decode_step(SPEC, WEIGHTS, packed, cache, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="slot 9 out of range"):
        sk.kda_decode_step(SPEC, WEIGHTS, packed, cache, torch.tensor([1, 9]))
    with pytest.raises(ValueError, match="decode slots must be"):
        sk.kda_decode_step(SPEC, WEIGHTS, packed, cache, torch.tensor([[1], [2]]))
    with pytest.raises(ValueError, match="packed projection: shape"):
        sk.kda_decode_step(SPEC, WEIGHTS, packed[:, :-1], cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="FP32 recurrent state"):
        bf16 = rk.KdaCache(cache.conv, cache.recurrent.bfloat16())
        sk.kda_decode_step(SPEC, WEIGHTS, packed, bf16, torch.tensor([1, 2]))
    two = packed.view(2, 1, -1).expand(2, 2, -1).contiguous()
    with pytest.raises(ValueError, match=r"num_accepted 3 outside 1\.\.2"):
        sk.kda_verify_step(SPEC, WEIGHTS, two, cache, torch.tensor([[1, 2], [3, 4]]), torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"accepted state slot\[0, 1\] = -1 is NULL"):
        sk.kda_verify_step(SPEC, WEIGHTS, two, cache, torch.tensor([[1, -1], [3, 4]]), torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="conv state has 4 columns; this step needs 6"):
        sk.kda_verify_step(
            SPEC, WEIGHTS, two.repeat(1, 2, 1), cache, torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]]), torch.ones(2)
        )
