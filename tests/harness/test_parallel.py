"""harness.parallel: results come back in rank order, each child runs with NVLink multicast off, and a rank that
raises, dies or hangs becomes one RankFailure naming it."""

from __future__ import annotations

import os
import time

import pytest

from harness.parallel import MULTICAST_OFF, RankFailure, run_ranks


def echo(rank: int, world: int, address: str, port: int, kind: str, tag: str) -> dict:
    env = {k: os.environ.get(k) for k in MULTICAST_OFF}
    return {"rank": rank, "world": world, "kind": kind, "tag": tag, "env": env}


def fail_on(rank: int, world: int, address: str, port: int, kind: str, bad: list[int]) -> int:
    if rank in bad:
        raise ValueError(f"rank {rank} refuses\nsecond line")
    return rank


def die(rank: int, world: int, address: str, port: int, kind: str) -> None:
    if rank == 1:
        os._exit(7)


def hang(rank: int, world: int, address: str, port: int, kind: str) -> None:
    if rank == 0:
        time.sleep(60)


def test_results_in_rank_order_with_multicast_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the caller's setting must not reach the ranks
    out = run_ranks(echo, 3, "cpu", ("t",))
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["kind"] == "cpu" and o["tag"] == "t" for o in out)
    assert all(o["env"] == dict(MULTICAST_OFF) for o in out)
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"  # and the caller's environment is restored


def test_one_failing_rank_is_named_with_its_first_line() -> None:
    with pytest.raises(RankFailure, match=r"^1 of 3 ranks failed: rank 2: ValueError: rank 2 refuses$"):
        run_ranks(fail_on, 3, "cpu", ([2],))


def test_every_rank_failing_alike_is_one_message() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(fail_on, 2, "cpu", ([0, 1],))
    assert "2 of 2 ranks failed" in str(info.value)  # the messages differ by rank number


def test_a_rank_that_dies_or_hangs_is_reported() -> None:
    with pytest.raises(RankFailure, match="rank 1 died with exit code 7"):
        run_ranks(die, 2, "cpu")
    with pytest.raises(RankFailure, match="rank 0 still running after 3 s"):
        run_ranks(hang, 2, "cpu", timeout_s=3)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="world size 0"):
        run_ranks(echo, 0, "cpu", ("t",))
    with pytest.raises(ValueError, match="device kind 'tpu'"):
        run_ranks(echo, 1, "tpu", ("t",))
