"""Deliberately broken variants of a backend (default FLA), run through the real runner on a GPU:
each must come out ``incorrect`` on every point it touches (the correctness check's acceptance run).

    python scripts/airgapped/correctness_acceptance.py --fwd configs/h200_fwd_quick.yaml \
        --bwd configs/h200_bwd_quick.yaml --out runs/correctness_acceptance [--backend tilelang]

Variants (each a subclass of the backend's class, patched in for its name, in-process; the
outputs are found through the backend's own ``outputs_to_canonical``):

- ``state-hole``: the final state is copied into a fresh ``torch.empty`` except one sequence's,
  which is left unwritten (the allocator may hand back a buffer holding a right answer);
- ``dg-block``: one 1024-token block of one head of ``dg`` is written 1.5x too large;
- ``graph-only``: eager calls are right, but under CUDA-graph capture the last 64 tokens of one
  head of ``o`` come out NaN, as if unwritten (a library that takes another path when captured);
- ``cached``: the answer is computed once, in ``prepare``; every call copies it out (a graph of
  copies: right on the inputs it was checked on, wrong on any other);
- ``work-once``: a call computes only when checked (under the poisoning mode) or every 8th time,
  and otherwise hands back the last answer (a timed graph of n calls doing the work of n / 8).

Writes ``OUT/<variant>/`` result directories and ``OUT/summary.json``; exits 1 if any row of a
broken variant is not ``incorrect``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from qlabench import backends as B
from qlabench import config as C
from qlabench import runner
from qlabench.backends.base import Prepared


def _slot(raw, t: torch.Tensor):
    """Index (or key) of the raw output that holds canonical output ``t`` (same storage)."""
    p = t.untyped_storage().data_ptr()
    items = raw.items() if isinstance(raw, dict) else enumerate(raw)
    return next(i for i, r in items
                if isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() == p)


def broken(base: type, variant: str):
    """A subclass of backend class ``base`` broken as ``variant`` says."""

    class Broken(base):
        def version(self):
            return f"broken:{variant}"

        def prepare(self, x, direction):
            inner = super().prepare(x, direction)
            lens = x.cu_seqlens.diff().tolist()
            s = max(range(x.N), key=lambda i: lens[i])
            t0 = int(x.cu_seqlens[s]) + (lens[s] // 2048) * 1024  # a block inside the longest sequence
            t1 = min(t0 + 1024, int(x.cu_seqlens[s + 1]))
            j = x.N // 2

            if variant == "cached":
                r0 = inner.fn()
                cache = ({k: v.clone() for k, v in r0.items()} if isinstance(r0, dict)
                         else [v.clone() if isinstance(v, torch.Tensor) else v for v in r0])

                def copies():
                    if isinstance(cache, dict):
                        return {k: v.clone() for k, v in cache.items()}
                    return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in cache)
                return Prepared(fn=copies, graph_safe=inner.graph_safe)
            if variant == "work-once":
                calls, last = [0], []

                def lazy():
                    calls[0] += 1
                    if (_get_current_dispatch_mode() is not None or calls[0] % 8 == 1
                            or not last):
                        last[:] = [inner.fn()]
                    return last[0]
                return Prepared(fn=lazy, graph_safe=inner.graph_safe, refresh=inner.refresh)

            def fn():
                r0 = inner.fn()
                raw = dict(r0) if isinstance(r0, dict) else list(r0)
                c = self.outputs_to_canonical(raw if isinstance(raw, dict) else tuple(raw), x,
                                              direction)
                if variant == "state-hole":
                    st = torch.empty_like(c["final_state"])
                    keep = torch.tensor([i for i in range(x.N) if i != j], dtype=torch.long,
                                        device=st.device)
                    st.index_copy_(0, keep, c["final_state"].index_select(0, keep))
                    raw[_slot(raw, c["final_state"])] = st
                elif variant == "dg-block":
                    c["dg"][0, t0:t1, 0].mul_(1.5)
                elif (variant == "graph-only" and torch.cuda.is_available()
                      and torch.cuda.is_current_stream_capturing()):
                    o = c["o"].clone()
                    o[0, -64:, 0] = float("nan")  # as if never written
                    raw[_slot(raw, c["o"])] = o
                return raw if isinstance(raw, dict) else tuple(raw)
            return Prepared(fn=fn, graph_safe=inner.graph_safe, refresh=inner.refresh)

    return Broken


VARIANTS = {"state-hole": "fwd", "dg-block": "bwd", "graph-only": "fwd", "cached": "fwd",
            "work-once": "fwd"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fwd", required=True)
    ap.add_argument("--bwd", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated variants")
    ap.add_argument("--backend", default="fla", help="the backend to break (fla, tilelang, flashqla)")
    a = ap.parse_args(argv)
    real_get = B.get
    summary, ok = {}, True
    base = type(real_get(a.backend))
    for name, direction in VARIANTS.items():
        if a.only and name not in a.only.split(","):
            continue
        sw = C.load(a.fwd if direction == "fwd" else a.bwd)
        sw = sw.model_copy(update={"backends": [a.backend], "timing": sw.timing.model_copy(
            update={"budget_s": 0.2, "min_samples": 3, "max_samples": 5, "gpm": False})})
        cls = broken(base, name)
        B.get = lambda n, params=None, cls=cls: cls(params) if n == a.backend else real_get(n, params)
        try:
            s = runner.run(sw, Path(a.out) / name, config_name=f"correctness-acceptance:{name}",
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
