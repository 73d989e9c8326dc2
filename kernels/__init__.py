"""In-repo TileLang GDN kernels (import name: qlabench_kernels)."""
