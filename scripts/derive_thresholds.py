"""Print the correctness limits derived from kept runs (``qlabench.correctness.derive_limits``): twice
the largest global error of the libraries' ``ok`` rows, per output, as a ``thresholds:`` block.

    python scripts/derive_thresholds.py results/h200_fwd results/h200_bwd
"""

from __future__ import annotations

import argparse

import pandas as pd

from qlabench import correctness
from qlabench import results as R


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="results directories (Parquet parts)")
    ap.add_argument("--margin", type=float, default=correctness.LIMIT_MARGIN)
    a = ap.parse_args()
    rows = pd.concat([R.load(d) for d in a.dirs], ignore_index=True)
    print("thresholds:")
    for name, lim in correctness.derive_limits(rows, a.margin).items():
        print(f"  {name}: {lim:g}")


if __name__ == "__main__":
    main()
