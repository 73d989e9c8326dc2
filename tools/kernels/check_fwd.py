"""Correctness and timing check of the TileLang GDN forward on a Hopper GPU.

    python -m qlabench_tools.kernels.check_fwd [--quick] [--no-time] [--cases NAME,...] [--stage prep]

For each case: runs chunk_gdn_fwd_lowlevel on fwd_o's paths (``save_prep``; the fused kernel:
check_fused.py), compares o / final state with an fp32 token
recurrence (rel L2), and every stage with its torch emulation fed the kernel's own inputs
(prep: gcs, a_beta; seg_state: e_end, m_tr; fixup: h_start; fwd_o: o, ht) so a mismatch
points at one kernel. Then times the whole forward with CUDA-graph replay (median) for
several split settings, plus each stage's CUDA-graph time. Each case runs in try/except.
``--stage prep``: prep alone on each case at every way of slicing the GVA group over CTAs (every
chunk slot's gcs, A_β and P against its mirror, all three outputs NaN-poisoned first; a package
whose prep has no slicing gets P poisoned only), then its CUDA-graph median; versions of it
compare one process per package on PYTHONPATH.
Writes check_fwd.json and check_fwd.txt to $OUT when set.
"""

import argparse
import inspect
import json
import os
import pathlib
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _import_pkg():
    import qlabench_kernels as pkg
    from qlabench_tools.kernels import emulate as emu

    return pkg, emu


LINES = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LINES.append(s)


def make_inputs(seqlens, h_qk, h_v, seed=0, dev="cuda", with_h0=True):
    gen = torch.Generator(device=dev).manual_seed(seed)
    T, N, D = sum(seqlens), len(seqlens), 128

    def rn(*s):
        return torch.randn(*s, generator=gen, device=dev)

    q = torch.nn.functional.normalize(rn(1, T, h_qk, D), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(rn(1, T, h_qk, D), dim=-1).to(torch.bfloat16)
    v = rn(1, T, h_v, D).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(rn(1, T, h_v) + 3.0) * 0.5
    g[..., h_v - max(1, h_v // 4) :] = 0.0  # 25% of v-heads: g = 0 (no decay)
    beta = torch.sigmoid(rn(1, T, h_v))
    h0 = rn(N, h_v, D, D) * 0.1 if with_h0 else None
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(seqlens), 0).tolist()], dtype=torch.int32, device=dev)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu=cu)


def reference_fp32(x, scale=128**-0.5):
    """fp32 token recurrence on the GPU, batched over v-heads."""
    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "h0", "cu"))
    T, h_qk, h_v = q.shape[1], q.shape[2], v.shape[2]
    G = h_v // h_qk
    qh = q[0].float().repeat_interleave(G, dim=1) * scale
    kh = k[0].float().repeat_interleave(G, dim=1)
    vh, eg, bb = v[0].float(), torch.exp(g[0].float()), beta[0].float()
    o = torch.empty(T, h_v, 128, device=q.device)
    hts = []
    cl = cu.tolist()
    for n in range(len(cl) - 1):
        S = torch.zeros(h_v, 128, 128, device=q.device) if h0 is None else h0[n].float().clone()
        for t in range(cl[n], cl[n + 1]):
            S.mul_(eg[t][:, None, None])
            kS = torch.bmm(kh[t][:, None, :], S)[:, 0]
            S.baddbmm_(kh[t][:, :, None], (bb[t][:, None] * (vh[t] - kS))[:, None, :])
            o[t] = torch.bmm(qh[t][:, None, :], S)[:, 0]
        hts.append(S)
    return o[None], torch.stack(hts)


def graph_time_ms(fn, reps=20, inner=None, target_s=0.01, max_inner=20):
    """Median per-call ms over CUDA-graph replays (``inner`` calls captured per graph; None:
    enough for ``target_s`` of work per replay, at most ``max_inner``)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = time.perf_counter() - t0
    if inner is None:
        inner = max(1, min(max_inner, int(target_s / max(est, 1e-6))))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    times.sort()
    return times[len(times) // 2]


def stage_times_ms(pkg, x, split_tokens, block_v, reps=10):
    """Per-stage CUDA-graph medians (:func:`graph_time_ms`) of the plan (``split_tokens``,
    ``block_v``) the whole forward ran, each launcher re-run on saved inputs (the unsplit fused
    kernel runs no prep)."""
    from qlabench_kernels.fixup import run_fixup
    from qlabench_kernels.fwd_fused import run_fwd_fused
    from qlabench_kernels.fwd_o import run_fwd_o
    from qlabench_kernels.prep import run_prep
    from qlabench_kernels.seg_state import run_seg_state
    from qlabench_kernels.tables import run_tables

    r = pkg.chunk_gdn_fwd_lowlevel(
        x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], True, x["cu"], split_tokens, block_v=block_v,
        save_prep=True,
    )  # fmt: skip
    scale = 128**-0.5
    cu = x["cu"].long()
    T, N = x["q"].shape[1], cu.numel() - 1
    sp = r["split_tokens"]
    seg = sp if sp else (max(T, 1) + 63) // 64 * 64
    fused = r["block_v"] == 128
    # the final kernel's table: stab's rows longest first where the forward ordered them
    fstab = r.get("stab_lpt", r["stab"])
    stages = {"tables": lambda: run_tables(cu, T, N, seg, bool(sp), fstab is not r["stab"])}
    if sp or not fused:
        stages["prep"] = lambda: run_prep(x["q"], x["k"], x["g"], x["beta"], r["ctab"], scale, p_all=r["p_all"])
    if sp:
        stages["seg_state"] = lambda: run_seg_state(x["k"], x["v"], r["gcs"], r["a_beta"], r["stab"], r["cu_segs"].int(), r["e_end"], r["m_tr"])
        stages["fixup"] = lambda: run_fixup(r["m_tr"], r["e_end"], r["cu_segs"].int(), x["h0"], r["h_start"])
        init = r["h_start"]
    else:
        init = x["h0"]
    if fused:
        g, beta = x["g"].float().contiguous(), x["beta"].float().contiguous()
        stages["fused"] = lambda: run_fwd_fused(
            x["q"], x["k"], x["v"], g, beta, fstab, init, scale, r["o"], r["final_state"]
        )  # fmt: skip
    else:
        # a package whose fwd_o has one V block takes no block_v
        bv = {"block_v": r["block_v"]} if "block_v" in inspect.signature(run_fwd_o).parameters else {}
        stages["fwd_o"] = lambda: run_fwd_o(
            x["q"], x["k"], x["v"], r["gcs"], r["a_beta"], r["p_all"], fstab, init, scale, r["o"], r["final_state"],
            **bv,
        )  # fmt: skip
    return {name: graph_time_ms(fn, reps=reps) for name, fn in stages.items()}


_REF = {}


def check_prep(pkg, emu, name, seqlens, h_qk, h_v, results, do_time=True):
    """prep alone at each way of slicing the GVA group over CTAs (every divisor of G; the planned
    one marked): its outputs (NaN-poisoned first) against emu_prep's, then its graph median."""
    from qlabench_kernels._common import chunk_table
    from qlabench_kernels.prep import run_prep

    x = make_inputs(seqlens, h_qk, h_v, with_h0=False)
    T, N, scale = x["q"].shape[1], len(seqlens), 128**-0.5
    ctab, _ = chunk_table(x["cu"].long(), T, N)
    ctab = ctab.to(x["q"].device)
    ncs = ctab.shape[0]
    want = emu.emu_prep(x["k"], x["g"], x["beta"], ctab, q=x["q"], scale=scale)
    nvalid = int((ctab[:, 2] >= 0).sum()) * 64
    G = h_v // h_qk
    try:
        from qlabench_kernels.plan import prep_slices, sm_count

        planned = prep_slices(h_qk, h_v, ncs, sm_count(x["q"].device))
        choices = [d for d in range(1, G + 1) if G % d == 0]
    except ImportError:  # a version of the package whose prep has one CTA per v-head
        planned, choices = None, [None]
    for d in choices:
        p_all = torch.full((h_v, ncs * 64, 64), float("nan"), device=x["q"].device, dtype=torch.bfloat16)
        kw = {} if d is None else {"slices": d}
        if d is not None:  # this package's prep takes its other outputs too: poisoned as well
            kw.update(gcs=torch.full((h_v, ncs * 64), float("nan"), device=p_all.device), a_beta=p_all.clone())
        got = run_prep(x["q"], x["k"], x["g"], x["beta"], ctab, scale, p_all=p_all, **kw)
        torch.cuda.synchronize()
        rec = dict(case=name, stage="prep", h_qk=h_qk, h_v=h_v, seqlens=list(seqlens), slices=d, planned=d == planned)
        for key, a, b in zip(("gcs", "a_beta", "p"), got, want):
            a, b = a[:, :nvalid].float(), b[:, :nvalid].float()
            rec[f"nan_{key}"] = int(torch.isnan(a).sum())
            rec[f"rel_{key}"] = emu.rel_l2(torch.nan_to_num(a, nan=1e30), b)
        rec["ok"] = all(rec[f"nan_{k}"] == 0 and rec[f"rel_{k}"] < 1e-2 for k in ("gcs", "a_beta", "p"))
        if do_time:
            rec["prep_ms"] = graph_time_ms(
                lambda kw=kw, p_all=p_all: run_prep(x["q"], x["k"], x["g"], x["beta"], ctab, scale, p_all=p_all, **kw)
            )
        log(
            f"PREP {name:20s} slices={d}{'*' if d == planned else ' '} {'PASS' if rec['ok'] else 'FAIL'} "
            f"rel gcs={rec['rel_gcs']:.1e} a_beta={rec['rel_a_beta']:.1e} p={rec['rel_p']:.1e} "
            f"nan={rec['nan_gcs'] + rec['nan_a_beta'] + rec['nan_p']}"
            + (f" | graph median {rec['prep_ms']:.4f} ms" if do_time else "")
        )
        results.append(rec)


def kernel_launches(fn):
    """CUDA kernels launched by one call of ``fn`` (torch.profiler), or -1 if unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001
        return -1


def check_case(pkg, emu, name, seqlens, h_qk, h_v, split_tokens, results, stages=True):
    log(
        f"\n=== {name}: h_qk={h_qk} h_v={h_v} seqlens={seqlens if len(seqlens) <= 8 else len(seqlens)} "
        f"split={split_tokens}"
    )
    x = make_inputs(seqlens, h_qk, h_v)
    t0 = time.perf_counter()
    r = pkg.chunk_gdn_fwd_lowlevel(
        x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], True, x["cu"], split_tokens=split_tokens,
        save_prep=True,
    )
    torch.cuda.synchronize()
    log(
        f"first call (incl. compile/cache load) {time.perf_counter() - t0:.1f} s; "
        f"split_tokens used = {r['split_tokens']}"
    )
    rec = dict(case=name, h_qk=h_qk, h_v=h_v, seqlens=list(seqlens), split_tokens=r["split_tokens"])
    rec["nan_o"] = int(torch.isnan(r["o"].float()).sum())
    rec["nan_ht"] = int(torch.isnan(r["final_state"]).sum())
    # the one-launch tables must equal the torch builders' exactly
    from qlabench_kernels._common import chunk_table, segment_table

    cu = x["cu"].long()
    T, N = x["q"].shape[1], len(seqlens)
    sp = r["split_tokens"]
    ct, cc = chunk_table(cu, T, N)
    stb, cs = segment_table(cu, cc, T, N, sp if sp else (max(T, 1) + 63) // 64 * 64, split=bool(sp))
    rec["tables_equal"] = bool(
        torch.equal(ct, r["ctab"]) and torch.equal(stb, r["stab"]) and torch.equal(cc.int(), r["cu_chunks"].int())
    )
    log(f"tl tables equal torch tables: {rec['tables_equal']}")
    key = (tuple(seqlens), h_qk, h_v)
    if key not in _REF:
        _REF.clear()
        _REF[key] = reference_fp32(x)
    ref_o, ref_h = _REF[key]
    rec["rel_o"] = emu.rel_l2(r["o"].float(), ref_o)
    rec["rel_ht"] = emu.rel_l2(r["final_state"], ref_h)
    log(
        f"vs recurrence: rel_o={rec['rel_o']:.3e} rel_ht={rec['rel_ht']:.3e} "
        f"nan_o={rec['nan_o']} nan_ht={rec['nan_ht']}"
    )
    if stages:
        ctab = r["ctab"]
        nvalid = int((ctab[:, 2] >= 0).sum()) * 64
        gcs_e, a_e = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
        rec["stage_prep_gcs"] = emu.rel_l2(r["gcs"][:, :nvalid], gcs_e[:, :nvalid])
        rec["stage_prep_a"] = emu.rel_l2(r["a_beta"][:, :nvalid].float(), a_e[:, :nvalid].float())
        del gcs_e, a_e
        init = x["h0"]
        if r["split_tokens"]:
            e_e, m_e = emu.emu_seg_state(x["k"], x["v"], r["gcs"], r["a_beta"], r["stab"], r["cu_segs"])
            used = torch.isfinite(e_e).flatten(1).all(1)
            if bool(used.any()):
                rec["stage_seg_e"] = emu.rel_l2(r["e_end"][used], e_e[used])
                rec["stage_seg_m"] = emu.rel_l2(r["m_tr"][used].float(), m_e[used])
            hs_e = emu.emu_fixup(r["m_tr"], r["e_end"], r["cu_segs"], x["h0"])
            used = torch.isfinite(hs_e).flatten(1).all(1)
            rec["stage_fixup"] = emu.rel_l2(r["h_start"][used], hs_e[used])
            init = r["h_start"]
        o_e, h_e = emu.emu_fwd_o(
            x["q"], x["k"], x["v"], r["gcs"], r["a_beta"], r["stab"], init, 128**-0.5, len(seqlens)
        )
        rec["stage_fwd_o_o"] = emu.rel_l2(r["o"].float(), o_e)
        rec["stage_fwd_o_ht"] = emu.rel_l2(r["final_state"], h_e)
        log("stages vs emulation: " + " ".join(f"{k[6:]}={v:.2e}" for k, v in rec.items() if k.startswith("stage_")))
    ok = rec["rel_o"] < 1e-2 and rec["rel_ht"] < 1e-2 and rec["nan_o"] == 0 and rec["nan_ht"] == 0
    ok = ok and rec.get("tables_equal", True)
    rec["ok"] = ok
    log("RESULT", "PASS" if ok else "FAIL")
    results.append(rec)
    return x


def time_case(pkg, name, x, splits, results):
    for sp in splits:
        try:

            def fn(sp=sp):
                return pkg.chunk_gdn_fwd_lowlevel(
                    x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], True, x["cu"], split_tokens=sp
                )

            ms = graph_time_ms(fn)
            plan = fn()
            used, bv = plan["split_tokens"], plan["block_v"]
            st = stage_times_ms(pkg, x, used, bv)
            nk = kernel_launches(fn)
            log(
                f"TIME {name:28s} split={str(sp):5s}(used {used:5d}, block_v {bv:3d}) graph median {ms:8.3f} ms "
                f"launches {nk:3d} | " + " ".join(f"{k}={v:.3f}" for k, v in st.items())
            )
            results.append(
                dict(case=name, split_tokens=sp, used_split=used, block_v=bv, latency_ms=ms, launches=nk, stage_ms=st)
            )  # fmt: skip
        except Exception:  # noqa: BLE001
            log(f"TIME {name} split={sp} FAILED:\n" + "".join(traceback.format_exc().splitlines(True)[-8:]))


CASES = [
    # name, seqlens, h_qk, h_v, split for the correctness run, time?, splits to time
    ("mixed_2_8", (1, 63, 64, 65, 1000, 4097), 2, 8, 0, False, []),
    ("mixed_2_8_split1024", (1, 63, 64, 65, 1000, 4097), 2, 8, 1024, False, []),
    ("mixed_1_3_split512", (5, 700, 64, 2000), 1, 3, 512, False, []),
    ("2_8_1x32768", (32768,), 2, 8, None, True, [None, 0, 1024, 2048, 4096]),
    ("16_64_1x32768", (32768,), 16, 64, None, True, [None, 0, 8192, 16384]),
    ("16_64_4x8192", (8192,) * 4, 16, 64, None, True, [None, 4096]),
    ("2_8_8x1024", (1024,) * 8, 2, 8, None, True, [None, 512]),
    ("2_8_1x2048", (2048,), 2, 8, None, True, [None, 512, 1024]),
    ("2_8_1x8192", (8192,), 2, 8, None, True, [None, 512, 2048, 0]),
    ("16_32_8x4096", (4096,) * 8, 16, 32, None, True, [None]),
    ("16_16_2x8192", (8192,) * 2, 16, 16, None, True, [None]),
    ("16_16_1x32768", (32768,), 16, 16, None, True, [None, 4096, 8192]),
    ("8_24_1x32768", (32768,), 8, 24, None, True, [None, 4096, 8192]),
    ("8_32_1x32768", (32768,), 8, 32, None, True, [None, 0, 8192, 16384]),
    ("4_16_1x32768", (32768,), 4, 16, None, True, [None, 4096, 8192]),
]



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the per-stage emulation on the big cases")
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--cases", default="", help="comma-separated case names (default all)")
    ap.add_argument("--stage", choices=("prep",), help="one stage alone: its outputs, then its time")
    args = ap.parse_args()
    pkg, emu = _import_pkg()
    log(f"device {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    results, timings = [], []
    want = set(filter(None, args.cases.split(",")))
    for name, seqlens, hq, hv, split, do_time, splits in CASES:  # one case at a time: the reference is cached
        if want and name not in want:
            continue
        try:
            if args.stage == "prep":
                check_prep(pkg, emu, name, seqlens, hq, hv, results, do_time=not args.no_time)
                torch.cuda.empty_cache()
                continue
            big = sum(seqlens) * hv > 300000
            x = check_case(pkg, emu, name, seqlens, hq, hv, split, results, stages=not (args.quick and big))
            if do_time and not args.no_time:
                time_case(pkg, name, x, splits, timings)
            del x
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            log(f"CASE {name} CRASHED:\n" + "".join(traceback.format_exc().splitlines(True)[-12:]))
            results.append(dict(case=name, ok=False, crashed=True))
    log("\n=== summary")
    for r in results:
        if r.get("stage") == "prep":
            log(
                f"{r['case']:52s} slices={r['slices']}{'*' if r['planned'] else ' '} {'PASS' if r['ok'] else 'FAIL'} "
                f"prep {r.get('prep_ms', float('nan')):.4f} ms"
            )
            continue
        log(
            f"{r['case']:60s} {'PASS' if r.get('ok') else 'FAIL'} rel_o={r.get('rel_o', float('nan')):.2e} "
            f"rel_ht={r.get('rel_ht', float('nan')):.2e}"
        )
    for t in timings:
        log(f"{t['case']:60s} split={str(t['split_tokens']):5s} {t['latency_ms']:.3f} ms launches={t['launches']}")
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(out) / "check_fwd.json").write_text(json.dumps(dict(results=results, timings=timings), indent=1))
        (pathlib.Path(out) / "check_fwd.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
