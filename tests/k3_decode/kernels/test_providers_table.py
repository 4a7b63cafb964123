"""providers.toml on the CPU: the two forms of a row limit (max_rows, 1..N per TP size; rows, inclusive ranges per TP
size), what each gives the runtime (served_rows) and the older (most rows, why) accessor, and a one-line refusal,
naming the entry and the fix, for every malformed range list."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3_decode.kernels import providers
from k3_decode.runtime.backend import RowLimit

WHY = 'why = "measured"\n'


@pytest.fixture
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Serve a providers.toml written by the test in place of the shipped one (restored after it)."""

    def write(text: str) -> Path:
        path = tmp_path / "providers.toml"
        path.write_text(text)
        monkeypatch.setattr(providers, "CHOICE", path)
        providers._limits.cache_clear()  # the same tmp path may hold another text in the next case
        return path

    yield write
    providers._limits.cache_clear()


def test_the_shipped_projection_serves_its_tp8_ranges_and_tp16_whole():
    tp8 = providers.served_rows("in_proj", "cute-kda-in-proj", 8)
    assert tp8 is not None and tp8.ranges == ((1, 8), (16, 31), (33, 64))
    assert providers.served_rows("in_proj", "cute-kda-in-proj", 16).ranges == ((1, 64),)
    # max_rows entries are unchanged: o_proj at one block and from two blocks on
    assert providers.served_rows("o_proj", "cute-kda-o-proj", 8) == RowLimit.of(
        providers.max_rows("o_proj", "cute-kda-o-proj", 8)
    )
    assert providers.served_rows("o_proj", "cute-kda-o-proj", 8, blocks=2).ranges == ((1, 64),)


def test_rows_ranges_reach_the_runtime_as_listed(table):
    table(
        '[in_proj]\nrows = { "8" = [[1, 8], [16, 16], [33, 64]], "16" = [[1, 64]] }\n' + WHY + "\n"
        '[o_proj]\nmax_rows = { "8" = 32 }\n' + WHY + "\n"
        '[o_proj.mixing]\nmin_blocks = 2\nrows = { "8" = [[1, 4], [48, 64]] }\n' + WHY
    )
    limit = providers.served_rows("in_proj", "p", 8)
    assert limit == RowLimit(((1, 8), (16, 16), (33, 64)), "rows p serves at TP8 (measured)")
    in_proj = providers.CuteKdaInProjProvider()
    assert in_proj.served_rows(8) == providers.served_rows("in_proj", in_proj.name, 8)  # what the runtime asks
    assert providers.served_rows("in_proj", "p", 4) is None  # a TP size it names no limit for: served everywhere
    assert providers.max_rows("in_proj", "p", 16) == (64, "rows p serves at TP16 (measured)")  # one range from 1
    with pytest.raises(ValueError, match=r"serves 1-8, 16, 33-64 rows at TP8, not 1\.\.N"):
        providers.max_rows("in_proj", "p", 8)
    assert providers.served_rows("o_proj", "p", 8, blocks=1).ranges == ((1, 32),)
    mixing = providers.served_rows("o_proj", "p", 8, blocks=2)
    assert mixing.ranges == ((1, 4), (48, 64)) and "mixes 2 or more bank blocks" in mixing.why


BAD = [
    (
        '[in_proj]\nrows = { "8" = [[1, 8], [8, 16]] }\n' + WHY,
        '[in_proj] rows "8" = [[1, 8], [8, 16]]: [8, 16] overlaps [1, 8]',
    ),
    ('[in_proj]\nrows = { "8" = [[1, 8], [4, 6]] }\n' + WHY, "[4, 6] overlaps [1, 8]"),
    ('[in_proj]\nrows = { "8" = [[16, 16], [1, 8]] }\n' + WHY, "[1, 8] comes after [16, 16] (unsorted)"),
    ('[in_proj]\nrows = { "8" = [[9, 8]] }\n' + WHY, "[9, 8] has first > last"),
    ('[in_proj]\nrows = { "8" = [[0, 8]] }\n' + WHY, "[0, 8] is outside 1..64"),
    ('[in_proj]\nrows = { "16" = [[33, 65]] }\n' + WHY, '[in_proj] rows "16" = [[33, 65]]: [33, 65] is outside 1..64'),
    ('[in_proj]\nrows = { "8" = [1, 8] }\n' + WHY, "1 is not a [first, last] pair of row counts"),
    ('[in_proj]\nrows = { "8" = [[1, 8, 9]] }\n' + WHY, "[1, 8, 9] is not a [first, last] pair"),
    ('[in_proj]\nrows = { "8" = [[1, true]] }\n' + WHY, "[1, True] is not a [first, last] pair"),
    ('[in_proj]\nrows = { "8" = [] }\n' + WHY, '[in_proj] rows "8" = []: no ranges'),
    ('[in_proj]\nrows = { "x" = [[1, 8]] }\n' + WHY, "[in_proj] rows: 'x' is not a TP size"),
    ("[in_proj]\nrows = 8\n" + WHY, "[in_proj] rows is 8"),
    (
        '[in_proj]\nmax_rows = { "8" = 8 }\nrows = { "8" = [[1, 8]] }\n' + WHY,
        "[in_proj] gives both max_rows and rows; keep one",
    ),
    (
        '[o_proj]\nmax_rows = { "8" = 32 }\n' + WHY + '[o_proj.mixing]\nmin_blocks = 2\nmax_rows = { "8" = 64 }\n'
        'rows = { "8" = [[1, 64]] }\n' + WHY,
        "[o_proj].mixing gives both max_rows and rows",
    ),
    (
        '[o_proj]\nmax_rows = { "8" = 32 }\n'
        + WHY
        + '[o_proj.mixing]\nmin_blocks = 2\nrows = { "8" = [[40, 30]] }\n'
        + WHY,
        '[o_proj].mixing rows "8" = [[40, 30]]: [40, 30] has first > last',
    ),
    ("[in_proj]\n" + WHY, "[in_proj] needs max_rows and a why (or rows"),  # no limit at all
    ('[in_proj]\nrows = { "8" = [[1, 8]] }\n', "[in_proj] needs max_rows and a why"),  # no why
]


@pytest.mark.parametrize(("text", "says"), BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_a_malformed_row_limit_is_one_line_naming_the_entry_and_the_fix(tmp_path: Path, text: str, says: str):
    path = tmp_path / "providers.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        providers.limits(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith("providers.toml: ["), message
    assert says in message, message
    if "both" in says:
        assert "max_rows = {" in message and "rows = {" in message, message  # the two forms to choose from
    elif "needs" not in says:
        assert 'write { "<tp>" = [[first, last], ...] }' in message and "[[1, 8], [16, 16], [33, 64]]" in message


def test_a_good_table_with_both_forms_is_accepted(tmp_path: Path):
    """The control of the cases above: the same entries, well formed, load (adjacent ranges are not overlapping)."""
    path = tmp_path / "providers.toml"
    path.write_text(
        '[in_proj]\nrows = { "8" = [[1, 8], [9, 9], [33, 64]], "16" = [[1, 64]] }\n' + WHY + "\n"
        '[o_proj]\nmax_rows = { "8" = 32, "16" = 64 }\n' + WHY + "\n"
        '[o_proj.mixing]\nmin_blocks = 2\nmax_rows = { "8" = 64 }\n' + WHY
    )
    assert set(providers.limits(path)) == {"in_proj", "o_proj"}
