"""harness.ptx_values on small hand-written kernels: concrete addresses and branches, symbolic arithmetic, and the
fused product that made two builds of one kernel round apart."""

from __future__ import annotations

import pytest

from harness.ptx_values import PtxValueError, compare, compare_groups, run_thread

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
    assert run.stores[("global", ("abs", (2 << 20) + 268))].args == (("abs", (1 << 20) + 24), 4)  # x[6], 4 bytes
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
    """mov.b64 {lo, hi} splits at bit 32 (mov.b32 {lo, hi} at bit 16): a pointer above 4 GiB taken apart and put
    back must load where the original does (split at bit 16, its high word would be lost), and swapping the
    halves must not."""
    high = INDEX + "\n    add.s64 %rd4, %rd4, 4294967296;"
    split = high + "\n    mov.b64 {%r7, %r8}, %rd4;\n    mov.b64 %rd4, {%r7, %r8};"
    assert compare(kernel(index=high), kernel(index=split), [0, 9]) == []
    swapped = high + "\n    mov.b64 {%r7, %r8}, %rd4;\n    mov.b64 %rd4, {%r8, %r7};"
    assert [d.thread for d in compare(kernel(index=high), kernel(index=swapped), [0, 9])] == [0, 0, 9, 9]


# Thread 0 stages x[0..63] (256 bytes) into shared memory with one bulk copy (and EXTRA, if given); every thread
# then loads its pair from there instead of from global (STAGED_INDEX replaces INDEX's global address with the
# shared one).
STAGING = """    setp.ne.u32 %p2, %r1, 0;
    @%p2 bra $L__staged;
    {guard}cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{dst}], [%rd1{src}], 256, [64];
{extra}$L__staged:
    bar.sync 0;
"""
STAGED_INDEX = "    shl.b32 %r8, %r1, 3;\n    add.s32 %r2, %r8, 512;\n    cvt.u64.u32 %rd4, %r2;"
LOADED_FLAG = "    ld.global.u32 %r9, [%rd2];\n    setp.eq.u32 %p3, %r9, 0;\n"


def staged(dst: str = "512", src: str = "", extra: str = "", guard: str = "", fused: str = FUSED) -> str:
    """KERNEL with x staged through shared memory, and the block's size, which says whose copies to collect."""
    index = STAGING.format(dst=dst, src=src, extra=extra, guard=guard) + STAGED_INDEX
    text = kernel(index=index, fused=fused, extra="")
    text = text.replace("k_param_1)\n", "k_param_1)\n.reqntid 32, 1, 1\n")
    return text.replace("ld.global.v2.f32", "ld.shared.v2.f32")


def test_a_load_of_what_a_bulk_copy_staged_is_the_global_load_it_replaces():
    plain = kernel(extra="")
    assert compare(plain, staged(), [0, 5, 31], follow_copies=True) == []
    assert len(compare(plain, staged(), [5], follow_copies=False)) == 1  # not followed: a shared load
    # a copy from the wrong place, or to the wrong place, is a difference where the loads see it
    assert [d.thread for d in compare(plain, staged(src="+8"), [0, 5], follow_copies=True)] == [0, 5]
    assert [d.thread for d in compare(plain, staged(dst="520"), [0, 5], follow_copies=True)] == [0, 5]


def test_what_no_single_copy_stages_is_not_followed():
    """A ring refilled from elsewhere, shared memory a thread overwrites, or a copy on a loaded flag hold no one
    global byte: their loads stay shared loads, a difference."""
    plain = kernel(extra="")
    refill = "    cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [512], [%rd1+4096], 16, [64];\n"
    assert [d.thread for d in compare(plain, staged(extra=refill), [0, 1, 2], follow_copies=True)] == [0, 1]
    overwrite = "    st.shared.f32 [520], %r1;\n"  # thread 0's store; thread 1 loads those bytes
    assert [d.thread for d in compare(plain, staged(extra=overwrite), [1, 3], follow_copies=True)] == [1]
    guarded = staged(guard="@%p3 ").replace("    @%p2 bra", LOADED_FLAG + "    @%p2 bra")
    assert [d.thread for d in compare(plain, guarded, [3], follow_copies=True)] == [3]
    with pytest.raises(PtxValueError, match=r"no \.reqntid"):
        compare(plain, staged().replace(".reqntid 32, 1, 1", ""), [0], follow_copies=True)


def test_staged_memory_reused_after_a_block_wide_barrier_is_followed_until_then():
    """Every thread stores over x's staged bytes after its loads, past a barrier of the whole block: the loads
    came first, so they read what the copy brought. Past a named barrier of part of the block they may not have."""
    reuse = FUSED + "\n    bar.sync 0;\n    st.shared.f32 [520], %r1;"
    assert compare(kernel(fused=reuse, extra=""), staged(fused=reuse), [1, 3], follow_copies=True) == []
    part = reuse.replace("bar.sync 0;", "bar.sync 1, 64;")
    assert [
        d.thread for d in compare(kernel(fused=part, extra=""), staged(fused=part), [1, 3], follow_copies=True)
    ] == [1]


def test_16_bit_integer_steps_wrap_and_divide_at_16_bits():
    """Compilers divide by a constant in 16 bits (mul.hi.u16 by a magic number): x[tid / 3] addressed that way
    must be the address div.u32 gives, and a register cut to 16 bits must lose its high bits."""
    by_div = "    div.u32 %r8, %r1, 3;\n    mul.wide.u32 %rd3, %r8, 8;\n    add.s64 %rd4, %rd1, %rd3;"
    by_magic = (
        "    cvt.u16.u32 %rs1, %r1;\n    mul.hi.u16 %rs2, %rs1, 21846;\n    shl.b16 %rs3, %rs2, 3;\n"
        "    cvt.u32.u16 %r8, %rs3;\n    cvt.u64.u32 %rd7, %r8;\n    add.s64 %rd4, %rd7, %rd1;"
    )
    assert compare(kernel(index=by_div, extra=""), kernel(index=by_magic, extra=""), [0, 5, 40, 1000]) == []
    wrapped = by_magic.replace("cvt.u16.u32 %rs1, %r1;", "add.u32 %r9, %r1, 196608;\n    cvt.u16.u32 %rs1, %r9;")
    assert compare(kernel(index=by_div, extra=""), kernel(index=wrapped, extra=""), [40]) == []  # 3 << 16 is cut


def test_operand_order_of_an_add_or_multiply_is_not_a_difference_and_of_a_subtract_is():
    """a * b and b * a (a + b, b + a) have the same bits on the GPU, and a compiler emits either: two builds of the
    gated norm differed only so. A subtract's operands, or an fma's addend against a factor, are no such pair."""
    base = "    mul.f32 %r5, %r3, %r4;\n    add.f32 %r6, %r5, %r3;"
    swapped = "    mul.f32 %r5, %r4, %r3;\n    add.f32 %r6, %r3, %r5;"
    assert compare(kernel(fused=base), kernel(fused=swapped), [0]) == []
    subtract = [kernel(fused=text.replace("add.f32", "sub.f32")) for text in (base, swapped)]
    assert len(compare(*subtract, [0])) == 1
    fma = "    mul.f32 %r5, %r3, %r3;\n    fma.rn.f32 %r6, %r4, %r5, %r3;"
    assert len(compare(kernel(fused=fma), kernel(fused=fma.replace("%r4, %r5, %r3", "%r4, %r3, %r5")), [0])) == 1


# out[0..1] = two BF16 of x, stored one at a time or packed into one word (PACKED), from two 16-bit loads or halves
# of one 32-bit load (HALVES)
PAIR = """
.visible .entry k(.param .u64 k_param_0, .param .u64 k_param_1)
{{
    .reg .b16 %rs<5>;
    .reg .b32 %r<9>;
    .reg .b64 %rd<9>;
    ld.param.u64 %rd1, [k_param_0];
    ld.param.u64 %rd2, [k_param_1];
{load}
{store}
    ret;
}}
"""
NARROW = "    ld.global.b16 %rs1, [%rd1+8];\n    ld.global.b16 %rs2, [%rd1+10];"
HALVES = "    ld.global.b32 %r1, [%rd1+8];\n    mov.b32 {%rs1, %rs2}, %r1;"
APART = "    st.global.b16 [%rd2], %rs1;\n    st.global.b16 [%rd2+2], %rs2;"
PACKED = "    mov.b32 %r2, {%rs1, %rs2};\n    st.global.b32 [%rd2], %r2;"


def test_a_packed_store_and_halves_of_a_load_are_their_bytes():
    """Memory is bytes: a word packed from two halves and stored stores each half at its own two bytes, and the
    halves of a loaded word are what 16-bit loads there read (a wide build stores eight BF16 outputs a lane at once,
    the four-row build four). Packed in the other order, or read one element off, they differ."""
    apart = PAIR.format(load=NARROW, store=APART)
    assert compare(apart, PAIR.format(load=HALVES, store=PACKED), [0]) == []
    assert compare(apart, PAIR.format(load=NARROW, store=PACKED), [0]) == []
    swapped = PAIR.format(load=HALVES, store=PACKED.replace("{%rs1, %rs2}", "{%rs2, %rs1}"))
    assert len(compare(apart, swapped, [0])) == 2
    assert len(compare(apart, PAIR.format(load=HALVES.replace("+8]", "+10]"), store=APART), [0])) == 2
    wide = run_thread(
        PAIR.format(load="    ld.global.b32 %r2, [%rd1+8];", store="    st.global.b32 [%rd2], %r2;"), 0, (0, 0, 0)
    )
    assert next(iter(wide.stores.values())).args == (("abs", (1 << 20) + 8), 4)  # a 4-byte load is not a 2-byte one


# *(p + 16 tid + c) = x where p is a pointer loaded from memory, its constant added in one step or in several
SYMBOLIC = """
.visible .entry k(.param .u64 k_param_0, .param .u64 k_param_1)
{{
    .reg .b32 %r<9>;
    .reg .b64 %rd<9>;
    ld.param.u64 %rd1, [k_param_0];
    ld.global.u64 %rd2, [%rd1];
    ld.global.u32 %r2, [%rd1+8];
    mov.u32 %r1, %tid.x;
{address}
    st.global.u32 [%rd5], %r2;
    ret;
}}
"""
ONE_STEP = "    mul.wide.u32 %rd3, %r1, 16;\n    add.s64 %rd4, %rd2, %rd3;\n    add.s64 %rd5, %rd4, 24;"
SEVERAL = (
    "    cvt.u64.u32 %rd6, %r1;\n    add.s64 %rd3, %rd2, 8;\n    mad.lo.s64 %rd4, %rd6, 16, %rd3;\n"
    "    add.s64 %rd5, %rd4, 16;"
)


def test_a_symbolic_address_is_the_same_sum_in_any_order():
    """A 64-bit sum of a loaded pointer and constants addresses one byte however the compiler groups it (the state
    row of a loaded slot, offset per warp: a wide warp's rows are two four-row warps' at the same addresses). A
    different constant, or a 32-bit step whose wrap-around the widening does not commute with, is no such sum."""
    one = SYMBOLIC.format(address=ONE_STEP)
    assert compare(one, SYMBOLIC.format(address=SEVERAL), [0, 3]) == []
    assert [d.thread for d in compare(one, SYMBOLIC.format(address=SEVERAL.replace("16;", "20;")), [3])] == [3, 3]
    wrapped = "    ld.global.u32 %r3, [%rd1+16];\n    add.u32 %r4, %r3, 24;\n    cvt.u64.u32 %rd5, %r4;"
    widened = "    ld.global.u32 %r3, [%rd1+16];\n    cvt.u64.u32 %rd4, %r3;\n    add.s64 %rd5, %rd4, 24;"
    assert len(compare(SYMBOLIC.format(address=wrapped), SYMBOLIC.format(address=widened), [0])) == 2


def test_builds_that_split_work_between_threads_otherwise_are_compared_by_groups():
    """out[tid] in one build, out[tid ^ 1] in the other (thread t stores what thread t ^ 1 does): every thread
    differs, the pair does not. A group whose threads store two values at one address is an error."""
    other = (
        kernel(index=INDEX.replace("%r1, 8;", "%r7, 8;"), extra="")
        .replace("mov.u32 %r1, %tid.x;", "mov.u32 %r1, %tid.x;\n    xor.b32 %r7, %r1, 1;")
        .replace("mul.wide.u32 %rd5, %r1, 4;", "mul.wide.u32 %rd5, %r7, 4;")
    )
    assert len(compare(kernel(extra=""), other, [0, 1])) == 4
    assert compare_groups(kernel(extra=""), other, [([0, 1], [0, 1]), ([6, 7], [7, 6])]) == []
    assert len(compare_groups(kernel(extra=""), other, [([0, 1], [0, 3])])) == 2  # out[0] against out[2]
    clash = kernel(extra="").replace("mul.wide.u32 %rd5, %r1, 4;", "mov.u64 %rd5, 0;")
    with pytest.raises(PtxValueError, match="store two values"):
        compare_groups(clash, clash, [([0, 1], [0, 1])])


def test_a_run_counts_the_instructions_it_executed():
    """Thread 3 runs EXTRA's store where thread 33 takes the branch past it (a predicated branch not taken is not
    run), and one instruction more in the body is one more run."""
    assert run_thread(kernel(), 3, (0, 0, 0)).executed == run_thread(kernel(), 33, (0, 0, 0)).executed == 14
    longer = kernel(fused=FUSED + "\n    mov.f32 %r7, %r6;")
    assert run_thread(longer, 3, (0, 0, 0)).executed == 15
