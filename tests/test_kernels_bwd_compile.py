"""CPU test: every in-repo TileLang backward kernel compiles for sm_90a and uses wgmma.

Needs nvcc and tilelang (skipped otherwise); no GPU. One head config (2/8), one variant per
kernel: bwd_h (with h0), bwd_dhu (with dht and dh0), bwd_dqkwg, bwd_wy.
"""

import importlib
import importlib.util
import pathlib

import pytest
from kernel_helpers import kernels_pkg as _kernels_pkg
from kernel_helpers import why_cannot_compile as _why_cannot_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_K = '{"arch": "sm_90a", "kind": "cuda"}'






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


def test_bwd_h_ws_compiles_warp_specialised():
    """bwd_ws=1: bwd_h_ws compiles for sm_90a with wgmma, TMA loads behind mbarriers, setmaxnreg per
    role and one CTA-wide barrier (after the mbarrier init); bwd_dhu's rowexp variant compiles too."""
    _kernels_pkg()
    ws = importlib.import_module("qlabench_kernels.bwd_h_ws")
    src = ws.get_bwd_h_ws_kernel(2, 8, True, 32, target_k=TARGET_K).get_kernel_source()
    assert "__launch_bounds__(384" in src
    assert "wgmma" in src and "tma_load" in src and "expect_transaction" in src
    assert f"warpgroup_reg_alloc<{ws.NREG[0]}>" in src and f"warpgroup_reg_dealloc<{ws.NREG[2]}>" in src
    assert src.count("__syncthreads()") == 1
    dhu = importlib.import_module("qlabench_kernels.bwd_dhu")
    src = dhu.get_bwd_dhu_kernel(2, 8, True, True, 32, target_k=TARGET_K, rowexp=True).get_kernel_source()
    assert "wgmma" in src


def test_backward_exports():
    pkg = _kernels_pkg()
    for name in ("chunk_gdn_bwd", "chunk_gdn", "ChunkGDNFunction"):
        assert hasattr(pkg, name), name


def test_split_backward_kernels_compile():
    """The split chains: bwd_dhu's pass 1 (split="seg": writes F only) and pass 2 (split="carry"),
    the pipelined bwd_dhu (stages=2: TMA loads), and the reverse fix-up, all with wgmma."""
    _kernels_pkg()
    dhu = importlib.import_module("qlabench_kernels.bwd_dhu")
    fx = importlib.import_module("qlabench_kernels.fixup")
    seg = dhu.get_bwd_dhu_kernel(2, 8, True, True, 32, target_k=TARGET_K, rowexp=True, split="seg").get_kernel_source()
    carry = dhu.get_bwd_dhu_kernel(2, 8, True, True, 32, target_k=TARGET_K, rowexp=True, split="carry")
    carry = carry.get_kernel_source()
    for src in (seg, carry):
        assert "wgmma" in src
    # pass 1 stores neither dh nor dv_new: no writes through those parameters
    for buf in ("dh_all", "dvnew"):
        assert f"{buf}[" not in seg and f"tma_store({buf}_desc" not in seg, buf
    piped = dhu.get_bwd_dhu_kernel(2, 8, True, True, 32, target_k=TARGET_K, rowexp=True, stages=2)
    src = piped.get_kernel_source()
    assert "wgmma" in src and "tma_load" in src
    assert "wgmma" in fx.get_rfixup_kernel(8, True, 32, target_k=TARGET_K).get_kernel_source()


def test_bwd_dhu_ws_compiles_warp_specialised():
    """The warp-specialised bwd_dhu (variant bwd_dhu_ws=1, the default at block_v 32) compiles for
    sm_90a: 512 threads, wgmma, TMA loads behind mbarriers, setmaxnreg per role, one CTA-wide
    barrier (after the mbarrier init), in the unsplit and both split-pass forms."""
    _kernels_pkg()
    ws = importlib.import_module("qlabench_kernels.bwd_dhu_ws")
    for split in ("", "seg", "carry"):
        src = ws.get_bwd_dhu_ws_kernel(2, 8, True, True, 32, target_k=TARGET_K, split=split).get_kernel_source()
        assert "__launch_bounds__(512" in src
        assert "wgmma" in src and "tma_load" in src and "expect_transaction" in src
        for nreg in ws.NREG:  # raise above the launch count, lower below it (else illegal on the GPU)
            assert f"warpgroup_reg_{'alloc' if nreg > ws.NREG_LAUNCH else 'dealloc'}<{nreg}>" in src
        assert src.count("__syncthreads()") == 1
        assert ("tma_store" in src) == (split != "seg")  # dh / dv_new leave through the store warps


def test_bwd_pw_and_group_forms_compile():
    """bwd_pw (Pᵀ, W' per chunk and v-head) and the GVA-group forms of dqkwg / wy (bwd_grp=1, the
    defaults) compile for sm_90a with wgmma; the group forms loop over the group's v-heads."""
    _kernels_pkg()
    pw = importlib.import_module("qlabench_kernels.bwd_pw")
    dq = importlib.import_module("qlabench_kernels.bwd_dqkwg")
    wy = importlib.import_module("qlabench_kernels.bwd_wy")
    src = pw.get_bwd_pw_kernel(2, 8, TARGET_K).get_kernel_source()
    assert "wgmma" in src
    for src in (
        dq.get_bwd_dqkwg_kernel(2, 8, TARGET_K, threads=256, rsum=True, bf16_out=True, grp=True).get_kernel_source(),
        wy.get_bwd_wy_kernel(2, 8, TARGET_K, threads=256, bf16_dk=True, grp=True).get_kernel_source(),
    ):
        assert "wgmma" in src and "for (int gi = 0; gi < 4; ++gi)" in src




@pytest.mark.parametrize("name,getter,spec", [
    ("bwd_wy_ws", "get_bwd_wy_ws_kernel", "bwd_wy_ws=1"),
    ("bwd_dqkwg_ws", "get_bwd_dqkwg_ws_kernel", "bwd_dqkwg_ws=1"),
])  # fmt: skip
def test_persistent_ws_kernels_compile(name, getter, spec):
    """bwd_wy_ws / bwd_dqkwg_ws (the defaults): 384 threads, wgmma, TMA loads behind mbarriers and TMA
    stores, setmaxnreg per role with .inc / .dec chosen against the launch count and .inc asking for
    no more than .dec releases (else every CTA hangs), one CTA-wide barrier (the mbarrier init); the
    variant's compile list names the kernel instead of the group form."""
    _kernels_pkg()
    mod = importlib.import_module(f"qlabench_kernels.{name}")
    wy = importlib.import_module("qlabench_kernels.bwd_wy_ws")  # both use its roles and budgets
    comp = importlib.import_module("qlabench_kernels.compile")
    src = getattr(mod, getter)(2, 8, TARGET_K).get_kernel_source()
    assert "__launch_bounds__(384" in src
    assert "wgmma" in src and "tma_load" in src and "expect_transaction" in src and "tma_store" in src
    for nreg in wy.NREG:
        assert f"warpgroup_reg_{'alloc' if nreg > wy.NREG_LAUNCH else 'dealloc'}<{nreg}>" in src
    assert 2 * wy.NREG[0] + wy.NREG[1] <= 3 * wy.NREG_LAUNCH
    assert src.count("__syncthreads()") == 1
    group = name.removesuffix("_ws")
    names = [n for n, *_ in comp.bwd_variant_kernels(2, 8, spec)]
    assert name in names and not any(n.startswith(group + "[") for n in names)
    names = [n for n, *_ in comp.bwd_variant_kernels(2, 8, spec + ",bwd_bf16=0")]
    assert name not in names  # fp32 partials: the group form
