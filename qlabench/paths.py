"""The directories inside a results directory (:mod:`qlabench.results` describes the layout).

A module of its own, importing nothing, so that a run names its worker's log directory before it
imports the storage code (pandas, pyarrow)."""

PARTS_DIR, RUNS_DIR, LOGS_DIR, FIGURES_DIR, SHARDS_DIR = "parts", "_runs", "_logs", "_figures", "_shards"
