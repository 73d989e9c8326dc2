"""Stored rows (the fixtures cut from the kept runs) store the derived columns ``metrics`` computes now (Parquet readers that
never call ``metrics.add_derived`` get the same numbers as the plots)."""

from pathlib import Path

import numpy as np
import pytest

from qlabench import metrics, results

ROOT = Path(__file__).resolve().parents[1]
DIRS = sorted({p.parent.parent.relative_to(ROOT)
               for p in (ROOT / "tests" / "fixtures" / "results").glob("**/parts/*.parquet")})


def test_fixture_results_are_found():
    names = {str(d) for d in DIRS}
    assert {"tests/fixtures/results/h200_fwd", "tests/fixtures/results/h200_bwd"} <= names


@pytest.mark.parametrize("d", DIRS, ids=str)
def test_stored_derived_columns_equal_recomputed(d):
    df = results.load(ROOT / d)
    fresh = metrics.add_derived(df, None, results.load_meta(ROOT / d))
    ok = df["status"] == "ok"
    assert df.loc[ok, "tflops"].notna().all(), f"{d}: ok rows without tflops"
    for c in metrics.DERIVED:
        a, b = df[c].astype(float).to_numpy(), fresh[c].astype(float).to_numpy()
        same = np.isclose(a, b, rtol=1e-9, atol=0) | (np.isnan(a) & np.isnan(b))
        assert same.all(), (f"{d}: {int((~same).sum())} rows store a {c} other than "
                            f"metrics.add_derived's (python scripts/rederive.py {d})")


def test_add_derived_matches_what_the_runner_writes():
    """ok GPU rows: metrics.derive with the run's ceilings; CPU-timed rows: no roofline; other
    statuses: no derived columns (the runner calls derive only for ok rows)."""
    import pandas as pd
    base = {"run_id": "r", "direction": "fwd", "total_tokens": 32768, "h_qk": 16, "h_v": 64,
            "num_seqs": 1, "head_dim": 128, "dtype": "bf16", "initial_state": True,
            "output_final_state": True, "gpu_name": "NVIDIA H200"}
    df = pd.DataFrame([{**base, "status": "ok", "latency_ms": 1.0, "timing_mode": "graph-batch"},
                       {**base, "status": "ok", "latency_ms": 1.0, "timing_mode": "cpu"},
                       {**base, "status": "incorrect", "latency_ms": None,
                        "timing_mode": "graph-batch"}])
    metas = {"r": {"ceilings": {"matmul_tflops": 800.0, "copy_gbps": 4200.0}}}
    out = metrics.add_derived(df, None, metas)
    want = metrics.derive("fwd", 1.0, 32768, 16, 64, 1, 128, "bf16", 800.0, 4200.0, True, True)
    for c in metrics.DERIVED:
        assert out[c].iloc[0] == pytest.approx(want[c]), c
    assert out["tflops"].iloc[1] == pytest.approx(want["tflops"])
    assert np.isnan(out["roofline_ms"].iloc[1]) and np.isnan(out["pct_roofline"].iloc[1])
    assert out.loc[2, list(metrics.DERIVED)].isna().all()
