"""``python scripts/plan_refit.py ARGS`` = ``python -m qlabench_tools.kernels.plan_refit ARGS`` (tools/kernels/plan_refit.py; see its docstring)."""

import sys

from qlabench_tools.kernels import plan_refit

if __name__ == "__main__":
    sys.exit(plan_refit.main())
