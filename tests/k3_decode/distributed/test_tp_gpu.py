"""TP across two or more GPUs (one process each, NCCL and peer memory): the all-reduces' bits, the fused
epilogues, and a real-shape TP stack against the oracle, replicated exactly, audited per rank."""

from __future__ import annotations

import pytest
import torch

from harness.parallel import run_ranks
from suites.k3 import tp
from tests.k3_decode.distributed import ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two or more CUDA devices"
    ),
]
# Every GPU of the host up to 4 (TP2 on two GPUs, TP4 on four): K3 shards at TP 1, 2, 4, 8, 16.
WORLD = 4 if torch.cuda.device_count() >= 4 else 2


@pytest.mark.parametrize("transport", ["ordered", "peer"])
def test_rank_order_transports_give_the_oracles_bits_on_gpus(transport: str) -> None:
    for rank_result in run_ranks(ranks.all_reduce_bits, WORLD, "cuda", (transport, 8), timeout_s=300):
        for cell, r in rank_result.items():
            assert r == {"oracle": "ok", "identical": True, "input_unchanged": True}, (transport, cell, r)


def test_nccl_replicates_but_is_not_held_to_the_rank_order_rule() -> None:
    for rank_result in run_ranks(ranks.all_reduce_bits, WORLD, "cuda", ("nccl",), timeout_s=300):
        assert all(r["identical"] and r["input_unchanged"] for r in rank_result.values()), rank_result


def test_the_bit_check_fails_a_wrongly_rounding_transport_on_gpus() -> None:
    # A BF16 running sum only differs from the rule from three ranks on (two ranks add once and round once).
    for transport in ("truncating", *(("bf16-running",) if WORLD > 2 else ())):
        results = run_ranks(ranks.all_reduce_bits, WORLD, "cuda", (transport,), timeout_s=300)
        assert all("values differ" in r["64x7168"]["oracle"] for r in results), transport


def test_fused_epilogues_give_the_unfused_bits() -> None:
    for rank_result in run_ranks(ranks.fused_epilogues, WORLD, "cuda", ([1, 8, 64],), timeout_s=300):
        assert all(rank_result.values()), rank_result


def test_real_shape_tp_stack_matches_the_oracle_and_fused_equals_unfused() -> None:
    # The numerics stage's own TP stack cell: oracle over every shard, exact replication, per-rank audit, and the
    # fused peer stack bit for bit the ordered one.
    variants = [("ordered", False), ("peer", True), ("nccl", False)]
    results = run_ranks(tp.stack_rank, WORLD, "cuda", ("k3-kda-mla", variants), timeout_s=580)
    for rank, r in enumerate(results):
        assert set(r) == {"ordered", "peer+fused", "nccl", "fused equals unfused"}
        for label, problems in r.items():
            found = problems if isinstance(problems, list) else [p for ps in problems.values() for p in ps]
            assert found == [], (rank, label, found)
