"""Fill a TileLang cache offline (no GPU, nvcc only) with the in-repo kernels the device runs.

    TILELANG_CACHE_DIR=.devsite/tilelang-cache python scripts/precompile_cache.py [tests|sweep|variants|bwd|bwd_variant|all]

Sweep head configs get the variants a sweep uses (initial + final state, default stages);
the GPU-test configs get every state-flag variant; "variants" compiles every speed variant
of qlabench_kernels._common.CHECK_VARIANTS for the head configs that
kernels/dev/check_fwd.py and tests/test_kernels_gpu.py run them on (2/8, 1/3, 16/64), incl. the
warp-specialised fwd_o (fwd_ws=1, also with fastmath), plus GPU_TEST_VARIANTS for 2/8
(tests/test_kernels_gpu.py's variants that are not in CHECK_VARIANTS, e.g. fwd_ws=1,fwd_bv=32).
"""
import sys
import time

from qlabench_kernels._common import CHECK_VARIANTS, target_key
from qlabench_kernels.compile import precompile_variants

SWEEP = [(2, 8), (16, 64), (4, 16), (8, 32), (16, 32), (8, 24), (16, 48), (16, 16), (32, 32)]
TESTS = [(2, 2), (2, 4), (1, 3), (2, 8)]
BWD_SWEEP_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]
VARIANT_HEADS = [(2, 8), (1, 3), (16, 64)]
GPU_TEST_VARIANTS = [
    "tables=torch,prep=subst,fastmath=0,fwd_ws=0", "fwd_ws=0", "fwd_ws=0,fwd_threads=256", "fwd_bv=32",
    "prep=tc", "prep=subst", "prep=blocked_pad", "prep=blocked", "rowexp=0", "prep=blocked,rowexp=0",
]


def build(hq, hv, flags, h0s):
    """The default variant's kernels (what the backend and the tests run) for these state flags,
    or the variant named by the second argument (``precompile_cache.py sweep prep=tc``)."""
    t0 = time.time()
    spec = sys.argv[2] if len(sys.argv) > 2 else "default"
    precompile_variants(hq, hv, [spec], flags=tuple(flags), h0s=tuple(h0s))
    print(f"{hq}/{hv}: {time.time() - t0:.0f} s", flush=True)


which = sys.argv[1] if len(sys.argv) > 1 else "all"
if which in ("tests", "all"):
    for hq, hv in TESTS:
        build(hq, hv, [(1, 1), (1, 0), (0, 1), (0, 0)], [1, 0])
if which in ("sweep", "all"):
    for hq, hv in SWEEP + [hk for hk in BWD_SWEEP_HEADS if hk not in SWEEP]:
        build(hq, hv, [(1, 1)], [1])
if which in ("variants", "all"):
    for hq, hv in VARIANT_HEADS:
        t0 = time.time()
        precompile_variants(hq, hv, CHECK_VARIANTS, verbose=True)
        print(f"{hq}/{hv} variants: {time.time() - t0:.0f} s", flush=True)
    precompile_variants(2, 8, GPU_TEST_VARIANTS, verbose=True)


# --- backward (kernels/bwd_*.py): `precompile_cache.py bwd` (also part of "all") ---------------
# Test configs get every state-flag variant (bwd_h: h0 0/1; bwd_dhu: dht, dh0 in {0,1}^2) at
# block_v 32 (the default), plus block_v 64 for 1/3; the check_bwd.py / sweep configs get
# h0 + dht at block_v 64 and 32, and their forward (prep, fwd_o, seg_state, fixup).
BWD_TESTS = TESTS
BWD_SWEEP = BWD_SWEEP_HEADS


def build_bwd(hq, hv, all_flags, bvs):
    from qlabench_kernels.bwd_dhu import get_bwd_dhu_kernel
    from qlabench_kernels.bwd_dqkwg import get_bwd_dqkwg_kernel
    from qlabench_kernels.bwd_h import get_bwd_h_kernel
    from qlabench_kernels.bwd_wy import get_bwd_wy_kernel

    tk = target_key(None)
    t0 = time.time()
    for bv in bvs:
        for hi in ([1, 0] if all_flags else [1]):
            get_bwd_h_kernel(hq, hv, bool(hi), bv, target_k=tk)
        for dht, dh0 in ([(1, 1), (1, 0), (0, 1), (0, 0)] if all_flags else [(1, 1)]):
            get_bwd_dhu_kernel(hq, hv, bool(dht), bool(dh0), bv, target_k=tk)
    get_bwd_dqkwg_kernel(hq, hv, target_k=tk)
    get_bwd_wy_kernel(hq, hv, target_k=tk)
    print(f"{hq}/{hv} bwd: {time.time() - t0:.0f} s", flush=True)


def build_bwd_variant(hq, hv, all_flags, bvs):
    """The backward speed variant bwd_ws=1,rowexp=1 (bwd_h_ws.py, bwd_dhu per-row exps) plus the
    forward kernels of rowexp=1 for this head config (what check_bwd.py --variants runs)."""
    from qlabench_kernels.bwd_dhu import get_bwd_dhu_kernel
    from qlabench_kernels.bwd_h_ws import get_bwd_h_ws_kernel

    tk = target_key(None)
    t0 = time.time()
    for bv in bvs:
        for hi in ([1, 0] if all_flags else [1]):
            get_bwd_h_ws_kernel(hq, hv, bool(hi), bv, target_k=tk)
        for dht, dh0 in ([(1, 1), (1, 0), (0, 1), (0, 0)] if all_flags else [(1, 1)]):
            get_bwd_dhu_kernel(hq, hv, bool(dht), bool(dh0), bv, target_k=tk, rowexp=True)
    print(f"{hq}/{hv} bwd variant: {time.time() - t0:.0f} s", flush=True)


if which == "bwdnew":
    # `precompile_cache.py bwdnew "spec;spec" [2/8,1/3,...]`: the backward kernels (split and unsplit
    # chains) of these variants with the state flags check_bwd.py / the backward sweep use, plus the
    # forward kernels of the default for those heads
    from qlabench_kernels.compile import precompile_bwd_variants

    specs = (sys.argv[2] if len(sys.argv) > 2 else "default").split(";")
    # (has_h0, has_dht) per head config: check_bwd.py's cases, then the sweep's (h0 + dht)
    BWD_FLAGS = {(2, 8): ((1, 1), (1, 0)), (1, 3): ((0, 0),), (2, 4): ((1, 1),), (4, 8): ((1, 1),),
                 (8, 16): ((1, 1),), (16, 32): ((1, 1),)}  # fmt: skip
    heads = BWD_FLAGS
    if len(sys.argv) > 3:
        heads = [tuple(int(x) for x in hh.split("/")) for hh in sys.argv[3].split(",")]
    for hq, hv in heads:
        t0 = time.time()
        fl = BWD_FLAGS.get((hq, hv), ((1, 1),))
        precompile_bwd_variants(hq, hv, specs, flags=fl, bvs=(32,), verbose=True)
        h0s = tuple(sorted({h0 for h0, _ in fl}))
        precompile_variants(hq, hv, ["default"], flags=tuple((h0, 1) for h0 in h0s), h0s=h0s)
        print(f"{hq}/{hv} bwd: {time.time() - t0:.0f} s", flush=True)
if which == "bwdtests":
    # `precompile_cache.py bwdtests [2/2,2/4,...]`: what tests/test_kernels_bwd_gpu.py runs (default variant
    # with every state flag, the bwd_ws / rowexp variants on 2/8 and 1/3, prep recomputed without P)
    from qlabench_kernels.compile import precompile_bwd_variants
    from qlabench_kernels.prep import get_prep_kernel

    FLAGS4 = ((1, 1), (1, 0), (0, 1), (0, 0))
    heads = [(2, 2), (2, 4), (1, 3), (2, 8)]
    if len(sys.argv) > 2:
        heads = [tuple(int(x) for x in hh.split("/")) for hh in sys.argv[2].split(",")]
    for hq, hv in heads:
        t0 = time.time()
        precompile_bwd_variants(hq, hv, ["default"], flags=FLAGS4, bvs=(32,), verbose=True)
        precompile_variants(hq, hv, ["default"], flags=((1, 1), (0, 1), (1, 0), (0, 0)), h0s=(1, 0))
        get_prep_kernel(hq, hv, method="rt", target_k=target_key(None))
        if (hq, hv) in ((2, 8), (1, 3)):
            precompile_bwd_variants(hq, hv, ["bwd_ws=1,rowexp=1", "bwd_ws=0,rowexp=0"], flags=((1, 1), (0, 1)),
                                    bvs=(32,), verbose=True)  # fmt: skip
        if (hq, hv) == (2, 4):  # the bwd_dhu_ws=0 / bwd_grp=0 GPU tests
            precompile_bwd_variants(hq, hv, ["bwd_dhu_ws=0", "bwd_grp=0"], flags=((1, 1),), bvs=(32,), verbose=True)
        if (hq, hv) in ((2, 4), (1, 3), (2, 2)):  # test_wy_ws_matches_group_wy
            precompile_bwd_variants(hq, hv, ["bwd_wy_ws=0", "bwd_dqkwg_ws=0"],
                                    flags=((1, 1),), bvs=(32,), verbose=True)  # fmt: skip
        print(f"{hq}/{hv} bwd tests: {time.time() - t0:.0f} s", flush=True)
if which in ("bwd", "all"):
    for hq, hv in BWD_TESTS:
        build_bwd(hq, hv, True, (32, 64) if (hq, hv) == (1, 3) else (32,))
    for hq, hv in BWD_SWEEP:
        if (hq, hv) not in SWEEP and (hq, hv) not in TESTS:
            build(hq, hv, [(1, 1)], [1])
        build_bwd(hq, hv, (hq, hv) in BWD_TESTS, (64, 32))
if which in ("bwd", "bwd_variant", "all"):  # bwd_ws=1, rowexp=1 are the backward defaults
    for hq, hv in BWD_TESTS:  # check_bwd.py's cases run block_v 64 unless they say otherwise
        build_bwd_variant(hq, hv, True, (32, 64))
    for hq, hv in BWD_SWEEP:
        build_bwd_variant(hq, hv, (hq, hv) in BWD_TESTS, (32, 64))
        precompile_variants(hq, hv, ["rowexp=1"], flags=((1, 1),), h0s=(1,))
