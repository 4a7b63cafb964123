"""compute-sanitizer over the CuTe DSL kernels, on the CPU: the plan's CuTe cells, the kernel filter, attribution of
reports naming CuTe DSL's generated kernel names, launches from the device counters, and NOT_RUN where the kernels
cannot run (never PASSED, never dropped)."""

from __future__ import annotations

import json
import re
import sys
import types
from importlib import resources

import pytest

from suites import sanitize
from suites.sanitize import judge, load_plan, summarize

PLAN = load_plan()
TEXT = resources.files("suites").joinpath("sanitize.toml").read_text()
# CUDA names as CuTe DSL generates them (the PTX entries of `k3gate kernels build`, signatures at B = 3 shortened).
CUTE_NAMES = {
    "AttnResKernel": "kernel_cutlass_kernel_k3_decodekernelsattn_resAttnResKernel_object_at__tensorptrbf16gmemalign16o"
    "3716871681_tensorptrbf16_gmem_align16_o_3716871681_tensorptrbf16gmemalign16o387168573447168_0",
    "KdaInProjKernel": "kernel_cutlass_kernel_k3_decodekernelskda_in_projKdaInProjKernel_object_at__tensorptrbf16"
    "gmemalign16o3716871681_tensorptrbf16gmemalign16o3216716871681_tensorptrbf16gmemalign16o332163216_0",
    "KdaStepKernel": "kernel_cutlass_kernel_k3_decodekernelskda_stepKdaStepKernel_object_at__tensorptrbf16gmemalign16o"
    "3321632161_tensorptrbf16gmemalign16o7681281281_tensorptrbf16gmemalign16o92161_tensorptrf32g_0",
}
STOCK = [k for k in PLAN.kernels if k not in PLAN.patterns]
REASON = "the CUDA device is sm_80; the CuTe DSL kernels are built for sm_90a"
CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"


def cells_of(runner):
    return {c.op: c for c in PLAN.cells if c.runner == runner}


def child(launched, not_run=None, cells=None):
    """A child report: every planned stock cell ok; `cells` adds or replaces cells."""
    report = {op: {"status": "ok", "error": "", "launched": list(c.names)} for op, c in cells_of("stock").items()}
    for op, cell in cells_of("cute").items():
        if not_run:
            report[op] = {"status": "not_run", "error": "", "reason": REASON, "launched": []}
        else:
            report[op] = {"status": "ok", "error": "", "launched": [k for k in cell.names if k in launched]}
    report |= cells or {}
    return {"cells": report, "launched": sorted(launched), "not_run": not_run or {}}


def judged(log, report, exit_code=0, tool="memcheck"):
    expected = list(PLAN.kernels)
    return judge(tool, exit_code, log, report, expected, PLAN.tools[tool], PLAN.patterns, PLAN.cute_kernels)


# --- the plan ----------------------------------------------------------------------------------------------------


def test_the_plan_has_a_cell_per_cute_dsl_kernel_named_by_pattern():
    from k3_decode.attn_res_state import AttnResSite
    from k3_decode.config import K3, RankShapes
    from k3_decode.kernels.attn_res_plan import AttnResKind, site_kinds
    from k3_decode.kernels.kda_step_plan import KdaStepPlan, KdaVerifyPlan
    from k3_decode.kernels.providers import PENDING, PROVIDERS

    cute = cells_of("cute")
    assert set(cute) == {"cute_attn_res", "cute_kda_in_proj", "cute_kda_step", "cute_kda_o_proj"}
    kernels = {"AttnResKernel", "KdaInProjKernel", "KdaStepKernel", "KdaOProjKernel"}
    assert PLAN.patterns == PLAN.cute_kernels == kernels
    # The patterns are the names the providers declare for the ledger: one kernel, one name, everywhere. Every
    # registered provider's kernel has a cell; a pending provider's kernel may have one before its GPU run.
    registered = {k for p in PROVIDERS for k in p.launches}
    assert registered <= PLAN.patterns <= registered | {k for p in PENDING for k in p.launches}
    assert all(not c.kernels and dict(c.axes)["batches"] == 3 for c in cute.values())  # odd batch, patterns only

    attn = dict(cute["cute_attn_res"].axes)
    kinds = [AttnResKind.from_tag(t) for t in attn["kinds"]]
    assert all(k in site_kinds(K3) for k in kinds)  # sites of the model, not made-up kinds
    assert any(k.save and k.delta == "add" and k.num_blocks >= 2 for k in kinds)  # saves, reads a bank, has delta
    assert any(k.delta == "restart" for k in kinds)
    proj = dict(cute["cute_kda_in_proj"].axes)
    assert RankShapes.for_tp(K3, proj["tp"]).kda_in_proj_rows == 3216
    from k3_decode.kernels.kda_in_proj_mma_plan import InProjMmaPlan

    ring = InProjMmaPlan.for_shape(3216, K3.hidden_size, proj["ring_batch"])
    assert ring.x_stages > 1 and ring.m_tiles > 1 and proj["ring_batch"] % 8  # a shared ring, a ragged last tile
    step = dict(cute["cute_kda_step"].axes)
    shard = RankShapes.for_tp(K3, step["tp"])
    assert step["tp"] == 16 and len(step["slots"]) == step["batches"]
    assert any(s <= 0 for s in step["slots"]) and sum(s > 0 for s in step["slots"]) >= 2  # a NULL row, two live
    assert all(s < step["cache_slots"] for s in step["slots"]) and step["cache_slots"] > max(step["slots"]) + 1
    plan = KdaStepPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, step["batches"])  # an H200's 132 SMs
    assert plan.cluster == 8  # DSMEM pushes into 7 peers, both cluster barrier phases
    verify = KdaVerifyPlan.for_shape(shard.kda_heads, shard.kda_in_proj_rows, step["batches"], tokens=step["tokens"])
    assert verify.cluster == 8 and 2 <= verify.tokens <= 8
    o_proj = dict(cute["cute_kda_o_proj"].axes)
    assert K3.shard(o_proj["tp"]).kda_o_proj == (K3.hidden_size, 768) and o_proj["batches"] == 3
    kinds = [AttnResKind.from_tag(t) for t in o_proj["kinds"]]
    after = {AttnResSite.after_attention(layer, K3.attn_res_block_size).delta for layer in range(K3.num_layers)}
    assert all(k in site_kinds(K3) and k.delta in after and k.delta_dtype == "bfloat16" for k in kinds)
    assert {k.delta for k in kinds} == {"add", "restart"} and max(k.num_blocks for k in kinds) == 8  # the full bank
    from k3_decode.kernels.kda_o_proj_plan import OProjPlan
    from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan

    shape = K3.shard(o_proj["tp"]).kda_o_proj
    for wide in (  # both builds run it: two rows per epilogue cluster, one cluster's second row past the batch
        OProjPlan.for_shape(*shape, o_proj["two_row_batch"], kinds[0]),
        OProjWgmmaPlan.for_shape(*shape, o_proj["two_row_batch"], kinds[0]),
    ):
        assert wide.epilogue_rows == 2 and wide.epilogue_clusters * 2 > wide.batch


def test_the_kda_step_cells_verify_table_is_one_the_oracle_accepts():
    """A NULL request whose other slots must stay untouched, a live request without a slot for one token, one that
    accepted every token, canary slots (slot 0 among them)."""
    torch = pytest.importorskip("torch")
    from k3_decode.reference.kda import verify_write_set

    step = dict(cells_of("cute")["cute_kda_step"].axes)
    q, batch = step["tokens"], step["batches"]
    table = torch.tensor(step["verify_slots"]).view(batch, q)
    writes = verify_write_set(table)  # raises on a duplicate write
    accepted = list(step["accepted"])
    live = [b for b in range(batch) if table[b, 0] > 0]
    assert len(live) == batch - 1 and (table[live] <= 0).any()  # one NULL request, a NULL token slot
    assert all(1 <= accepted[b] <= q and table[b, accepted[b] - 1] > 0 for b in live) and q in accepted
    assert all(0 <= s < step["verify_cache_slots"] for s in table.flatten().clamp(min=0).tolist())
    untouched = set(range(step["verify_cache_slots"])) - {w.slot for w in writes}
    (null,) = (b for b in range(batch) if b not in live)
    assert 0 in untouched and {int(s) for s in table[null, 1:]} <= untouched and len(untouched) >= 4


def test_every_cute_cell_has_its_runner_in_the_child():
    pytest.importorskip("triton")
    from suites import sanitize_child

    for op, cell in cells_of("cute").items():
        assert sanitize_child.CUTE_OPS[op].kernel == cell.patterns[0]


@pytest.mark.parametrize(
    "old, new, message",
    [
        ('kernel_patterns = ["AttnResKernel"]', 'kernel_patterns = ["AttnRes,Kernel"]', "one identifier"),
        ('kernel_patterns = ["AttnResKernel"]', 'kernel_patterns = ["kernel"]', "also matches"),
        ('kernel_patterns = ["AttnResKernel"]', 'kernel_patterns = ["oob"]', "also matches"),  # the red team's
        ('kernel_patterns = ["AttnResKernel"]', 'kernels = ["AttnResKernel"]', "exactly one kernel"),
        ('kernel_patterns = ["KdaInProjKernel"]', 'kernel_patterns = ["AttnResKernel"]', "planned twice"),
        ('op = "cute_kda_in_proj"', 'op = "cute_attn_res"', "have two cells"),
        (
            'runner = "cute"\naxes = { tp = 16, batches = 3, wgmma_batch = 17, ring_batch = 30 }',
            'runner = "cuda"\naxes = { tp = 16, batches = 3, wgmma_batch = 17, ring_batch = 30 }',
            "runner 'cuda'",
        ),
        ('kernel_patterns = ["KdaStepKernel"]', 'kernel_patterns = ["Kda"]', "also matches"),
        ('kernel_patterns = ["KdaInProjKernel"]', 'kernel_pattern = ["KdaInProjKernel"]', "unknown key"),
    ],
)
def test_a_plan_that_would_match_kernels_wrongly_is_refused(old, new, message):
    assert TEXT.count(old) == 1
    with pytest.raises(ValueError, match=message):
        load_plan(TEXT.replace(old, new))


def own_allocation(t):
    """Exactly its own storage: an access past its end leaves the allocation, which memcheck sees."""
    return t is None or (t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def test_the_child_builds_inputs_the_ops_take_each_in_its_own_allocation(monkeypatch):
    """The CuTe cells' inputs on the CPU, handed to the stock AttnRes and KDA decode ops (the CuTe ops' contracts,
    k3_decode/kernels/attn_res_op.py and kda_step_op.py) and to the in_proj plan, instead of the CuTe DSL ops, which
    need an sm_90 GPU."""
    pytest.importorskip("triton")
    import torch

    from k3_decode.config import K3
    from k3_decode.kernels import attn_res_op, kda_in_proj_op, kda_step_op
    from k3_decode.kernels.kda_in_proj_plan import InProjPlan
    from k3_decode.stock import attn_res as stock_attn_res
    from k3_decode.stock import kda as stock_kda
    from suites import sanitize_child

    calls = []

    def attn_res(buffers, site, delta, weights, eps):
        tensors = [buffers.prefix, buffers.blocks, delta, weights.res_norm, weights.res_proj, weights.out_norm]
        assert all(own_allocation(t) for t in tensors)
        calls.append((site, buffers.prefix.shape[0], buffers.capacity))
        return stock_attn_res.apply(buffers, site, delta, weights, eps)

    def linear(x, w, kernel=None):
        assert own_allocation(x) and own_allocation(w) and x.dtype == w.dtype == torch.bfloat16
        calls.append((kernel, InProjPlan.for_shape(w.shape[0], w.shape[1], x.shape[0])))
        return x.float() @ w.float().T

    def decode_step(spec, weights, packed, cache, slots):
        tensors = [packed, cache.conv, cache.recurrent, slots]
        tensors += [getattr(weights, name) for name in ("f_b", "conv", "a_log", "dt_bias", "o_norm")]
        assert all(own_allocation(t) for t in tensors)
        start = (cache.conv.clone(), cache.recurrent.clone())
        out = stock_kda.kda_decode_step(spec, weights, packed, cache, slots)  # checks shapes, dtypes, slot range
        calls.append((spec, slots.tolist(), out, start, cache))
        return out

    monkeypatch.setattr(attn_res_op, "apply", attn_res)
    monkeypatch.setattr(kda_in_proj_op, "linear", linear)

    def verify_step(spec, weights, packed, cache, slots, num_accepted):
        tensors = [packed, cache.conv, cache.recurrent, slots, num_accepted]
        tensors += [getattr(weights, name) for name in ("f_b", "conv", "a_log", "dt_bias", "o_norm")]
        assert all(own_allocation(t) for t in tensors)
        start = (cache.conv.clone(), cache.recurrent.clone())
        out = stock_kda.kda_verify_step(spec, weights, packed, cache, slots, num_accepted)  # validates the tables
        calls.append((spec, slots.tolist(), out, start, cache))
        return out

    monkeypatch.setattr(kda_step_op, "decode_step", decode_step)
    monkeypatch.setattr(kda_step_op, "verify_step", verify_step)
    cute, cpu = cells_of("cute"), torch.device("cpu")
    assert sanitize_child.attn_res_cell(cute["cute_attn_res"], PLAN, cpu) == len(calls) == 2
    saves = [site for site, batch, capacity in calls if site.save_index is not None]
    assert all(batch == 3 and capacity == K3.num_attn_res_blocks for _, batch, capacity in calls)
    assert saves and saves[0].save_index == K3.num_attn_res_blocks - 1  # writes the bank's last block
    calls.clear()
    assert sanitize_child.kda_in_proj_cell(cute["cute_kda_in_proj"], PLAN, cpu) == len(calls) == 4
    assert [kernel for kernel, _ in calls] == ["cuda_core", "tensor_core", "wgmma", "tensor_core"]  # every build
    # batch 3 in the CUDA-core and tensor-core builds, 17 in the wgmma one (its least is 9), then the tensor-core
    # build's 32-row pass with x staged in its ring
    assert [(p.rows, p.k, p.batch) for _, p in calls] == [(3216, K3.hidden_size, b) for b in (3, 3, 17, 30)]
    calls.clear()
    assert sanitize_child.kda_step_cell(cute["cute_kda_step"], PLAN, cpu) == len(calls) == 2
    (spec, slots, out, (conv, recurrent), cache), verify = calls
    assert (spec.heads, spec.in_proj_rows, len(slots)) == (6, 3216, 3) and cache.conv.shape[2] == 3  # TP16, q = 1
    null = [b for b, s in enumerate(slots) if s <= 0]
    assert null and not out[null].any() and out[[b for b in range(3) if b not in null]].abs().amax() > 0
    changed = sorted({i for i in range(conv.shape[0]) if not torch.equal(conv[i], cache.conv[i])})
    assert changed == sorted(s for s in slots if s > 0)  # the live requests' rows, nothing else
    assert torch.equal(recurrent[0], cache.recurrent[0])  # slot 0, the NULL row's, untouched
    spec, table, out, (conv, recurrent), cache = verify
    q = len(table[0])
    assert (spec.heads, len(table), out.shape) == (6, 3, (3, q, spec.proj)) and cache.conv.shape[2] == 2 + q
    null = [b for b, row in enumerate(table) if row[0] <= 0]
    assert null and not out[null].any()
    changed = {i for i in range(conv.shape[0]) if not torch.equal(conv[i], cache.conv[i])}
    assert changed == {row[0] for row in table if row[0] > 0}  # the live requests' conv rows
    changed = {i for i in range(recurrent.shape[0]) if not torch.equal(recurrent[i], cache.recurrent[i])}
    assert changed == {s for row in table if row[0] > 0 for s in row if s > 0}  # every real token slot, no other


# --- the kernel filter -------------------------------------------------------------------------------------------


def instrumented(flags, name):
    """Whether compute-sanitizer checks the kernel `name` under these --kernel-name flags, per its manual's
    "Specifying Filters": any filter matching suffices; kne = the whole name, kns = a substring, regex = searched."""
    specs = [flags[i + 1] for i, f in enumerate(flags) if f == "--kernel-name"]
    for spec in specs:
        key, _, value = spec.partition("=")
        if (
            (key in ("kne", "kernel_name") and name == value)
            or (key in ("kns", "kernel_substring") and value in name)
            or (key == "regex" and re.search(value, name))
        ):
            return True
    return False


def test_the_kernel_filter_instruments_the_planned_kernels_and_no_other(tmp_path):
    cmd = sanitize.command("cs", "memcheck", PLAN, tmp_path / "r.json", redteam=False)
    assert all(instrumented(cmd, n) for n in STOCK)
    assert all(instrumented(cmd, n) for n in CUTE_NAMES.values())
    others = ["nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "k3san_oob_kernel", "attn_res_kernel_v2"]
    others += ["kernel_cutlass_kernel_somewhereelseGemmKernel_object_at__tensorptrbf16_0"]
    assert not any(instrumented(cmd, n) for n in others)
    # Every spec is well formed: an ill-formed one would be ignored by the sanitizer without a word.
    specs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kernel-name"]
    assert all(re.fullmatch(r"(regex=[^,]+|kns=\w+)", s) for s in specs) and "kns=AttnResKernel" in specs
    red = sanitize.command("cs", "memcheck", PLAN, tmp_path / "r.json", redteam=True)
    assert instrumented(red, "k3san_oob_kernel") and not instrumented(red, CUTE_NAMES["AttnResKernel"])


# --- attribution -------------------------------------------------------------------------------------------------


def memcheck_report(kernel, thread=0):
    return (
        "========= Invalid __global__ read of size 16 bytes\n"
        f"=========     at {kernel}+0x1a70 in attn_res.py:203\n"
        f"=========     by thread ({thread},0,0) in block (3,2,0)\n"
        "=========     Access to 0x7f8e2c800290 is out of bounds\n"
        "=========     and is 16 bytes after the nearest allocation at 0x7f8dfac00000 of size 43008 bytes\n"
        "=========     Saved host backtrace up to driver entry point at kernel launch time\n"
        "========= \n"
    )


def test_a_report_naming_a_mangled_cute_kernel_goes_to_its_pattern():
    log = "========= COMPUTE-SANITIZER\n" + memcheck_report(CUTE_NAMES["AttnResKernel"])
    log += memcheck_report("kda_decode_kernel", 5) + "========= ERROR SUMMARY: 2 errors\n"
    result = judged(log, child(set(PLAN.kernels)), exit_code=sanitize.ERROR_EXIT)
    assert result.status == "FAILED"
    assert result.kernels["AttnResKernel"].errors == 1 and result.kernels["kda_decode_kernel"].errors == 1
    assert result.kernels["KdaInProjKernel"].errors == 0
    assert not result.other_kernels and result.unattributed_errors == 0
    assert "AttnResKernel (1)" in result.reason
    # Without the pattern, the same report is a kernel outside the plan, by its full generated name.
    strict = judge("memcheck", 86, log, child(set(PLAN.kernels)), list(PLAN.kernels))
    assert strict.kernels["AttnResKernel"].errors == 0 and CUTE_NAMES["AttnResKernel"] in strict.other_kernels


def test_a_racecheck_report_between_cute_and_stock_names_goes_to_the_first_named():
    line = (
        "========= Error: Race reported between Write access at "
        f"{CUTE_NAMES['KdaInProjKernel']}+0x6780 in kda_in_proj.py:293\n"
        "=========     and Read access at merge_kernel+0x6700 in mla.py:290 [16 hazards]\n"
        "========= \n========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n"
    )
    result = judged("========= COMPUTE-SANITIZER\n" + line, child(set(PLAN.kernels)), 86, "racecheck")
    assert result.kernels["KdaInProjKernel"].errors == 1 and result.kernels["merge_kernel"].errors == 0


# --- launches from the device counters ---------------------------------------------------------------------------


def test_a_cute_cell_whose_counter_did_not_move_is_an_error():
    launched = set(STOCK) | {"AttnResKernel"}  # the in_proj counter did not move, its cell said nothing
    result = judged(CLEAN, child(launched))
    assert result.status == "ERROR"
    assert "never launched: KdaInProjKernel" in result.reason
    assert not result.kernels["KdaInProjKernel"].launched and result.kernels["AttnResKernel"].launched
    assert judged(CLEAN, child(set(PLAN.kernels))).status == "PASSED"


class FakeCounter:
    """Stands in for a *_op module: launch_count() reads `value`."""

    def __init__(self, monkeypatch, moves):
        self.value, self.moves = 10, moves
        module = types.ModuleType("k3san_fake_counter")
        module.launch_count = lambda: self.value  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "k3san_fake_counter", module)

    def run(self, cell, plan, device):
        self.value += self.moves
        return 1  # the op claims one launch


@pytest.mark.parametrize("moves, launched, error", [(1, True, None), (0, False, "moved by 0"), (2, True, "moved by 2")])
def test_the_child_records_a_cute_launch_only_when_the_device_counter_moves(monkeypatch, moves, launched, error):
    pytest.importorskip("triton")
    from suites import sanitize_child

    fake = FakeCounter(monkeypatch, moves)
    cell = cells_of("cute")["cute_kda_in_proj"]
    op = sanitize_child.CuteOp(fake.run, "k3san_fake_counter", "KdaInProjKernel")
    monkeypatch.setitem(sanitize_child.CUTE_OPS, cell.op, op)
    seen: list[str] = []
    body = sanitize_child.cute_runner(cell, PLAN, None, seen)
    if error is None:
        body()
    else:
        with pytest.raises(RuntimeError, match=error):
            body()
    assert seen == (["KdaInProjKernel"] if launched else [])


def test_the_child_refuses_a_cell_naming_another_kernel_than_its_op_launches(monkeypatch):
    pytest.importorskip("triton")
    from suites import sanitize_child

    fake = FakeCounter(monkeypatch, 1)
    cell = cells_of("cute")["cute_kda_in_proj"]
    monkeypatch.setitem(sanitize_child.CUTE_OPS, cell.op, sanitize_child.CuteOp(fake.run, "k3san_fake_counter", "X"))
    with pytest.raises(ValueError, match="its op launches 'X'"):
        sanitize_child.cute_runner(cell, PLAN, None, [])()


# --- NOT_RUN where the CuTe DSL kernels cannot run ---------------------------------------------------------------


def test_cute_cells_are_not_run_with_the_reason_where_the_kernels_cannot_run(tmp_path, monkeypatch):
    """The real child, CuTe cells only, on this machine: without an sm_90 GPU it reports them not run, with
    providers.not_built_reason(), and exits 0 (no cell failed)."""
    pytest.importorskip("triton")
    from k3_decode.kernels.providers import not_built_reason
    from suites import sanitize_child

    reason = not_built_reason()
    if reason is None:
        pytest.skip("the CuTe DSL kernels can run here")
    monkeypatch.setattr(sanitize_child, "_install_launch_hook", lambda record: None)  # no global hook in tests
    report = tmp_path / "child.json"
    assert sanitize_child.main(["--report", str(report), "--cells", ",".join(cells_of("cute"))]) == 0
    got = json.loads(report.read_text())
    assert got["not_run"] == dict.fromkeys(PLAN.cute_kernels, reason)
    assert {op: c["status"] for op, c in got["cells"].items()} == dict.fromkeys(cells_of("cute"), "not_run")
    assert got["launched"] == []


def test_not_run_cute_cells_make_the_tool_and_the_run_not_run_never_passed():
    not_run = dict.fromkeys([k for k in PLAN.kernels if k in PLAN.cute_kernels], REASON)
    result = judged(CLEAN, child(set(STOCK), not_run))
    assert result.status == "NOT_RUN"
    assert result.not_run == not_run
    assert result.kernels["AttnResKernel"].not_run == REASON and not result.kernels["AttnResKernel"].launched
    assert result.kernels["kda_decode_kernel"].not_run == "" and result.kernels["kda_decode_kernel"].launched
    assert f"{len(STOCK)} kernel(s) launched" in result.reason
    assert f"AttnResKernel, KdaInProjKernel, KdaStepKernel, KdaOProjKernel ({REASON})" in result.reason

    tools = [judged(CLEAN, child(set(STOCK), not_run), tool=t) for t in sanitize.TOOLS]
    run = summarize(PLAN, tools)
    assert run["status"] == "NOT_RUN" and sanitize.EXIT[run["status"]] == 3
    assert run["not_run"] == not_run
    assert REASON in run["reason"] and "not a pass" in run["reason"]
    assert f"{len(STOCK)} of {len(PLAN.kernels)} planned kernels" in run["reason"]
    # The same run with the CuTe kernels launched is a pass: NOT_RUN above came from the cells not run alone.
    assert summarize(PLAN, [judged(CLEAN, child(set(PLAN.kernels)), tool=t) for t in sanitize.TOOLS])["status"] == (
        "PASSED"
    )


def test_errors_and_missing_stock_kernels_outrank_cells_not_run():
    not_run = dict.fromkeys(PLAN.cute_kernels, REASON)
    log = "========= COMPUTE-SANITIZER\n" + memcheck_report("merge_kernel") + "========= ERROR SUMMARY: 1 error\n"
    assert judged(log, child(set(STOCK), not_run), sanitize.ERROR_EXIT).status == "FAILED"
    missing = judged(CLEAN, child(set(STOCK) - {"merge_kernel"}, not_run))
    assert missing.status == "ERROR" and "never launched: merge_kernel" in missing.reason
    # Only CuTe DSL cells may be not run: the child saying so of a stock kernel does not excuse it.
    excused = judged(CLEAN, child(set(STOCK) - {"merge_kernel"}, not_run | {"merge_kernel": REASON}))
    assert excused.status == "ERROR" and "merge_kernel" not in excused.not_run


# --- the CuTe DSL red team ---------------------------------------------------------------------------------------


def test_the_cute_red_team_saves_one_block_past_the_bank(monkeypatch):
    """On the CPU, with CuTe DSL's compile and the launch stubbed (this process never imports CuTe DSL): the launch
    the red team makes writes outside the bank."""
    pytest.importorskip("triton")
    import torch

    from k3_decode.config import K3
    from k3_decode.kernels import attn_res_op
    from suites import sanitize_child

    kernel = types.ModuleType("k3_decode.kernels.attn_res")
    kernel.AttnResKernel = lambda hidden, kind: kind  # type: ignore[attr-defined]
    kernel.compile_args = lambda hidden, kind, batch, capacity: (batch, capacity)  # type: ignore[attr-defined]
    cute = types.ModuleType("cutlass.cute")
    cute.compile = lambda kind, *args: ("compiled", kind, args)  # type: ignore[attr-defined]
    cutlass = types.ModuleType("cutlass")
    cutlass.cute = cute  # type: ignore[attr-defined]
    for name, module in (("k3_decode.kernels.attn_res", kernel), ("cutlass", cutlass), ("cutlass.cute", cute)):
        monkeypatch.setitem(sys.modules, name, module)
    launches = []
    monkeypatch.setattr(attn_res_op, "launch_counter", lambda device: torch.zeros(1, dtype=torch.int32))
    monkeypatch.setattr(attn_res_op, "launch", lambda *args: launches.append(args))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=0))
    sanitize_child.cute_redteam(PLAN, torch.device("cpu"))
    ((compiled, tensors, save_index, _eps, _stream),) = launches
    kind, bank = compiled[1], tensors[2]
    assert kind.save and kind.num_blocks >= 2  # the saving kind of the plan's cell
    assert compiled[2] == (3, K3.num_attn_res_blocks)  # compiled for the bank it gets
    assert bank.shape == (3, K3.num_attn_res_blocks, K3.hidden_size) and own_allocation(bank)
    assert save_index == bank.shape[1]  # one past the last block: the last row writes past the allocation


def _sanitizer_and_cute():
    sanitizer = sanitize.find_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not installed here")
    from k3_decode.kernels.providers import not_built_reason

    if (reason := not_built_reason()) is not None:
        pytest.skip(reason)
    return sanitizer


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", sanitize.TOOLS)
def test_the_cute_cells_launch_their_kernels_clean_under_each_tool(tmp_path, tool):
    """Needs an sm_90 GPU, CuTe DSL and compute-sanitizer: the CuTe DSL cells alone, as `k3gate sanitize` runs them."""
    sanitizer = _sanitizer_and_cute()
    result = sanitize.run_tool(sanitizer, tool, PLAN, tmp_path, timeout=600, cells=tuple(cells_of("cute")))
    assert set(result.kernels) == PLAN.cute_kernels
    assert all(k.launched for k in result.kernels.values()), result.reason
    assert result.status == "PASSED", f"{result.reason}\n{(tmp_path / result.log).read_text()[-4000:]}"


@pytest.mark.gpu
@pytest.mark.slow
def test_memcheck_flags_the_out_of_bounds_cute_launch(tmp_path):
    """Needs an sm_90 GPU, CuTe DSL and compute-sanitizer: the `kns=` filter instruments the generated kernel and its
    reports are attributed to the pattern, on a real log."""
    import os
    import subprocess

    from suites import sanitize_child

    sanitizer = _sanitizer_and_cute()
    names, report = [sanitize_child.CUTE_REDTEAM_KERNEL], tmp_path / "child.json"
    memcheck = PLAN.tools["memcheck"]
    cmd = [sanitizer, "--tool", "memcheck", "--error-exitcode", str(sanitize.ERROR_EXIT)]
    cmd += [*sanitize._kernel_filter(names, names), *memcheck.options]
    cmd += [sys.executable, "-m", "suites.sanitize_child", "--report", str(report), "--redteam-cute"]
    env = {**os.environ, **memcheck.env, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    log = proc.stdout + proc.stderr
    child_report = json.loads(report.read_text()) if report.is_file() else None
    result = judge("memcheck-redteam-cute", proc.returncode, log, child_report, names, memcheck, names)
    assert result.kernels[names[0]].errors > 0, f"{result.reason}\n{log[-4000:]}"
    assert not result.other_kernels, result.other_kernels  # every report went to the pattern
