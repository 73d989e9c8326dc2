"""Developer tools (installed as ``qlabench_tools`` from ``tools/``; not part of the benchmark's
API): ``qlabench_tools.kernels`` checks, emulates, traces and dumps the in-repo TileLang kernels,
``qlabench_tools.correctness`` looks into the correctness check's errors, a few run-directory
reports (``fixed_cost_report``, ``plan_refit``, ``ncu_stalls``) that thin scripts in ``scripts/``
also run, and ``readme_examples`` makes README.md's example outputs from the kept rows. Each tool
runs as ``python -m qlabench_tools.<module> ...``."""
