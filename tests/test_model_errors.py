"""tools/kernels/model_errors.py on a committed run (results/h100_planner/job_5d7a2ad): each row's plan
is the one its label's table makes, priced by the model; errors per regime; bad input exits 2."""

import math
import pathlib

import pandas as pd
import pytest
from qlabench_kernels import calibration, plan
from qlabench_tools.kernels import model_errors

RUN = pathlib.Path(__file__).resolve().parents[1] / "results/h100_planner/job_5d7a2ad"
TABLE = RUN / "calibration/cost_table.json"
#: the committed table the run's `tilelang` label planned with (the fitted H200 table of that day)
FITTED = RUN.parents[1] / "h200_planner/fitted_cost_table.json"
LABELS = {"tl-measured": str(TABLE), "tilelang": str(FITTED)}


def test_each_row_is_priced_under_the_plan_its_label_made():
    df = pd.read_parquet(RUN / "fwd_heldout_tables")
    measured = calibration.from_file(TABLE)
    recs = model_errors.rows_of(df, measured, LABELS, 132)
    assert len(recs) == len(df) == 40
    by_label = {(r["point"], r["label"]): r for r in recs}
    for (point, label), r in by_label.items():
        other = by_label[(point, "tilelang" if label == "tl-measured" else "tl-measured")]
        assert (r["block_v"], r["seg"]) != (other["block_v"], other["seg"])  # the config holds differing points only
    r = next(r for r in recs if r["label"] == "tl-measured")
    row = df[(df.backend == "tl-measured") & (df.layout == r["layout"]) & (df.model == r["point"][0])].iloc[0]
    lens = tuple(int(x) for x in row.seqlens)
    assert (r["block_v"], r["seg"]) == plan.plan_fwd(sum(lens), len(lens), int(row.h_v), 132, lens, h_qk=int(row.h_qk),
                                                      costs=measured.fwd)  # fmt: skip
    assert r["model"] == plan.split_cost(lens, int(row.h_v), r["seg"], 132, r["block_v"], h_qk=int(row.h_qk),
                                         costs=measured.fwd)  # fmt: skip


def test_the_report_groups_by_regime_and_scales_a_relative_table():
    df = pd.read_parquet(RUN / "fwd_heldout_tables")
    recs = model_errors.rows_of(df, calibration.from_file(FITTED), LABELS, 132)
    lines = model_errors.report(recs, relative=True)
    assert math.exp(sum(math.log(r["err"]) for r in recs) / len(recs)) == pytest.approx(1.0)
    assert any(line.startswith("points whose two plans differ: 20;") for line in lines)
    regimes = [line for line in lines if line.startswith("  fwd_o") or line.startswith("  fused")]
    assert sum(int(line.split()[3]) for line in regimes) == 40


def test_grids_count_working_ctas():
    assert model_errors.grids((32768,), 64, 0, 64) == (128, 0)
    assert model_errors.grids((32768,), 64, 16384, 64) == (256, 256)
    assert model_errors.grids((100, 0, 300), 4, 256, 128) == (12, 4 * 4)


def test_a_table_it_cannot_read_exits_2(capsys):
    assert model_errors.main([str(RUN / "fwd_heldout_tables"), "--price", str(TABLE)]) == 2  # a device path
    assert "cost_table.json" in capsys.readouterr().err
    assert model_errors.main([str(RUN / "nowhere"), "--price", str(TABLE)]) == 2


def test_an_unlabelled_row_plans_with_the_table_of_its_commit():
    """Without --label, a row's plan is the one its commit's committed table made (the table at
    the row's git_sha), and rows of a commit this repository lacks are refused with the way out."""
    import subprocess

    df = pd.read_parquet(RUN / "fwd_heldout_tables")
    sha = str(df.git_sha.iloc[0])
    root = pathlib.Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{sha}^{{commit}}"]).returncode:
        pytest.skip(f"commit {sha} is not in this clone")
    measured = calibration.from_file(TABLE)
    assert model_errors.rows_of(df, measured, {"tl-measured": str(TABLE)}, 132) == model_errors.rows_of(
        df, measured, LABELS, 132)  # fmt: skip


def test_rows_of_an_unknown_commit_ask_for_their_table():
    df = pd.read_parquet(RUN / "fwd_heldout_tables").assign(git_sha="0123456789ab")
    with pytest.raises(ValueError, match="--label"):
        model_errors.rows_of(df, calibration.from_file(TABLE), {"tl-measured": str(TABLE)}, 132)
