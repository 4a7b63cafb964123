"""harness.ptx_values on small hand-written kernels: concrete addresses and branches, symbolic arithmetic, and the
fused product that made two builds of one kernel round apart."""

from __future__ import annotations

import pytest

from harness.ptx_values import PtxValueError, compare, run_thread

# out[tid] = x[2 tid]^2 + x[2 tid + 1]^2 (FUSED names the product the FMA takes), and for tid < 32 also
# out[64 + tid] = x[2 tid] (EXTRA). Register names and the order of independent integer steps are free.
KERNEL = """
.visible .entry k(.param .u64 k_param_0, .param .u64 k_param_1)
{{
    .reg .pred %p<3>;
    .reg .b32 %r<9>;
    .reg .b64 %rd<9>;
    ld.param.u64 %rd1, [k_param_0];
    ld.param.u64 %rd2, [k_param_1];
    mov.u32 %r1, %tid.x;
{index}
    ld.global.v2.f32 {{%r3, %r4}}, [%rd4];
{fused}
    mul.wide.u32 %rd5, %r1, 4;
    add.s64 %rd6, %rd2, %rd5;
    st.global.f32 [%rd6], %r6;
    setp.gt.u32 %p1, %r1, 31;
    @%p1 bra $L__done;
{extra}
$L__done:
    ret;
}}
"""
INDEX = "    mul.wide.u32 %rd3, %r1, 8;\n    add.s64 %rd4, %rd1, %rd3;"
INDEX_SHIFTED = "    shl.b32 %r8, %r1, 3;\n    cvt.u64.u32 %rd7, %r8;\n    add.s64 %rd4, %rd7, %rd1;"  # same address
FUSED = "    mul.f32 %r5, %r3, %r3;\n    fma.rn.f32 %r6, %r4, %r4, %r5;"  # x1 * x1 + (x0 * x0)
FUSED_OTHER = "    mul.f32 %r5, %r4, %r4;\n    fma.rn.f32 %r6, %r3, %r3, %r5;"  # x0 * x0 + (x1 * x1): rounds apart
EXTRA = "    st.global.f32 [%rd6+256], %r3;"


def kernel(index: str = INDEX, fused: str = FUSED, extra: str = EXTRA) -> str:
    return KERNEL.format(index=index, fused=fused, extra=extra)


def test_the_same_arithmetic_through_other_address_steps_stores_the_same_values():
    assert compare(kernel(), kernel(index=INDEX_SHIFTED), [0, 5, 40]) == []


def test_fusing_the_other_product_is_a_difference_in_every_thread():
    """The bug this check was written for: a + b where both are products, fused differently by two builds."""
    diffs = compare(kernel(), kernel(fused=FUSED_OTHER), [0, 40])
    assert [(d.thread, d.address) for d in diffs] == [(0, ("abs", 2 << 20)), (40, ("abs", (2 << 20) + 160))]
    assert "fma.rn.f32" in diffs[0].mine


def test_addresses_and_branches_on_the_thread_index_are_exact():
    run = run_thread(kernel(), 3, (0, 0, 0))
    assert set(run.stores) == {("global", ("abs", (2 << 20) + 12)), ("global", ("abs", (2 << 20) + 268))}
    assert run.stores[("global", ("abs", (2 << 20) + 268))].args == (("abs", (1 << 20) + 24),)  # x[6], loaded
    assert len(run_thread(kernel(), 33, (0, 0, 0)).stores) == 1  # past the branch: no EXTRA store
    diffs = compare(kernel(), kernel(extra=""), [3, 33])
    assert [d.thread for d in diffs] == [3] and diffs[0].theirs == "None"


def test_a_branch_on_a_loaded_value_is_reported_and_not_taken():
    symbolic = kernel(extra="").replace("setp.gt.u32 %p1, %r1, 31;", "setp.gt.u32 %p1, %r3, 31;")
    run = run_thread(symbolic.replace("@%p1 bra $L__done;", "@%p1 bra $L__done;\n" + EXTRA), 0, (0, 0, 0))
    assert len(run.untaken) == 1 and "ld.global" in run.untaken[0] and len(run.stores) == 2


def test_what_it_cannot_run_is_an_error_never_equal():
    with pytest.raises(PtxValueError, match="integer operation bfind"):
        run_thread(kernel(extra="    bfind.u32 %r7, %r1;"), 0, (0, 0, 0))
    loop = kernel(extra="$L__spin:\n    bra $L__spin;")
    with pytest.raises(PtxValueError, match="more than 1000 instructions"):
        run_thread(loop, 0, (0, 0, 0), max_steps=1000)
    with pytest.raises(PtxValueError, match=r"no \.entry"):
        run_thread("// not a kernel", 0, (0, 0, 0))


# out[tid] = mma's first result over two loaded words, written over several lines as the compiler prints mma.sync
MMA = """
    ld.global.v2.b32 {{%r3, %r4}}, [%rd4];
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
        {{%r5, %r6, %r7, %r8}},
        {{{a}, %r4, %r4}},
        {{%r3, %r4}},
        {{%r9, %r9, %r9, %r9}};
    mov.f32 %r6, %r5;"""


def test_an_mma_over_several_lines_is_a_value_of_every_input():
    plain = kernel(fused=MMA.format(a="%r3, %r4"), extra="")
    assert compare(plain, kernel(fused=MMA.format(a="%r3, %r4"), extra="", index=INDEX_SHIFTED), [0, 7]) == []
    swapped = compare(plain, kernel(fused=MMA.format(a="%r4, %r3"), extra=""), [0, 7])
    assert [d.thread for d in swapped] == [0, 7] and "mma.sync" in swapped[0].mine


WAIT_ASM = """    {{
    .reg .pred P1;
    LAB_WAIT:
    mbarrier.try_wait.parity.shared.b64 P1, [%r1], 0, 10000000;
    @P1 bra.uni DONE;
    bra.uni LAB_WAIT;
    DONE:
    }}
"""
WGMMA_ASM = """    {{
    .reg .pred p;
    setp.ne.b32 p, %r1, 0;
    wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {{%r5, %r6, %r7, %r8}}, %rd1, %rd2, p, 1, 1, 0, 0;
    }}
"""


def test_inline_assembly_that_writes_a_kernel_register_is_an_error_and_a_wait_is_not():
    """A wait block defines nothing a store reads, so it is skipped; a wgmma block writes accumulators this reader
    cannot follow, and skipping it would compare stale registers: an error, never "equal"."""
    waiting = kernel(fused=WAIT_ASM + FUSED, extra="")
    assert compare(kernel(extra=""), waiting, [0, 3]) == []
    with pytest.raises(PtxValueError, match=r"inline assembly writes %r5, %r6, %r7"):
        run_thread(kernel(fused=WGMMA_ASM + FUSED, extra=""), 0, (0, 0, 0))


def test_a_64_bit_address_split_into_halves_and_packed_again_is_the_same_address():
    """mov.b64 {lo, hi} splits at bit 32 (mov.b32 {lo, hi} at bit 16): a pointer taken apart and put back must
    store where the original does, and a wrong split would store elsewhere."""
    split = INDEX + "\n    mov.b64 {%r7, %r8}, %rd4;\n    mov.b64 %rd4, {%r7, %r8};"
    assert compare(kernel(), kernel(index=split), [0, 9]) == []
    swapped = INDEX + "\n    mov.b64 {%r7, %r8}, %rd4;\n    mov.b64 %rd4, {%r8, %r7};"
    assert [d.thread for d in compare(kernel(), kernel(index=swapped), [0, 9])] == [0, 0, 9, 9]  # x loaded elsewhere
