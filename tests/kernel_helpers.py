"""Shared by the kernel tests: import the in-repo kernels (installed, or straight from kernels/)
and say why offline sm_90a compilation is impossible here, if it is."""

import importlib
import importlib.util
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def kernels_pkg():
    try:
        return importlib.import_module("qlabench_kernels")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "qlabench_kernels",
            ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")],
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["qlabench_kernels"] = mod
        spec.loader.exec_module(mod)
        return mod


def why_cannot_compile():
    if shutil.which("nvcc") is None:
        return "nvcc not on PATH (needed for offline sm_90a compilation)"
    try:
        importlib.import_module("tilelang")
    except Exception as e:  # noqa: BLE001 - any import failure means no compilation
        return f"tilelang not importable: {e!r}"
    return None
