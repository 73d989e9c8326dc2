"""Fill a TileLang cache offline (no GPU, nvcc only) with the in-repo kernels the device runs.

    TILELANG_CACHE_DIR=.devsite/tilelang-cache python scripts/precompile_cache.py

Sweep head configs get the variants a sweep uses (initial + final state, default stages);
the GPU-test configs get every state-flag variant.
"""
import sys
import time

from qlabench_kernels._common import target_key
from qlabench_kernels.fixup import get_fixup_kernel
from qlabench_kernels.fwd_o import get_fwd_o_kernel
from qlabench_kernels.prep import get_prep_kernel
from qlabench_kernels.seg_state import get_seg_state_kernel

SWEEP = [(2, 8), (16, 64), (4, 16), (8, 32), (16, 32), (8, 24), (16, 48), (16, 16), (32, 32)]
TESTS = [(2, 2), (2, 4), (1, 3), (2, 8)]


def build(hq, hv, flags, h0s):
    tk = target_key(None)
    t0 = time.time()
    get_prep_kernel(hq, hv, target_k=tk)
    for hi, hh in flags:
        get_fwd_o_kernel(hq, hv, bool(hi), bool(hh), 64, 0, target_k=tk)
    get_seg_state_kernel(hq, hv, 64, 0, target_k=tk)
    for h0 in h0s:
        get_fixup_kernel(hv, bool(h0), 32, target_k=tk)
    print(f"{hq}/{hv}: {time.time() - t0:.0f} s", flush=True)


which = sys.argv[1] if len(sys.argv) > 1 else "all"
if which in ("tests", "all"):
    for hq, hv in TESTS:
        build(hq, hv, [(1, 1), (1, 0), (0, 1), (0, 0)], [1, 0])
if which in ("sweep", "all"):
    for hq, hv in SWEEP:
        build(hq, hv, [(1, 1)], [1])
