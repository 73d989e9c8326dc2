"""Library versions as a sweep axis: backend entries with a label and an environment of their own
(``python`` / ``pythonpath``, ``${VAR}`` expanded at run time), each run in a worker of its own;
rows keep label (``backend``) and library (``backend_name``) apart; compare pairs two labels."""

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import synth_results as S
import yaml
from typer.testing import CliRunner

from qlabench import backends as B
from qlabench import config as C
from qlabench import plots, results, runner
from qlabench import reproduce as R
from qlabench.cli import app
from qlabench.compare import compare_frames
from qlabench.supervisor import worker_environment

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "versions", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
        "seqlens": [[5], [9]], "directions": ["fwd"],
        "reference": {"impl": "chunked", "dtype": "fp64"},
        "timing": {"min_samples": 10, "max_samples": 12, "budget_s": 0.2}, "row_timeout_s": 120}


def _validate(tmp_path, backends) -> tuple[int, str]:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({**BASE, "backends": backends}))
    r = CliRunner().invoke(app, ["validate", str(p)])
    return r.exit_code, r.output


def test_entries_plain_and_mapping_with_defaults():
    s = C.parse({**BASE, "backends": [
        "reference", {"name": "flashinfer", "label": "flashinfer@0.7.4",
                      "pythonpath": "${QLABENCH_FLASHINFER07_PATH}"},
        {"name": "tilelang", "python": "${VENV}/bin/python"}, {"name": "fla", "label": "fla"}]})
    e = s.entries()
    assert list(e) == ["reference", "flashinfer@0.7.4", "tilelang", "fla"]
    assert e["reference"].name == "reference" and not e["reference"].own_environment
    assert e["flashinfer@0.7.4"].name == "flashinfer"
    assert e["flashinfer@0.7.4"].pythonpath == "${QLABENCH_FLASHINFER07_PATH}"  # expanded at run time
    assert e["tilelang"].label == "tilelang" and e["tilelang"].own_environment
    # plain entries dump as names (stored sweep dumps, hence campaigns, stay as they were)
    dump = s.model_dump(mode="json")["backends"]
    assert dump[0] == "reference" and dump[3] == "fla"
    assert dump[1] == {"name": "flashinfer", "label": "flashinfer@0.7.4",
                       "pythonpath": "${QLABENCH_FLASHINFER07_PATH}"}
    assert C.Sweep.model_validate(s.model_dump(mode="json")) == s
    assert C.parse({**BASE, "backends": ["reference", "fla"]}).model_dump(mode="json")[
        "backends"] == ["reference", "fla"]
    # --backends: a label of the sweep keeps its entry, a registry name is a plain entry
    picked = s.entries(["flashinfer@0.7.4", "flashqla"])
    assert picked["flashinfer@0.7.4"].pythonpath and picked["flashqla"].name == "flashqla"


@pytest.mark.parametrize("backends, field, words", [
    (["reference", "reference"], "backends:", "duplicate backend label(s) reference"),
    ([{"name": "fla", "label": "x"}, {"name": "reference", "label": "x"}], "backends:",
     "duplicate backend label(s) x"),
    ([{"name": "reference", "lable": "r@1"}], "backends[0].lable", "Extra inputs"),
    ([{"name": "flashinfr", "label": "fi"}], "backends[0].name", "unknown backend 'flashinfr'"),
    (["reference", "flashinfr"], "backends[1].name", "unknown backend 'flashinfr'"),
    ([{"name": "reference", "label": ""}], "backends[0].label", "label ''"),
    ([{"name": "reference", "label": "a|b"}], "backends[0].label", "label 'a|b'"),
    ([{"name": "reference", "label": "x/y"}], "backends[0].label", "label 'x/y'"),
    ([{"name": "reference", "label": "r2", "pythonpath": "$HOME/x"}], "backends[0].pythonpath",
     "${NAME}"),
    ([{"name": "reference", "label": "r2", "python": ""}], "backends[0].python", "at least 1"),
])
def test_bad_entries_exit_2_naming_the_field(tmp_path, backends, field, words):
    code, out = _validate(tmp_path, backends)
    assert code == 2, out
    line = next((ln for ln in out.splitlines() if ln.strip().startswith(field)), "")
    assert words in line, out
    assert "Traceback" not in out


def test_var_expansion_and_label_versions():
    assert C.expand("${A}/x:${B}", {"A": "/a", "B": "/b"}) == ("/a/x:/b", "")
    assert C.expand("${A}/x", {}) == (None, "A is not set")
    assert C.expand("${A}:${B}", {"A": ""})[1] == "A, B are not set"
    assert C.label_version_problem("flashinfer@0.7.4", "0.7.4") == ""
    assert C.label_version_problem("flashinfer@0.7", "0.7.4.post1") == ""
    assert C.label_version_problem("tilelang@old", "0.1.9") == ""  # not a version: not checked
    assert C.label_version_problem("fla", "0.6.0") == ""
    assert "imports 0.6.13" in C.label_version_problem("flashinfer@0.7.4", "0.6.13")
    assert C.label_version_problem("flashinfer@0.7", "0.71.0")  # 0.7 does not prefix 0.71


def test_worker_environment_is_asked_in_that_environment(tmp_path, monkeypatch):
    alt = tmp_path / "alt"
    alt.mkdir()
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    monkeypatch.setenv("ALT", str(alt))
    e = C.BackendEntry.model_validate({"name": "reference", "label": "r@alt",
                                       "pythonpath": "${ALT}"})
    w, avail, version = worker_environment(e)
    assert avail == (True, "") and version.startswith("torch-")
    assert w.env == {"PYTHONPATH": f"{alt}:/inherited"} and w.python == sys.executable
    assert w.sys_path.index(str(alt)) < w.sys_path.index("/inherited")
    # the interpreter named by `python` is the one asked (a wrapper that leaves a mark)
    mark = tmp_path / "mark"
    py = tmp_path / "py"
    py.write_text(f"#!/bin/sh\necho asked >> {mark}\nexec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    monkeypatch.setenv("PY", str(py))
    w, avail, _ = worker_environment(C.BackendEntry.model_validate(
        {"name": "reference", "label": "r2", "python": "${PY}"}))
    assert avail[0] and w.python == str(py) and mark.read_text() == "asked\n"
    for entry, words in (({"pythonpath": "${NOPE_UNSET}"}, "NOPE_UNSET is not set"),
                         ({"pythonpath": str(tmp_path / "missing")}, "no such directory"),
                         ({"python": str(tmp_path / "nopython")}, "not an executable file"),
                         ({"python": "${NOPE_UNSET}/bin/python"}, "NOPE_UNSET is not set")):
        w, (ok, why), version = worker_environment(C.BackendEntry.model_validate(
            {"name": "reference", "label": "r3", **entry}))
        assert w is None and not ok and words in why and "r3" in why
        assert version == "unavailable"
    # the availability check runs there: a backend that cannot import there is unavailable
    (alt / "torch").mkdir()
    (alt / "torch" / "__init__.py").write_text("raise ImportError('not this torch')\n")
    w, (ok, why), _ = worker_environment(e)
    assert w is None and not ok and "not this torch" in why


def test_versioned_entries_run_in_their_own_worker_next_to_plain_ones(tmp_path, monkeypatch):
    alt = tmp_path / "alt"
    alt.mkdir()
    mark = tmp_path / "started"
    # imported at start-up by every interpreter that has `alt` on PYTHONPATH
    (alt / "sitecustomize.py").write_text(
        f"import sys\nopen({str(mark)!r}, 'a').write(' '.join(sys.argv) + '\\n')\n")
    monkeypatch.setenv("QLABENCH_TEST_ALT", str(alt))
    monkeypatch.delenv("QLABENCH_TEST_UNSET", raising=False)
    s = C.parse({**BASE, "backends": [
        "reference",
        {"name": "reference", "label": "reference@alt", "pythonpath": "${QLABENCH_TEST_ALT}"},
        {"name": "reference", "label": "reference@gone", "pythonpath": "${QLABENCH_TEST_UNSET}"},
        {"name": "reference", "label": "reference@9.9", "pythonpath": "${QLABENCH_TEST_ALT}"}]})
    out = tmp_path / "out"
    summary = runner.run(s, out, log=lambda m: None)
    df = results.load(out).set_index(["backend", "point_index"])
    assert summary.counts == {"ok": 4, "unavailable": 4}
    for i in (0, 1):
        assert df.loc[("reference", i), "status"] == "ok"
        alt_row = df.loc[("reference@alt", i)]
        assert alt_row["status"] == "ok" and alt_row["backend_name"] == "reference"
        assert alt_row["backend_version"] == df.loc[("reference", i), "backend_version"]
        gone = df.loc[("reference@gone", i)]
        assert gone["status"] == "unavailable" and "QLABENCH_TEST_UNSET is not set" in gone["reason"]
        v = df.loc[("reference@9.9", i)]
        assert v["status"] == "unavailable" and "asks for version 9.9" in v["reason"]
    # the probe and one spawned worker started with the entry's PYTHONPATH; the plain entries'
    # worker did not (it leaves no mark)
    started = mark.read_text().splitlines()
    assert sum("--multiprocessing-fork" in ln for ln in started) == 1, started
    logs = list((out / results.LOGS_DIR).glob("*reference@alt*"))
    assert len(logs) == 1 and f"sys.path ['', '{alt}'" in logs[0].read_text()  # the worker imports there
    assert not any(str(alt) in p.read_text() for p in (out / results.LOGS_DIR).glob("*") if p not in logs)
    meta = next(iter(results.load_meta(out).values()))
    assert meta["environments"]["reference@alt"]["PYTHONPATH"].startswith(str(alt))
    assert meta["backend_names"]["reference@alt"] == "reference"

    # resume keeps the two labels of one backend apart: both ok rows are done, the
    # unavailable ones are tried again
    again = runner.run(s, out, resume=True, log=lambda m: None)
    assert again.skipped_done == 4 and again.counts == {"unavailable": 4}

    # two labels in one directory, through the CLI
    v = tmp_path / "v.json"
    r = CliRunner().invoke(app, ["compare", str(out), "--base-backend", "reference",
                                 "--new-backend", "reference@alt", "--threshold", "100",
                                 "--out", str(v)])
    assert r.exit_code == 0, r.output
    got = json.loads(v.read_text())
    assert len(got["rows"]) == 2 and got["summary"]["pairs"] == 2
    assert {x["backend"] for x in got["rows"]} == {"reference → reference@alt"}
    assert {x["verdict"] for x in got["rows"]} <= {"same", "faster"}
    assert {(x["base_backend"], x["new_backend"]) for x in got["rows"]} == {("reference",
                                                                             "reference@alt")}
    assert all(x["pairing"] == "" for x in got["rows"])  # one run, one device, one campaign
    r = CliRunner().invoke(app, ["compare", str(out), "--base-backend", "reference",
                                 "--new-backend", "reference@nope"])
    assert r.exit_code == 2 and "no rows of backend 'reference@nope'" in r.output
    r = CliRunner().invoke(app, ["compare", str(out), "--base-backend", "reference"])
    assert r.exit_code == 2


def test_compare_two_labels_prints_regressions_and_labels_cross_campaign_pairs(tmp_path):
    bes = ("fla", "flashinfer@0.6.13", "flashinfer@0.7.4")
    rows = S.make_rows("20261201T000000-aaaaaa", "2026-12-01T00:00:00", backends=bes,
                       scale={"flashinfer@0.7.4": 1.5}, extra={"gpu_uuid": "GPU-1"})
    for r in rows:
        r["backend_name"] = r["backend"].split("@")[0]
        r["campaign_id"] = "c-old" if r["backend"] == "flashinfer@0.6.13" else "c-new"
    d = S.write_rows(tmp_path / "d", rows)
    r = CliRunner().invoke(app, ["compare", str(d), "--base-backend", "flashinfer@0.6.13",
                                 "--new-backend", "flashinfer@0.7.4"])
    assert r.exit_code == 1, r.output
    n = len(S.MODELS) * len(S.LAYOUTS)
    assert r.output.count("REGRESSION flashinfer@0.6.13 → flashinfer@0.7.4 fwd") == n
    assert r.output.count("[cross-campaign]") == n and f"cross-campaign: {n} of {n}" in r.output
    # the other way round: improvements, exit 0
    r = CliRunner().invoke(app, ["compare", str(d), "--base-backend", "flashinfer@0.7.4",
                                 "--new-backend", "flashinfer@0.6.13"])
    assert r.exit_code == 0 and r.output.count("IMPROVEMENT flashinfer@0.7.4 → flashinfer@0.6.13") == n
    # points the new label has no row for are not judged
    df = results.load(d)
    part = df[~((df["backend"] == "flashinfer@0.7.4") & (df["point_index"] > 0))]
    t, summ = compare_frames(part, part, base_backend="flashinfer@0.6.13",
                             new_backend="flashinfer@0.7.4")
    assert len(t) == 1 and summ["only_base"] == n - 1 and summ["slower"] == 1


def test_stored_rows_resume_by_label_version_and_params(tmp_path):
    row = {c: None for c in results.COLUMNS}
    row.update(run_id="r1", point_index=0, backend="fla", backend_name="fla", direction="fwd",
               status="ok", point_key="2/8/d128|8192|bf16", backend_version="0.6.0",
               backend_params="{}", recipe_hash="h")
    store = results.ResultStore(tmp_path)
    store.append(row)
    store.append({**row, "run_id": "r2", "backend": "fla@0.5"})
    df = results.load(tmp_path).set_index("run_id")
    assert df.loc["r1", "backend_name"] == "fla" and df.loc["r2", "backend_name"] == "fla"
    assert df.loc["r2", "backend"] == "fla@0.5"
    # resume keys of stored rows: the label (= the name for plain entries), the version and the
    # parameters
    assert set(store.done_keys()) == {
        ("2/8/d128|8192|bf16", "fla", "fwd", "0.6.0", "{}"),
        ("2/8/d128|8192|bf16", "fla@0.5", "fwd", "0.6.0", "{}")}


def test_kept_results_load_with_backend_name_equal_to_backend():
    """Rows of plain entries (written before labels existed, or plain since) carry their name as
    both; the labelled FlashInfer 0.7.4 rows carry the library."""
    df = results.load(ROOT / "tests" / "fixtures" / "results" / "h200_fwd", latest=True)
    plain = ~df["backend"].str.contains("@", regex=False)
    assert plain.sum() and (df.loc[plain, "backend_name"] == df.loc[plain, "backend"]).all()
    fi = df[df["backend"] == "flashinfer@0.7.4"]
    assert len(fi) == 6 and (fi["backend_name"] == "flashinfer").all()  # 2 models x 3 layouts
    assert (fi["backend_version"] == "0.7.4").all()


def test_two_labels_of_one_library_get_their_own_colours_and_reproduce_columns(tmp_path):
    df = pd.DataFrame({"backend": ["flashinfer@0.7.4", "fla", "flashinfer"],
                       "backend_name": ["flashinfer", "fla", "flashinfer"]})
    pal = plots.palette(df)
    assert list(pal) == ["fla", "flashinfer", "flashinfer@0.7.4"]
    assert pal["flashinfer"] == B.backend_class("flashinfer").color
    assert pal["flashinfer@0.7.4"] not in (None, pal["flashinfer"])

    pub = R.load_published("flashqla-h200", "fwd")
    rows = []
    for i, p in enumerate(pub.table.head(3).itertuples(index=False)):
        for b, lib, f in (("fla", "fla", 1.0), ("flashinfer", "flashinfer", 1.0),
                          ("flashinfer@0.7.4", "flashinfer", 0.5), ("flashqla", "flashqla", 1.0)):
            rows.append(dict(run_id="r", point_index=i, backend=b, backend_name=lib,
                             direction="fwd", status="ok", reason="",
                             latency_ms=getattr(p, f"{lib}_ms") * f,
                             h_qk=p.h_qk, h_v=p.h_v, head_dim=128, seqlens=list(p.key[2]),
                             point_key=f"{p.h_qk}/{p.h_v}/d128|{' '.join(map(str, p.key[2]))}|bf16",
                             started_at="2026-12-01T00:00:00", gpu_name="NVIDIA H200",
                             timing_mode="graph-batch", gate_zero_frac=0.25, model=p.model,
                             backend_version="0.7.4" if "@" in b else "0.6.13"))
    rep = R.compare_rows(pub, pd.DataFrame(rows), {}, "test")
    t = rep.table
    assert t.loc[:2, "flashinfer_ratio"].round(6).tolist() == [1.0] * 3
    assert t.loc[:2, "flashinfer@0.7.4_ratio"].round(6).tolist() == [0.5] * 3
    assert (t["flashinfer@0.7.4_pub_ms"] == t["flashinfer_pub_ms"]).all()
    assert rep.summary["backends"]["flashinfer@0.7.4"]["ok"] == 3
    assert "flashinfer@0.7.4 pub → meas ms (ratio)" in R._point_head(pub, t)
    R.write(rep, tmp_path)
    md = (tmp_path / "reproduce_flashqla-h200_fwd.md").read_text()
    assert "| flashinfer@0.7.4 | 3/171 |" in md and "| flashinfer | 3/171 |" in md


def test_cli_gpu_config_on_cpu_gives_unavailable_rows_for_every_label(tmp_path, monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    cfg = tmp_path / "fi.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "backends": [
        "reference", {"name": "flashinfer", "label": "flashinfer@0.6.13"},
        {"name": "flashinfer", "label": "flashinfer@0.7.4", "pythonpath": "${QLABENCH_TEST_FI07}"}]}))
    monkeypatch.setenv("QLABENCH_TEST_FI07", str(tmp_path))
    r = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o"), "--no-plot"])
    assert r.exit_code == 0, r.output
    df = results.load(tmp_path / "o").set_index(["backend", "point_index"])
    assert set(df.loc["reference", "status"]) == {"ok"}
    for b in ("flashinfer@0.6.13", "flashinfer@0.7.4"):
        assert set(df.loc[b, "status"]) == {"unavailable"}
        assert df.loc[b, "reason"].str.contains("no CUDA device").all()
        assert set(df.loc[b, "backend_name"]) == {"flashinfer"}
