"""The K3 cells beyond the KDA step (AttnRes, MLA decode, the MoE op by op and whole, the dense MLP, the KDA
projections) on the CPU stock path:
the stock ops pass every check, and for each op a deliberately broken version, modelling a real bug, fails the
check that should catch it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from harness.numerics import redteam_kernels as rt
from harness.numerics.cells import Impl, OpCall
from k3_decode.config import K3_MINI
from k3_decode.reference import moe as ref
from suites.k3 import attn_res, mla, moe, projections
from tests.suites.helpers import failed, run, stock

D = K3_MINI


def tampered(op: str, before: Callable[[OpCall], Callable[[], None] | None] | None = None, after=None) -> Impl:
    """The stock op with its call altered first (`before` may return an undo, run after the op) and/or its outputs
    altered afterwards: the way a buggy kernel reads the wrong thing or writes the wrong place."""
    impl = stock(op)

    def run_(call: OpCall) -> dict[str, torch.Tensor]:
        undo = before(call) if before else None
        out = impl(call)
        if undo:
            undo()
        return after(call, out) if after else out

    return run_


def _swap(t: torch.Tensor, replacement: torch.Tensor) -> Callable[[], None]:
    saved = t.clone()
    t.copy_(replacement)
    return lambda: t.copy_(saved)


# --- the stock path passes -------------------------------------------------------------------------------------

CORRECT = [
    *(attn_res.AttnResCell(D, b, s) for s in attn_res.SITES for b in (1, 5)),
    mla.MlaCell(D, 1, 1, 1),
    mla.MlaCell(D, 2, 5, 200, "max", 16),
    mla.MlaCell(D, 1, 3, 64, "auto", 64),
    mla.MlaCell(D, 2, 6, 37, "auto", 1),
    moe.RouteCell(D, 1),
    moe.RouteCell(D, 7, "ties"),
    moe.LatentDownCell(D, 3),
    moe.ExpertsCell(D, 2, 6),
    moe.GatedCell(D, 2, 3, "shared"),
    moe.GatedCell(D, 8, 3, "dense"),
    moe.LatentTailCell(D, 4),
    moe.MoeCell(D, 2, 5),
    projections.InProjCell(D, 1, 1),
    projections.InProjCell(D, 2, 5),
    *(projections.OProjCell(D, tp, b, site) for site in projections.O_PROJ_SITES for tp, b in ((1, 1), (2, 6))),
]


@pytest.mark.parametrize("case", CORRECT, ids=lambda c: c.id)
def test_the_stock_op_passes_every_check(case):
    result = run(case)
    assert result.passed, failed(result)
    assert len(result.checks) >= 15


@pytest.mark.parametrize("case", CORRECT, ids=lambda c: c.id)
def test_zeros_fail_every_op(case):
    names = failed(run(case, rt.returns_zeros(stock(case.spec.op))))
    assert any("matched fraction" in n or "reference is non-trivial" in n for n in names), names


# --- AttnRes ------------------------------------------------------------------------------------------------------


def test_attn_res_reading_a_wrong_bank_slot_is_caught():
    """A kernel that loads block 0 from the wrong place (here: zeros) mixes a different source set."""
    broken = tampered(
        "attn_res", before=lambda c: _swap(c.tensors["blocks"][:, 0], torch.zeros_like(c.tensors["blocks"][:, 0]))
    )
    names = failed(run(attn_res.AttnResCell(D, 4, "before-plain"), broken))
    assert "out: matched fraction" in names


def test_attn_res_saving_the_block_at_the_next_slot_is_caught():
    def misplace(call, out):
        blocks = call.tensors["blocks"]
        blocks[:, 1] = blocks[:, 0]
        blocks[:, 0] = float("nan")
        return out

    names = failed(run(attn_res.AttnResCell(D, 3, "before-first"), tampered("attn_res", after=misplace)))
    assert "blocks: writes outside the declared write set" in names
    assert any(n.startswith("blocks (state after the call)") for n in names)


def test_attn_res_forgetting_the_output_norm_is_caught():
    def no_norm(call):
        return _swap(call.tensors["out_norm"], torch.ones_like(call.tensors["out_norm"]))

    names = failed(run(attn_res.AttnResCell(D, 4, "after-plain"), tampered("attn_res", before=no_norm)))
    assert "out: matched fraction" in names


def test_attn_res_reading_past_the_bank_reads_nan():
    """Slots past the saved blocks hold NaN: a kernel that mixes one block too many poisons the token."""
    for site in ("before-first", "before-write"):
        cell = attn_res.AttnResCell(D, 2, site)
        blocks = cell.make(0, torch.device("cpu")).tensors["blocks"]
        bank = cell.rule.bank_before
        assert bank < D.num_attn_res_blocks, site
        assert bool(blocks[:, bank:].isnan().all()) and not bool(blocks[:, :bank].isnan().any()), site


# --- MLA ---------------------------------------------------------------------------------------------------------


def test_mla_attending_one_position_short_is_caught():
    def short(call):
        lens = call.tensors["seq_lens"]
        return _swap(lens, (lens - 1).clamp(min=0))

    names = failed(run(mla.MlaCell(D, 2, 5, 64, "auto", 16), tampered("mla_decode", before=short)))
    assert "out: matched fraction" in names


def test_mla_ignoring_the_block_table_is_caught():
    def in_order(call):
        table = call.tensors["block_table"]
        return _swap(table, torch.arange(table.numel(), dtype=table.dtype).view_as(table) % table.max().add(1))

    names = failed(run(mla.MlaCell(D, 1, 4, 100, "max", 16), tampered("mla_decode", before=in_order)))
    assert "out: matched fraction" in names


def test_mla_writing_the_new_row_one_slot_late_is_caught():
    def late(call, out):
        cache = call.tensors["cache"].view(-1, D.mla.cache_row)
        slots = call.tensors["slot_mapping"]
        for s in slots[slots >= 0].tolist():
            cache[s + 1] = cache[s]
        return out

    names = failed(run(mla.MlaCell(D, 1, 2, 40, "auto", 64), tampered("mla_decode", after=late)))
    assert "cache: writes outside the declared write set" in names


def _shift(flat_indices: list[int], by: float = 0.2) -> Callable[[OpCall, dict[str, torch.Tensor]], dict]:
    """Adds `by` (beyond atol, within max_abs) to these elements of the flattened output, on every call."""

    def change(call: OpCall, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        o = out["out"].float().flatten()
        o[flat_indices] += by
        return {"out": o.view_as(out["out"]).to(out["out"].dtype)}

    return change


def _head(h: int) -> list[int]:
    """The flattened elements of head h (request h // heads, head h % heads) of the output [B, H * v]."""
    v = D.mla.v_head_dim
    return list(range(h * v, (h + 1) * v))


def test_mla_matches_count_heads_so_one_shifted_head_passes_and_two_fail():
    """The mla_decode entry's failure mode: one query byte rounded one E4M3 step apart moves one head's whole v row
    (the hypothesis example tp1/b1/ctx17/p16/x3, seed 22647). At batch 1 that head is 1/8 of the output, which 0.99
    of the elements could not absorb; the entry allows one head off (within max_abs), and no second."""
    cell = mla.MlaCell(D, 1, 1, 17, "auto", 16)
    assert cell.unit_size("out", "head") == D.mla.v_head_dim and cell.unit_size("cache", "head") is None
    one = run(cell, tampered("mla_decode", after=_shift(_head(1))))
    assert one.passed, failed(one)
    assert one.metrics["out"]["matched_fraction"] < 0.99  # counted by elements, this shift would fail
    assert (one.metrics["out"]["units"], one.metrics["out"]["matched_units"]) == (8, 7)
    two = failed(run(cell, tampered("mla_decode", after=_shift(_head(1) + _head(5)))))
    assert "out: matched fraction" in two and "fresh values in reused buffers: out: matched fraction" in two


def test_mla_errors_scattered_over_many_heads_fail_though_few_elements_are_off():
    """A bug that is not head-aligned (a wrong element here and there, e.g. a bad lane in an epilogue): 30 elements
    of 4096 (0.7%, which 0.99 of the elements allowed) in 30 heads of 128 fail the per-head count."""
    cell = mla.MlaCell(D, 1, 16, 100, "auto", 16)
    v = D.mla.v_head_dim
    scattered = [h * v + (7 * h) % v for h in range(30)]
    result = run(cell, tampered("mla_decode", after=_shift(scattered)))
    assert result.metrics["out"]["matched_fraction"] >= 0.99
    assert "out: matched fraction" in failed(result)


@pytest.mark.parametrize("tp", [1, 8])
def test_mla_stale_output_in_reused_buffers_is_caught_per_head(tp):
    """A kernel that returns its previous result for the same buffers (cached by address) is off in every head:
    the per-head count fails it, and where the cell has a single head (TP8, batch 1: one head may be off by the
    entry's allowance) max_abs still does."""
    result = run(mla.MlaCell(D, tp, 1, 17, "auto", 16), rt.caches_by_address(stock("mla_decode")))
    names = [n for n in failed(result) if n.startswith("fresh values in reused buffers: ")]
    assert "fresh values in reused buffers: out: max abs error" in names
    if tp == 1:
        assert "fresh values in reused buffers: out: matched fraction" in names


def test_mla_cells_cover_padding_short_requests_and_partial_pages():
    lens = mla.seq_lens(8, 300)
    assert lens[0] == 300 and lens[1] == 1 and lens[-1] == 0
    assert any(n % 64 for n in lens if n > 64)  # a partial last page
    cell = mla.MlaCell(D, 2, 8, 300, "max", 64)
    assert cell.num_splits == 64 and cell.pages_per[-1] == 1  # the padded request still owns a (spare) row


# --- the router ----------------------------------------------------------------------------------------------------


def test_routing_ties_to_the_higher_id_is_caught_on_the_tie_cells_only():
    """The bug: equal keys resolved to the higher expert id (here by running the stock router on the experts in
    reverse order and mapping the ids back)."""
    e = D.moe.num_experts

    def reversed_ids(call):
        t = call.tensors
        undo_r = _swap(t["router"], t["router"].flip(0))
        undo_b = _swap(t["router_bias"], t["router_bias"].flip(0))
        return lambda: (undo_r(), undo_b())

    def map_back(call, out):
        return {
            "logits": out["logits"].flip(-1),
            "ids": (e - 1 - out["ids"]).to(torch.int32),
            "weights": out["weights"],
        }

    broken = tampered("moe_route", before=reversed_ids, after=map_back)
    assert "ids: matched fraction" in failed(run(moe.RouteCell(D, 8, "ties"), broken))
    assert run(moe.RouteCell(D, 8, "synthetic"), broken).passed  # no exact ties there: the id rule never decides


def test_routing_bias_in_the_weights_is_caught():
    def biased(call, out):
        keys = torch.sigmoid(out["logits"]) + call.tensors["router_bias"]
        chosen = keys.gather(-1, out["ids"].long())
        return {**out, "weights": chosen / chosen.sum(-1, keepdim=True)}

    names = failed(run(moe.RouteCell(D, 4), tampered("moe_route", after=biased)))
    assert "weights: matched fraction" in names


def test_bf16_router_logits_are_caught():
    def bf16(call, out):
        return {**out, "logits": out["logits"].bfloat16().float()}

    assert "logits: matched fraction" in failed(run(moe.RouteCell(D, 4), tampered("moe_route", after=bf16)))


def test_tie_cells_really_tie_at_the_kth_slot_and_the_oracle_takes_the_lower_id():
    cell = moe.RouteCell(D, 16, "ties")
    t = cell.make(3, torch.device("cpu")).tensors
    logits = t["hidden"].float() @ t["router"].float().T
    assert torch.equal(logits, ref.router_logits(t["hidden"], t["router"]))  # exact in any order
    keys = torch.sigmoid(logits.double()).float() + t["router_bias"]
    k = D.moe.top_k
    ids = cell.reference(OpCall(t))["ids"]
    straddling = 0
    for b in range(keys.shape[0]):
        kth = keys[b, ids[b, -1]]
        tied = (keys[b] == kth).nonzero().flatten()
        chosen = set(ids[b].tolist())
        if any(int(i) not in chosen for i in tied):
            straddling += 1
            assert max(int(i) for i in tied if int(i) in chosen) < min(int(i) for i in tied if int(i) not in chosen)
    assert straddling >= keys.shape[0] // 2, f"only {straddling} of {keys.shape[0]} tokens tie at slot {k}"


def test_synthetic_route_cells_draw_only_decided_tokens():
    cell = moe.RouteCell(D, 64)
    t = cell.make(0, torch.device("cpu")).tensors
    logits = ref.router_logits(t["hidden"], t["router"])
    margin = moe.key_margin(logits)
    assert 1e-6 < margin < 1e-3
    assert not bool(moe.undecided(logits, t["router_bias"], D.moe.top_k, margin).any())
    scores = torch.sigmoid(logits[0].double()).float()
    order = (scores + t["router_bias"]).argsort(descending=True)
    kth, next_ = order[D.moe.top_k - 1], order[D.moe.top_k]
    bias = t["router_bias"].clone()
    bias[next_] = scores[kth] + bias[kth] - scores[next_] - margin / 4  # the (k+1)-th key just below the k-th
    assert bool(moe.undecided(logits, bias, D.moe.top_k, margin)[0])


# --- experts, shared, tail, down, whole, dense ------------------------------------------------------------------


def test_experts_dropping_the_last_slot_is_caught():
    def drop(call):
        w = call.tensors["weights"]
        return _swap(w, w * torch.tensor([1.0] * (w.shape[1] - 1) + [0.0]))

    assert "routed: matched fraction" in failed(run(moe.ExpertsCell(D, 1, 5), tampered("moe_experts", before=drop)))


def test_experts_reading_a_scale_block_off_by_one_is_caught():
    def off(call):
        s = call.tensors["w13_scales"]
        return _swap(s, s.roll(1, dims=-1))

    assert "routed: matched fraction" in failed(run(moe.ExpertsCell(D, 2, 4), tampered("moe_experts", before=off)))


@pytest.mark.parametrize("which", ["shared", "dense"])
def test_gate_and_up_swapped_is_caught(which):
    def swap(call):
        gu = call.tensors["gate_up"]
        return _swap(gu, torch.cat(gu.chunk(2, dim=0)[::-1]))

    op = "moe_shared" if which == "shared" else "dense_mlp"
    out = "shared" if which == "shared" else "out"
    names = failed(run(moe.GatedCell(D, 2, 3, which), tampered(op, before=swap)))
    assert f"{out}: matched fraction" in names


def test_latent_tail_adding_the_shared_partial_twice_is_caught():
    def twice(call):
        s = call.tensors["shared"]
        return _swap(s, s * 2)

    assert "out: matched fraction" in failed(run(moe.LatentTailCell(D, 3), tampered("moe_latent_tail", before=twice)))


def test_latent_down_skipping_a_k_block_is_caught():
    def skip(call):
        h = call.tensors["hidden"]
        return _swap(h[:, -32:], torch.zeros_like(h[:, -32:]))

    assert "latent: matched fraction" in failed(run(moe.LatentDownCell(D, 3), tampered("moe_latent_down", before=skip)))


def test_moe_without_the_shared_experts_is_caught():
    def no_shared(call):
        d = call.tensors["shared_down"]
        return _swap(d, torch.zeros_like(d))

    assert "out: matched fraction" in failed(run(moe.MoeCell(D, 1, 3), tampered("moe", before=no_shared)))
