"""Developer tools of the correctness check (``qlabench.correctness``): per-unit error dumps
(dump_errors) and the last tokens of each sequence (last_tokens). Run each as
``python -m qlabench_tools.correctness.<name>``."""
