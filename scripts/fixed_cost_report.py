"""``python scripts/fixed_cost_report.py ARGS`` = ``python -m qlabench_tools.fixed_cost_report ARGS`` (tools/fixed_cost_report.py; see its docstring)."""

import sys

from qlabench_tools import fixed_cost_report

if __name__ == "__main__":
    sys.exit(fixed_cost_report.main())
