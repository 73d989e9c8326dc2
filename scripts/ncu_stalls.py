"""``python scripts/ncu_stalls.py ARGS`` = ``python -m qlabench_tools.kernels.ncu_stalls ARGS`` (tools/kernels/ncu_stalls.py; see its docstring)."""

import sys

from qlabench_tools.kernels import ncu_stalls

if __name__ == "__main__":
    sys.exit(ncu_stalls.main())
