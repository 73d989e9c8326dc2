"""Per-role timeline of the fused forward kernel (kernels/fwd_fused.py) on a Hopper GPU.

    python -m qlabench_tools.kernels.trace_fused [--shapes NAME,...] [--compile-only]

A copy of the kernel's program gets, before every line marked ``# @trace NAME`` there, a store of
the SM clock (``clock64``) by one thread of the line's role (state: thread 0, aux: thread 256,
producer: thread 384) into ``tr[cta, chunk, slot]``; the kernel in the package is not changed, so
its cache entries stay valid. Per shape: the traced kernel's outputs against the untraced one's
(the stamps must not change them), both timed by CUDA-graph replay (what the stamps cost), then per
role the median cycles of each phase (from its stamp to the role's next one) over the chunks of
every CTA but each walk's first two and its last, and each role's chunk period (its first stamp to
the next chunk's); per walk length, the fill (the producer's first stamp to the state's first GEMM)
and the span (to the state's last stamp). Exit 1 when the traced kernel's outputs differ from the untraced one's or a stamp
was never written (a mark whose role prefix is not the role whose branch holds it). ``--compile-only`` builds the traced kernels for the shapes' head configs (no GPU; into
$TILELANG_CACHE_DIR). Writes trace_fused.json / .txt to $OUT when set.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import re
import sys
import tempfile

from qlabench_tools.kernels.check_fused import SERVING_64
from qlabench_tools.kernels.check_fwd import LINES, _import_pkg, log

SHAPES = {  # name: (seqlens, h_qk, h_v)
    "16/64 4x8192": ([8192] * 4, 16, 64),
    "16/64 8x1024": ([1024] * 8, 16, 64),
    "2/8 1x32768": ([32768], 2, 8),
    "32/32 4x8192": ([8192] * 4, 32, 32),
    "2/8 serving": (SERVING_64, 2, 8),
    "16/64 serving": (SERVING_64, 16, 64),
}
ROLE_TX = {"s": 0, "a": 256, "p": 384}
NSLOT = 32
MARK = re.compile(r"^(\s*)(.*?)\s*# @trace (\w+)\s*$")


def traced_source(src: str):
    """(source of the traced program, [slot names]): the stamps inserted, ``tr`` in the signature."""
    out, names = [], []
    for line in src.split("\n"):
        m = MARK.match(line)
        if m:
            ind, _, name = m.groups()
            role = name.split("_", 1)[0]
            if role not in ROLE_TX:
                raise ValueError(f"@trace {name}: the name must start with s_, a_ or p_")
            out.append(f"{ind}if T.And(tx == {ROLE_TX[role]}, ci < TC):")
            out.append(f'{ind}    tr[sh, ci, {len(names)}] = T.call_extern("int64", "clock64")')
            names.append(name)
        out.append(line)
        if line.strip() == 'N = T.dynamic("N")':
            out += [line.replace('N = T.dynamic("N")', 'NT = T.dynamic("NT")'),
                    line.replace('N = T.dynamic("N")', 'TC = T.dynamic("TC")')]  # fmt: skip
        if line.strip() == 'ht: T.Tensor((N, h_v, D, D), "float32"),':
            out.append(
                line.replace('ht: T.Tensor((N, h_v, D, D), "float32"),', 'tr: T.Tensor((NT, TC, NSLOT_), "int64"),')
            )
    text = "\n".join(out).replace("NSLOT_", str(NSLOT))
    if len(names) > NSLOT or "tr: T.Tensor" not in text or "TC = T.dynamic" not in text:
        raise ValueError("the fused kernel's source no longer has the lines this tool edits")
    return text, names


def traced_module(pkg):
    """The package's fwd_fused module, traced, loaded from a temporary file beside no other."""
    src = pathlib.Path(pkg.fwd_fused.__file__).read_text()
    text, names = traced_source(src)
    path = pathlib.Path(tempfile.mkdtemp()) / "fwd_fused_traced.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"{pkg.__name__}._fwd_fused_traced", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod, names


def summarize(tr, names, nchunks_per_cta, skip=2):
    """Per role: median cycles per phase and the chunk period, over valid chunks >= skip."""
    import torch

    tr = tr.double()
    res = {}
    for role in ROLE_TX:
        idx = [i for i, n in enumerate(names) if n.startswith(role + "_")]
        if not idx:
            continue
        phases = {}
        for a, b in zip(idx, idx[1:] + [None]):
            if b is None:  # the last phase ends at the role's first stamp of the next chunk
                d = tr[:, 1:, idx[0]] - tr[:, :-1, a]
                valid = _valid(nchunks_per_cta, tr.shape[1] - 1, skip)
            else:
                d = tr[:, :, b] - tr[:, :, a]
                valid = _valid(nchunks_per_cta, tr.shape[1], skip)
            phases[names[a]] = float(torch.median(d[valid]))
        per = tr[:, 1:, idx[0]] - tr[:, :-1, idx[0]]
        res[role] = dict(phases=phases, period=float(torch.median(per[_valid(nchunks_per_cta, tr.shape[1] - 1, skip)])))
    return res


def walks(tr, names, nchunks_per_cta):
    """Per walk length (chunks): CTAs, median cycles from the producer's first stamp to the state's
    first GEMM (fill) and to the state's last stamp (span), and the median span per chunk."""
    p0, s0, s1 = names.index("p_wait_empty"), names.index("s_xo"), names.index("s_store")
    out = {}
    for n in sorted(set(nchunks_per_cta.tolist()) - {0}):
        sel = nchunks_per_cta == n
        if n > tr.shape[1]:
            continue
        t = tr[sel].double()
        fill, span = t[:, 0, s0] - t[:, 0, p0], t[:, n - 1, s1] - t[:, 0, p0]
        out[int(n)] = dict(ctas=int(sel.sum()), fill=float(fill.median()), span=float(span.median()),
                           per_chunk=float(span.median()) / n)  # fmt: skip
    return out


def unwritten_stamps(tr, names, nchunks_per_cta):
    """The stamps left 0 on some chunk of a walk (its last chunk aside): a mark no thread reaches."""
    valid = _valid(nchunks_per_cta, tr.shape[1], 0)
    return [n for i, n in enumerate(names) if bool((tr[:, :, i][valid] == 0).any())]


def _valid(nch, tc, skip):
    import torch

    c = torch.arange(tc, device=nch.device)[None, :]
    return (c >= skip) & (c < nch[:, None] - 1)


def run_shape(pkg, mod, names, name, seqlens, h_qk, h_v, results):
    import torch
    from qlabench_tools.kernels.check_fused import _fused_call, rel
    from qlabench_tools.kernels.check_fwd import graph_time_ms, make_inputs

    x = make_inputs(seqlens, h_qk, h_v)
    tc = max(seqlens) // 64 + 1
    hold = {}
    plain = pkg.forward.run_fwd_fused

    def traced(q, k, v, g, beta, stab, h_init, scale, o, ht, target=None):
        kern = mod.get_fwd_fused_kernel(q.shape[2], v.shape[2], h_init is not None, ht is not None)
        if "tr" not in hold:  # the first (uncaptured) call allocates; replays write the same buffer
            hold["tr"] = torch.zeros(stab.shape[0] * v.shape[2], tc, NSLOT, device=q.device, dtype=torch.int64)
            hold["dummy"] = torch.empty(1, v.shape[2], 128, 128, device=q.device)
            hold["stab"] = stab
        dummy = hold["dummy"]
        kern(q, k, v, g, beta, stab, h_init if h_init is not None else dummy, float(scale), o,
             ht if ht is not None else dummy, hold["tr"])  # fmt: skip
        return o, ht

    o_ref, ht_ref = _fused_call(pkg, x, 0)
    plain_ms = graph_time_ms(lambda: _fused_call(pkg, x, 0))
    pkg.forward.run_fwd_fused = traced
    try:
        o_t, ht_t = _fused_call(pkg, x, 0)
        traced_ms = graph_time_ms(lambda: _fused_call(pkg, x, 0))
        _fused_call(pkg, x, 0)  # the stamps of one plain call (not a replay)
        torch.cuda.synchronize()
    finally:
        pkg.forward.run_fwd_fused = plain
    tr, stab = hold["tr"], hold["stab"]
    nch = ((stab[:, 1] - stab[:, 0] + 63) // 64).clamp(min=0).where(stab[:, 2] >= 0, torch.zeros_like(stab[:, 0]))
    nch = nch.repeat_interleave(h_v).to(torch.int64)  # CTA sh = segment * h_v + v-head
    unwritten = unwritten_stamps(tr, names, nch)
    summ = summarize(tr, names, nch)
    wk = walks(tr, names, nch)
    row = dict(shape=name, plain_ms=plain_ms, traced_ms=traced_ms, o_vs_plain=rel(o_t.float(), o_ref.float()),
               ht_vs_plain=rel(ht_t, ht_ref), unwritten_stamps=unwritten, roles=summ, walks=wk)  # fmt: skip
    row["ok"] = row["o_vs_plain"] == 0 and row["ht_vs_plain"] == 0 and not unwritten
    results["shapes"].append(row)
    log(
        f"\n=== {name}: plain {plain_ms:.4f} ms, traced {traced_ms:.4f} ms; traced vs plain: o {row['o_vs_plain']:.2e}, "
        f"final state {row['ht_vs_plain']:.2e}" + (f"; stamps never written: {unwritten}" if unwritten else "")
    )
    for role, r in summ.items():
        log(f"  {role}: period {r['period']:.0f} cycles; " + ", ".join(f"{k} {v:.0f}" for k, v in r["phases"].items()))
    for n, w in wk.items():
        log(f"  walk {n:3d} chunks: {w['ctas']:5d} CTAs, fill {w['fill']:.0f}, span {w['span']:.0f} ({w['per_chunk']:.0f} per chunk)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of " + ", ".join(SHAPES))
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        print(f"error: --shapes: unknown {bad}; known: {list(SHAPES)}", file=sys.stderr)
        return 2
    pkg, _ = _import_pkg()
    mod, names = traced_module(pkg)
    log(f"{len(names)} stamps: {names}")
    if args.compile_only:
        for hk in sorted({SHAPES[s][1:] for s in shapes}):
            mod.get_fwd_fused_kernel(*hk, True, True)
            log(f"compiled {hk[0]}/{hk[1]}")
        return 0
    results = {"stamps": names, "shapes": []}
    import torch

    results["gpu"] = torch.cuda.get_device_name()
    for s in shapes:
        run_shape(pkg, mod, names, s, *SHAPES[s], results)
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out, "trace_fused.json").write_text(json.dumps(results, indent=1))
        pathlib.Path(out, "trace_fused.txt").write_text("\n".join(LINES) + "\n")
    return 0 if all(r["ok"] for r in results["shapes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
