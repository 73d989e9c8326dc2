"""CPU test: every in-repo TileLang backward kernel compiles for sm_90a and uses wgmma.

Needs nvcc and tilelang (skipped otherwise); no GPU. One head config (2/8), one variant per
kernel: bwd_h (with h0), bwd_dhu (with dht and dh0), bwd_dqkwg, bwd_wy.
"""

import importlib
import importlib.util
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_K = '{"arch": "sm_90a", "kind": "cuda"}'


def _kernels_pkg():
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


def _why_cannot_compile():
    if shutil.which("nvcc") is None:
        return "nvcc not on PATH (needed for offline sm_90a compilation)"
    try:
        importlib.import_module("tilelang")
    except Exception as e:  # noqa: BLE001 - any import failure means no compilation
        return f"tilelang not importable: {e!r}"
    return None


pytestmark = pytest.mark.skipif(_why_cannot_compile() is not None, reason=str(_why_cannot_compile()))


@pytest.fixture(scope="module")
def sources():
    _kernels_pkg()
    out = {}
    for mod, fn, args in [
        ("bwd_h", "get_bwd_h_kernel", (2, 8, True, 64)),
        ("bwd_dhu", "get_bwd_dhu_kernel", (2, 8, True, True, 64)),
        ("bwd_dqkwg", "get_bwd_dqkwg_kernel", (2, 8)),
        ("bwd_wy", "get_bwd_wy_kernel", (2, 8)),
    ]:
        m = importlib.import_module(f"qlabench_kernels.{mod}")
        out[mod] = getattr(m, fn)(*args, target_k=TARGET_K).get_kernel_source()
    return out


def test_every_backward_kernel_compiles_with_wgmma(sources):
    assert set(sources) == {"bwd_h", "bwd_dhu", "bwd_dqkwg", "bwd_wy"}
    for name, src in sources.items():
        assert "__global__" in src, name
        assert "wgmma" in src, f"{name}: generated source has no wgmma"


def test_backward_exports():
    pkg = _kernels_pkg()
    for name in ("chunk_gdn_bwd", "chunk_gdn", "ChunkGDNFunction"):
        assert hasattr(pkg, name), name
