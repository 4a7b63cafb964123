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
