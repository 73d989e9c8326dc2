"""Deliberately broken variants of the FLA backend, run through the real runner on a GPU: each
must come out ``incorrect`` on every point it touches (the gate's acceptance run).

    python scripts/gate_acceptance.py --fwd configs/h200_fwd_quick.yaml \
        --bwd configs/h200_bwd_quick.yaml --out runs/gate_acceptance

Variants (each a subclass of ``FLABackend``, patched in for the ``fla`` name, in-process):

- ``state-hole``: the final state is copied into a fresh ``torch.empty`` except one sequence's,
  which is left unwritten (the allocator may hand back a buffer holding a right answer);
- ``dg-block``: one 1024-token block of one head of ``dg`` is written 1.5x too large;
- ``graph-only``: eager calls are right, but under CUDA-graph capture the last 64-token chunk of
  one head of ``o`` is left unwritten (a library that takes another path when captured).

Writes ``OUT/<variant>/`` result directories and ``OUT/summary.json``; exits 1 if any row of a
broken variant is not ``incorrect``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from qlabench import backends as B
from qlabench import config as C
from qlabench import runner
from qlabench.backends.base import Prepared
from qlabench.backends.fla import FLABackend


class StateHole(FLABackend):
    def version(self):
        return "broken:state-hole"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        j = x.N // 2

        def fn():
            r = list(inner.fn())
            st = torch.empty_like(r[3])
            keep = [i for i in range(x.N) if i != j]
            st[keep] = r[3][keep]
            r[3] = st
            return tuple(r)
        return Prepared(fn=fn, graph_safe=inner.graph_safe)


class DgBlock(FLABackend):
    def version(self):
        return "broken:dg-block"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        lens = x.cu_seqlens.diff().tolist()
        s = max(range(x.N), key=lambda i: lens[i])
        t0 = int(x.cu_seqlens[s]) + (lens[s] // 2048) * 1024  # a block inside the longest sequence
        t1 = min(t0 + 1024, int(x.cu_seqlens[s + 1]))

        def fn():
            r = list(inner.fn())
            r[4][0, t0:t1, 0].mul_(1.5)  # FLA's bwd: (dq, dk, dv, dbeta, dg, dh0, ...)
            return tuple(r)
        return Prepared(fn=fn, graph_safe=inner.graph_safe)


class GraphOnly(FLABackend):
    def version(self):
        return "broken:graph-only"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)

        def fn():
            r = list(inner.fn())
            if torch.cuda.is_current_stream_capturing():
                o = torch.empty_like(r[1])
                o.copy_(r[1])
                o[0, -64:, 0] = o[0, -64:, 0] * float("nan")  # as if never written
                r[1] = o
            return tuple(r)
        return Prepared(fn=fn, graph_safe=inner.graph_safe)


VARIANTS = {"state-hole": (StateHole, "fwd"), "dg-block": (DgBlock, "bwd"),
            "graph-only": (GraphOnly, "fwd")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fwd", required=True)
    ap.add_argument("--bwd", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated variants")
    a = ap.parse_args(argv)
    real_get = B.get
    summary, ok = {}, True
    for name, (cls, direction) in VARIANTS.items():
        if a.only and name not in a.only.split(","):
            continue
        sw = C.load(a.fwd if direction == "fwd" else a.bwd)
        sw = sw.model_copy(update={"backends": ["fla"], "timing": sw.timing.model_copy(
            update={"budget_s": 0.2, "min_samples": 3, "max_samples": 5, "gpm": False})})
        B.get = lambda n, cls=cls: cls() if n == "fla" else real_get(n)
        try:
            s = runner.run(sw, Path(a.out) / name, config_name=f"gate-acceptance:{name}",
                           isolate=False)
        finally:
            B.get = real_get
        rows = [{"point": r["point_key"], "status": r["status"], "reason": r["reason"][:200]}
                for r in s.rows]
        summary[name] = {"rows": len(rows), "incorrect": sum(r["status"] == "incorrect"
                                                             for r in rows), "detail": rows}
        ok &= bool(rows) and all(r["status"] == "incorrect" for r in rows)
        print(f"{name}: {summary[name]['incorrect']}/{len(rows)} incorrect", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
