"""The correctness gate: a backend's outputs against the reference, before and after timing.

:func:`reference_outputs` computes the reference of one point x direction. :func:`check_outputs`
gates each canonical output twice: its global relative L2 error against the sweep's threshold,
and its worst local error — per (sequence, head) for states, per (1024-token block, head) for
the others — against a multiple of it (``SEQ_FACTOR``, ``BLOCK_FACTOR``), so that one wrong chunk,
head or sequence is not averaged away. :func:`checked_call` makes one eager call with every
output it can write poisoned beforehand (:mod:`qlabench.poison`), so an output left unwritten
cannot pass with a stale answer; :func:`check_replay` does the same for the timed CUDA graph.
"""

from __future__ import annotations

import time

import torch

from . import backends as B
from . import poison
from .config import Sweep
from .workloads import Inputs

FWD_OUTPUTS = ("o", "final_state")
BWD_OUTPUTS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(‖out − ref‖ / ‖ref‖, max |out − ref|) computed in fp64; NaN/inf -> inf."""
    a = out.detach().to(torch.float64).reshape(-1)
    b = ref.detach().to(torch.float64).reshape(-1).to(a.device)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: got {tuple(out.shape)}, reference {tuple(ref.shape)}")
    if not torch.isfinite(a).all():
        return float("inf"), float("inf")
    diff = a - b
    denom = b.norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    return rel, diff.abs().max().item()


TOKEN_OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta")
STATE_OUTPUTS = ("final_state", "dh0")
BLOCK_TOKENS = 1024
#: a 1024-token block x head may be this many times worse than the global threshold (short
#: blocks are noisier)
BLOCK_FACTOR = 3.0
#: a (sequence, head) state may be this many times worse than the global threshold (each holds
#: K x V = 16k elements, as tight as the global norm; one sequence of 8 with a 5% error moves
#: the global norm by ~1.8%)
SEQ_FACTOR = 1.5


def _worst_rel(d2: torch.Tensor, r2: torch.Tensor) -> float:
    """max sqrt(d2 / r2) over the entries whose reference norm is not negligible."""
    if not torch.isfinite(d2).all():
        return float("inf")
    if not d2.numel():
        return 0.0
    mask = r2 > 1e-20 * max(float(r2.max()), 1e-300)
    if not mask.any():
        return 0.0
    return float((d2[mask] / r2[mask]).sqrt().max())


def worst_block_rel_err(out: torch.Tensor, ref: torch.Tensor, cu_seqlens: torch.Tensor) -> float:
    """Largest relative L2 error over (block of <= 1024 tokens of one sequence) x head, for a
    [1, T, H, D] or [1, T, H] output. A global norm hides a wrong chunk or head in a long
    sequence (one wrong 64-token chunk of 16/64 1x32768 moves the global error by ~5e-3); per
    block it stands out."""
    a = out.detach().reshape(out.shape[1], out.shape[2], -1).to(torch.float64)
    b = ref.detach().reshape(ref.shape[1], ref.shape[2], -1).to(torch.float64).to(a.device)
    T = a.shape[0]
    cu = cu_seqlens.to(a.device)
    t = torch.arange(T, device=a.device)
    seq = torch.searchsorted(cu[1:], t, right=True)
    blk = seq * (T // BLOCK_TOKENS + 2) + (t - cu[seq]) // BLOCK_TOKENS
    _, blk = torch.unique(blk, return_inverse=True)
    nb = int(blk.max()) + 1 if T else 0
    d2 = torch.zeros(nb, a.shape[1], dtype=torch.float64, device=a.device)
    r2 = torch.zeros_like(d2)
    d2.index_add_(0, blk, ((a - b) ** 2).sum(-1))
    r2.index_add_(0, blk, (b ** 2).sum(-1))
    return _worst_rel(d2, r2)


def worst_state_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative L2 error over (sequence, head) of an [N, H, K, V] state or gradient."""
    a = out.detach().to(torch.float64)
    b = ref.detach().to(torch.float64).to(a.device)
    return _worst_rel(((a - b) ** 2).sum((-1, -2)), (b ** 2).sum((-1, -2)))


def local_rel_err(name: str, out: torch.Tensor, ref: torch.Tensor,
                  cu_seqlens: torch.Tensor) -> tuple[float, float, str]:
    """(worst local rel L2, its factor over the global threshold, what "local" is) of an output."""
    if name in STATE_OUTPUTS:
        return worst_state_rel_err(out, ref), SEQ_FACTOR, "sequence x head"
    return (worst_block_rel_err(out, ref, cu_seqlens), BLOCK_FACTOR,
            f"{BLOCK_TOKENS}-token block x head")


def reference_outputs(x: Inputs, direction: str, impl: str, dtype: str) -> dict:
    from .backends.reference import gdn_chunked, gdn_chunked_grads, gdn_recurrent
    dt = torch.float64 if dtype == "fp64" else torch.float32
    with torch.no_grad() if direction == "fwd" else torch.enable_grad():
        if direction == "fwd":
            fn = gdn_recurrent if impl == "recurrent" else gdn_chunked
            o, ht = fn(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens, dtype=dt)
            return {"o": o, "final_state": ht}
        return gdn_chunked_grads(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens,
                                 x.do, x.dht, dtype=dt)


def check_outputs(outs: dict, ref: dict, x: Inputs, direction: str, sweep: Sweep,
                  row: dict | None = None) -> tuple[float, float, list[str]]:
    """Compare canonical outputs with the reference: (worst global rel L2, worst local rel L2,
    problems). Each output is gated twice: globally against its threshold, and per (sequence,
    head) for states / per (1024-token block, head) for the others against a multiple of it.
    Fills ``rel_l2_*`` / ``max_abs_*`` / ``local_rel_l2_*`` into ``row`` when given."""
    names = FWD_OUTPUTS if direction == "fwd" else BWD_OUTPUTS
    worst, worst_loc, bad = 0.0, 0.0, []
    for n in names:
        if n not in ref or ref[n] is None:
            continue
        if n == "final_state" and not x.output_final_state:
            continue  # not asked for: libraries return None
        if outs.get(n) is None:
            bad.append(f"{n} missing")
            continue
        rel, mx = rel_err(outs[n], ref[n])
        loc, factor, what = local_rel_err(n, outs[n], ref[n], x.cu_seqlens)
        if row is not None:
            row[f"rel_l2_{n}"], row[f"max_abs_{n}"], row[f"local_rel_l2_{n}"] = rel, mx, loc
        worst, worst_loc = max(worst, rel), max(worst_loc, loc)
        lim = sweep.thresholds.get(n)
        if not rel <= lim:
            bad.append(f"{n} rel_l2={rel:.3g} > {lim:g}")
        elif not loc <= factor * lim:
            bad.append(f"{n} worst {what} rel_l2={loc:.3g} > {factor * lim:g}")
    return worst, worst_loc, bad


def checked_call(be: B.Backend, prep: B.Prepared, x: Inputs, direction: str,
                 expected_out_bytes: int) -> tuple[dict, float]:
    """One eager call of ``prep.fn`` with every output it can write poisoned beforehand
    (``poison``): its canonical outputs and the call's seconds (poisoning excluded)."""
    poison.poison_cached_memory(2 * expected_out_bytes)
    poison.fill_nan(prep.outputs)
    _sync()
    t0 = time.perf_counter()
    with poison.PoisonAllocations():
        raw = prep.fn()
    _sync()
    return be.outputs_to_canonical(raw, x, direction), time.perf_counter() - t0


def check_replay(be: B.Backend, replay, raw, x: Inputs, direction: str, ref: dict,
                 sweep: Sweep, preallocated=()) -> tuple[float, list[str]]:
    """Check the timed path itself: ``raw`` are the outputs of the last call captured in the
    timing graph; they and the backend's ``preallocated`` output buffers are poisoned (inputs a
    library hands back are spared), the graph is replayed once, and what it wrote is compared
    with the reference."""
    n = poison.fill_nan((raw, tuple(preallocated)), keep=x.tensors().values())
    _sync()
    replay()
    _sync()
    if n == 0:
        return float("nan"), ["the captured call returned no floating-point output to check"]
    outs = be.outputs_to_canonical(raw, x, direction)
    worst, _, bad = check_outputs(outs, ref, x, direction, sweep)
    return worst, bad
