"""The TP pieces across real processes on the CPU (gloo), at k3-mini dims: the rank-order all-reduce's bits, the
start-up agreement, cross-rank bit identity and the teacher-forced oracle over every rank's shard.

Each test starts 2 or 4 processes (harness.parallel); the red-team cases prove each check can fail.
"""

from __future__ import annotations

import pytest

from harness.parallel import RankFailure, run_ranks
from tests.k3_decode.distributed import ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 4])
def test_ordered_all_reduce_gives_every_rank_the_oracles_bits(world: int) -> None:
    for rank_result in run_ranks(ranks.all_reduce_bits, world, "cpu", ("ordered",)):
        for cell, r in rank_result.items():
            assert r == {"oracle": "ok", "identical": True, "input_unchanged": True}, cell


@pytest.mark.parametrize("transport", ["reversed", "bf16-running", "truncating"])
def test_the_bit_check_fails_a_transport_that_sums_in_another_order_or_rounds_early(transport: str) -> None:
    results = run_ranks(ranks.all_reduce_bits, 4, "cpu", (transport,))
    verdicts = [r["3x7168"]["oracle"] for r in results]
    assert all(v.startswith("rank 0:") and "values differ" in v for v in verdicts), verdicts


def test_tp2_stack_matches_the_oracle_over_both_shards_and_replicates_exactly() -> None:
    results = run_ranks(ranks.stack_numerics, 2, "cpu", ("k3-mini-kda3-mla", "ordered", False))
    for rank, r in enumerate(results):
        assert r["failures"] == [], (rank, r["failures"])
        assert r["replication"] == [], (rank, r["replication"])
        # Prefill runs the longest context (5 tokens) as 5 iterations, the decode step one more: 6 x 4 layers, each
        # with an attention combine and an MoE tail; the traced decode reduces each layer's attention output once more.
        assert r["calls"] == {"attention_out": 24, "moe_tail": 24, "reduce": 4}, r["calls"]


def test_tp2_dense_start_stack_reduces_the_dense_mlp() -> None:
    results = run_ranks(ranks.stack_numerics, 2, "cpu", ("k3-mini-dense-start", "ordered", False))
    assert [r["failures"] for r in results] == [[], []]
    # Layer 0's dense MLP output in each of the 6 iterations, and the traced decode's four attention outputs.
    assert results[0]["calls"]["reduce"] == 6 + 4


def test_the_oracle_check_fails_a_tp_stack_that_skips_its_all_reduces() -> None:
    results = run_ranks(ranks.stack_numerics, 2, "cpu", ("k3-mini-kda3-mla", "ordered", True))
    for r in results:
        assert any("attn_output" in f for f in r["failures"]), r["failures"]
        # Each rank keeps its own partial: the replicated values differ between the ranks.
        assert any("ranks disagree" in e for e in r["replication"]), r["replication"]


def test_ranks_that_disagree_on_the_scope_stop_every_rank_with_one_error() -> None:
    # Rank 1 asks for the real-size K3 stack, which the CPU refuses; rank 0's k3-mini stack is accepted.
    with pytest.raises(RankFailure) as info:
        run_ranks(ranks.start_with_stack, 2, "cpu", (["k3-mini-kda3-mla", "k3-kda-mla"],), timeout_s=120)
    message = str(info.value)
    assert message.startswith("every rank of 2 failed: RankDisagreementError: TP ranks disagree on the scope verdict")
    assert "rank 0 accept" in message and "rank 1 reject" in message, message
    assert "\n" not in message


def test_replication_check_names_the_tensor_and_the_ranks_that_differ() -> None:
    results = run_ranks(ranks.digest_check, 4, "cpu", (2,))
    for errors in results:
        assert len(errors) == 1 and errors[0].startswith("layer 6 mlp_output: ranks disagree"), errors
        assert "ranks [0, 1, 3]" in errors[0] and "ranks [2]" in errors[0]
    assert run_ranks(ranks.digest_check, 2, "cpu", (-1,)) == [[], []]
