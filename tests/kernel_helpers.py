"""Shared by the kernel tests: say why offline sm_90a compilation is impossible here, if it is, and
a per-test watchdog for the GPU tests. (The tests import the kernels as ``qlabench_kernels`` and
the developer tools as ``qlabench_tools.kernels``, both installed by ``pip install -e .``.)"""

import faulthandler
import importlib
import importlib.util
import os
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def why_cannot_compile():
    if shutil.which("nvcc") is None:
        return "nvcc not on PATH (needed for offline sm_90a compilation)"
    try:
        importlib.import_module("tilelang")
    except Exception as e:  # noqa: BLE001 - any import failure means no compilation
        return f"tilelang not importable: {e!r}"
    return None


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
