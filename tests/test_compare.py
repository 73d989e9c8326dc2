import json

import numpy as np
import pandas as pd
import pytest
import synth_results as S
from typer.testing import CliRunner

from qlabench import compare as Q
from qlabench import results
from qlabench.cli import app


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One synthetic H200 run: 2 models × 4 layouts × 3 backends, 60 samples, ~1% noise."""
    return S.write_run(tmp_path_factory.mktemp("cmp") / "base")


def _json(p):
    return json.loads(p.read_text())


def test_run_against_itself_is_refused_as_the_same_rows(base, tmp_path, capsys):
    rc = Q.compare_cmd(base, base, out=tmp_path / "v.json")
    assert rc == 2
    out = _json(tmp_path / "v.json")
    assert len(out["rows"]) == 24 and {r["verdict"] for r in out["rows"]} == {"same-row"}
    assert all(r["ratio"] is None and "same stored row" in r["reason"] for r in out["rows"])
    assert {r["base_run_id"] for r in out["rows"]} == {r["new_run_id"] for r in out["rows"]} \
        == set(results.load(base)["run_id"])
    cap = capsys.readouterr()
    assert cap.out == ""  # found before the table: no table, no footnotes
    assert cap.err.count("\n") == 1
    assert "every one of the 24 compared pairs is the same stored row" in cap.err


def test_rerun_against_base_is_all_same(base, tmp_path, capsys):
    new = S.copy_scaled(base, tmp_path / "new", {})
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 0
    rows = _json(tmp_path / "v.json")["rows"]
    assert len(rows) == 24 and {r["verdict"] for r in rows} == {"same"}
    assert all(r["ratio"] == pytest.approx(1.0) for r in rows)
    assert "24 same," in capsys.readouterr().out


def test_some_rows_shared_are_flagged_the_others_judged(base, tmp_path):
    # new = base's own fla rows (as a merge would copy them) + re-measured rows of the others
    new = S.copy_scaled(base, tmp_path / "new", {"flashqla": 1.10})
    remeasured = results.load(new)
    for f in (new / "parts").glob("*.parquet"):
        f.unlink()
    kept = results.latest(results.load(base))
    results._write_rows_file(new / "parts", "merge", pd.concat(
        [kept[kept["backend"] == "fla"], remeasured[remeasured["backend"] != "fla"]]))
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 1  # the slower flashqla rows
    by: dict = {}
    for r in _json(tmp_path / "v.json")["rows"]:
        by.setdefault(r["backend"], set()).add(r["verdict"])
    assert by == {"fla": {"same-row"}, "flashqla": {"slower"}, "tilelang": {"same"}}


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


METHOD_CHANGES = [
    ({"timing_mode": "events"}, "timing_mode", "timing_mode graph-batch vs events"),
    ({"l2": "cold"}, "l2", "l2 warm vs cold"),
    ({"gpu_name": "NVIDIA H100 80GB HBM3"}, "gpu_name", "gpu NVIDIA H200 vs NVIDIA H100"),
    ({"recipe_hash": "0123456789ab"}, "recipe_hash", "input recipe "),
    ({"gate_recipe": "zero0.5/seed0"}, "gate_recipe", "gate recipe zero0.25/seed0 vs zero0.5/seed0"),
]


@pytest.mark.parametrize("change,col,word", METHOD_CHANGES, ids=[c for _, c, _ in METHOD_CHANGES])
def test_different_method_gpu_or_recipe_is_incomparable_and_exits_3(base, tmp_path, capsys, change,
                                                                    col, word):
    new = S.copy_scaled(base, tmp_path / "new", {"fla": 1.5}, **change)
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 3
    out = _json(tmp_path / "v.json")
    assert {r["verdict"] for r in out["rows"]} == {"incomparable"}
    assert all(word in r["reason"] and r["differs"] == col for r in out["rows"])
    assert out["summary"]["differs_pairs"] == 24 and out["summary"]["differs"] == {col: 24}
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: method, GPU or recipe differ from the baseline in 24 of 24 pairs: {col} in 24 (e.g. ")
    assert "--allow-incomparable" in err[0] and "Traceback" not in cap.err
    assert "incomparable: method, GPU or recipe differ" in cap.out  # the table is printed too
    # a human who knows: the pairs stay unjudged, the exit code is the other pairs' (none here)
    assert Q.compare_cmd(base, new, allow_incomparable=True) == 0
    assert capsys.readouterr().err == ""


def test_method_change_takes_precedence_over_a_regression_until_allowed(base, tmp_path, capsys):
    """flashqla 10% slower (same method); fla re-timed with per-call events: exit 3 naming the
    slower pairs too; --allow-incomparable: exit 1 for flashqla, fla unjudged."""
    new = S.copy_scaled(base, tmp_path / "new", {"flashqla": 1.10})
    df = results.load(new)
    df.loc[df["backend"] == "fla", "timing_mode"] = "events"
    rewrite(new, df)
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 3
    err = capsys.readouterr().err
    assert "in 8 of 24 pairs: timing_mode in 8" in err and "besides, 8 pairs are slower or broken" in err
    by = {}
    for r in _json(tmp_path / "v.json")["rows"]:
        by.setdefault(r["backend"], set()).add((r["verdict"], r["differs"]))
    assert by == {"fla": {("incomparable", "timing_mode")}, "flashqla": {("slower", "")},
                  "tilelang": {("same", "")}}
    assert Q.compare_cmd(base, new, allow_incomparable=True) == 1


def test_same_method_and_gpu_model_keep_exit_0_and_1(base, tmp_path):
    """Another H200 (gpu_uuid) of another campaign is the same GPU model: 0 or 1, never 3."""
    other = {"gpu_uuid": "GPU-2", "campaign_id": "c9"}
    same = S.copy_scaled(base, tmp_path / "same", {}, **other)
    assert Q.compare_cmd(base, same, out=tmp_path / "v.json") == 0
    out = _json(tmp_path / "v.json")
    assert out["summary"]["differs_pairs"] == 0 and {r["differs"] for r in out["rows"]} == {""}
    slow = S.copy_scaled(base, tmp_path / "slow", {"fla": 1.10}, **other)
    assert Q.compare_cmd(base, slow) == 1


def test_cli_exit_3_and_allow_incomparable(base, tmp_path):
    new = S.copy_scaled(base, tmp_path / "new", {"fla": 2.0}, gpu_name="NVIDIA H100 80GB HBM3")
    r = CliRunner().invoke(app, ["compare", str(base), str(new)])
    assert r.exit_code == 3 and r.stderr.startswith("error: method, GPU or recipe differ"), r.output
    assert len(r.stderr.strip().splitlines()) == 1
    r = CliRunner().invoke(app, ["compare", str(base), str(new), "--allow-incomparable"])
    assert r.exit_code == 0 and r.stderr == "", r.output
    h = CliRunner().invoke(app, ["compare", "--help"], env={"COLUMNS": "200"})
    assert h.exit_code == 0
    text = " ".join(h.output.split())
    for code in ("2 bad input", "3 method, GPU or recipe differ from the baseline", "1 a row is slower",
                 "0 otherwise", "--allow-incomparable"):
        assert code in text, code


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


@pytest.mark.parametrize("status", ["unavailable", "unsupported"])
def test_ok_turned_unavailable_or_unsupported_is_broken_and_fails(base, tmp_path, capsys, status):
    new = S.copy_scaled(base, tmp_path / "new", {})
    df = results.load(new)
    df.loc[df["backend"] == "flashqla", ["status", "reason"]] = [status, f"why {status}"]
    rewrite(new, df)
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 1
    rows = _json(tmp_path / "v.json")["rows"]
    bad = [r for r in rows if r["verdict"] == "broken"]
    assert len(bad) == 8 and {r["backend"] for r in bad} == {"flashqla"}
    assert all(f"was ok, now {status} (why {status})" in r["reason"] for r in bad)
    out = capsys.readouterr().out
    assert out.count("REGRESSION flashqla fwd") == 8 and "8 broken" in out


def test_ok_row_missing_from_new_is_broken(base, tmp_path):
    # flashqla measured at the first model's points only: its other 4 rows went missing
    new = S.write_run(tmp_path / "new", run_id="r2", started_at="2025-01-02T00:00:00")
    df = results.load(new)
    rewrite(new, df[~((df["backend"] == "flashqla") & (df["model"] == S.MODELS[1][0]))])
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 1
    out = _json(tmp_path / "v.json")
    bad = [r for r in out["rows"] if r["verdict"] == "broken"]
    assert len(bad) == 4 and {r["backend"] for r in bad} == {"flashqla"}
    assert all("now missing" in r["reason"] and r["new_run_id"] is None for r in bad)
    assert out["summary"]["only_base"] == 0


def test_a_label_absent_from_new_is_bad_input_naming_the_pairing_options(base, tmp_path, capsys):
    """A label NEW holds no row of (another run's labels, e.g. tilelang@prev against tilelang)
    is not judged broken at every point: exit 2, one line naming it and the options."""
    new = S.write_run(tmp_path / "new", run_id="r2", started_at="2025-01-02T00:00:00",
                      backends=("fla", "tilelang"))
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "'flashqla'" in err and "--base-backend flashqla --new-backend" in err
    assert "fla, tilelang" in err and not (tmp_path / "v.json").exists()
    # a label only NEW holds is not an error (a backend added to the sweep)
    assert Q.compare_cmd(new, base) == 0


def test_points_the_new_side_did_not_measure_are_only_base(base, tmp_path):
    new = S.write_run(tmp_path / "new", run_id="r2", started_at="2025-01-02T00:00:00",
                      layouts=S.LAYOUTS[:2])
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 0
    out = _json(tmp_path / "v.json")
    assert len(out["rows"]) == 12 and out["summary"]["only_base"] == 12
    assert out["summary"]["broken"] == 0


def test_changed_calls_per_sample_is_shown(tmp_path, capsys):
    b = S.write_run(tmp_path / "b", extra={"calls_per_sample": 8})
    n = S.write_run(tmp_path / "n", run_id="r2", started_at="2025-01-02T00:00:00", seed=3,
                    extra={"calls_per_sample": 32})
    assert Q.compare_cmd(b, n, out=tmp_path / "v.json") == 0
    rows = _json(tmp_path / "v.json")["rows"]
    assert all(r["base_calls_per_sample"] == 8 and r["new_calls_per_sample"] == 32 for r in rows)
    # how the samples were taken is shown apart from the reasons, not as one
    assert all(r["reason"] == "" for r in rows)
    out = capsys.readouterr().out
    assert "every row: dir fwd; calls 8→32" in out and "calls_per_sample 8" not in out
    same = S.write_run(tmp_path / "s", run_id="r3", started_at="2025-01-03T00:00:00", seed=4,
                       extra={"calls_per_sample": 8})
    assert Q.compare_cmd(b, same, out=tmp_path / "v2.json") == 0
    assert not any("calls_per_sample" in r["reason"] for r in _json(tmp_path / "v2.json")["rows"])


def test_pairing_is_stated_per_pair_and_in_the_summary(tmp_path, capsys):
    g = {"gpu_uuid": "GPU-1", "campaign_id": "c1"}
    b = S.write_run(tmp_path / "b", extra=g)
    n = S.write_run(tmp_path / "n", run_id="r2", started_at="2025-01-02T00:00:00", seed=3, extra=g)
    assert Q.compare_cmd(b, n, out=tmp_path / "v.json") == 0
    out = _json(tmp_path / "v.json")
    assert all(r["pairing"] == "" and r["same_gpu"] and r["same_campaign"] for r in out["rows"])
    assert out["summary"]["pairing"] == "same GPU and campaign: 24 pairs"
    assert "pairing of the 24 ratios: same GPU and campaign: 24 pairs" in capsys.readouterr().out
    # another campaign on the same GPU, fla rows throttled; rows without ids: unknown
    t = S.write_run(tmp_path / "t", run_id="r3", started_at="2025-01-03T00:00:00", seed=4,
                    extra={"gpu_uuid": "GPU-1", "campaign_id": "c2"})
    df = results.load(t)
    df.loc[df["backend"] == "fla", "throttled"] = True
    rewrite(t, df)
    Q.compare_cmd(b, t, out=tmp_path / "v2.json")
    out = _json(tmp_path / "v2.json")
    assert {r["pairing"] for r in out["rows"] if r["backend"] == "fla"} == {"cross-campaign, throttled"}
    assert {r["pairing"] for r in out["rows"] if r["backend"] != "fla"} == {"cross-campaign"}
    assert out["summary"]["pairing"] == "cross-campaign: 24 of 24 pairs; throttled: 8"
    Q.compare_cmd(S.write_run(tmp_path / "old"), t, out=tmp_path / "v3.json")
    assert _json(tmp_path / "v3.json")["summary"]["pairing"] == (
        "cross-GPU: 24 of 24 pairs (24 unknown); cross-campaign: 24 of 24 pairs (24 unknown); "
        "throttled: 8")


def rewrite(d, df):
    """Replace a results directory's rows by ``df`` (one Parquet file)."""
    for f in (d / "parts").glob("*.parquet"):
        f.unlink()
    results._write_rows_file(d / "parts", "rows", df)


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
            "schema": (foreign, "rows lack columns"), "disjoint": (other, "nothing in common")}


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


def test_a_backend_that_broke_after_an_ok_row_in_the_same_directory_is_broken(base, tmp_path):
    """The new side holds the base's rows and a later run where flashqla is unavailable (a
    --resume or a merge into one directory): its newest row per key is judged."""
    new = S.copy_scaled(base, tmp_path / "new", {})
    df = results.load(new)
    later = df[df["backend"] == "flashqla"].copy()
    later[["status", "reason", "run_id", "started_at"]] = ["unavailable", "gone", "r9",
                                                           "2030-01-01T00:00:00"]
    rewrite(new, pd.concat([results.load(base), later], ignore_index=True))
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 1
    bad = [r for r in _json(tmp_path / "v.json")["rows"] if r["verdict"] == "broken"]
    assert len(bad) == 8 and {r["backend"] for r in bad} == {"flashqla"}


def test_base_reads_before_new_everywhere(base, tmp_path, capsys):
    new = S.copy_scaled(base, tmp_path / "new", {"flashqla": 1.10})
    assert Q.compare_cmd(base, new) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{base} → {new} (threshold 5%")
    head = next(ln for ln in out if ln.startswith("model"))
    assert head.index("base ms") < head.index("new ms") < head.index("new/base")
    # two labels: the title and the backend read A → B
    assert Q.compare_cmd(base, base, base_backend="fla", new_backend="tilelang") == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{base}: fla → tilelang (threshold") and "backend fla → tilelang" in out


def test_a_label_dropped_from_the_sweep_is_missing_once_not_forever(base, tmp_path):
    """A CI baseline that keeps every earlier run: once a run without label ``fla`` has joined it,
    the next run without ``fla`` is judged (exit 0), not refused for a label the sweep dropped;
    against a baseline whose newest run still has it, its absence is still refused (exit 2)."""
    def without_fla(src, dst, run_id, started_at):
        out = S.copy_scaled(src, dst, {}, run_id=run_id, started_at=started_at)
        df = results.load(out)
        for f in (out / "parts").glob("*.parquet"):
            f.unlink()
        results._write_rows_file(out / "parts", "rows", df[df["backend"] != "fla"])
        return out

    first = without_fla(base, tmp_path / "first", "20250103T000000-cccccc", "2025-01-03T00:00:00")
    assert Q.compare_cmd(base, first) == 2
    history = tmp_path / "history"
    results.merge(history, [base, first], mix_sweeps=True)
    second = without_fla(base, tmp_path / "second", "20250104T000000-dddddd", "2025-01-04T00:00:00")
    assert Q.compare_cmd(history, second) == 0


def test_a_backend_version_change_is_shown(base, tmp_path, capsys):
    """A new library version is what CI measures after an upgrade: judged as usual (exit 1 for
    the slowdown), with the change named in the output and in every --out row."""
    new = S.copy_scaled(base, tmp_path / "new", {"fla": 2.0})
    S.restamp(new, backend_version="9.9.9")
    assert Q.compare_cmd(base, new, out=tmp_path / "v.json") == 1
    out = capsys.readouterr().out
    assert "version fla:" in out and "→ 9.9.9" in out
    rows = _json(tmp_path / "v.json")["rows"]
    assert {r["new_version"] for r in rows} == {"9.9.9"} and None not in {r["base_version"] for r in rows}
