"""Rewrite the stored derived columns of results directories to what ``metrics`` computes now.

    python scripts/rederive.py results/h200_fwd results/h200_bwd ...   # --check: only report

Per directory: every row of every part file is read, ``metrics.add_derived`` (with the
directory's run metadata for the ceilings) recomputes ``metrics.DERIVED``, and the rows are
written back as one Parquet file (like ``qlabench compact``: new file first, then the old parts
removed). Every other column is kept as stored (checked before writing). Rows already equal are
left alone; a directory with nothing to change is not rewritten.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from qlabench import metrics, results


def stale(df, fresh) -> int:
    """Rows whose stored derived columns differ from the recomputed ones."""
    bad = np.zeros(len(df), bool)
    for c in metrics.DERIVED:
        a = df[c].astype(float).to_numpy() if c in df else np.full(len(df), np.nan)
        b = fresh[c].astype(float).to_numpy()
        bad |= ~(np.isclose(a, b, rtol=1e-12, atol=0) | (np.isnan(a) & np.isnan(b)))
    return int(bad.sum())


def rederive(d: Path, check: bool = False) -> str:
    parts = d / "parts"
    files = sorted(f for f in parts.glob("*.parquet") if not f.name.startswith("."))
    if not files:
        return f"{d}: no rows"
    df = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default").to_pandas()
    fresh = metrics.add_derived(df, None, results.load_meta(d))
    n = stale(df, fresh)
    if check or not n:
        return f"{d}: {len(df)} rows, {n} with stale derived columns"
    keep = [c for c in df.columns if c not in metrics.DERIVED]
    assert fresh[keep].equals(df[keep]), "only derived columns may change"
    name = results._write_rows_file(parts, "rederived", fresh)
    for f in files:
        f.unlink()
    back = results.load(d)
    assert len(back) == len(df) and stale(back, metrics.add_derived(back, None,
                                                                    results.load_meta(d))) == 0
    return f"{d}: {len(df)} rows, {n} rewritten -> parts/{name} ({len(files)} file(s) replaced)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="report stale rows, write nothing")
    a = ap.parse_args()
    for d in a.dirs:
        print(rederive(d, a.check))
    if a.check:
        sys.exit(0)


if __name__ == "__main__":
    main()
