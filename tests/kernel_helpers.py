"""Shared by the kernel tests: import the in-repo kernels (installed, or straight from kernels/) and
the developer tools (tools/kernels/), say why offline sm_90a compilation is impossible here, if it
is, and a per-test watchdog for the GPU tests."""

import faulthandler
import importlib
import importlib.util
import os
import pathlib
import shutil
import sys

import pytest

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


def tool(name):
    """A module of tools/kernels/ (developer tools, not installed), by file name."""
    path = str(ROOT / "tools" / "kernels")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


@pytest.fixture(autouse=True)
def per_test_timeout():
    """A watchdog per test ($QLABENCH_TEST_TIMEOUT_S, default 150 s; 0 = off): a test that runs past
    it (a kernel that hangs blocks inside CUDA, where no Python signal handler runs) makes the
    process print every thread's traceback and exit, so that the job goes on instead of stalling."""
    timeout_s = float(os.environ.get("QLABENCH_TEST_TIMEOUT_S", "150"))
    if timeout_s > 0:
        faulthandler.dump_traceback_later(timeout_s, exit=True)
    yield
    if timeout_s > 0:
        faulthandler.cancel_dump_traceback_later()
