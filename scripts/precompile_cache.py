"""Fill a TileLang cache offline (no GPU, nvcc only) with the in-repo kernels the device runs.

    TILELANG_CACHE_DIR=.tlcache/tests python scripts/precompile_cache.py tests [--jobs 2]
    TILELANG_CACHE_DIR=DIR python scripts/precompile_cache.py {tests|fwd_sweep|bwd_sweep|sweep|all} [--jobs N]

tests      what the GPU tests compile (tests/test_kernels_gpu.py, tests/test_kernels_bwd_gpu.py,
           tests/test_backends_gpu.py): heads 2/2, 2/4, 1/3, 2/8, 4/12, forward and backward, every
           state flag, split kernels included
fwd_sweep  configs/h200_fwd.yaml: the forward's kernels with initial + final state, 9 head configs
bwd_sweep  configs/h200_bwd.yaml: forward (saved tensors) and backward with h0 and d(final state),
           4 head configs
sweep      both sweeps; all = tests + sweep
--config F the head configs and directions of a sweep YAML instead (repeatable; initial + final
           state, as the sweeps run)

The list per head config is ``qlabench_kernels.compile.default_kernels``; the target is sm_90a, the
runtime default, so the cache is the one the H200 loads. ``--jobs N`` compiles N head configs at a
time in worker processes (scripts/cache_subset.py records one process only: use --jobs 1 there).
"""

import argparse
import concurrent.futures
import sys
import time

from qlabench_kernels.compile import ALL_FLAGS, precompile

TEST_HEADS = [(2, 2), (2, 4), (1, 3), (2, 8), (4, 12)]
FWD_SWEEP_HEADS = [(2, 8), (16, 64), (4, 16), (8, 32), (16, 32), (8, 24), (16, 48), (16, 16), (32, 32)]
BWD_SWEEP_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]


def plan(which, configs=()):
    """[(h_qk, h_v, default_kernels kwargs)] for a target (or the sweep YAMLs ``configs``); a head
    config in several targets gets the union."""
    jobs = {}

    def add(heads, fwd_flags, bwd_flags):
        for hk in heads:
            f, b = jobs.setdefault(hk, (set(), set()))
            f.update(fwd_flags)
            b.update(bwd_flags)

    if configs:
        from qlabench.config import load
        from qlabench.sweep import points
        for c in configs:
            sw = load(c)
            heads = sorted({(p.h_qk, p.h_v) for p in points(sw)})
            add(heads, [(1, 1)], [(1, 1)] if set(sw.directions) - {"fwd"} else [])
        which = None
    if which in ("tests", "all"):
        add(TEST_HEADS, ALL_FLAGS, ALL_FLAGS)
    if which in ("fwd_sweep", "sweep", "all"):
        add(FWD_SWEEP_HEADS, [(1, 1)], [])
    if which in ("bwd_sweep", "sweep", "all"):
        add(BWD_SWEEP_HEADS, [(1, 1)], [(1, 1)])
    return [(hq, hv, dict(fwd_flags=tuple(sorted(f)), bwd_flags=tuple(sorted(b)))) for (hq, hv), (f, b) in jobs.items()]


def build(hq, hv, kw):
    t0 = time.time()
    precompile(hq, hv, **kw)
    return f"{hq}/{hv}: {time.time() - t0:.0f} s"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="?", default="all", choices=("tests", "fwd_sweep", "bwd_sweep", "sweep", "all"))
    ap.add_argument("--jobs", type=int, default=1, help="head configs compiled at a time (worker processes)")
    ap.add_argument("--config", action="append", default=[], help="a sweep YAML (repeatable)")
    args = ap.parse_args(argv)
    jobs = plan(args.which, args.config)
    if args.jobs <= 1:
        for hq, hv, kw in jobs:
            print(build(hq, hv, kw), flush=True)
        return 0
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as ex:
        for line in ex.map(build, *zip(*jobs)):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
