"""Stored rows a command cannot use as they are: rows of an older schema (a column the views read
missing), a part file that is not readable Parquet or whose column type clashes with another
part's, and rows with degenerate values (a null key column, an ``ok`` row without a finite
latency > 0).

The first two: every view, ``merge``, ``compact`` and ``run --resume`` give one ``error: ...``
line naming the directory or file, exit 2. Degenerate rows: the views set them aside, say how
many in one ``note: ...`` line, and show the rest (exit 0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import synth_results as S
import yaml
from typer.testing import CliRunner

from qlabench import results as R
from qlabench.cli import app

#: each view's arguments for a results directory ``d`` and a scratch folder ``root``
VIEWS = {
    "summary": lambda d, root: ["summary", str(d)],
    "recommend": lambda d, root: ["recommend", str(d), "--out", str(root / "dispatch.json")],
    "report": lambda d, root: ["report", str(d), "--out", str(root / "site")],
    "reproduce": lambda d, root: ["reproduce", "flashqla-h200", "--from", str(d), "--out",
                                  str(root / "rep")],
    "compare": lambda d, root: ["compare", str(S.write_run(root / "base", directions=("fwd", "bwd"),
                                                           run_id="20241231T000000-cccccc",
                                                           started_at="2024-12-31T00:00:00")),
                                str(d)],
}


def _invoke(args: list[str]):
    r = CliRunner().invoke(app, args)
    assert r.exception is None or isinstance(r.exception, SystemExit), (
        f"{args}: {type(r.exception).__name__}: {r.exception}\n{r.stdout}{r.stderr}")
    return r


def _one_error(r, *words) -> str:
    """Exit 2, one stderr line starting ``error: `` holding ``words``, no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _rewrite(d: Path, frames: list[pd.DataFrame]) -> Path:
    """Replace a results directory's rows by ``frames``, one Parquet file each, written by
    pandas as given (no schema applied: columns may be missing or of another type)."""
    for f in (d / R.PARTS_DIR).glob("*.parquet"):
        f.unlink()
    for i, df in enumerate(frames):
        df.to_parquet(d / R.PARTS_DIR / f"p{i}.parquet", index=False)
    return d


def _run(d: Path) -> pd.DataFrame:
    """A synthetic run in ``d`` (fwd and bwd, three labels, two models); its rows."""
    S.write_run(d, directions=("fwd", "bwd"))
    return R.load(d)


# --------------------------------------------------------------------------- older schema


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("column", ["layout", "backend_version", "started_at", "git_sha"])
def test_rows_without_a_column_the_views_read_are_one_error_line(tmp_path, view, column):
    d = tmp_path / "old"
    rows = _run(d)
    _rewrite(d, [rows.drop(columns=[column])])
    line = _one_error(_invoke(VIEWS[view](d, tmp_path)), f"{d}: rows lack columns {column} ",
                      "older qlabench")
    assert "Traceback" not in line


def test_a_directory_of_old_and_new_parts_names_how_many_files_lack_columns(tmp_path):
    d = tmp_path / "mixed"
    rows = _run(d)
    half = len(rows) // 2
    _rewrite(d, [rows.iloc[:half].drop(columns=["layout", "tp"]), rows.iloc[half:]])
    _one_error(_invoke(VIEWS["report"](d, tmp_path)), f"{d}: rows lack columns tp, layout",
               "1 of 2 files, e.g. p0.parquet")


def test_done_keys_refuses_rows_without_backend_params(tmp_path):
    d = tmp_path / "old"
    _rewrite(d, [_run(d).drop(columns=["backend_params"])])
    with pytest.raises(R.RowsError, match="rows lack columns backend_params"):
        R.ResultStore(d).done_keys()
    assert R.ResultStore(tmp_path / "nothing-yet").done_keys() == {}


def test_resume_over_rows_without_backend_params_is_one_error_line(tmp_path):
    cfg = tmp_path / "a.yaml"
    cfg.write_text(yaml.safe_dump(
        {"name": "a", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
         "seqlens": [[5]], "directions": ["fwd"], "backends": ["reference"],
         "reference": {"impl": "chunked", "dtype": "fp64"}, "isolate": False,
         "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}))
    out = tmp_path / "o"
    assert _invoke(["run", str(cfg), "--out", str(out), "--no-plot"]).exit_code == 0
    rows = R.load(out)
    _rewrite(out, [rows.drop(columns=["backend_params"])])
    _one_error(_invoke(["run", str(cfg), "--out", str(out), "--resume", "--no-plot"]),
               f"{out}: rows lack columns backend_params")


# --------------------------------------------------------------------------- corrupt parts


def _corrupt(d: Path) -> Path:
    S.write_run(d)
    (d / R.PARTS_DIR / "zz.parquet").write_bytes(b"PAR1 not really")
    return d / R.PARTS_DIR / "zz.parquet"


def test_merge_and_compact_name_a_corrupt_part(tmp_path):
    bad = _corrupt(tmp_path / "c")
    _one_error(_invoke(["merge", str(tmp_path / "c"), "--out", str(tmp_path / "m")]),
               f"{bad}: not a readable Parquet file")
    assert not (tmp_path / "m").exists()
    before = sorted((tmp_path / "c" / R.PARTS_DIR).iterdir())
    _one_error(_invoke(["compact", str(tmp_path / "c")]), f"{bad}: not a readable Parquet file")
    assert sorted((tmp_path / "c" / R.PARTS_DIR).iterdir()) == before  # nothing removed


def test_a_view_names_a_corrupt_part(tmp_path):
    bad = _corrupt(tmp_path / "c")
    _one_error(_invoke(VIEWS["summary"](tmp_path / "c", tmp_path)),
               f"{bad}: not a readable Parquet file")


def test_compact_names_a_part_whose_column_type_differs(tmp_path):
    d = tmp_path / "drift"
    rows = _run(d)
    half = len(rows) // 2
    late = rows.iloc[half:].assign(latency_ms=[None if pd.isna(v) else f"{v:.3f}"
                                               for v in rows["latency_ms"].iloc[half:]])
    _rewrite(d, [rows.iloc[:half], late])
    _one_error(_invoke(["compact", str(d)]), f"{d / R.PARTS_DIR / 'p1.parquet'}: column "
               "latency_ms is", str(d / R.PARTS_DIR / "p0.parquet"))


def test_merge_over_rows_without_started_at_is_one_error_line(tmp_path):
    d = tmp_path / "old"
    _rewrite(d, [_run(d).drop(columns=["started_at"])])
    _one_error(_invoke(["merge", str(d), "--out", str(tmp_path / "m")]),
               f"{d}: rows lack columns started_at")


# --------------------------------------------------------------------------- degenerate rows


def _zero_latency(df):
    ok = df.index[df["status"] == "ok"][:4]
    df.loc[ok, "latency_ms"] = 0.0
    df["samples_ms"] = [[0.0] * 5 if i in ok else s for i, s in zip(df.index, df["samples_ms"])]
    return df, 4, "ok with a latency_ms"


def _inf_latency(df):
    """Every ok row's latency infinite; the rows left to show are not ok (fla crashed)."""
    fla = df["backend"] == "fla"
    df.loc[fla, ["status", "latency_ms", "samples_ms"]] = ["crashed", np.nan, None]
    df.loc[~fla, "latency_ms"] = np.inf
    return df, int((~fla).sum()), "ok with a latency_ms"


def _null(column):
    def edit(df):
        df[column] = df[column].astype(object)
        df.loc[df.index[:3], column] = None
        return df, 3, f"3 with a null {column}"
    return edit


#: (view, edit of the rows -> (rows, rows set aside, words of the note))
DEGENERATE = {
    "zero latency": ("summary", _zero_latency),
    "inf latency": ("report", _inf_latency),
    "null model": ("report", _null("model")),
    "null h_qk": ("report", _null("h_qk")),
    "null backend": ("recommend", _null("backend")),
}


@pytest.mark.parametrize("case", list(DEGENERATE))
def test_degenerate_rows_are_set_aside_with_a_note(tmp_path, case):
    view, edit = DEGENERATE[case]
    d = tmp_path / "r"
    rows, n, words = edit(_run(d))
    _rewrite(d, [rows])
    r = _invoke(VIEWS[view](d, tmp_path))
    assert r.exit_code == 0, (r.stdout, r.stderr)
    notes = [ln for ln in r.stdout.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1, r.stdout
    assert notes[0].startswith(f"note: {d}: {n} of {len(rows)} rows set aside: ") and \
        words in notes[0], notes[0]


def test_no_usable_row_is_one_error_line_saying_why(tmp_path):
    d = tmp_path / "r"
    rows = _run(d)
    _rewrite(d, [rows.assign(backend=None)])
    _one_error(_invoke(VIEWS["summary"](d, tmp_path)), f"{d}: no usable rows",
               f"{len(rows)} of {len(rows)} rows set aside")
