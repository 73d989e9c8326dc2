"""Error and reference energy of every backend's outputs on a sweep's points, per gate unit, for
deriving and judging the correctness check's local checks offline: for each point x direction x backend, an
``.npz`` (float32, a few hundred KB at most) with, per output, ``d2_<out>`` = sum of (out - ref)^2
and ``r2_<out>`` = sum of ref^2 over each (64-token unit, head) of a token output
(``qlabench.correctness.token_units``) or each (sequence, head) of a state, and ``n_<out>`` the elements
per unit; ``unit_seq`` (the sequence of each unit) and ``cu_seqlens``. Any scale the check could
use (the sequence's, the head's, the unit's own) can be rebuilt from these.

    python -m qlabench_tools.correctness.dump_errors CONFIG... --out DIR [--backends flashqla,tilelang] [--directions bwd]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from qlabench import backends as B
from qlabench import config as C
from qlabench import correctness
from qlabench.sweep import points
from qlabench.workloads import make


def energies(out: torch.Tensor, ref: torch.Tensor, cu: torch.Tensor, state: bool) -> dict:
    """d2, r2 and element counts per (unit, head) (token outputs) or (sequence, head) (states)."""
    a, b = out.detach().double(), ref.detach().double().to(out.device)
    if state:
        d2, r2 = ((a - b) ** 2).sum((-1, -2)), (b ** 2).sum((-1, -2))
        n = torch.full_like(d2, a.shape[-1] * a.shape[-2])
    else:
        T, H = a.shape[1], a.shape[2]
        a, b = a.reshape(T, H, -1), b.reshape(T, H, -1)
        _, unit = correctness.token_units(cu.to(a.device), T)
        nu = int(unit.max()) + 1 if T else 0
        z = torch.zeros(nu, H, dtype=torch.float64, device=a.device)
        d2 = z.clone().index_add_(0, unit, ((a - b) ** 2).sum(-1))
        r2 = z.clone().index_add_(0, unit, (b ** 2).sum(-1))
        n = z.clone().index_add_(0, unit, torch.full((T, H), float(a.shape[-1]),
                                                     dtype=torch.float64, device=a.device))
    return {k: v.float().cpu().numpy() for k, v in (("d2", d2), ("r2", r2), ("n", n))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--backends", default="flashqla,tilelang,fla")
    ap.add_argument("--directions", default="bwd")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    names = a.backends.split(",")
    for name in names:  # one backend at a time: a slow compile costs only its own points
        be = B.get(name)
        ok, why = be.available()
        if not ok:
            print(f"{name}: {why}", flush=True)
            continue
        for cfg in a.configs:
            sw = C.load(cfg)
            for p in points(sw):
                for direction in a.directions.split(","):
                    if not be.supports(p, direction)[0]:
                        continue
                    t0 = time.time()
                    x = make(p, dev, with_grads=direction != "fwd")
                    ref = correctness.reference_outputs(x, direction, "chunked", "fp32")
                    prep = be.prepare(x, direction)
                    outs, _ = correctness.checked_call(be, prep, x, direction, 0)
                    seq, unit = correctness.token_units(x.cu_seqlens, x.T)
                    unit_seq = torch.zeros(int(unit.max()) + 1, dtype=torch.int64,
                                           device=unit.device).scatter_(0, unit, seq)
                    arrs = {"cu_seqlens": x.cu_seqlens.cpu().numpy(),
                            "unit_seq": unit_seq.cpu().numpy()}
                    for n, t in outs.items():
                        if t is None or ref.get(n) is None:
                            continue
                        e = energies(t, ref[n], x.cu_seqlens, n in correctness.STATE_OUTPUTS)
                        arrs.update({f"{k}_{n}": v for k, v in e.items()})
                    f = out / f"{sw.name}__{p.index}__{direction}__{name}.npz"
                    np.savez_compressed(f, **arrs)
                    print(f"{f.name}: {p.tp_label} {p.layout_label[:30]} {time.time() - t0:.1f} s",
                          flush=True)
                    del x, ref, prep, outs
                    torch.cuda.empty_cache() if dev == "cuda" else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
