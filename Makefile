# Thin wrappers over the CLI and pytest.
PY ?= python3

.PHONY: deps install test lint readme smoke bench-quick bench-fwd bench-bwd
deps:               ## install only when something is missing
	@$(PY) -c "import torch, qlabench, qlabench_kernels, qlabench_tools, pytest, hypothesis, ruff" 2>/dev/null || $(MAKE) install

install:            ## CPU machine: torch (CPU build) first, then the package with dev extras
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]"

test: deps          ## the test suite (GPU tests skip without CUDA)
	$(PY) -m pytest -q

lint:
	ruff check qlabench kernels tools tests

readme: deps        ## README.md's example outputs, made again from the kept rows
	$(PY) -m qlabench_tools.readme_examples

smoke: deps         ## the smoke sweep (CPU: the reference backend; GPU: every backend)
	qlabench run configs/smoke.yaml

bench-quick:
	qlabench run configs/h200_fwd_quick.yaml --resume

bench-fwd:
	qlabench run configs/h200_fwd.yaml --resume

bench-bwd:
	qlabench run configs/h200_bwd.yaml --resume
