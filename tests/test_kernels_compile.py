"""CPU test: every in-repo TileLang forward kernel compiles for sm_90a and uses wgmma.

Needs nvcc and tilelang (skipped otherwise); no GPU. Builds one head config (2/8) with one
variant per code path: prep, fwd_o, seg_state, fixup.
"""

import importlib
import importlib.util
import pathlib

import pytest
from kernel_helpers import kernels_pkg as _kernels_pkg
from kernel_helpers import why_cannot_compile as _why_cannot_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]






pytestmark = pytest.mark.skipif(_why_cannot_compile() is not None, reason=str(_why_cannot_compile()))

TARGET = {"kind": "cuda", "arch": "sm_90a"}


@pytest.fixture(scope="module")
def sources():
    _kernels_pkg()
    comp = importlib.import_module("qlabench_kernels.compile")
    return comp.kernel_sources(2, 8, TARGET, full=False)


def test_every_code_path_compiles(sources):
    assert set(sources) == {"prep", "fwd_o[init=1,ht=1]", "seg_state", "fixup[h0=1]"}
    for name, src in sources.items():
        assert "__global__" in src, name


def test_every_kernel_uses_wgmma(sources):
    for name, src in sources.items():
        assert "wgmma" in src, f"{name}: generated source has no wgmma"


def test_gva_head_index_is_compiled_in(sources):
    # v-head j reads q/k head j // 4 for 2/8: the kernels divide the v-head index by 4 (a shift).
    assert ">> 2" in sources["prep"] or "/ 4" in sources["prep"]


def test_speed_variants_compile_with_wgmma():
    """Every kernel of every checked speed variant compiles for sm_90a; all but the table builder use wgmma."""
    _kernels_pkg()
    common = importlib.import_module("qlabench_kernels._common")
    comp = importlib.import_module("qlabench_kernels.compile")
    tk = common.target_key(TARGET)
    seen = set()
    for spec in common.CHECK_VARIANTS:
        for name, getter, args, kw in comp.variant_kernels(2, 8, spec):
            key = (getter.__name__, args, tuple(sorted(kw.items())))
            if key in seen:
                continue
            seen.add(key)
            src = getter(*args, target_k=tk, **kw).get_kernel_source()
            assert "__global__" in src, name
            if name != "tables":
                assert "wgmma" in src, f"{spec}: {name} has no wgmma"


@pytest.mark.parametrize("heads", [(2, 8), (16, 64)], ids=lambda h: f"{h[0]}/{h[1]}")
def test_fwd_o_ws_compiles_warp_specialised(heads):
    """fwd_ws=1: the hand warp-specialised fwd_o compiles for sm_90a with wgmma, TMA loads into the
    2-stage ring behind mbarriers, setmaxnreg per role, and no CTA-wide barrier inside the roles."""
    _kernels_pkg()
    common = importlib.import_module("qlabench_kernels._common")
    ws = importlib.import_module("qlabench_kernels.fwd_o_ws")
    src = ws.get_fwd_o_ws_kernel(*heads, True, True, 64, target_k=common.target_key(TARGET), fastmath=False)
    src = src.get_kernel_source()
    assert "__launch_bounds__(512" in src
    assert "wgmma" in src and "tma_load" in src and "expect_transaction" in src
    for r in ws.NREG[:3]:
        assert f"warpgroup_reg_alloc<{r}>" in src
    assert f"warpgroup_reg_dealloc<{ws.NREG[3]}>" in src
    assert "fence_proxy_async" in src and ".wait(" in src and ".arrive()" in src
    # the only CTA-wide barrier is the one after mbarrier init; roles sync with named barriers
    assert src.count("__syncthreads()") == 1
