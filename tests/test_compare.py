import json

import numpy as np
import pandas as pd
import pytest
import synth_results as S
from typer.testing import CliRunner

from qlabench import compare as Q
from qlabench.cli import app


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One synthetic H200 run: 2 models × 4 layouts × 3 backends, 60 samples, ~1% noise."""
    return S.write_run(tmp_path_factory.mktemp("cmp") / "base")


def _json(p):
    return json.loads(p.read_text())


def test_run_against_itself_is_all_same(base, tmp_path, capsys):
    rc = Q.compare_cmd(base, base, out=tmp_path / "v.json")
    assert rc == 0
    out = _json(tmp_path / "v.json")
    assert len(out["rows"]) == 24 and {r["verdict"] for r in out["rows"]} == {"same"}
    assert all(r["ratio"] == pytest.approx(1.0) for r in out["rows"])
    assert "24 same" in capsys.readouterr().out


def test_one_backend_ten_percent_slower_fails_naming_exactly_those_rows(base, tmp_path, capsys):
    new = S.copy_scaled(base, tmp_path / "new", {"fla": 1.10})
    rc = Q.compare_cmd(base, new, out=tmp_path / "v.json")
    assert rc == 1
    rows = _json(tmp_path / "v.json")["rows"]
    slower = {(r["point_key"], r["backend"], r["direction"]) for r in rows if r["verdict"] == "slower"}
    expected = {(r["point_key"], r["backend"], r["direction"]) for r in rows if r["backend"] == "fla"}
    assert slower == expected and len(slower) == 8
    assert all(r["verdict"] == "same" for r in rows if r["backend"] != "fla")
    assert all(r["ratio"] == pytest.approx(1.10) and r["p_value"] < 1e-6 and r["ratio_lo"] > 1.05
               for r in rows if r["backend"] == "fla")
    text = capsys.readouterr().out
    assert text.count("REGRESSION fla fwd") == 8 and "REGRESSION flashqla" not in text


def test_one_percent_slower_with_fresh_noise_passes(base, tmp_path):
    # an independent re-run (new noise draw) 1% slower everywhere: significant, but within 5%
    new = S.write_run(tmp_path / "new", run_id="r2", started_at="2025-01-02T00:00:00", seed=7,
                      scale={b: 1.01 for b in S.BACKENDS})
    assert Q.compare_cmd(base, new, out=tmp_path / "v.csv") == 0
    df = pd.read_csv(tmp_path / "v.csv")
    assert set(df["verdict"]) == {"same"} and df["ratio"].between(0.98, 1.04).all()


def test_noise_only_rerun_has_no_false_alarm(base, tmp_path):
    new = S.write_run(tmp_path / "new", run_id="r2", started_at="2025-01-02T00:00:00", seed=11,
                      noise=0.03)
    assert Q.compare_cmd(base, new) == 0


def test_faster_is_reported_and_passes(base, tmp_path):
    new = S.copy_scaled(base, tmp_path / "new", {"tilelang": 0.8})
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 0
    rows = _json(tmp_path / "v.json")["rows"]
    assert {r["verdict"] for r in rows if r["backend"] == "tilelang"} == {"faster"}


def test_slow_but_within_threshold_or_not_significant_is_same():
    rng = np.random.default_rng(0)
    a = {"status": "ok", "samples_ms": list(1 + 0.01 * rng.standard_normal(50))}
    within = {"status": "ok", "samples_ms": list(np.array(a["samples_ms"]) * 1.04)}
    assert Q.judge(a, within)["verdict"] == "same"
    # 20% slower median but samples too spread to tell (p >= alpha): not a regression
    wide = {"status": "ok", "samples_ms": list(1.2 + 0.8 * rng.standard_normal(6))}
    j = Q.judge(a, wide)
    assert j["verdict"] in ("same", "incomparable") and j["verdict"] != "slower"


def test_too_few_samples_is_incomparable():
    a = {"status": "ok", "samples_ms": [1.0, 1.01, 0.99]}
    b = {"status": "ok", "samples_ms": [2.0, 2.01, 1.99]}
    j = Q.judge(a, b, alpha=0.01)
    assert j["verdict"] == "incomparable" and "too few samples" in j["reason"]
    assert j["ratio"] == pytest.approx(2.0)


@pytest.mark.parametrize("change,word", [
    ({"timing_mode": "events"}, "timing_mode graph-batch vs events"),
    ({"gpu_name": "NVIDIA H100 80GB HBM3"}, "gpu NVIDIA H200 vs NVIDIA H100"),
])
def test_different_method_or_gpu_is_incomparable(base, tmp_path, change, word):
    new = S.copy_scaled(base, tmp_path / "new", {"fla": 1.5}, **change)
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 0  # never a regression
    rows = _json(tmp_path / "v.json")["rows"]
    assert {r["verdict"] for r in rows} == {"incomparable"}
    assert all(word in r["reason"] for r in rows)


def test_ok_turned_incorrect_is_broken_and_fails(base, tmp_path):
    new = S.write_run(tmp_path / "new", run_id="r2", started_at="2025-01-02T00:00:00",
                      status={"flashqla": "incorrect"})
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 1
    rows = _json(tmp_path / "v.json")["rows"]
    bad = [r for r in rows if r["backend"] == "flashqla"]
    assert {r["verdict"] for r in bad} == {"broken"}
    assert all("now incorrect" in r["reason"] for r in bad)


def test_status_not_ok_on_the_base_side_is_incomparable(base, tmp_path):
    old = S.write_run(tmp_path / "old", run_id="r0", started_at="2024-12-31T00:00:00",
                      status={"flashqla": "unavailable"})
    assert Q.compare_cmd(old, base, out=tmp_path / "v.json") == 0
    rows = _json(tmp_path / "v.json")["rows"]
    bad = [r for r in rows if r["backend"] == "flashqla"]
    assert {r["verdict"] for r in bad} == {"incomparable"}
    assert all("base status unavailable" in r["reason"] for r in bad)


def test_latest_row_per_key_is_used(base, tmp_path):
    # the new dir holds an older 10%-slower run and a later normal one: the later wins
    d = tmp_path / "new"
    S.copy_scaled(base, d, {"fla": 1.10}, run_id="r1", started_at="2025-01-02T00:00:00")
    S.copy_scaled(base, d, {}, run_id="r2", started_at="2025-01-03T00:00:00")
    assert Q.compare_cmd(base, d) == 0


def _bad_inputs(base, tmp):
    empty = tmp / "empty"
    (empty / "parts").mkdir(parents=True)
    foreign = tmp / "foreign.parquet"
    pd.DataFrame({"x": [1.0], "backend": ["fla"]}).to_parquet(foreign)
    other = S.write_run(tmp / "other", layouts=[[77]])
    return {"missing": (tmp / "nope", "no such file"), "empty": (empty, "no result rows"),
            "schema": (foreign, "missing column"), "disjoint": (other, "nothing in common")}


def test_bad_inputs_exit_2_with_a_one_line_message(base, tmp_path, capsys):
    for name, (path, word) in _bad_inputs(base, tmp_path).items():
        rc = Q.compare_cmd(base, path)
        err = capsys.readouterr().err
        assert rc == 2, name
        assert word in err and str(path) in err and "Traceback" not in err, (name, err)
        assert len(err.strip().splitlines()) == 1, err
    assert Q.compare_cmd(base, base, out=tmp_path / "v.txt") == 2
    assert "--out must end in .json or .csv" in capsys.readouterr().err


def test_cli_exit_codes(base, tmp_path):
    new = S.copy_scaled(base, tmp_path / "new", {"flashqla": 1.10})
    r = CliRunner().invoke(app, ["compare", str(base), str(new), "--out", str(tmp_path / "v.json")])
    assert r.exit_code == 1 and "REGRESSION flashqla" in r.output
    # a looser threshold lets the same data pass
    r = CliRunner().invoke(app, ["compare", str(base), str(new), "--threshold", "0.2"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["compare", str(base), str(tmp_path / "missing")])
    assert r.exit_code == 2 and "Traceback" not in r.output
