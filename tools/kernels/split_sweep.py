"""Whole-forward latency against the segment length of sequence splitting, on a Hopper GPU.

    python -m qlabench_tools.kernels.split_sweep [--cases NAME,...]

For each case (head config + sequence lengths) the forward runs unsplit and with every segment
length of ``SPLITS`` shorter than its longest sequence; every split output (o and final state)
is compared with the unsplit one (rel L2, both bf16-class) before it is timed, then timed by
CUDA-graph replay (median). The case's automatic choice (``plan_split``) is marked. Data for
``plan_split``: which segment length wins where. Writes split_sweep.json / .txt to $OUT when set.
"""

import argparse
import json
import os
import pathlib
import sys
import traceback

import torch
from qlabench_tools.kernels import check_fwd as cf

SPLITS = [0, 256, 512, 1024, 2048, 4096, 8192, 16384]  # 256 only for sequences up to 4096 tokens

#: (name, h_qk, h_v, seqlens): the kept run's weakest points against FLA (unsplit grids of 64-128
#: CTAs, long or unequal sequences) and a few that split today.
CASES = [
    ("8/24 28672+4096", 8, 24, [28672, 4096]),
    ("8/32 28672+4096", 8, 32, [28672, 4096]),
    ("4/16 28672+4096", 4, 16, [28672, 4096]),
    ("8/24 1024+7168", 8, 24, [1024, 7168]),
    ("2/8 1024+7168", 2, 8, [1024, 7168]),
    ("16/48 1x8192", 16, 48, [8192]),
    ("8/24 1x2048", 8, 24, [2048]),
    ("8/24 1x8192", 8, 24, [8192]),
    ("8/24 1x32768", 8, 24, [32768]),
    ("8/32 1x4096", 8, 32, [4096]),
    ("8/32 1x16384", 8, 32, [16384]),
    ("16/32 1x32768", 16, 32, [32768]),
    ("16/16 1x8192", 16, 16, [8192]),
    ("16/16 1x32768", 16, 16, [32768]),
    ("16/16 16384x2", 16, 16, [16384, 16384]),
    ("2/8 1x2048", 2, 8, [2048]),
    ("2/8 1x8192", 2, 8, [8192]),
    ("2/8 8192x4", 2, 8, [8192] * 4),
    ("2/8 1x32768", 2, 8, [32768]),
    ("4/16 1x2048", 4, 16, [2048]),
    ("4/16 1x8192", 4, 16, [8192]),
]


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(pkg, name, hq, hv, lens, block_v):
    x = cf.make_inputs(lens, hq, hv)
    T, N = sum(lens), len(lens)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    auto = pkg.plan_split(T, N, hv, sms, block_v=block_v, seqlens=lens)
    cf.log(f"  {name}: plan_split (bv {block_v}) -> {auto}; plan_fwd -> {pkg.plan_fwd(T, N, hv, sms, seqlens=lens)}")

    def fwd(sp):
        return pkg.chunk_gdn_fwd_lowlevel(
            x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], True, x["cu"], sp, block_v=block_v
        )

    base = fwd(0)
    o0, h0 = base["o"].clone(), base["final_state"].clone()
    rows = []
    for sp in SPLITS:
        if sp and (sp >= max(lens) or (sp < 512 and max(lens) > 4096)):
            continue
        r = fwd(sp)
        torch.cuda.synchronize()
        eo, eh = rel(r["o"], o0), rel(r["final_state"], h0)
        row = dict(case=name, split=sp, auto=sp == auto, rel_o_vs_unsplit=eo, rel_ht_vs_unsplit=eh)
        if eo > 2e-2 or eh > 2e-2 or not torch.isfinite(r["o"]).all():
            row.update(status="mismatch")
        else:
            row.update(status="ok", ms=cf.graph_time_ms(lambda sp=sp: fwd(sp)))
        rows.append(row)
        cf.log(f"  {name:18s} split {sp:6d}{' (auto)' if sp == auto else '       '}  "
               f"{row.get('ms', float('nan')):8.4f} ms  rel o {eo:.1e} ht {eh:.1e}  {row['status']}")  # fmt: skip
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-v", type=int, default=64, choices=(64,), help="fwd_o's V block")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    pkg, _ = cf._import_pkg()
    want = {c.strip() for c in args.cases.split(",") if c.strip()}
    out = []
    cf.log(f"split sweep, block_v {args.block_v}, {torch.cuda.get_device_name(0)}")
    for name, hq, hv, lens in CASES:
        if want and name not in want:
            continue
        try:
            out += run_case(pkg, name, hq, hv, lens, args.block_v)
        except Exception as e:  # one failing case does not stop the others
            cf.log(f"  {name}: FAILED {type(e).__name__}: {e}")
            cf.log(traceback.format_exc())
            out.append(dict(case=name, status="error", error=f"{type(e).__name__}: {e}"))
    dest = os.environ.get("OUT")
    if dest:
        tag = f"bv{args.block_v}"
        pathlib.Path(dest, f"split_sweep_{tag}.json").write_text(json.dumps(out, indent=1))
        pathlib.Path(dest, f"split_sweep_{tag}.txt").write_text("\n".join(cf.LINES) + "\n")
    return 0 if all(r["status"] == "ok" for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
