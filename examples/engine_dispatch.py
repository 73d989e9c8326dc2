"""An engine picking its GDN chunked-prefill kernel for each batch from a dispatch table.

    python examples/engine_dispatch.py [--table results/dispatch/h200_fwd.json]
                                       [--heads 4/16] [--seqlens 1024,512] [--require]

It loads the table once, then per batch: builds ``cu_seqlens``, asks the table for that batch's
kernel (``Dispatch.kernel``: the backend it names, as a call with the canonical signature) and
calls it. Where the chosen backend cannot run here (no GPU, or its library missing) it prints why
and makes the same call through the torch ``reference`` backend, so the script runs on a CPU;
where it can run, the output is compared with the reference's.
"""

from __future__ import annotations

import argparse
import sys

import torch

from qlabench import dispatch
from qlabench.sweep import Point
from qlabench.workloads import make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", default="results/dispatch/h200_fwd.json")
    ap.add_argument("--heads", default="4/16", help="H_QK/H_V")
    ap.add_argument("--seqlens", default="1024,512", help="comma-separated lengths of the batch")
    ap.add_argument("--require", action="store_true",
                    help="exit 1 when the chosen backend cannot run here (no reference stand-in)")
    a = ap.parse_args(argv)
    try:                                                # bad input: one line, exit 2
        table = dispatch.load(a.table)                  # once, at engine start
    except (OSError, ValueError) as e:
        print(f"error: --table {a.table}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    try:
        h_qk, h_v = dispatch.parse_heads(a.heads)
        seqlens = tuple(dispatch.parse_seqlens(a.seqlens))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # a batch in the canonical layout (FLA's): q, k [1,T,H_qk,128], v [1,T,H_v,128] bf16 on a GPU
    # (fp32 on a CPU, where the reference runs), g (log-space decay) and beta [1,T,H_v] fp32,
    # initial state [N,H_v,128,128] fp32, cu_seqlens [N+1] int64
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = make(Point(model="engine", h_qk=h_qk, h_v=h_v, head_dim=128, seqlens=seqlens,
                   dtype="bf16" if device == "cuda" else "fp32", gate_zero_frac=0.0, gate_seed=0,
                   seed=0), device=device)

    choice = table.choose(h_qk, h_v, seqlens)
    print(f"{h_qk}/{h_v} {list(seqlens)} -> {choice.backend}: {choice.reason}")
    reference = dispatch.kernel_of("reference", h_qk, h_v, x.cu_seqlens)
    try:
        kernel = table.kernel(h_qk, h_v, x.cu_seqlens)
    except dispatch.BackendUnavailable as e:
        if a.require:
            print(f"not here: {e}", file=sys.stderr)
            return 1
        print(f"not here: {e}; the same call through the reference")
        kernel = None
    o_ref, ht_ref = reference(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0)
    if kernel is None:
        print(f"reference: o {tuple(o_ref.shape)}, final state {tuple(ht_ref.shape)}")
        return 0
    o, ht = kernel(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0)
    rel = float((o.float() - o_ref.float()).norm() / o_ref.float().norm())
    print(f"{kernel.label}: o {tuple(o.shape)}, final state {tuple(ht.shape)}, "
          f"|o - o_ref| / |o_ref| = {rel:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
