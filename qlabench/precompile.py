"""``qlabench precompile``: fill a TileLang cache offline (no GPU, nvcc only) with the in-repo
kernels (``qlabench_kernels``) that sweeps or the GPU tests compile.

    TILELANG_CACHE_DIR=.tlcache/tests qlabench precompile tests [--jobs 2]
    TILELANG_CACHE_DIR=DIR qlabench precompile configs/h200_fwd.yaml configs/h200_bwd.yaml [--jobs N]

Each TARGET is a sweep YAML (its head configs and directions, initial + final state, as the sweeps
run) or one of the named sets:

tests      what the GPU tests compile (tests/test_kernels_gpu.py, tests/test_kernels_bwd_gpu.py,
           tests/test_backends_gpu.py): heads 2/2, 2/4, 1/3, 2/8, 4/12, forward and backward, every
           state flag, split kernels included
fwd_sweep  configs/h200_fwd.yaml: the forward's kernels with initial + final state, 9 head configs
bwd_sweep  configs/h200_bwd.yaml: forward (saved tensors) and backward with h0 and d(final state),
           4 head configs
sweep      both sweeps
calibration  the cost-table micro-benchmark's (python -m qlabench_tools.kernels.calibrate): heads 1/1
           and 1/4, forward and backward, initial + final state
all        tests + sweep + calibration

The list per head config is ``qlabench_kernels.compile.default_kernels``; the target is sm_90a, the
runtime default, so the cache is the one the H200 loads. ``jobs`` > 1 compiles that many head
configs at a time in worker processes (scripts/airgapped/cache_subset.py records one process only:
it compiles with ``jobs=1``).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterable
from pathlib import Path

#: the named sets a target may be instead of a sweep YAML
NAMED = ("tests", "fwd_sweep", "bwd_sweep", "sweep", "calibration", "all")
TEST_HEADS = [(2, 2), (2, 4), (1, 3), (2, 8), (4, 12), (1, 4)]
FWD_SWEEP_HEADS = [(2, 8), (16, 64), (4, 16), (8, 32), (16, 32), (8, 24), (16, 48), (16, 16), (32, 32)]
BWD_SWEEP_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]


def plan(targets: Iterable) -> list[tuple[int, int, dict]]:
    """[(h_qk, h_v, default_kernels kwargs)] for the targets (named sets or sweep YAML paths); a
    head config in several targets gets the union of their state flags. A YAML that does not load
    raises :class:`qlabench.config.ConfigError`."""
    from qlabench_kernels.compile import ALL_FLAGS

    jobs: dict = {}

    def add(heads, fwd_flags, bwd_flags):
        for hk in heads:
            f, b = jobs.setdefault(hk, (set(), set()))
            f.update(fwd_flags)
            b.update(bwd_flags)

    for t in targets:
        t = str(t)
        if t not in NAMED:
            from .config import load
            from .sweep import points

            sw = load(Path(t))
            heads = sorted({(p.h_qk, p.h_v) for p in points(sw)})
            add(heads, [(1, 1)], [(1, 1)] if set(sw.directions) - {"fwd"} else [])
        if t in ("tests", "all"):
            add(TEST_HEADS, ALL_FLAGS, ALL_FLAGS)
        if t in ("fwd_sweep", "sweep", "all"):
            add(FWD_SWEEP_HEADS, [(1, 1)], [])
        if t in ("bwd_sweep", "sweep", "all"):
            add(BWD_SWEEP_HEADS, [(1, 1)], [(1, 1)])
        if t in ("calibration", "all"):
            from qlabench_kernels.calibration import HEADS

            add(list(HEADS), [(1, 1)], [(1, 1)])
    return [(hq, hv, dict(fwd_flags=tuple(sorted(f)), bwd_flags=tuple(sorted(b))))
            for (hq, hv), (f, b) in jobs.items()]


def build(hq: int, hv: int, kw: dict) -> str:
    """Compile one head config's kernels into the TileLang cache; a line for the log."""
    from qlabench_kernels.compile import precompile

    t0 = time.time()
    precompile(hq, hv, **kw)
    return f"{hq}/{hv}: {time.time() - t0:.0f} s"


def precompile_targets(targets: Iterable, jobs: int = 1, echo: Callable[[str], None] = print) -> int:
    """Compile what the targets need, ``jobs`` head configs at a time; 0 when done."""
    work = plan(targets)
    if jobs <= 1 or len(work) <= 1:
        for hq, hv, kw in work:
            echo(build(hq, hv, kw))
        return 0
    with concurrent.futures.ProcessPoolExecutor(jobs) as ex:
        for line in ex.map(build, *zip(*work)):
            echo(line)
    return 0
