"""Correctness and timing check of the TileLang GDN backward on a Hopper GPU.

    python -m qlabench_tools.kernels.check_bwd [--quick] [--no-time] [--no-check] [--cases NAME,...] [--bwd-only]

For each case: forward (chunk_gdn_fwd_lowlevel) then chunk_gdn_bwd with intermediates;
every gradient (dq, dk, dv, dg, dβ, dh0) against autograd through the chunked fp32 reference
(qlabench.backends.reference.gdn_chunked_grads); then the stages: a case the planner splits
against the same backward unsplit (h, dh, v_new, dv_new), an unsplit one (without ``--quick`` on
the big cases) against its torch emulation fed the kernel's own inputs (emulate_bwd.stage_errors),
so a wrong kernel is named. Then the
backward alone (saved forward tensors) and forward+backward are timed with CUDA-graph replay
(median), plus per-stage event times. Each case runs in try/except.
Writes check_bwd.json and check_bwd.txt to $OUT when set.
"""

import argparse
import json
import os
import pathlib
import time
import traceback

import torch
from qlabench_tools.kernels.check_fused import SERVING_64
from qlabench_tools.kernels.check_fwd import graph_time_ms

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _import_pkg():
    import qlabench_kernels as pkg

    return pkg, None


TOL = {"dq": 4e-2, "dk": 4e-2, "dv": 4e-2, "dbeta": 4e-2, "dh0": 4e-2, "dg": 8e-2}
LINES = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LINES.append(s)


def make_inputs(seqlens, h_qk, h_v, seed=0, dev="cuda", with_h0=True, with_dht=True):
    gen = torch.Generator(device=dev).manual_seed(seed)
    T, N, D = sum(seqlens), len(seqlens), 128

    def rn(*s):
        return torch.randn(*s, generator=gen, device=dev)

    x = dict(
        q=torch.nn.functional.normalize(rn(1, T, h_qk, D), dim=-1).to(torch.bfloat16),
        k=torch.nn.functional.normalize(rn(1, T, h_qk, D), dim=-1).to(torch.bfloat16),
        v=rn(1, T, h_v, D).to(torch.bfloat16),
        g=torch.nn.functional.logsigmoid(rn(1, T, h_v) + 3.0) * 0.5,
        beta=torch.sigmoid(rn(1, T, h_v)),
    )
    x["g"][..., h_v - max(1, h_v // 4) :] = 0.0
    x["h0"] = rn(N, h_v, D, D) * 0.1 if with_h0 else None
    x["do"] = rn(1, T, h_v, D).to(torch.bfloat16)
    x["dht"] = rn(N, h_v, D, D) * 0.1 if with_dht else None
    x["cu"] = torch.tensor([0, *torch.cumsum(torch.tensor(seqlens), 0).tolist()], dtype=torch.int32, device=dev)
    x["lens"] = list(seqlens)
    return x


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def run_bwd(pkg, x, r, inter=False, split=None):
    return pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], gcs=r["gcs"], a_beta=r["a_beta"], ctab=r["ctab"],
        return_intermediates=inter, split_tokens=split, seqlens=x["lens"],
    )  # fmt: skip


def run_fwd(pkg, x):
    return pkg.chunk_gdn_fwd_lowlevel(
        x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], True, x["cu"], save_prep=True
    )  # fmt: skip


def check_case(
    pkg, name, seqlens, h_qk, h_v, results, stages=True, with_h0=True, with_dht=True, split=None
):
    from qlabench_tools.kernels import emulate_bwd as eb

    from qlabench.backends.reference import gdn_chunked_grads

    log(f"\n=== {name}: h_qk={h_qk} h_v={h_v} seqlens={seqlens if len(seqlens) <= 8 else len(seqlens)} "
        f"h0={with_h0} dht={with_dht} split={split}")  # fmt: skip
    x = make_inputs(seqlens, h_qk, h_v, with_h0=with_h0, with_dht=with_dht)
    t0 = time.perf_counter()
    r = run_fwd(pkg, x)
    g = run_bwd(pkg, x, r, inter=True, split=split)
    torch.cuda.synchronize()
    log(f"first fwd+bwd call (incl. compile / cache load) {time.perf_counter() - t0:.1f} s; "
        f"backward split_tokens={g['split_tokens']}")  # fmt: skip
    ref = gdn_chunked_grads(x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["h0"], x["cu"], x["do"], x["dht"])
    rec = dict(case=name, h_qk=h_qk, h_v=h_v, seqlens=list(seqlens), split=g["split_tokens"])
    ok = True
    for n in ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if with_h0 else []):
        t = g[n].float()
        nonfinite = int((~torch.isfinite(t)).sum())
        e = rel_l2(t, ref[n].detach())
        rec[f"rel_{n}"] = e
        rec[f"nonfinite_{n}"] = nonfinite
        ok = ok and nonfinite == 0 and e < TOL[n]
    log("vs reference: " + " ".join(f"{n[4:]}={rec[n]:.2e}" for n in rec if n.startswith("rel_")))
    if stages and g["split_tokens"]:
        # the split path's stages: h and dh per chunk against the unsplit kernels' (same inputs)
        u = run_bwd(pkg, x, r, inter=True, split=0)
        # only what the kernels define: valid chunk slots, and their rows < the chunk's length
        ct = g["ctab"].long()
        ln = (ct[:, 1] - ct[:, 0]).clamp(min=0)
        slot_ok = ln > 0
        row_ok = (torch.arange(64, device=ln.device)[None, :] < ln[:, None]).reshape(-1)
        errs = {}
        for n in ("h_all", "dh_all"):
            errs[n] = rel_l2(g[n][:, slot_ok].float(), u[n][:, slot_ok].float())
        for n in ("vnew", "dvnew"):
            errs[n] = rel_l2(g[n][:, row_ok].float(), u[n][:, row_ok].float())
        rec["stages"] = errs
        log("split vs unsplit stages: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
        del u
    elif stages:
        errs = eb.stage_errors(g, x["q"], x["k"], x["v"], x["beta"], x["do"], x["dht"], x["h0"], 128**-0.5)
        rec["stages"] = errs
        log("stages vs emulation: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    rec["ok"] = ok
    log("RESULT", "PASS" if ok else "FAIL")
    results.append(rec)
    del g, ref
    return x, r


def stage_times_ms(x, r, g, reps=10):
    from qlabench_kernels.bwd_dhu import run_bwd_dhu
    from qlabench_kernels.bwd_dqkwy import run_bwd_dqkwy
    from qlabench_kernels.bwd_h import run_bwd_h
    from qlabench_kernels.fixup import run_fixup
    from qlabench_kernels.seg_state import run_seg_state

    sc = 128**-0.5
    if g["split_tokens"]:
        e_end = torch.empty_like(g["h_start"])
        m_tr = torch.empty_like(g["h_start"], dtype=torch.bfloat16)
        run_seg_state(x["k"], x["v"], g["gcs"], g["a_beta"], g["stab"], g["cu_segs"], e_end, m_tr)
        chains = {
            "seg_state": lambda: run_seg_state(x["k"], x["v"], g["gcs"], g["a_beta"], g["stab"], g["cu_segs"], e_end, m_tr),
            "fixup": lambda: run_fixup(m_tr, e_end, g["cu_segs"], x["h0"], torch.empty_like(e_end)),
            "bwd_h": lambda: run_bwd_h(x["k"], x["v"], g["gcs"], g["a_beta"], g["stab"], g["h_start"], g["h_all"], g["vnew"]),
            "dhu_seg": lambda: run_bwd_dhu(
                x["q"], x["k"], g["gcs"], g["a_beta"], x["do"], x["dht"], g["stab"], sc, torch.empty_like(e_end),
                g["dh_all"], g["dvnew"], split="seg",
            ),
            "rfixup": lambda: run_fixup(m_tr, g["f_start"], g["cu_segs"], x["dht"], torch.empty_like(e_end), reverse=True),
            "dhu_carry": lambda: run_bwd_dhu(
                x["q"], x["k"], g["gcs"], g["a_beta"], x["do"], g["d_end"], g["stab"], sc, g["dh0"],
                g["dh_all"], g["dvnew"], split="carry",
            ),
        }  # fmt: skip
    else:
        chains = {
            "bwd_h": lambda: run_bwd_h(x["k"], x["v"], g["gcs"], g["a_beta"], g["stab"], x["h0"], g["h_all"], g["vnew"]),
            "bwd_dhu": lambda: run_bwd_dhu(
                x["q"], x["k"], g["gcs"], g["a_beta"], x["do"], x["dht"], g["stab"], sc, g["dh0"], g["dh_all"],
                g["dvnew"],
            ),
        }  # fmt: skip
    stages = {
        **chains,
        "bwd_dqkwy": lambda: run_bwd_dqkwy(
            x["q"], x["k"], x["v"], x["beta"], x["do"], g["gcs"], g["a_beta"], g["ctab"], g["h_all"], g["dh_all"],
            g["vnew"], g["dvnew"], sc,
        ),
    }  # fmt: skip
    out = {}
    for name, fn in stages.items():
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        out[name] = ts[len(ts) // 2]
    return out


def time_case(pkg, name, seqlens, h_qk, h_v, timings, bwd_only=False):
    x = make_inputs(seqlens, h_qk, h_v)
    r = run_fwd(pkg, x)
    try:
        ms_b = graph_time_ms(lambda: run_bwd(pkg, x, r))
        ms_f = ms_fb = float("nan")
        if not bwd_only:
            ms_f = graph_time_ms(lambda: run_fwd(pkg, x))
            ms_fb = graph_time_ms(lambda: run_bwd(pkg, x, run_fwd(pkg, x)))
        g = run_bwd(pkg, x, r, inter=True)
        g_split = g["split_tokens"]
        st = stage_times_ms(x, r, g)
        del g
        log(
            f"TIME {name:18s} split={g_split} bwd {ms_b:8.3f} ms  fwd {ms_f:7.3f}  fwd+bwd {ms_fb:8.3f} | "
            + " ".join(f"{k}={v:.3f}" for k, v in st.items())
        )
        timings.append(dict(case=name, split=g_split, bwd_ms=ms_b, fwd_ms=ms_f, fwdbwd_ms=ms_fb, stage_ms=st))
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        log(f"TIME {name} FAILED:\n" + "".join(traceback.format_exc().splitlines(True)[-10:]))


EIGHT = (3274, 1029, 2909, 5061, 2011, 3793, 9932, 4759)
CHECKS = [
    # name, seqlens, h_qk, h_v, kwargs
    ("mixed_2_8", (1, 63, 64, 65, 1000, 4097), 2, 8, {}),
    ("mixed_1_3_noh0", (1, 63, 64, 65, 1000, 4097), 1, 3, dict(with_h0=False, with_dht=False)),
    ("mixed_2_4", (5, 700, 0, 2000), 2, 4, {}),
    ("mixed_2_2", (5, 700, 0, 2000), 2, 2, {}),
    ("split_2_4", (5, 700, 0, 2000, 3001), 2, 4, dict(split=512)),
    ("split_1_3_noh0", (1, 63, 1000, 4097), 1, 3, dict(split=256, with_h0=False, with_dht=False)),
    ("split_2_8_h0only", (4097, 1000), 2, 8, dict(split=1024, with_dht=False)),
    ("2_4_1x8192", (8192,), 2, 4, {}),
    ("4_8_8way32768", EIGHT, 4, 8, {}),
    ("16_32_1x32768", (32768,), 16, 32, {}),
]
TIMES = [
    ("16_32_1x32768", (32768,), 16, 32),
    ("4_8_8way32768", EIGHT, 4, 8),
    ("2_4_1x8192", (8192,), 2, 4),
    ("2_4_1x32768", (32768,), 2, 4),
    ("8_16_4x8192", (8192,) * 4, 8, 16),
    ("16_32_8x1024", (1024,) * 8, 16, 32),
    # head configs and layouts off the backward sweep (configs/h200_bwd_heldout.yaml's kind)
    ("16_64_8way32768", EIGHT, 16, 64),
    ("4_12_serving", SERVING_64, 4, 12),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the per-stage emulation on the big cases")
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--no-check", action="store_true", help="timing only")
    ap.add_argument("--cases", default="", help="comma-separated case names (default all)")
    ap.add_argument("--bwd-only", action="store_true", help="time the backward alone (not fwd, fwd+bwd)")
    args = ap.parse_args()
    pkg, _ = _import_pkg()
    log(f"device {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    want = set(filter(None, args.cases.split(",")))
    results, timings = [], []
    if not args.no_check:
        for name, seqlens, hq, hv, kw in CHECKS:
            if want and name not in want:
                continue
            try:
                big = sum(seqlens) * hv > 300000
                check_case(pkg, name, seqlens, hq, hv, results, stages=not (args.quick and big), **kw)
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                log(f"CASE {name} CRASHED:\n" + "".join(traceback.format_exc().splitlines(True)[-12:]))
                results.append(dict(case=name, ok=False, crashed=True))
    if not args.no_time:
        for name, seqlens, hq, hv in TIMES:
            if want and name not in want:
                continue
            time_case(pkg, name, seqlens, hq, hv, timings, bwd_only=args.bwd_only)
    log("\n=== summary")
    for r in results:
        errs = " ".join(f"{k[4:]}={v:.2e}" for k, v in r.items() if k.startswith("rel_"))
        log(f"{r['case']:18s} {'PASS' if r.get('ok') else 'FAIL'} {errs}")
    for t in timings:
        log(f"{t['case']:18s} bwd {t['bwd_ms']:.3f} ms fwd+bwd {t['fwdbwd_ms']:.3f} ms")
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(out) / "check_bwd.json").write_text(json.dumps(dict(results=results, timings=timings), indent=1))
        (pathlib.Path(out) / "check_bwd.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
