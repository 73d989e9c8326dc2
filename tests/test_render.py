"""qlabench.render: tables keep every cell whole; too wide, whole columns go in their stated order."""

from __future__ import annotations

import io

from rich.console import Console

from qlabench import render
from qlabench.render import Column


def _print(columns, rows, width):
    buf = io.StringIO()
    con = Console(file=buf, width=width or 1000)
    f = render.table(con, columns, rows, width, title="t")
    return f, buf.getvalue()


COLS = [Column("label"), Column("a", "right", drop=2), Column("b", "right", drop=1),
        Column("c", "right", drop=2), Column("text", wrap=True, min_width=10)]
ROWS = [["flashinfer@0.7.4", "1.0000", "2.0000", "3.0000", "a few words of free text here"],
        ["tilelang", "4.0000", "5.0000", "6.0000", ""]]


def test_columns_go_in_rank_order_whole_ranks_at_a_time_and_cells_stay_whole():
    cols, rows = COLS[:4], [r[:4] for r in ROWS]
    full = render.fit(cols, rows, None).width
    f, out = _print(cols, rows, full)
    assert f.dropped == [] and "left out" not in out
    f, out = _print(cols, rows, full - 1)           # one column less is enough: b (rank 1)
    assert f.dropped == ["b"] and f"(left out to fit {full - 1} columns: b; --wide" in out
    f, out = _print(cols, rows, full - 9)           # rank 2 goes as one: a and c together,
    assert f.dropped == ["a", "c"] and f.keep == [0, 2]  # then b fits again
    f, out = _print(cols, rows, full - 17)          # b does not fit back
    assert f.dropped == ["b", "a", "c"] and f.keep == [0]
    for width in (full - 1, full - 9, full - 17):
        f, out = _print(cols, rows, width)
        assert "…" not in out and "flashinfer@0.7.4" in out
        assert max(len(ln) for ln in out.splitlines()) <= width
    # below what the always-shown column needs, the table keeps it whole (wider than asked)
    f, out = _print(cols, rows, 10)
    assert f.keep == [0] and f.width == len("flashinfer@0.7.4") and "flashinfer@0.7.4" in out


def test_free_text_wraps_within_the_room_left_before_a_column_goes():
    full = render.fit(COLS, ROWS, None).width
    f, out = _print(COLS, ROWS, full - 8)           # the text wraps; every column stays
    assert f.dropped == [] and f.width == full - 8
    assert max(len(ln) for ln in out.splitlines()) <= full - 8
    f, out = _print(COLS, ROWS, 40)                 # the text at its least width, columns go
    assert f.dropped and 4 in f.keep and "…" not in out
    words = " ".join(out.split())
    assert all(w in words for w in "a few words of free text here".split())


def test_one_value_in_every_row_is_stated_once_and_empty_columns_go():
    cols = [Column("layout"), Column("dir", same=True), Column("bad", same=True),
            Column("note", omit_empty=True)]
    f, out = _print(cols, [["1x8192", "fwd", "", ""], ["2x4096", "fwd", "", ""]], None)
    assert f.keep == [0] and f.same == [("dir", "fwd")] and "every row: dir fwd" in out
    f, _ = _print(cols, [["1x8192", "fwd", "1 incorrect", "x"], ["2x4096", "bwd", "", ""]], None)
    assert f.keep == [0, 1, 2, 3] and f.same == []


def test_long_layout_labels_read_as_count_and_mean_with_the_label_under_the_table():
    long = "6x[65,1025,4097,193,2049,129]"
    cells = render.layout_cells([("1x8192", 1, 8192), (long, 6, 7558),
                                 ("6x[1260,1260,1259,1259,1260,1260]", 6, 7558), (long, 6, 7558)])
    assert cells == ["1x8192", "6x~1260", "6x~1260#2", "6x~1260"]
    assert render.layout_notes(cells, ["1x8192", long, "6x[1260,1260,1259,1259,1260,1260]", long]) \
        == [f"6x~1260 = {long}", "6x~1260#2 = 6x[1260,1260,1259,1259,1260,1260]"]


def test_width_comes_from_columns_then_the_terminal_and_wide_or_a_pipe_keep_everything(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert render.terminal_width() == 80 and render.terminal_width(wide=True) is None
    monkeypatch.delenv("COLUMNS")
    monkeypatch.setattr("sys.stdout.isatty", lambda: False, raising=False)
    assert render.terminal_width() is None


def test_a_rank_left_out_comes_back_when_it_fits_beside_what_is_kept():
    # a wide rank-2 column forces rank 1 out first; once rank 2 is out too, rank 1 fits again
    cols = [Column("label"), Column("n", "right", drop=1), Column("wide", drop=2)]
    rows = [["tilelang", "12", "x" * 40], ["fla", "3", ""]]
    least = render.fit(cols[:2], rows, None).width
    f = render.fit(cols, rows, least)
    assert f.dropped == ["wide"] and f.keep == [0, 1] and f.width == least
    # the most important rank left out comes back first
    cols = [Column("label"), Column("a", drop=1), Column("b", drop=2), Column("wide", drop=3)]
    rows = [["tilelang", "aaaa", "bbbb", "x" * 40]]
    f = render.fit(cols, rows, render.fit(cols[:3], rows, None).width - 1)
    assert f.dropped == ["a", "wide"] and f.keep == [0, 2]


def test_parts_every_row_holds_are_stated_once_and_the_cells_keep_the_rest():
    cols = [Column("layout"), Column("pairing", same=True, parts=", ")]
    rows = [["1x8192", "cross-GPU, cross-campaign"], ["4x8192", "cross-GPU, cross-campaign, throttled"]]
    f, out = _print(cols, rows, None)
    assert f.same == [("pairing", "cross-GPU, cross-campaign")] and f.keep == [0, 1]
    assert [r[1].plain for r in f.rows] == ["", "throttled"]
    assert "every row: pairing cross-GPU, cross-campaign" in out
    f, _ = _print(cols, [["1x8192", "cross-GPU"], ["4x8192", ""]], None)  # nothing in every row
    assert f.same == [] and [r[1].plain for r in f.rows] == ["cross-GPU", ""]


def test_a_COLUMNS_of_zero_or_not_a_number_counts_as_unset(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: False, raising=False)
    for bad in ("0", "-3", "wide", ""):
        monkeypatch.setenv("COLUMNS", bad)
        assert render.terminal_width() is None
        buf = io.StringIO()
        con = render.console(None)
        con.file = buf
        render.table(con, [Column("layout"), Column("ms", "right")], [["1x8192", "0.1234"]], None)
        render.line(con, "a line", None)
        assert "1x8192" in buf.getvalue() and "0.1234" in buf.getvalue() and "a line" in buf.getvalue()
