"""The row schema's documentation, the results layout ``pandas.read_parquet`` reads, and the
layout labels and ``tp_degree`` of stored rows."""

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from qlabench import config as C
from qlabench import results as R
from qlabench.sweep import label_fits, layout_label, points, tp_degree

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "results"  # rows cut from the kept runs


def test_every_column_is_documented_and_nothing_else():
    assert list(R.FIELDS) and set(R.FIELDS) == set(R.COLUMNS)
    for name, (_unit, meaning) in R.FIELDS.items():
        assert meaning.strip(), name


def test_schema_doc_is_generated_from_the_code():
    doc = (ROOT / "docs/schema.md").read_text()
    assert doc == R.schema_markdown(), \
        "docs/schema.md differs from the code: python -m qlabench.results --schema-md docs/schema.md"
    for c in R.COLUMNS:
        assert f"| `{c}` |" in doc


def test_schema_md_command_writes_the_doc(tmp_path):
    assert R.main(["--schema-md", str(tmp_path / "s.md")]) == 0
    assert (tmp_path / "s.md").read_text() == R.schema_markdown()


def _row(**kw):
    base = {"run_id": "20250101T000000-aaaaaa", "point_index": 0, "backend": "reference",
            "direction": "fwd", "status": "ok", "model": "397B/122B TP8", "tp": "2/8",
            "h_qk": 2, "h_v": 8, "seqlens": [8192] * 4, "layout": "4x8192",
            "point_key": "2/8/d128|8192 8192 8192 8192|bf16", "started_at": "2025-01-01T00:00:00"}
    return {**base, **kw}


def test_pandas_reads_a_results_directory(tmp_path):
    """Rows in parts/, everything else under ``_`` names: pd.read_parquet(OUT) reads the rows."""
    store = R.ResultStore(tmp_path)
    store.append(_row())
    store.append(_row(point_index=1, backend="fla"))
    store.write_meta("20250101T000000-aaaaaa", {"run_id": "x"})
    for d in (R.LOGS_DIR, R.FIGURES_DIR, "_notes"):
        (tmp_path / d).mkdir()
    (tmp_path / R.LOGS_DIR / "worker-1.log").write_text("log")
    (tmp_path / R.FIGURES_DIR / "latency_fwd.png").write_bytes(b"\x89PNG not parquet")
    (tmp_path / "_notes" / "README.md").write_text("notes")
    assert (tmp_path / "_runs" / "20250101T000000-aaaaaa.json").exists()
    assert not (tmp_path / "runs").exists()
    df = pd.read_parquet(tmp_path)
    assert len(df) == 2 and set(df["backend"]) == {"reference", "fla"}
    assert len(R.load(tmp_path)) == 2


def test_load_ignores_non_parquet_files_anywhere(tmp_path):
    R.ResultStore(tmp_path).append(_row())
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a.png").write_bytes(b"\x89PNG")
    (tmp_path / "parts" / "notes.txt").write_text("x")
    (tmp_path / "README.md").write_text("x")
    assert len(R.load(tmp_path)) == 1


def test_committed_results_have_no_metadata_outside_underscore_dirs():
    for parts in (ROOT / "results").glob("**/parts"):
        d = parts.parent
        assert not (d / "runs").exists(), f"{d}: metadata belongs in _runs/"
        stray = [p.name for p in d.iterdir() if p.name not in ("parts",) and
                 not p.name.startswith(("_", ".")) and p.suffix != ".png"]
        assert not stray, f"{d}: {stray} would break pd.read_parquet({d})"
        assert R.load_meta(d), f"{d}: no run metadata found"


def test_committed_results_are_stored_in_todays_schema():
    """The loader does not upgrade rows: every kept run directory is one or more Parquet files of
    exactly :data:`SCHEMA` (read from the files' footers only)."""
    for parts in sorted((ROOT / "results").glob("**/parts")):
        files = R._part_files(parts)
        assert files, f"{parts}: no rows"
        for f in files:
            assert pq.read_schema(f).remove_metadata().equals(R.SCHEMA), f


# ---- layout labels ---------------------------------------------------------------------------

@pytest.mark.parametrize("lens,seed,label", [
    ([32768], None, "1x32768"), ([8192] * 4, None, "4x8192"), ([28672, 4096], None, "2x[28672,4096]"),
    ([1, 63, 65, 130], None, "4x[1,63,65,130]"), ([1000, 3096, 2048, 2048], 42, "4x~2048s42"),
    ([8192], 42, "1x8192"), ([1, 2], 7, "2x~1.5s7")])
def test_layout_label_scheme(lens, seed, label):
    assert layout_label(lens, seed) == label
    assert label_fits(label, lens)


@pytest.mark.parametrize("old,lens", [("8192x4", [8192] * 4), ("28672+4096", [28672, 4096]),
                                      ("32768/8seq", [4096] * 8), ("259/4seq", [1, 63, 65, 130])])
def test_old_labels_do_not_fit_the_scheme(old, lens):
    assert not label_fits(old, lens)


def test_layout_labels_unique_per_point_in_every_config():
    for f in sorted((ROOT / "configs").glob("*.yaml")):
        pts = points(C.load(f))
        labels = {(p.model, p.gate_recipe, p.layout_label) for p in pts}
        assert len(labels) == len(pts), f.name


def test_random_splits_of_different_seeds_get_different_labels():
    s = C.parse({"name": "x", "models": [{"name": "m", "h_qk": 1, "h_v": 2}],
                 "seqlens": [{"total": 8192, "num_seqs": 4, "seed": 42},
                             {"total": 8192, "num_seqs": 4, "seed": 7}]})
    a, b = points(s)
    assert a.layout_label == "4x~2048s42" and b.layout_label == "4x~2048s7"
    assert a.key != b.key and "s42" not in a.key  # keys are built from the lengths, not labels


def test_tp_degree_from_model_names_and_new_rows(tmp_path):
    assert [tp_degree(m) for m in ("397B/122B TP8", "27B TP2", "hk16_hv32", "Sym h32", None)] == \
        [8, 2, None, None, None]
    R.ResultStore(tmp_path).append(_row(tp_degree=None))
    assert pd.read_parquet(tmp_path)["tp_degree"].tolist() == [8]


def test_kept_rows_load_with_unique_labels_and_tp_degree():
    df = R.load(FIX / "h200_fwd", latest=True)
    assert not df.duplicated(R.KEY).any()
    per_model = df.groupby(["model", "backend", "direction"])["layout"].nunique()
    assert (per_model == df.groupby(["model", "backend", "direction"])["point_key"].nunique()).all()
    assert all(label_fits(lab, lens) for lab, lens in zip(df["layout"], df["seqlens"]))
    tp8 = df[df["model"] == "397B/122B TP8"]
    assert len(tp8) and set(tp8["tp_degree"]) == {8} and set(tp8["tp"]) == {"2/8"}
    bwd = R.load(FIX / "h200_bwd", latest=True)
    assert {"2x~4096s42", "8x~4096s42"} <= set(bwd["layout"])
    assert set(zip(bwd["tp"], bwd["tp_degree"])) == {("16/32", 1), ("8/16", 2), ("4/8", 4), ("2/4", 8)}


def test_results_latest_still_works():
    df = R.load(FIX / "h200_fwd")
    assert R.latest(df).equals(R.load(FIX / "h200_fwd", latest=True))


def test_pandas_reads_what_a_run_writes(tmp_path):
    """End to end: rows, run metadata, worker logs and figures of a real run; pandas reads rows."""
    from typer.testing import CliRunner

    from qlabench.cli import app
    cfg = {"name": "t", "models": [{"name": "m TP2", "h_qk": 1, "h_v": 2, "head_dim": 8}],
           "seqlens": [[5], {"total": 9, "num_seqs": 3, "seed": 3}], "directions": ["fwd"],
           "backends": ["reference", "fla"], "reference": {"impl": "chunked", "dtype": "fp64"},
           "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}
    p = tmp_path / "c.yaml"
    p.write_text(__import__("yaml").safe_dump(cfg))
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["run", str(p), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / R.LOGS_DIR).is_dir() and not (out / "logs").exists()
    df = pd.read_parquet(out)
    assert len(df) == 4 and set(df["tp_degree"]) == {2}
    assert set(df["layout"]) == {"1x5", "3x~3s3"}
