"""What can be checked of the tileops backend without a GPU (docs/backends.md, "tileops in an
environment of its own"), against a tileops installed in SITE (e.g. unpacked from .tileops/):

    python scripts/airgapped/tileops_offline_check.py --site /tmp/tileops_site contract
    TILELANG_CACHE_DIR=/tmp/tlc python scripts/airgapped/tileops_offline_check.py \
        --site /tmp/tileops_site build [--heads 2/8] [--routes fused,direct,wgsolve,split]
    python scripts/airgapped/tileops_offline_check.py --site /tmp/tileops_site routes configs/h200_fwd.yaml

contract  the backend's prepare / outputs_to_canonical through tileops' real GDNFwdOp on CPU
          tensors: a "cpu" target registered with tileops answers with qlabench's chunked
          reference, so tileops' own signature and result checks judge the converted inputs and
          the outputs, and qlabench's correctness check judges the canonical outputs.
build     its GDN prefill programs (TileLang, whichever SITE or the environment holds) built for
          sm_90a, the device queries answered as an H200's (132 SMs): one line per route.
routes    the route its planner picks for every point of a sweep on an H200, with and without the
          host offsets (the backend's ``host_offsets``).
rounding  what its dtype contract costs an exact kernel: the fp32 reference recurrence on g and on
          beta rounded to bf16 against it on the canonical inputs, per gate recipe (no tileops
          needed).

Exit code 1 when a contract row fails the check or a route does not build.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
H200_SMS = 132
#: route -> (solve pass, uniform row length, partitions) of GDNDensePrefillFwdKernel._programs
ROUTES = {"fused": ("fused", 0, 0), "direct": ("blocksolve", 0, 0),
          "wgsolve": ("warpgroup", 4096, 0), "split": ("blocksolve", 0, 8)}


def as_h200() -> None:
    """torch's device queries answered as an H200's; TileLang's CUDA target detected as sm_90a."""
    import torch
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0,
                                  multi_processor_count=H200_SMS,
                                  shared_memory_per_block_optin=232448, total_memory=150e9,
                                  L2_cache_size=50 * 2**20, warp_size=32, uuid="offline")
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.current_device = lambda: 0
    from tilelang.backend.target import register_target_detector
    from tilelang.contrib import nvcc
    from tvm.target import Target
    arch = "sm_" + nvcc.get_target_arch((9, 0))
    register_target_detector("cuda", lambda: Target({"kind": "cuda", "arch": arch}), override=True)


def contract() -> int:
    import torch
    from tileops.backend import register_detector, register_kernel_builder

    from qlabench import backends as B
    from qlabench import config as C
    from qlabench.backends.reference import gdn_chunked
    from qlabench.correctness import check_outputs, reference_outputs
    from qlabench.sweep import points
    from qlabench.workloads import make

    class Reference:
        def __init__(self, scale, **_):
            self.scale = scale

        def __call__(self, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, A_log,
                     dt_bias):
            o, ht = gdn_chunked(q, k, v, g.float(), beta.float(), self.scale, initial_state,
                                cu_seqlens)
            return o.to(q.dtype), ht

    register_detector(target="qlabench-cpu-reference", detect=lambda device: device.type == "cpu")
    register_kernel_builder(op="GDNFwdOp", target="qlabench-cpu-reference",
                            build_kernel=lambda *tensors, **params: Reference(**params))
    B.backend_class("tileops").available = lambda self: (True, "")
    s = C.parse({"name": "tileops-contract", "backends": ["reference"],
                 "models": [{"name": "a", "h_qk": 2, "h_v": 8, "head_dim": 128},
                            {"name": "b", "h_qk": 1, "h_v": 2, "head_dim": 64}],
                 "seqlens": [[1024], [64, 1, 63, 500], [300, 200]]})
    failed = 0
    for host_offsets in (True, False):
        be = B.get("tileops", {"host_offsets": host_offsets})
        for p in points(s):
            x = make(p)
            out = be.outputs_to_canonical(be.prepare(x, "fwd").fn(), x, "fwd")
            row: dict = {}
            _, _, bad = check_outputs(out, reference_outputs(x, "fwd", "chunked", "fp32"), x,
                                      "fwd", s, row)
            failed += bool(bad)
            print(f"host_offsets={host_offsets!s:5} {p.tp_label} K={p.head_dim} "
                  f"{p.layout_label:14} o {row['rel_l2_o']:.2e} final_state "
                  f"{row['rel_l2_final_state']:.2e} {'; '.join(bad) or 'ok'}", flush=True)
    print(f"torch {torch.__version__}: {failed} failed", flush=True)
    return 1 if failed else 0


def build(heads: str, routes: list[str]) -> int:
    import tilelang
    import torch
    as_h200()
    from tileops._kernels.linear_attention.gdn.prefill import GDNDensePrefillFwdKernel
    hq, hv = (int(n) for n in heads.split("/"))
    k = GDNDensePrefillFwdKernel(batch=1, heads=hq, value_heads=hv, seq_len=8192,
                                 num_sequences=2, varlen=True, dim=128, scale=128 ** -0.5,
                                 dtype=torch.bfloat16, device_index=0)
    print(f"tilelang {tilelang.__version__}, sm_90a, {heads} bf16, fp32 initial state", flush=True)
    failed = 0
    for r in routes:
        solve, uniform, parts = ROUTES[r]
        t0 = time.time()
        try:
            k._programs(None, torch.int64, torch.bfloat16, torch.float32, solve, uniform, parts, 0)
            print(f"{r:8} builds ({time.time() - t0:.0f} s)", flush=True)
        except Exception as e:
            failed += 1
            print(f"{r:8} does not build: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 1 if failed else 0


def routes(config: str) -> int:
    import tilelang
    import torch
    as_h200()
    from tileops._kernels.linear_attention.gdn.prefill import GDNDensePrefillFwdKernel as K

    from qlabench import config as C
    from qlabench.sweep import points
    counts: collections.Counter = collections.Counter()
    for p in points(C.load(Path(config))):
        k = K(batch=1, heads=p.h_qk, value_heads=p.h_v, seq_len=p.total_tokens,
              num_sequences=p.num_seqs, varlen=True, dim=p.head_dim, scale=p.head_dim ** -0.5,
              dtype=torch.bfloat16, device_index=0)
        for host in (True, False):
            lengths = tuple(p.seqlens) if host else None
            T = p.total_tokens
            if p.head_dim == 128 and k._fused_serves(T, p.h_v, lengths, 0):
                route = "fused"
            elif k._width(T, p.h_v, lengths, 0) is not None:
                route = "split"
            else:
                uniform = k._uniform_length(lengths)
                pairs = p.num_seqs * tilelang.cdiv(uniform, 64) * p.h_v if uniform else 0
                route = "direct (warp-group solve)" if pairs >= 8 * H200_SMS else "direct"
            counts[(host, route)] += 1
    for (host, route), n in sorted(counts.items()):
        print(f"host offsets {'on ' if host else 'off'}  {route:26} {n}")
    return 0


def rounding() -> int:
    import torch

    from qlabench import config as C
    from qlabench.backends.reference import gdn_chunked
    from qlabench.correctness import rel_err
    from qlabench.sweep import points
    from qlabench.workloads import make
    for gate in ({"recipe": "published", "zero_frac": 0.25, "seed": 0},
                 {"recipe": "strong-decay"}, {"recipe": "model"}):
        s = C.parse({"name": "rounding", "backends": ["reference"], "gate": gate,
                     "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 128}],
                     "seqlens": [[4096, 4096]]})
        x = make(points(s)[0])
        with torch.no_grad():
            o0, h0 = gdn_chunked(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens)
            bf = {n: getattr(x, n).to(torch.bfloat16).float() for n in ("g", "beta")}
            for n in ("g", "beta"):
                o, h = gdn_chunked(x.q, x.k, x.v, bf["g"] if n == "g" else x.g,
                                   bf["beta"] if n == "beta" else x.beta, x.scale, x.h0,
                                   x.cu_seqlens)
                print(f"{gate['recipe']:13} {n:4} in bf16: o {rel_err(o, o0)[0]:.2e} "
                      f"final_state {rel_err(h, h0)[0]:.2e}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", help="a directory holding tileops (and the TileLang to use), put "
                    "first on sys.path")
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("contract")
    b = sub.add_parser("build")
    b.add_argument("--heads", default="2/8")
    b.add_argument("--routes", default=",".join(ROUTES))
    r = sub.add_parser("routes")
    r.add_argument("config")
    sub.add_parser("rounding")
    a = ap.parse_args()
    if a.site:
        if not Path(a.site).is_dir():
            print(f"--site {a.site}: no such directory", file=sys.stderr)
            return 2
        sys.path.insert(0, a.site)
    sys.path.append(str(REPO))
    if a.what == "build":
        unknown = [x for x in a.routes.split(",") if x not in ROUTES]
        if unknown:
            print(f"--routes: unknown {', '.join(unknown)} (known: {', '.join(ROUTES)})",
                  file=sys.stderr)
            return 2
        return build(a.heads, a.routes.split(","))
    if a.what == "routes":
        return routes(a.config)
    if a.what == "rounding":
        return rounding()
    return contract()


if __name__ == "__main__":
    sys.exit(main())
