"""Offline compilation of every forward kernel for one head configuration.

    python -m qlabench_kernels.compile --hqk 2 --hv 8 [--hqk 16 --hv 64 ...] [--target JSON] [--list]

compiles (nvcc, no GPU needed) each kernel variant and so fills TileLang's disk cache
($TILELANG_CACHE_DIR, default ~/.tilelang/cache); a later run on the GPU with the same
target (default {"kind":"cuda","arch":"sm_90a"}) loads the cached binaries.

Compiled per head configuration (h_qk, h_v):
    prep(h_qk, h_v)
    fwd_o(h_qk, h_v, has_init, has_ht)     for has_init, has_ht in {0,1}²
    seg_state(h_qk, h_v)                   (sequence splitting)
    fixup(h_v, has_h0)                     for has_h0 in {0,1} (sequence splitting)
    fwd_o and seg_state again with a pipelined chunk loop (stages=2, $QLABENCH_GDN_STAGES=2)
T, N and the sequence layout are runtime values: nothing recompiles per shape.
"""

import argparse
import json
import sys
import time

from ._common import target_key


def kernel_variants(h_qk: int, h_v: int, full: bool = True):
    """[(name, getter, args)] for every kernel compiled for (h_qk, h_v).

    full=False gives one variant per code path (what the CPU compile test builds).
    """
    from .fixup import get_fixup_kernel
    from .fwd_o import get_fwd_o_kernel
    from .prep import get_prep_kernel
    from .seg_state import get_seg_state_kernel

    out = [("prep", get_prep_kernel, (h_qk, h_v))]
    flags = [(1, 1), (1, 0), (0, 1), (0, 0)] if full else [(1, 1)]
    stages = [0, 2] if full else [0]
    for st in stages:
        sfx = "" if st == 0 else f",stages={st}"
        for hi, hh in flags:
            out.append((f"fwd_o[init={hi},ht={hh}{sfx}]", get_fwd_o_kernel, (h_qk, h_v, bool(hi), bool(hh), 64, st)))
        out.append((f"seg_state[{sfx[1:]}]" if sfx else "seg_state", get_seg_state_kernel, (h_qk, h_v, 64, st)))
    for h0 in [1, 0] if full else [1]:
        out.append((f"fixup[h0={h0}]", get_fixup_kernel, (h_v, bool(h0), 32)))
    return out


def variant_kernels(h_qk: int, h_v: int, spec, flags=((1, 1),), h0s=(1,), split: bool = True):
    """[(name, getter, args, kwargs)] of the kernels one speed variant (``_common.parse_variant``
    spec, e.g. "tables=tl,prep=blocked") runs for (h_qk, h_v) with the given fwd_o state flags."""
    from ._common import parse_variant, variant_name
    from .fixup import get_fixup_kernel
    from .fwd_o import get_fwd_o_kernel
    from .fwd_o_ws import get_fwd_o_ws_kernel
    from .prep import get_prep_kernel
    from .seg_state import get_seg_state_kernel
    from .tables import NT, get_tables_kernel

    var = parse_variant(spec)
    tag = variant_name(var)
    bv, thr, st, fm = int(var["fwd_bv"]), int(var["fwd_threads"]), var["stages"], var["fastmath"] == "1"
    out = []
    if var["tables"] == "tl":
        out.append(("tables", get_tables_kernel, (NT,), {}))
    if var["prep"] == "subst":
        out.append(("prep", get_prep_kernel, (h_qk, h_v), {}))
    else:
        out.append((f"prep[{var['prep']}]", get_prep_kernel, (h_qk, h_v), {"method": var["prep"]}))
    # autobv: plan_fwd picks fwd_o's V block, 64 or 32, per shape
    bvs = (bv, 32) if var["autobv"] == "1" and var["fwd_ws"] == "1" and bv != 32 else (bv,)
    if var["pprep"] == "1":  # prep writes P; the warp-specialised fwd_o loads it (run_fwd_o(p_all=...))
        from .fwd_o_ws import get_fwd_o_ws_p_kernel

        out[-1] = (f"prep[{var['prep']},P]", get_prep_kernel, (h_qk, h_v), {"method": var["prep"], "with_p": True})
        for hi, hh in flags:
            for b in bvs:
                out.append((
                    f"fwd_o_ws_p[init={hi},ht={hh},bv={b}|{tag}]", get_fwd_o_ws_p_kernel, (h_qk, h_v, bool(hi), bool(hh), b),
                    {**({"stages": 3} if var["ws_stages"] == "3" else {}), **({"uw": True} if var["uw"] == "1" else {})},
                ))  # fmt: skip
        flags = ()
    for hi, hh in flags:
        if var["fwd_ws"] == "1":  # same call as run_fwd_o(ws=True)
            for b in bvs:
                out.append((
                    f"fwd_o_ws[init={hi},ht={hh},bv={b}|{tag}]", get_fwd_o_ws_kernel, (h_qk, h_v, bool(hi), bool(hh), b),
                    {"fastmath": fm, **({"stages": 3} if var["ws_stages"] == "3" else {}),
                     **({"rowexp": True} if var["rowexp"] == "1" else {})},
                ))  # fmt: skip
            continue
        args = (h_qk, h_v, bool(hi), bool(hh), bv, st)
        kw = {"threads": thr} if thr != 128 else {}
        if fm:
            kw = {"threads": thr, "fastmath": True}
        out.append((f"fwd_o[init={hi},ht={hh}|{tag}]", get_fwd_o_kernel, args, kw))
    if split:
        kw = {"fastmath": True} if fm else {}
        if var["rowexp"] == "1":
            kw = {"fastmath": fm, "rowexp": True}
        name = f"seg_state[stages={st}{',fm' if fm else ''}{',rowexp' if var['rowexp'] == '1' else ''}]"
        out.append((name, get_seg_state_kernel, (h_qk, h_v, 64, st), kw))
        for h0 in h0s:
            out.append((f"fixup[h0={h0}]", get_fixup_kernel, (h_v, bool(h0), 32), {}))
    return out


def bwd_variant_kernels(h_qk: int, h_v: int, spec, flags=((1, 1),), bvs=(32,), split: bool = True):
    """[(name, getter, args, kwargs)] of the backward kernels one variant spec runs for (h_qk, h_v):
    flags = (has_h0, has_dht) pairs; ``split`` adds the split chains' kernels (seg_state, fixup,
    bwd_dhu's two split passes, the reverse fix-up). The forward's are :func:`variant_kernels`."""
    from ._common import bwd_ws_forms, parse_variant, variant_name
    from .bwd_dhu import get_bwd_dhu_kernel
    from .bwd_dqkwg import get_bwd_dqkwg_kernel
    from .bwd_h import get_bwd_h_kernel
    from .bwd_h_ws import get_bwd_h_ws_kernel
    from .bwd_wy import get_bwd_wy_kernel
    from .fixup import get_fixup_kernel, get_rfixup_kernel
    from .seg_state import get_seg_state_kernel

    var = parse_variant(spec)
    tag = variant_name(var)
    ws, rx = var["bwd_ws"] == "1", var["rowexp"] == "1"
    rkw = {"rowexp": True} if rx else {}
    # bwd_stages=auto runs both forms of bwd_dhu (by shape); 2 / 0 only that one
    stage_kws0 = [{}] if var["bwd_stages"] == "0" or not rx else [{"stages": 2}]
    if var["bwd_stages"] == "auto" and rx:
        stage_kws0 = [{}, {"stages": 2}]
    out = []
    for bv in bvs:
        get_dhu, dkw0, stage_kws = get_bwd_dhu_kernel, rkw, stage_kws0
        if var["bwd_dhu_ws"] == "1" and bv == 32:  # the warp-specialised bwd_dhu (no rowexp / stages forms)
            from .bwd_dhu_ws import get_bwd_dhu_ws_kernel

            get_dhu, dkw0, stage_kws = get_bwd_dhu_ws_kernel, {}, [{}]
        for h0, dht in flags:
            get_h = get_bwd_h_ws_kernel if ws else get_bwd_h_kernel
            out.append((f"bwd_h{'_ws' if ws else ''}[init={h0},bv={bv}]", get_h, (h_qk, h_v, bool(h0), bv), {}))
            for skw in stage_kws:
                st = f",stages={skw['stages']}" if skw else ""
                out.append((f"bwd_dhu[dht={dht},dh0={h0},bv={bv}{st}|{tag}]", get_dhu,
                            (h_qk, h_v, bool(dht), bool(h0), bv), {**dkw0, **skw}))  # fmt: skip
                if split and ws:
                    out.append((f"bwd_dhu[seg,dht={dht},bv={bv}{st}|{tag}]", get_dhu,
                                (h_qk, h_v, bool(dht), True, bv), {**dkw0, **skw, "split": "seg"}))  # fmt: skip
                    out.append((f"bwd_dhu[carry,dh0={h0},bv={bv}{st}|{tag}]", get_dhu,
                                (h_qk, h_v, True, bool(h0), bv), {**dkw0, **skw, "split": "carry"}))  # fmt: skip
            if split and ws:
                out.append((f"bwd_h_ws[init=1,bv={bv}]", get_bwd_h_ws_kernel, (h_qk, h_v, True, bv), {}))
    if split and ws:
        st, fm = var["stages"], var["fastmath"] == "1"
        kw = {"fastmath": fm, "rowexp": True} if rx else ({"fastmath": True} if fm else {})
        out.append((f"seg_state[stages={st}|{tag}]", get_seg_state_kernel, (h_qk, h_v, 64, st), kw))
        for h0, dht in flags:
            out.append((f"fixup[h0={h0}]", get_fixup_kernel, (h_v, bool(h0), 32), {}))
            out.append((f"rfixup[dht={dht}]", get_rfixup_kernel, (h_v, bool(dht), 32), {}))
    thr = int(var["bwd_threads"])
    tkw = {"threads": thr} if thr != 128 else {}
    dkw = dict(tkw)
    if var["bwd_rsum"] == "1" or var["bwd_bf16"] == "1":
        dkw.update(rsum=var["bwd_rsum"] == "1", bf16_out=var["bwd_bf16"] == "1")
    gkw = {"grp": True} if var["bwd_grp"] == "1" else {}
    dkw.update(gkw)
    if var["bwd_dhu_ws"] == "1" and 32 in bvs:
        from .bwd_pw import get_bwd_pw_kernel

        out.append(("bwd_pw", get_bwd_pw_kernel, (h_qk, h_v), {}))
    dq_ws, wy_ws = bwd_ws_forms(var, h_qk, h_v)  # what chunk_gdn_bwd runs
    if dq_ws:
        from .bwd_dqkwg_ws import get_bwd_dqkwg_ws_kernel

        out.append(("bwd_dqkwg_ws", get_bwd_dqkwg_ws_kernel, (h_qk, h_v), {}))
    else:
        out.append((f"bwd_dqkwg[threads={thr}|{tag}]", get_bwd_dqkwg_kernel, (h_qk, h_v), dkw))
    if wy_ws:
        from .bwd_wy_ws import get_bwd_wy_ws_kernel

        out.append(("bwd_wy_ws", get_bwd_wy_ws_kernel, (h_qk, h_v), {}))
        return out
    wkw = {**tkw, "bf16_dk": True, **gkw} if var["bwd_bf16"] == "1" else {**tkw, **gkw}
    out.append((f"bwd_wy[threads={thr}|{tag}]", get_bwd_wy_kernel, (h_qk, h_v), wkw))
    return out


def _compile_all(items, tk, verbose=False) -> dict:
    """Compile [(name, getter, args, kwargs)] once each (same getter, args and kwargs: once);
    returns {name: seconds}."""
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
            print(f"  {name:48s} {dt:7.1f} s", flush=True)
    return times_s


def precompile_bwd_variants(h_qk: int, h_v: int, specs, target=None, verbose=False, **kw):
    """Compile every backward kernel of each variant spec for (h_qk, h_v) (see :func:`bwd_variant_kernels`)."""
    items = [it for spec in specs for it in bwd_variant_kernels(h_qk, h_v, spec, **kw)]
    return _compile_all(items, target_key(target), verbose)


def precompile_variants(h_qk: int, h_v: int, specs, target=None, verbose=False, **kw):
    """Compile every kernel of each variant spec for (h_qk, h_v) (duplicates are cached)."""
    items = [it for spec in specs for it in variant_kernels(h_qk, h_v, spec, **kw)]
    return _compile_all(items, target_key(target), verbose)


def precompile(h_qk: int, h_v: int, target=None, full: bool = True, verbose: bool = False):
    """Compile every kernel for (h_qk, h_v); returns {name: compile seconds}."""
    tk = target_key(target)
    times_s = {}
    for name, getter, args in kernel_variants(h_qk, h_v, full):
        t0 = time.perf_counter()
        getter(*args, target_k=tk)
        times_s[name] = time.perf_counter() - t0
        if verbose:
            print(f"  {name:24s} {times_s[name]:7.1f} s", flush=True)
    return times_s


def kernel_sources(h_qk: int, h_v: int, target=None, full: bool = False):
    """{name: generated CUDA source} for each kernel of (h_qk, h_v) (compiles if needed)."""
    tk = target_key(target)
    return {
        name: getter(*args, target_k=tk).get_kernel_source() for name, getter, args in kernel_variants(h_qk, h_v, full)
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hqk", type=int, action="append", required=True, help="q/k heads (repeat for several configs)")
    ap.add_argument("--hv", type=int, action="append", required=True, help="v heads, paired with --hqk in order")
    ap.add_argument("--target", default=None, help='TileLang target as JSON, default {"kind":"cuda","arch":"sm_90a"}')
    ap.add_argument("--list", action="store_true", help="only list the kernel variants")
    ap.add_argument(
        "--variants", default="", help='also compile these speed variants, ";"-separated (e.g. "tables=tl;prep=blocked")'
    )
    args = ap.parse_args(argv)
    if len(args.hqk) != len(args.hv):
        ap.error(f"--hqk given {len(args.hqk)} times but --hv {len(args.hv)} times; pass them in pairs")
    target = json.loads(args.target) if args.target and args.target.startswith("{") else args.target
    for hq, hv in zip(args.hqk, args.hv):
        if hv % hq:
            ap.error(f"--hv {hv} is not a multiple of --hqk {hq}")
        print(f"head config h_qk={hq} h_v={hv}:", flush=True)
        if args.list:
            for name, _, a in kernel_variants(hq, hv):
                print(f"  {name} {a}")
            continue
        t = precompile(hq, hv, target, verbose=True)
        if args.variants:
            t.update(precompile_variants(hq, hv, args.variants.split(";"), target, verbose=True))
        print(f"  total {sum(t.values()):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
