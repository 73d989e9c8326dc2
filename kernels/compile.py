"""Offline compilation of the kernels for given head configurations (fills TileLang's disk cache).

    python -m qlabench_kernels.compile --hqk 2 --hv 8 [--hqk 16 --hv 64 ...] [--fwd-only] [--list]

compiles (nvcc, no GPU needed) every kernel the forward and backward may run for (h_qk, h_v) into
$TILELANG_CACHE_DIR (default ~/.tilelang/cache); a later run on the GPU with the same target
(default {"kind":"cuda","arch":"sm_90a"}) loads the cached binaries. T, N and the sequence layout
are run-time values: nothing recompiles per shape.
"""

import argparse
import json
import sys
import time

from ._common import target_key

#: every (has initial state, has final state / d final state) pair
ALL_FLAGS = ((1, 1), (1, 0), (0, 1), (0, 0))


def default_kernels(h_qk: int, h_v: int, fwd_flags=ALL_FLAGS, bwd_flags=ALL_FLAGS, split: bool = True):
    """[(name, getter, args, kwargs)] of the kernels the forward (``fwd_flags``: (has_init, has_ht)
    pairs) and the backward (``bwd_flags``: (has_h0, has_dht) pairs; () = no backward) run for
    (h_qk, h_v); ``split`` adds the split path's kernels (seg_state, fixup, the split chains)."""
    from .bwd_dhu import get_bwd_dhu_kernel
    from .bwd_dqkwy import get_bwd_dqkwy_kernel
    from .bwd_h import get_bwd_h_kernel
    from .fixup import get_fixup_kernel
    from .fwd_fused import get_fwd_fused_kernel
    from .fwd_o import get_fwd_o_kernel
    from .prep import get_prep_kernel
    from .seg_state import get_seg_state_kernel
    from .tables import NT, get_tables_kernel

    out = [("tables", get_tables_kernel, (NT,), {}), ("prep", get_prep_kernel, (h_qk, h_v), {})]
    h0s = sorted({h0 for h0, _ in (*fwd_flags, *bwd_flags)}, reverse=True)
    for hi, hh in fwd_flags:  # plan_fwd picks the fused kernel or fwd_o's V block per shape
        out.append((f"fwd_fused[init={hi},ht={hh}]", get_fwd_fused_kernel, (h_qk, h_v, bool(hi), bool(hh)), {}))
        if split and not hi:  # the split path hands the fused kernel segment start states
            out.append((f"fwd_fused[init=1,ht={hh}]", get_fwd_fused_kernel, (h_qk, h_v, True, bool(hh)), {}))
        out.append((f"fwd_o[init={hi},ht={hh}]", get_fwd_o_kernel, (h_qk, h_v, bool(hi), bool(hh)), {}))
    if split:
        out.append(("seg_state", get_seg_state_kernel, (h_qk, h_v), {}))
        for h0 in h0s:
            out.append((f"fixup[h0={h0}]", get_fixup_kernel, (h_v, bool(h0), 32), {}))
    for h0, dht in bwd_flags:
        out.append((f"bwd_h[init={h0}]", get_bwd_h_kernel, (h_qk, h_v, bool(h0)), {}))
        out.append((f"bwd_dhu[dht={dht},dh0={h0}]", get_bwd_dhu_kernel, (h_qk, h_v, bool(dht), bool(h0)), {}))
        if split:
            out.append(("bwd_h[init=1]", get_bwd_h_kernel, (h_qk, h_v, True), {}))
            out.append((f"bwd_dhu[seg,dht={dht}]", get_bwd_dhu_kernel, (h_qk, h_v, bool(dht), True), {"split": "seg"}))
            out.append((f"bwd_dhu[carry,dh0={h0}]", get_bwd_dhu_kernel, (h_qk, h_v, True, bool(h0)), {"split": "carry"}))
            out.append((f"rfixup[dht={dht}]", get_fixup_kernel, (h_v, bool(dht), 32), {"reverse": True}))
    if bwd_flags:
        out.append(("bwd_dqkwy", get_bwd_dqkwy_kernel, (h_qk, h_v), {}))
    return out


def precompile_items(items, target=None, verbose=False) -> dict:
    """Compile [(name, getter, args, kwargs)] once each; returns {name: seconds}."""
    tk = target_key(target)
    times_s, seen = {}, set()
    for name, getter, args, kwargs in items:
        key = (getter, args, tuple(sorted(kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        t0 = time.perf_counter()
        getter(*args, target_k=tk, **kwargs)
        dt = time.perf_counter() - t0
        times_s[name] = times_s.get(name, 0.0) + dt
        if verbose and dt > 0.5:
            print(f"  {name:40s} {dt:7.1f} s", flush=True)
    return times_s


def precompile(h_qk: int, h_v: int, target=None, verbose=False, **kw) -> dict:
    """Compile :func:`default_kernels` (h_qk, h_v, **kw); returns {name: compile seconds}."""
    return precompile_items(default_kernels(h_qk, h_v, **kw), target, verbose)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hqk", type=int, action="append", required=True, help="q/k heads (repeat for several configs)")
    ap.add_argument("--hv", type=int, action="append", required=True, help="v heads, paired with --hqk in order")
    ap.add_argument("--target", default=None, help='TileLang target as JSON, default {"kind":"cuda","arch":"sm_90a"}')
    ap.add_argument("--fwd-only", action="store_true", help="only the forward's kernels")
    ap.add_argument("--list", action="store_true", help="only list the kernels")
    args = ap.parse_args(argv)
    if len(args.hqk) != len(args.hv):
        ap.error(f"--hqk given {len(args.hqk)} times but --hv {len(args.hv)} times; pass them in pairs")
    target = json.loads(args.target) if args.target and args.target.startswith("{") else args.target
    kw = {"bwd_flags": ()} if args.fwd_only else {}
    for hq, hv in zip(args.hqk, args.hv):
        if hv % hq:
            ap.error(f"--hv {hv} is not a multiple of --hqk {hq}")
        print(f"head config h_qk={hq} h_v={hv}:", flush=True)
        if args.list:
            for name, _, a, k in default_kernels(hq, hv, **kw):
                print(f"  {name} {a} {k or ''}")
            continue
        t = precompile(hq, hv, target, verbose=True, **kw)
        print(f"  total {sum(t.values()):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
