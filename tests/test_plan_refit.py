"""qlabench_tools.kernels.plan_refit (tools/kernels/plan_refit.py): on latencies made from the planners' own cost models with known constants,
the refit recovers them, and the choices it reports are measured rows of the run."""

import dataclasses
from pathlib import Path

import pandas as pd
import pytest
from qlabench_kernels import calibration, plan

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    from qlabench_tools.kernels import plan_refit

    return plan_refit


REFIT = _load_script()


@pytest.fixture()
def refit():
    return REFIT


def _fwd_costs(**kw):
    """The default cost table's forward costs with ``kw`` in place."""
    return dataclasses.replace(calibration.default_table().fwd, **kw)


def _bwd_costs(**kw):
    return dataclasses.replace(calibration.default_table().bwd, **kw)


FWD_KEYS = [(16, 64, (8192,) * 4), (16, 64, (32768,)), (2, 8, (32768,)), (2, 8, (1024,) * 8), (8, 24, (1024,) * 8),
            (16, 48, (2048,) * 4), (32, 32, (4096,) * 8), (4, 16, (28672, 4096)), (16, 16, (4096, 4096))]  # fmt: skip
BWD_KEYS = [(16, 32, (32768,)), (8, 16, (7212, 25556)), (4, 8, (8192,)), (2, 4, (32768,)), (2, 4, (1024,) * 8),
            (16, 32, (161, 1928, 3157, 563)), (4, 8, (16384, 16384)), (8, 16, (4096,) * 8)]  # fmt: skip


def _fwd_table(u, fused, prep):
    c = _fwd_costs(fused=fused, prep=prep)
    rows = {}
    for hq, hv, lens in FWD_KEYS:
        T, N = sum(lens), len(lens)
        r = {"tl-fused": u * plan.split_cost(lens, hv, 0, 132, 128, h_qk=hq, costs=c)}
        # fwd_o's split as the refit tool takes it: planned with the table's own costs
        seg = plan.plan_split(T, N, hv, 132, block_v=64, seqlens=list(lens), h_qk=hq)
        r["tl-bv64"] = u * plan.split_cost(lens, hv, seg, 132, 64, h_qk=hq, costs=c)
        r["tilelang"] = min(r.values())
        rows[(hq, hv, lens)] = r
    return pd.DataFrame.from_dict(rows, orient="index")


def _fwd_choice(lens, hv, hq, costs):
    bv, seg = plan.plan_fwd(sum(lens), len(lens), hv, 132, seqlens=list(lens), h_qk=hq, costs=costs)
    return {128: "tl-fused" if seg == 0 else None, 64: "tl-bv64"}[bv]


def _fwd_choices_with(**costs):
    c = _fwd_costs(**costs)
    return {(hq, hv, lens): _fwd_choice(lens, hv, hq, c) for hq, hv, lens in FWD_KEYS}


def test_fwd_refit_recovers_the_constants_that_made_the_latencies(refit, monkeypatch, tmp_path):
    lat = _fwd_table(1.1e-3, 3.9, 2.6)
    monkeypatch.setattr(refit, "load", lambda d: lat)
    before = calibration.default_table()
    res = refit.fwd(tmp_path, tmp_path / "fit.json")
    got = res["constants_fitted"]
    assert got["ms_per_unit"] == pytest.approx(1.1e-3, rel=1e-3)
    assert got["fused"] == pytest.approx(3.9, rel=1e-3)
    assert got["prep"] == pytest.approx(2.6, rel=1e-3)
    assert res["rms_log_error"] < 1e-6
    assert calibration.default_table() == before  # the committed table is read, never changed
    # "now" is the planner with its own constants, "new" with the fitted ones, and they differ here
    now, new = _fwd_choices_with(), _fwd_choices_with(fused=3.9, prep=2.6)
    assert now != new and res["changed"] == sum(now[k] != new[k] for k in now) > 0
    for (hq, hv, lens), p in zip(FWD_KEYS, res["per_point"]):
        assert (p["now"], p["new"]) == (now[(hq, hv, lens)], new[(hq, hv, lens)]), p["seqlens"]
        assert p["best"] == min(("tl-fused", "tl-bv64"), key=lambda c: p[c])
    assert (tmp_path / "fit.json").is_file()


def _bwd_table(consts, splits=(0, 512, 1024, 2048, 4096, 8192, 16384)):
    c = _bwd_costs(**consts)
    rows = {}
    for i, (hq, hv, lens) in enumerate(BWD_KEYS):
        base = 500.0 + 300.0 * i  # µs of the stages the split does not change
        rows[(hq, hv, lens)] = {
            f"tl-split{s}": (base + plan.bwd_split_cost(lens, hv, s, 132, costs=c)) / 1000.0 for s in splits
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def _bwd_choices_with(consts):
    c = _bwd_costs(**consts)
    return [f"tl-split{plan.plan_bwd_split(sum(l), len(l), hv, 132, seqlens=list(l), costs=c)}" for _, hv, l in BWD_KEYS]


def test_bwd_refit_fits_the_measured_latencies_and_keeps_the_planner_as_it_was(refit, monkeypatch, tmp_path):
    consts = {"dhu": 2.1, "bwd_h": 1.7, "seg_state": 1.4, "fixup": 2.5, "launch": 30.0}
    lat = _bwd_table(consts)
    monkeypatch.setattr(refit, "load", lambda d: lat)
    before = calibration.default_table()
    res = refit.bwd(tmp_path)
    assert res["rms_rel_error"] < 1e-6
    for k, v in consts.items():
        assert res["constants_fitted"][k] == pytest.approx(v, rel=1e-3, abs=1e-3), k
    assert calibration.default_table() == before
    now, new = _bwd_choices_with({}), _bwd_choices_with(consts)
    assert now != new
    assert [p["now"] for p in res["per_point"]] == now
    assert [p["new"] for p in res["per_point"]] == new
    # with the constants that made the data the planner's choice is within its 5% margin of the best
    for p in res["per_point"]:
        assert p[p["new"]] <= p[p["best"]] / 0.95 + 1e-12


def test_bwd_refit_takes_points_with_missing_rows(refit, monkeypatch, tmp_path):
    lat = _bwd_table({"dhu": 2.1, "bwd_h": 1.7, "seg_state": 1.4, "fixup": 2.5, "launch": 30.0})
    now = _bwd_choices_with({})
    lat.iloc[0, lat.columns.get_loc(now[0])] = float("nan")  # the planner's pick not measured there
    lat.iloc[1, :] = float("nan")  # a point without any row
    monkeypatch.setattr(refit, "load", lambda d: lat)
    res = refit.bwd(tmp_path)
    assert res["points"] == len(BWD_KEYS) - 1
    assert res["per_point"][0]["now"] is None and res["unmeasured_choices"]["now"] >= 1
    assert res["points_compared"] < res["points"]  # the geomeans pair only points with both choices


def test_a_run_without_the_candidate_labels_is_an_error(refit, monkeypatch, tmp_path):
    lat = pd.DataFrame({"tilelang": [1.0]}, index=[(2, 8, (1024,))])
    monkeypatch.setattr(refit, "load", lambda d: lat)
    with pytest.raises(refit.RefitError, match="tl-fused"):
        refit.fwd(tmp_path)
    with pytest.raises(refit.RefitError, match="tl-split"):
        refit.bwd(tmp_path)


def test_cli_names_a_missing_run_dir(refit, tmp_path, capsys):
    assert refit.main(["fwd", str(tmp_path / "nope")]) == 2
    assert "run_dir" in capsys.readouterr().err


def test_cli_exits_2_with_the_reason_on_a_run_it_cannot_refit(refit, monkeypatch, tmp_path, capsys):
    lat = pd.DataFrame({"tilelang": [1.0]}, index=[(2, 8, (1024,))])
    monkeypatch.setattr(refit, "load", lambda d: lat)
    assert refit.main(["fwd", str(tmp_path)]) == 2
    assert "tl-fused" in capsys.readouterr().err
    assert refit.main(["bwd", str(tmp_path)]) == 2
    assert "tl-split" in capsys.readouterr().err
