"""The KDA layer's projection cells (suites/k3/projections.py) on the CPU (that the stock path passes them and zeros
fail them is in test_k3_cells.py): the oracle's contract, a deliberately broken version of each op failing the
check that should catch it, and the specialized adapters handing the kernels each cell's operands and AttnRes site
as the cell means them (their launchers swapped for torch here; the kernels run on an H200 only), declining only
the o_proj cells above the fused kernel's 16 rows."""

from __future__ import annotations

import pytest
import torch

from harness.numerics import redteam_kernels as rt
from harness.numerics.cells import OpCall
from k3_decode.config import K3_MINI
from k3_decode.kernels import kda_in_proj_op, kda_o_proj_op
from k3_decode.stock import attn_res as stock_attn_res
from suites.k3 import projections, specialized
from suites.k3.suite import K3Suite
from tests.suites.helpers import failed, run, stock

D = K3_MINI
CELLS = [projections.InProjCell(D, 2, 5), *(projections.OProjCell(D, 2, 6, site) for site in projections.O_PROJ_SITES)]


def test_the_oracle_is_the_exact_product_and_o_proj_feeds_the_attn_res_its_bf16_rounding():
    cell = projections.OProjCell(D, 1, 2, "after-write")
    call = cell.make(3, torch.device("cpu"))
    ref = cell.reference(call.clone())
    exact = call.tensors["o"].double() @ call.tensors["o_proj"].double().t()
    assert ref["attn_out"].dtype == torch.float64 and torch.equal(ref["attn_out"], exact)
    assert torch.equal(ref["prefix"], exact.to(torch.bfloat16))  # a restart: the prefix is the BF16 attn_out


def test_an_in_proj_skipping_a_k_block_is_caught():
    def skip(call):
        x = call.tensors["x"].clone()
        x[:, -32:] = 0
        return {"x": x}

    impl = rt.reads_altered_inputs(stock("kda_in_proj"), skip)
    assert "packed: matched fraction" in failed(run(projections.InProjCell(D, 1, 3), impl))


def test_an_in_proj_dropping_a_batch_row_is_caught():
    impl = rt.skips_part_of_the_batch(stock("kda_in_proj"), "x")
    assert "packed: matched fraction" in failed(run(projections.InProjCell(D, 1, 4), impl))


def _at_layer(shift: int):
    impl = stock("kda_o_proj")
    return lambda call: impl(OpCall(call.tensors, {**call.args, "layer": call.args["layer"] + shift}))


def test_o_proj_adding_where_the_prefix_restarts_is_caught():
    names = failed(run(projections.OProjCell(D, 1, 3, "after-write"), _at_layer(+1)))
    assert "prefix (state after the call): matched fraction" in names, names


def test_o_proj_restarting_where_the_prefix_adds_is_caught():
    names = failed(run(projections.OProjCell(D, 1, 3, "after-plain"), _at_layer(-1)))
    assert "prefix (state after the call): matched fraction" in names, names


def test_o_proj_whose_attn_res_reads_no_delta_is_caught():
    """Broken case: the GEMM is right but the AttnRes runs on zeros (a kernel that mixes before its stores land)."""
    impl = stock("kda_o_proj")

    def stale(call):
        saved = call.tensors["o"].clone()
        good = impl(call.clone())["attn_out"]
        call.tensors["o"].zero_()
        out = impl(call)
        call.tensors["o"].copy_(saved)
        return {"attn_out": good, "out": out["out"]}

    names = failed(run(projections.OProjCell(D, 1, 3, "after-plain"), stale))
    assert "out: matched fraction" in names, names


# --- the specialized adapters ----------------------------------------------------------------------------------


def _torch_linear(x, weight, out=None, kernel=None):
    return torch.nn.functional.linear(x, weight)


def _torch_o_proj(o, weight, buffers, site, weights, eps, attn_out=None):
    attn_out = torch.nn.functional.linear(o, weight)
    return attn_out, stock_attn_res.apply(buffers, site, attn_out, weights, eps, "torch-cpu")


@pytest.mark.parametrize("case", CELLS, ids=lambda c: c.id)
def test_the_adapters_give_the_kernels_each_cells_operands_and_site(case, monkeypatch):
    monkeypatch.setattr(kda_in_proj_op, "linear", _torch_linear)
    monkeypatch.setattr(kda_o_proj_op, "apply", _torch_o_proj)
    adapter = specialized.SpecializedAdapters(D).ops()[case.spec.op]
    assert failed(run(case, adapter)) == []


def test_an_o_proj_adapter_that_hands_the_kernel_the_wrong_site_fails_the_oracle(monkeypatch):
    """Broken case: the kernel told the plain layer's add where the cell's layer restarts the prefix."""

    def wrong_site(o, weight, buffers, site, weights, eps, attn_out=None):
        add = stock_attn_res.AttnResSite("add", site.save_index, site.num_blocks, site.bank_before)
        return _torch_o_proj(o, weight, buffers, add, weights, eps)

    monkeypatch.setattr(kda_o_proj_op, "apply", wrong_site)
    adapter = specialized.SpecializedAdapters(D).kda_o_proj
    assert failed(run(projections.OProjCell(D, 1, 3, "after-write"), adapter))


def test_the_specialized_path_declines_o_proj_above_64_rows_and_nothing_else():
    adapters = specialized.SpecializedAdapters(D)
    assert adapters.declines(projections.OProjCell(D, 1, 16, "after-plain")) is None
    assert adapters.declines(projections.OProjCell(D, 1, 64, "after-write")) is None
    reason = adapters.declines(projections.OProjCell(D, 1, 65, "after-write"))
    assert reason and "1..64 rows" in reason and "65" in reason
    assert adapters.declines(projections.InProjCell(D, 1, 64)) is None


def test_the_grid_has_both_ops_at_every_tp_and_batch_and_o_proj_at_both_sites():
    from harness.config.loader import load_config

    suite = K3Suite("k3-hopper", "k3-mini")
    config = load_config("cpu-smoke")
    in_proj = suite._combos(config, "kda_in_proj")
    o_proj = suite._combos(config, "kda_o_proj")
    assert len(o_proj) == 2 * len(in_proj) and {c["sites"] for c in o_proj} == set(projections.O_PROJ_SITES)
    assert {c["batches"] for c in in_proj} == set(config.data["workload"]["batches"])
