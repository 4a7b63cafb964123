"""The numerics stage's `evaluate` with a partial implementation (the specialized path replaces some ops): it runs
every cell of its ops and no other, while a complete implementation missing an op fails that op's cells."""

from __future__ import annotations

import torch

from harness.numerics.cells import Implementation, OpSpec
from harness.stages.numerics import evaluate
from tests.harness.numerics.toy_op import TABLE, ToyCase, correct

CPU = torch.device("cpu")


class OtherCase(ToyCase):
    """The toy op under another op name: a cell of an op the partial implementation does not replace."""

    def __post_init__(self):
        super().__post_init__()
        self.spec = OpSpec("other", "bfloat16", outputs=("y",), inplace=("state",), steps=3)
        self.id = f"other/b{self.batch}"


def _table() -> object:
    entries = dict(TABLE.entries)
    entries["other"] = entries["toy"]
    return type(TABLE)(entries, "test")


def test_a_partial_implementation_runs_only_its_ops_cells():
    cells = [ToyCase(2), OtherCase(3)]
    impls = [
        Implementation("stock", {"toy": correct, "other": correct}),
        Implementation("specialized", {"toy": correct}, partial=True),
    ]
    records = evaluate(cells, impls, CPU, _table(), (), seed=1)
    assert records.metrics["cells_by_implementation"] == {"stock": 2, "specialized": 1}
    assert records.metrics["cells_failed"] == 0
    assert set(records.metrics["pass_map"]) == {"stock toy", "stock other", "specialized toy"}
    assert all(c.passed for c in records.checks)


def test_a_complete_implementation_missing_an_op_fails_its_cells():
    cells = [ToyCase(2), OtherCase(3)]
    records = evaluate(cells, [Implementation("stock", {"toy": correct})], CPU, _table(), (), seed=1)
    failed = [c.name for c in records.checks if not c.passed]
    assert failed == ["stock other/b3: stock implements other"]


def _beyond_two_rows(case) -> str | None:
    return f"the kernel takes at most 2 rows, the cell has {case.batch}" if case.batch > 2 else None


def test_a_partial_implementation_declines_cells_beyond_its_limit_and_lists_them_untested():
    cells = [ToyCase(2), ToyCase(3)]
    impls = [
        Implementation("stock", {"toy": correct}),
        Implementation("specialized", {"toy": correct}, partial=True, declines=_beyond_two_rows),
    ]
    records = evaluate(cells, impls, CPU, TABLE, (), seed=1)
    assert records.metrics["cells_by_implementation"] == {"stock": 2, "specialized": 1}
    assert records.metrics["declined"] == [
        {"implementation": "specialized", "cell": "toy/b3", "reason": "the kernel takes at most 2 rows, the cell has 3"}
    ]
    assert set(records.metrics["pass_map"]["specialized toy"]) == {"b2"}  # the declined cell is not a pass
    assert all(c.passed for c in records.checks)


def test_a_complete_implementation_that_declines_a_cell_fails_it():
    """Broken case: an implementation claiming to be complete cannot skip the cells it finds hard."""
    records = evaluate(
        [ToyCase(2), ToyCase(3)],
        [Implementation("stock", {"toy": correct}, declines=_beyond_two_rows)],
        CPU,
        TABLE,
        (),
        1,
    )
    failed = [(c.name, c.detail) for c in records.checks if not c.passed]
    assert failed == [("stock toy/b3: stock serves the cell", "the kernel takes at most 2 rows, the cell has 3")]
    assert records.metrics["declined"] == []
