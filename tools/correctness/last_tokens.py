"""Where in a sequence a backend's error sits: the error of each of a sequence's last tokens, and
of its first and middle chunks, in units of the (sequence, head)'s reference RMS (the correctness check's
local scale), per backend on the same inputs — to tell a defect in a sequence's last tokens from
the noise every bf16 kernel has there.

    python -m qlabench_tools.correctness.last_tokens [--backends fla,flashqla,tilelang] [--out DIR]

Layouts with a 1 mod 64 / 1 mod 1024 tail ([4097], [1, 4097, 65]) under the published and model
gate recipes, backward and forward, head config 16/32. Prints one line per (backend, recipe,
direction, output) and writes ``last_tokens.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

from qlabench import backends as B
from qlabench import config as C
from qlabench import correctness
from qlabench.sweep import points
from qlabench.workloads import make

TAIL = 4  # the last tokens reported one by one


def profile(out: torch.Tensor, ref: torch.Tensor, cu: torch.Tensor) -> list[dict]:
    """Per sequence: RMS error (over heads and features) of the last TAIL tokens, one by one, of
    its first 64 tokens and of its middle 64, in units of its reference RMS."""
    T, H = out.shape[1], out.shape[2]
    a = out.detach().double().reshape(T, H, -1)
    b = ref.detach().double().reshape(T, H, -1)
    rows = []
    bounds = cu.tolist()
    for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        scale = b[lo:hi].pow(2).mean().sqrt().item() or 1.0

        def err(i0, i1, scale=scale):
            return ((a[i0:i1] - b[i0:i1]).pow(2).mean().sqrt().item()) / scale
        n = hi - lo
        r = {"seq": s, "len": n, "first64": err(lo, min(hi, lo + 64)),
             "mid64": err(lo + n // 2, min(hi, lo + n // 2 + 64))}
        for k in range(1, TAIL + 1):
            r[f"last-{k}"] = err(hi - k, hi - k + 1) if n >= k else float("nan")
        rows.append(r)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backends", default="fla,flashqla,tilelang")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    sw = C.parse({"name": "last-tokens", "models": ["35B/9B/4B TP1"],
                  "seqlens": [[4097], [1, 4097, 65]], "directions": ["fwd", "bwd"],
                  "backends": a.backends.split(","),
                  "gate": [{"recipe": "published", "zero_frac": 0.25}, {"recipe": "model"}]})
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lines = []
    for p in points(sw):
        for direction in sw.directions:
            x = make(p, dev, with_grads=direction != "fwd")
            ref = correctness.reference_outputs(x, direction, "chunked", "fp32")
            for name in a.backends.split(","):
                be = B.get(name)
                ok, why = be.available()
                if not ok or not be.supports(p, direction)[0]:
                    print(f"{name}: {why or 'unsupported'}")
                    continue
                prep = be.prepare(x, direction)
                outs, _ = correctness.checked_call(be, prep, x, direction, 0)
                for out_name, t in outs.items():
                    if out_name in correctness.STATE_OUTPUTS or t is None:
                        continue
                    for r in profile(t, ref[out_name], x.cu_seqlens):
                        r.update(backend=name, layout=p.layout_label, recipe=p.gate_recipe,
                                 direction=direction, output=out_name)
                        lines.append(r)
                        tail = " ".join(f"{r[f'last-{k}']:.2e}" for k in range(1, TAIL + 1))
                        print(f"{name:9s} {p.gate_recipe:9s} {p.layout_label:12s} {direction} "
                              f"{out_name:6s} seq {r['seq']} len {r['len']:5d}: first64 "
                              f"{r['first64']:.2e} mid64 {r['mid64']:.2e} last {tail}", flush=True)
                del prep, outs
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with open(Path(a.out) / "last_tokens.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(lines[0]) if lines else ["backend"])
        w.writeheader()
        w.writerows(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
