"""qlabench: benchmarking and profiling harness for Gated DeltaNet chunked-prefill kernels."""

__version__ = "0.1.0"
