"""The views' tables in a terminal of 80 and 100 columns, on the kept rows: no line wider than the
terminal, no cell cut short (no ``…``), backend labels whole; ``--wide`` keeps every column."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from qlabench.cli import app

ROOT = Path(__file__).resolve().parent.parent
RES = ROOT / "results"

VIEWS = {
    "summary": ["summary", str(RES / "h200_fwd"), "--model", "2/8"],
    "summary serving": ["summary", str(RES / "h200_serving"), "--model", "8/24"],
    "compare labels": ["compare", str(RES / "h200_kernels_prev" / "fwd_o_rs_batch"),
                       "--base-backend", "tilelang@prev", "--new-backend", "tilelang"],
    "compare runs": ["compare", str(RES / "scaleout" / "gpu1_a"), str(RES / "scaleout" / "gpu1_b")],
    "reproduce": ["reproduce", "flashqla-h200", "--from", str(RES / "h200_fwd")],
}
#: labels each view's output must hold whole
LABELS = {"summary": ["flashinfer@0.7.4"], "summary serving": ["flashinfer@0.7.4"],
          "compare labels": ["tilelang@prev → tilelang"], "compare runs": ["flashinfer"],
          "reproduce": ["flashinfer@0.7.4"]}


def _invoke(args, tmp_path, **env):
    if args[0] == "reproduce":
        args = [*args, "--out", str(tmp_path / "out")]
    r = CliRunner().invoke(app, args, env=env)
    assert r.exit_code in (0, 1), r.output
    return r.stdout


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize("view", list(VIEWS))
def test_tables_fit_the_terminal_without_cutting_a_cell(view, width, tmp_path):
    out = _invoke(VIEWS[view], tmp_path, COLUMNS=str(width))
    lines = out.splitlines()
    wide = [ln for ln in lines if cell_len(ln) > width]
    assert not wide, f"{len(wide)} lines wider than {width}: {wide[0]!r}"
    assert "…" not in out
    for label in LABELS[view]:
        assert label in out


def test_wide_keeps_every_column_and_a_narrow_terminal_names_what_it_left_out(tmp_path):
    args = VIEWS["summary"]
    narrow = _invoke(args, tmp_path, COLUMNS="80")
    assert "(left out to fit 80 columns: rel_l2, spread; --wide shows them)" in narrow
    head = next(ln for ln in narrow.splitlines() if ln.startswith("layout"))
    assert "rel_l2" not in head and "spread" not in head
    wide = _invoke([*args, "--wide"], tmp_path, COLUMNS="80")
    head = next(ln for ln in wide.splitlines() if ln.startswith("layout"))
    assert "rel_l2" in head and "spread" in head and "left out" not in wide
