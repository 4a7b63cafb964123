"""The peer two-shot kernels compile for sm_90 (H200) on the CPU at K3 widths and TP sizes, with the launch
configuration PeerAllReduce uses, without large spills; their barriers are system-scope release/acquire atomics.

The launchers run on meta tensors with the kernels replaced by recorders (as the stock kernels' compile test does),
so the constexprs compiled here are the ones a GPU run uses.
"""

from __future__ import annotations

import re

import pytest
import torch

from harness.ptx_lint import contracted_butterflies
from k3_decode.config import K3
from k3_decode.distributed.allreduce import AllReduceError, PeerAllReduce
from k3_decode.distributed.group import TpGroup
from tests.k3_decode.stock.test_attention_kernels_compile import (
    MAX_REGISTERS,
    MAX_SPILL_BYTES,
    Recorder,
    compile_recorded,
    meta,
    resource_usage,
)

triton = pytest.importorskip("triton", reason="Triton compiles the kernels")
pytestmark = pytest.mark.slow

RELEASE_CAS = re.compile(r"atom\.[\w.]*release[\w.]*\.sys[\w.]*\.cas|atom\.[\w.]*sys[\w.]*release[\w.]*\.cas")
ACQUIRE_CAS = re.compile(r"atom\.[\w.]*acquire[\w.]*\.sys[\w.]*\.cas|atom\.[\w.]*sys[\w.]*acquire[\w.]*\.cas")


def peer_on_meta(rank: int, world: int, max_rows: int = 64) -> PeerAllReduce:
    """A PeerAllReduce whose tables are meta tensors: it launches (into recorders) but owns no memory."""
    peer = object.__new__(PeerAllReduce)
    peer.group = TpGroup(rank, world, torch.device("meta"), "nccl")
    peer.max_rows, peer.max_width, peer.name = max_rows, K3.hidden_size, "peer"
    peer._tables = {k: meta(world, dtype=torch.int64) for k in ("slots", "gather", "pads")}
    return peer


def _record(monkeypatch: pytest.MonkeyPatch, name: str) -> Recorder:
    from k3_decode.distributed import triton_twoshot

    recorder = Recorder(getattr(triton_twoshot, name))
    monkeypatch.setattr(triton_twoshot, name, recorder)
    return recorder


def _check(recorder: Recorder) -> list[str]:
    assert recorder.calls, "the kernel was never launched"
    ptx = []
    for args, kwargs in recorder.calls:
        compiled = compile_recorded(recorder.kernel, args, kwargs)
        registers, spilled = resource_usage(compiled)
        assert spilled <= MAX_SPILL_BYTES, f"spills {spilled} bytes ({registers} registers)"
        assert registers <= MAX_REGISTERS
        assert not contracted_butterflies(compiled.asm["ptx"]), "a lane-asymmetric butterfly step (FP contraction)"
        ptx.append(compiled.asm["ptx"])
    return ptx


@pytest.mark.parametrize("world", [2, 8, 16])
def test_two_shot_with_copy_and_norm_epilogues_compiles(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _record(monkeypatch, "two_shot_kernel")
    peer = peer_on_meta(world - 1, world)
    peer(meta(64, K3.hidden_size))  # the o_proj / shared-expert row
    peer(meta(8, K3.moe.latent_size), norm=meta(K3.moe.latent_size), eps=1e-5)  # the latent + its RMSNorm
    for ptx in _check(recorder):
        assert RELEASE_CAS.search(ptx) and ACQUIRE_CAS.search(ptx), "barrier atomics are not release/acquire at .sys"
        assert "multimem" not in ptx  # no NVLink multicast


@pytest.mark.parametrize("world", [2, 8])
def test_two_shot_with_the_attn_res_epilogue_compiles(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _record(monkeypatch, "two_shot_attn_res_kernel")
    peer = peer_on_meta(0, world)
    h = K3.hidden_size
    for restart, blocks in ((False, 2), (True, 7)):
        peer.attn_res_after(
            meta(64, h), meta(64, h), meta(64, 8, h), meta(h), meta(h), meta(h),
            num_blocks=blocks, restart=restart, eps=1e-5,
        )  # fmt: skip
    assert len(_check(recorder)) == 2


def test_the_launcher_refuses_rows_it_cannot_reduce() -> None:
    peer = peer_on_meta(0, 2, max_rows=8)
    with pytest.raises(AllReduceError, match="9 rows exceed the 8"):
        peer(meta(9, K3.hidden_size))
    with pytest.raises(AllReduceError, match="width 7160 does not split into 2 chunks"):
        peer(meta(1, 7160))
    with pytest.raises(AllReduceError, match="BF16 rows"):
        peer(meta(1, K3.hidden_size, dtype=torch.float32))
