"""The op table data file: its layout checks and the per-layer op sequence."""

from __future__ import annotations

import pytest

from k3_decode.config import K3, K3_MINI
from k3_decode.runtime.backend import RowLimit
from k3_decode.runtime.errors import DataFileError
from k3_decode.runtime.optable import load_op_table, parse_op_table

TABLE = load_op_table()


def _raw() -> dict:
    return {
        "kda": {"ops": ["a", "k"], "specialized": ["k"], "stock_reason": "a later"},
        "mla": {"ops": ["m"], "specialized": [], "stock_reason": "later"},
        "dense": {"ops": ["d"], "specialized": ["d"]},
        "moe": {"ops": ["e"], "specialized": [], "stock_reason": "later"},
    }


def test_shipped_table_routes_the_built_kda_ops_and_keeps_the_rest_stock():
    assert TABLE.specialized_ops() == {"attn_res", "in_proj", "kda", "o_proj"}
    assert TABLE.parts["kda"].specialized == frozenset(TABLE.parts["kda"].ops)  # the whole KDA attention side
    assert TABLE.parts["mla"].specialized == frozenset()
    assert TABLE.parts["moe"].specialized == frozenset()


def test_layer_ops_follow_model_layer_kinds():
    ops = [(p.part, op) for p, op in TABLE.layer_ops(K3, 0)]
    assert ops == [("kda", "attn_res"), ("kda", "in_proj"), ("kda", "kda"), ("kda", "o_proj"), ("dense", "dense_mlp")]
    ops = [(p.part, op) for p, op in TABLE.layer_ops(K3, 3)]  # full_attn_layers are 1-indexed: layer 4 is index 3
    assert ops[2] == ("mla", "mla") and ops[-1] == ("moe", "moe")
    with pytest.raises(ValueError, match=r"outside k3-mini's layers 0\.\.11"):
        TABLE.layer_ops(K3_MINI, 12)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["kda"].update(specialized=["zz"]), r"specialized names \['zz'\], which are not in its ops"),
        (lambda r: r["mla"].pop("stock_reason"), "keeps ops on stock but has no stock_reason"),
        (lambda r: r["moe"].update(extra=1), "unknown keys"),
        (lambda r: r.pop("dense"), r"missing \['dense'\]"),
        (lambda r: r.update(ssm={}), r"unknown \['ssm'\]"),
        (lambda r: r["kda"].update(ops=[]), "non-empty list"),
        (lambda r: r["kda"].update(ops=["a", "a"]), "lists an op twice"),
    ],
)
def test_malformed_table_is_one_line_error(edit, message):
    raw = _raw()
    parse_op_table(raw)
    edit(raw)
    with pytest.raises(DataFileError, match=message):
        parse_op_table(raw)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        load_op_table(tmp_path / "nope.toml")


def test_the_expected_path_on_a_specialized_step_follows_the_table_and_the_row_limits():
    kda = TABLE.parts["kda"]
    assert kda.path_on_specialized_step("in_proj") == "specialized"
    assert TABLE.parts["mla"].path_on_specialized_step("mla") == "stock"  # the table keeps it stock
    limits = {"in_proj": RowLimit.up_to(4, "why")}
    assert kda.path_on_specialized_step("in_proj", 4, limits) == "specialized"
    assert kda.path_on_specialized_step("in_proj", 5, limits) == "stock"
    # ranges: stock between them as well as above
    ranges = {"in_proj": RowLimit(((1, 8), (16, 16), (33, 64)), "why")}
    served = [r for r in range(1, 66) if kda.path_on_specialized_step("in_proj", r, ranges) == "specialized"]
    assert served == [*range(1, 9), 16, *range(33, 65)]
    assert kda.path_on_specialized_step("attn_res", 64, limits) == "specialized"  # no limit for it
    assert TABLE.parts["mla"].path_on_specialized_step("attn_res", 1, limits) == "stock"
    paths = TABLE.expected_paths(K3, [0, 3], 5, limits)  # layer 0 is KDA+dense, layer 3 MLA+MoE
    assert paths[(0, "attn_res")] == "specialized" and paths[(0, "in_proj")] == "stock"
    assert paths[(3, "attn_res")] == "stock" and paths[(0, "dense_mlp")] == "stock" and len(paths) == 4 + 1 + 4 + 1
    layered = TABLE.expected_paths(K3, [0, 1], 5, limits, layer_limits={("in_proj", 1): RowLimit.up_to(8, "why")})
    assert layered[(0, "in_proj")] == "stock" and layered[(1, "in_proj")] == "specialized"  # its own layer only
