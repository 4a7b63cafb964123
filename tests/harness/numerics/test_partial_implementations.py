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
