"""The specialized implementation of the K3 suite: where the CuTe DSL kernels cannot run it is listed as not run
with the reason (never counted as tested), and its adapters hand each grid cell's AttnRes site, buffers, weights
and delta, and each KDA cell's packed rows, state, slot table and accepted counts, to the kernels exactly as the
cell means them. The kernels themselves run on an H200 only; here their launchers are swapped for the stock torch
implementation of the same contract, so a wiring mistake (a wrong site, weight, slot or count) fails the cell's
oracle comparison on the CPU."""

from __future__ import annotations

import pytest
import torch

from k3_decode.config import K3_MINI
from k3_decode.kernels import attn_res_op, kda_step_op
from k3_decode.stock import attn_res as stock_attn_res
from k3_decode.stock import kda as stock_kda
from suites.k3 import attn_res, kda, specialized
from suites.k3.suite import K3Suite
from tests.suites.helpers import failed, run

CPU = torch.device("cpu")


def test_on_the_cpu_only_stock_runs_and_the_specialized_path_is_listed_not_run():
    suite = K3Suite("k3-hopper", "k3-mini")
    assert [i.name for i in suite.implementations(CPU)] == ["stock"]
    assert suite.not_run() == [
        {
            "name": "specialized implementation (attn_res, kda_decode, kda_in_proj, kda_o_proj, kda_verify)",
            "reason": "this run is on the CPU",
        }
    ]


def test_on_a_gpu_without_the_kernels_the_reason_is_the_kernels_own(monkeypatch):
    monkeypatch.setattr(specialized, "not_run_reason", lambda: "no CuTe DSL here (test)")
    suite = K3Suite("k3-hopper", "k3-mini")
    assert [i.name for i in suite.implementations(torch.device("cuda"))] == ["stock"]
    assert suite.not_run()[0]["reason"] == "no CuTe DSL here (test)"


def test_where_the_kernels_can_run_the_specialized_implementation_is_partial(monkeypatch):
    monkeypatch.setattr(specialized, "not_run_reason", lambda: None)
    suite = K3Suite("k3-hopper", "k3-mini")
    stock, special = suite.implementations(torch.device("cuda"))
    assert (special.name, special.backend, special.partial, set(special.ops)) == (
        "specialized",
        "cute-dsl",
        True,
        {"attn_res", "kda_decode", "kda_verify", "kda_in_proj", "kda_o_proj"},
    )
    assert special.declines is not None and stock.declines is None
    assert not stock.partial and suite.not_run() == []


def _torch_kernel(buffers, site, delta, weights, eps):
    return stock_attn_res.apply(buffers, site, delta, weights, eps, "torch-cpu")


@pytest.mark.parametrize("site", attn_res.SITES)
def test_the_adapter_gives_the_kernel_each_sites_meaning(site, monkeypatch):
    monkeypatch.setattr(attn_res_op, "apply", _torch_kernel)
    adapter = specialized.SpecializedAdapters(K3_MINI).attn_res
    assert failed(run(attn_res.AttnResCell(K3_MINI, 3, site), adapter)) == []


def test_a_wrongly_wired_site_fails_the_oracle(monkeypatch):
    """Broken case: a kernel told the site after attention where the cell is before it."""

    def wrong_site(buffers, site, delta, weights, eps):
        wrong = stock_attn_res.AttnResSite("add", None, site.num_blocks, site.bank_before)
        return _torch_kernel(buffers, wrong, delta, weights, eps)

    monkeypatch.setattr(attn_res_op, "apply", wrong_site)
    adapter = specialized.SpecializedAdapters(K3_MINI).attn_res
    assert failed(run(attn_res.AttnResCell(K3_MINI, 3, "before-write"), adapter))


def _torch_decode(spec, weights, packed, cache, slots):
    return stock_kda.kda_decode_step(spec, weights, packed, cache, slots, implementation="torch-cpu")


def _torch_verify(spec, weights, packed, cache, slots, num_accepted):
    return stock_kda.kda_verify_step(spec, weights, packed, cache, slots, num_accepted, implementation="torch-cpu")


@pytest.mark.parametrize(("tp", "batch", "q"), [(1, 3, 1), (2, 2, 3), (1, 4, 8)])
def test_the_kda_adapters_give_the_kernel_each_cells_rows_state_and_slots(tp, batch, q, monkeypatch):
    monkeypatch.setattr(kda_step_op, "decode_step", _torch_decode)
    monkeypatch.setattr(kda_step_op, "verify_step", _torch_verify)
    adapters = specialized.SpecializedAdapters(K3_MINI)
    adapter = adapters.kda_decode if q == 1 else adapters.kda_verify
    assert failed(run(kda.KdaCell(K3_MINI, tp, batch, q), adapter)) == []


def test_a_verify_adapter_that_drops_the_accepted_counts_fails_the_oracle(monkeypatch):
    """Broken case: a kernel handed every request's count as q (it reads the wrong slot's state)."""

    def all_accepted(spec, weights, packed, cache, slots, num_accepted):
        return _torch_verify(spec, weights, packed, cache, slots, torch.full_like(num_accepted, slots.shape[1]))

    monkeypatch.setattr(kda_step_op, "verify_step", all_accepted)
    adapter = specialized.SpecializedAdapters(K3_MINI).kda_verify
    assert failed(run(kda.KdaCell(K3_MINI, 1, 4, 4), adapter))
