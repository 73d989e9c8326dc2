"""Where a worker's start-up goes, per backend: each backend checked in a fresh interpreter
(``qlabench.supervisor.check_backend``, what a worker's warm-up runs), phases timed, with
``-X importtime``'s heaviest packages.

    python scripts/import_profile.py fla flashqla tilelang [--repeat 2] [--json OUT.json]

Per backend and repeat, one interpreter: ``import torch``, the CUDA context (when a GPU is
present), ``check_backend(name)``; its stderr's import-time lines summed per top-level package
(cumulative microseconds of the outermost import of each). Then, once: every backend checked in
one interpreter one after another (what one worker does today) and the same backends in parallel
interpreters started together (wall of the slowest), so the two designs can be compared on the
machine itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
if torch.cuda.is_available():
    torch.empty(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
from qlabench.supervisor import check_backend
out = {"torch_s": t1 - t0, "cuda_s": t2 - t1, "backends": {}}
for name in sys.argv[1:]:
    a = time.perf_counter()
    ok, why, version = check_backend(name)
    out["backends"][name] = {"s": time.perf_counter() - a, "ok": ok, "why": why[:200],
                             "version": version}
out["total_s"] = time.perf_counter() - t0
print("IMPORT_PROFILE " + json.dumps(out), flush=True)
"""


def _child(names, importtime: bool) -> dict:
    cmd = [sys.executable] + (["-X", "importtime"] if importtime else []) + ["-c", CHILD, *names]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("IMPORT_PROFILE ")), None)
    got = json.loads(line.split(" ", 1)[1]) if line else {"error": p.stderr[-800:]}
    got["wall_s"] = wall
    if importtime:
        got["top_packages_s"] = _top(p.stderr)
    return got


def _top(stderr: str, n: int = 15) -> dict:
    """Cumulative import seconds per top-level package (its outermost imports only)."""
    per: dict = {}
    for ln in stderr.splitlines():
        if not ln.startswith("import time:") or "|" not in ln:
            continue
        parts = ln[len("import time:"):].split("|")
        try:
            cum = int(parts[1])
        except ValueError:
            continue
        mod = parts[2]
        depth = (len(mod) - len(mod.lstrip())) // 2
        if depth == 0:
            top = mod.strip().split(".")[0]
            per[top] = per.get(top, 0) + cum
    return dict(sorted(((k, v / 1e6) for k, v in per.items()), key=lambda kv: -kv[1])[:n])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backends", nargs="+")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = {"python": sys.version.split()[0], "each": {}, "sequential": [], "parallel": []}
    for name in a.backends:
        res["each"][name] = [_child([name], importtime=True) for _ in range(a.repeat)]
        for r in res["each"][name]:
            b = r.get("backends", {}).get(name, {})
            print(f"{name:10s} wall {r['wall_s']:6.2f}  torch {r.get('torch_s', 0):5.2f}  "
                  f"cuda {r.get('cuda_s', 0):5.2f}  check {b.get('s', 0):5.2f}  ok={b.get('ok')}  "
                  f"top {list(r.get('top_packages_s', {}).items())[:6]}", flush=True)
    for _ in range(a.repeat):
        r = _child(a.backends, importtime=False)
        res["sequential"].append(r)
        print(f"sequential (one interpreter): wall {r['wall_s']:.2f} s  "
              f"{ {k: round(v['s'], 2) for k, v in r.get('backends', {}).items()} }", flush=True)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(a.backends)) as pool:
            each = list(pool.map(lambda n: _child([n], importtime=False), a.backends))
        wall = time.perf_counter() - t0
        res["parallel"].append({"wall_s": wall, "each": dict(zip(a.backends, each))})
        print(f"parallel (one interpreter each, started together): wall {wall:.2f} s  "
              f"{ {n: round(e['wall_s'], 2) for n, e in zip(a.backends, each)} }", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
