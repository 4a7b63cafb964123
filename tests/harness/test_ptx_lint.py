"""The contracted-butterfly lint on hand-written PTX: what it must flag and what it must leave alone."""

from __future__ import annotations

from harness.ptx_lint import contracted_butterflies

# Lane i squares its value, takes its partner's rounded square and fuses its own square into the add.
CONTRACTED = """
\t.loc\t1 112 28                        // kda_decode.py:112:28
\tmul.f32 \t%r252, %r202, %r202;
\tshfl.sync.bfly.b32 \t%r253, %r252, 16, 31, -1;
\t.loc\t2 287 12                        // standard.py:287:12
\tfma.rn.f32 \t%r254, %r202, %r202, %r253;
\tshfl.sync.bfly.b32 \t%r255, %r254, 8, 31, -1;
\tadd.f32 \t%r256, %r254, %r255;
"""

# The same reduction without contraction: every step is a commutative add of two lanes' values.
SYMMETRIC = """
\tmul.f32 \t%r252, %r202, %r202;
\tshfl.sync.bfly.b32 \t%r253, %r252, 16, 31, -1;
\tadd.f32 \t%r254, %r252, %r253;
\tshfl.sync.bfly.b32 \t%r255, %r254, 8, 31, -1;
\tadd.f32 \t%r256, %r254, %r255;
\tfma.rn.f32 \t%r257, %r256, %r256, %r9;
"""

# A shuffled register rewritten by something else before an FMA reads it is no longer a shuffle result.
REWRITTEN = """
\tshfl.sync.bfly.b32 \t%r253, %r252, 16, 31, -1;
\tadd.f32 \t%r253, %r253, %r252;
\tfma.rn.f32 \t%r254, %r202, %r202, %r253;
"""


def test_a_contracted_step_is_found_with_its_source_line():
    (found,) = contracted_butterflies(CONTRACTED)
    assert found.ptx_line == 6
    assert found.source == "standard.py:287:12"
    assert found.instruction.startswith("fma.rn.f32 %r254")
    assert "standard.py:287:12" in found.describe()


def test_symmetric_steps_and_unrelated_fmas_pass():
    assert contracted_butterflies(SYMMETRIC) == []


def test_a_register_rewritten_after_the_shuffle_is_not_flagged():
    assert contracted_butterflies(REWRITTEN) == []


def test_predicated_and_multi_destination_shuffles_count():
    ptx = "\t@%p1 shfl.sync.bfly.b32 \t%r3|%p2, %r2, 1, 31, -1;\n\tfma.rn.ftz.f32 \t%r4, %r1, %r1, %r3;\n"
    assert len(contracted_butterflies(ptx)) == 1
