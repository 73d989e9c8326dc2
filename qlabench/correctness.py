"""The correctness check: a backend's outputs against the reference, before and after timing.

:func:`reference_outputs` computes the reference of one point x direction. :func:`check_outputs`
gates each canonical output globally (relative L2 against the sweep's limit for that output) and
locally (:func:`local_checks`): per (64-token chunk, head) for token outputs, in units of the
larger of the sequence's and the head's reference RMS, and per (sequence, head) for states —
against multiples of the limit, so that one wrong token, chunk, head or sequence is not averaged
away and one short sequence is not judged against its own vanishing norm.

:func:`checked_call` makes one eager call with every output it can write poisoned beforehand
(:mod:`qlabench.poison`), so an output left unwritten cannot pass with a stale answer.
:func:`check_timed_path` checks the timed path itself: fresh inputs written into the same
buffers, the timed path run once more as it was timed, every call's outputs compared, and what
the rerun and the backend's ``refresh`` cost (:class:`TimedPathCheck`), which
:func:`qlabench.measure.measure_backend` holds against the timed samples.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

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
#: the local unit of a token output: 64 tokens of one sequence (the chunk every kernel works in);
#: a sequence's tail of fewer than CHUNK_TOKENS // 2 tokens joins the chunk before it
CHUNK_TOKENS = 64
#: limits of the local figures as multiples of the output's global limit: a token output's chunk
#: x head RMS error in units of its sequence's scale (``CHUNK_FACTOR``), a state's (sequence,
#: head) relative error (``SEQ_FACTOR``). A correct kernel spreads its bf16 rounding error over
#: the whole output, so these fluctuate around the global relative error; a wrong chunk, head,
#: sequence or token stands out by far more (one zeroed token in a 64-token chunk: 1/8)
CHUNK_FACTOR = 3.0
SEQ_FACTOR = 2.0
#: token outputs whose local scale is floored at the head's RMS over the batch: the gate's and
#: beta's gradients, one scalar per token and head, a sum over the K x V state whose cancellation
#: can leave a short sequence's entries far below what a correct kernel's rounding moves them by
HEAD_FLOOR_OUTPUTS = ("dg", "dbeta")
#: the chance that a correct kernel's figure of one (unit, head) lands past its allowance, under
#: the chi-square law of an RMS over n independent rounding errors (:func:`spread_allowance`):
#: about one in the (unit, head) figures of a 65,536-token layout of 16 heads
UNIT_ALPHA = 1e-6


#: a derived limit is this many times the largest global error the libraries reach
LIMIT_MARGIN = 2.0
#: the backends whose rows the limits are derived from: the libraries, not the in-repo kernels
LIMIT_LIBRARIES = ("fla", "flashinfer", "flashqla")


def derive_limits(rows, margin: float = LIMIT_MARGIN) -> dict[str, float]:
    """Per output: ``margin`` x the largest global relative L2 error (``rel_l2_*``) of the
    ``ok`` rows of the libraries (``LIMIT_LIBRARIES``, by ``backend_name``) in ``rows`` (a
    DataFrame of result rows), rounded up to two significant digits. Derived on one set of
    layouts (the published sweeps), judged on others."""
    import math
    ok = rows[(rows["status"] == "ok") & rows["backend_name"].isin(LIMIT_LIBRARIES)]
    out = {}
    for n in FWD_OUTPUTS + BWD_OUTPUTS:
        col = f"rel_l2_{n}"
        if col not in ok or not ok[col].notna().any():
            continue
        v = margin * float(ok[col].max())
        e = math.floor(math.log10(v)) - 1  # two significant digits, rounded up
        out[n] = float(f"{math.ceil(round(v / 10 ** e, 6)) * 10 ** e:.2g}")
    return out


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


def spread_allowance(n: torch.Tensor, full: int) -> torch.Tensor:
    """How much farther than a full unit's (``full`` scalars) the RMS of ``n`` independent
    rounding errors may land from its expectation, at the same chance :data:`UNIT_ALPHA`:
    sqrt(χ²(n) / n) over sqrt(χ²(full) / full), each the 1 − α quantile; 1 where n ≥ full. One
    scalar (a one-token sequence's dg or dβ, one per head) spreads like |N(0, 1)|, a 64-token
    chunk's RMS far less, so a figure of few scalars is judged by this much more."""
    from scipy.stats import chi2

    def q(k: int) -> float:
        return math.sqrt(chi2.isf(UNIT_ALPHA, k) / k)

    full_q = q(full)
    vals = {k: max(q(k) / full_q, 1.0) for k in torch.unique(n).tolist()}
    return torch.tensor([vals[k] for k in n.tolist()], dtype=torch.float64, device=n.device)


def token_units(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each token, local unit of each token) for T tokens: a unit is a chunk of
    ``CHUNK_TOKENS`` tokens of one sequence, a tail under half a chunk merged into the chunk
    before it (a sequence shorter than a chunk is one unit). Unit ids are dense."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(T, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True)
    pos = t - cu[seq]
    n = (cu[1:] - cu[:-1])[seq]
    full = torch.clamp(n // CHUNK_TOKENS, min=1)  # chunks of the sequence after the merge
    tail = n % CHUNK_TOKENS
    full = torch.where((tail >= CHUNK_TOKENS // 2) & (n >= CHUNK_TOKENS), full + 1, full)
    c = torch.clamp(pos // CHUNK_TOKENS, max=full - 1)
    key = seq * (T // CHUNK_TOKENS + 2) + c
    _, unit = torch.unique(key, return_inverse=True)
    return seq, unit


def token_local_err(out: torch.Tensor, ref: torch.Tensor, cu_seqlens: torch.Tensor,
                    rounded: torch.Tensor | None = None, head_floor: bool = True) -> float:
    """Worst (chunk x head) RMS error of a [1, T, H, D] or [1, T, H] token output, in units of
    its (sequence, head)'s scale: the sequence's own reference RMS — floored at the head's RMS
    over the whole batch where ``head_floor`` (:data:`HEAD_FLOOR_OUTPUTS`) — and, given
    ``rounded`` (a correct bf16 kernel emulated, :func:`bf16_twin`), the chunk's rounding
    sensitivity (its RMS difference between the two) over the whole output's (the relative L2
    difference of the two), so that a chunk may be as far from the reference, in units of its
    own sensitivity, as the whole output may be in units of the whole output's. A global norm
    hides a wrong chunk, head, sequence or token; this does not, while a one-token sequence (one
    scalar of dg per head) or a sequence's last token is judged against a scale that neither
    vanishes with it nor falls below what its conditioning makes of a correct kernel's bf16
    rounding. A unit of fewer scalars than a full chunk (a one-token sequence's dg: one per
    head) spreads wider around its expectation: its sequence / head scale is widened by
    :func:`spread_allowance` (so the value is in a full chunk's terms); the twin's sensitivity
    is not, being itself one draw of that spread per scalar."""
    T, H = out.shape[1], out.shape[2]
    if T == 0:
        return 0.0
    a = out.detach().reshape(T, H, -1).to(torch.float64)
    b = ref.detach().reshape(T, H, -1).to(torch.float64).to(a.device)
    D = a.shape[-1]
    d2t = ((a - b) ** 2).sum(-1)  # [T, H]
    if not torch.isfinite(d2t).all():
        return float("inf")
    r2t = (b ** 2).sum(-1)
    seq, unit = token_units(cu_seqlens.to(a.device), T)
    ns, nu = int(seq.max()) + 1, int(unit.max()) + 1
    ones = torch.ones(T, dtype=torch.float64, device=a.device)
    seq_tok = torch.zeros(ns, dtype=torch.float64, device=a.device).index_add_(0, seq, ones)
    seq_r2 = torch.zeros(ns, H, dtype=torch.float64, device=a.device).index_add_(0, seq, r2t)
    head_ms = r2t.sum(0) / (T * D)  # [H]
    scale = seq_r2 / (seq_tok.clamp(min=1)[:, None] * D)
    if head_floor:
        scale = torch.maximum(scale, head_ms[None, :])
    unit_tok = torch.zeros(nu, dtype=torch.float64, device=a.device).index_add_(0, unit, ones)
    unit_d2 = torch.zeros(nu, H, dtype=torch.float64, device=a.device).index_add_(0, unit, d2t)
    unit_seq = torch.zeros(nu, dtype=torch.int64, device=a.device).scatter_(0, unit, seq)
    allow = spread_allowance((unit_tok * D).to(torch.int64), CHUNK_TOKENS * D)
    base = scale[unit_seq]  # the sequence's (or head's) scale of each (unit, head)
    sens = torch.zeros_like(base)  # the twin's rounding sensitivity, in the same units
    if rounded is not None:
        c = rounded.detach().reshape(T, H, -1).to(torch.float64).to(a.device)
        s2t = ((c - b) ** 2).sum(-1)  # [T, H]
        sens2 = float(s2t.sum() / r2t.sum().clamp(min=1e-300))  # the output's, squared
        if sens2 > 0:
            s2 = torch.zeros(nu, H, dtype=torch.float64, device=a.device).index_add_(0, unit, s2t)
            sens = s2 / (unit_tok[:, None] * D) / sens2
    return _worst_rel(unit_d2 / (unit_tok[:, None] * D), torch.maximum(base * allow[:, None] ** 2, sens))


def worst_state_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative L2 error over (sequence, head) of an [N, H, K, V] state or gradient."""
    a = out.detach().to(torch.float64)
    b = ref.detach().to(torch.float64).to(a.device)
    return _worst_rel(((a - b) ** 2).sum((-1, -2)), (b ** 2).sum((-1, -2)))


def local_checks(name: str, out: torch.Tensor, ref: torch.Tensor, cu_seqlens: torch.Tensor,
                 rounded: torch.Tensor | None = None) -> list[tuple[str, float, float]]:
    """The local figures of an output: (what, value, factor over the global limit) each."""
    if name in STATE_OUTPUTS:
        return [("sequence x head", worst_state_rel_err(out, ref), SEQ_FACTOR)]
    return [(f"{CHUNK_TOKENS}-token chunk x head",
             token_local_err(out, ref, cu_seqlens, rounded, name in HEAD_FLOOR_OUTPUTS), CHUNK_FACTOR)]


class Reference(dict):
    """The reference outputs of one point x direction (canonical names), and ``rounded``: a
    correct bf16 chunked kernel emulated on the same inputs (:func:`bf16_twin`). Where an output
    is ill-conditioned — the gradient of a one-token sequence is a sum over the K x V state with
    cancellation — the two differ by what any correct bf16 kernel is off by there, and the checks
    allow for it (:func:`token_local_err`, :func:`check_outputs`). ``layout``: the point's
    ``(cu_seqlens, output_final_state)`` as they were when the reference was made — a copy the
    backend under test never holds, which the checks read instead of its inputs'."""

    rounded: dict | None = None
    layout: tuple | None = None


def _bf16(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.bfloat16).to(t.dtype)


class RoundBF16(torch.autograd.Function):
    """Rounds to bf16 and back, its gradient too: an intermediate a kernel keeps in bf16."""

    @staticmethod
    def forward(ctx, a):
        return a.to(torch.bfloat16).to(a.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(g.dtype)


#: the outputs a bf16 kernel hands back in bf16 (the inputs' dtype); dg, dbeta and the states
#: are fp32
BF16_OUTPUTS = ("o", "dq", "dk", "dv")


def _reference(x: Inputs, direction: str, impl: str, dt: torch.dtype, h0, dht, beta,
               store=None) -> dict:
    from .backends.reference import gdn_chunked, gdn_chunked_grads, gdn_recurrent
    kw = {} if store is None else {"store": store}
    with torch.no_grad() if direction == "fwd" else torch.enable_grad():
        if direction == "fwd":
            fn = gdn_recurrent if impl == "recurrent" and store is None else gdn_chunked
            o, ht = fn(x.q, x.k, x.v, x.g, beta, x.scale, h0, x.cu_seqlens, dtype=dt, **kw)
            return {"o": o, "final_state": ht}
        return gdn_chunked_grads(x.q, x.k, x.v, x.g, beta, x.scale, h0, x.cu_seqlens,
                                 x.do, dht, dtype=dt, **kw)


def bf16_twin(x: Inputs, direction: str, dt: torch.dtype) -> dict:
    """A correct bf16 chunked kernel, emulated: the chunked reference with the fp32 operands a
    bf16 kernel rounds before its tensor-core GEMMs (h0, the final-state gradient, beta) read as
    bf16, every intermediate it keeps between GEMMs rounded to bf16 (in the forward and in the
    gradients through it), and the outputs it returns in bf16 rounded so."""
    out = _reference(x, direction, "chunked", dt, _bf16(x.h0), _bf16(x.dht), _bf16(x.beta),
                     store=RoundBF16.apply)
    return {n: (_bf16(t) if n in BF16_OUTPUTS and t is not None else t) for n, t in out.items()}


def reference_outputs(x: Inputs, direction: str, impl: str, dtype: str) -> Reference:
    """The reference (``impl``: chunked or recurrent, in ``dtype``) and its ``rounded`` twin."""
    dt = torch.float64 if dtype == "fp64" else torch.float32
    ref = Reference(_reference(x, direction, impl, dt, x.h0, x.dht, x.beta))
    ref.rounded = bf16_twin(x, direction, dt)
    ref.layout = (x.cu_seqlens.clone(), bool(x.output_final_state))
    return ref


def check_outputs(outs: dict, ref: dict, x: Inputs, direction: str, sweep: Sweep,
                  row: dict | None = None) -> tuple[float, float, list[str]]:
    """Compare canonical outputs with the reference: (worst global rel L2, worst local figure,
    problems). Each output is gated globally against
    its limit and locally (:func:`local_checks`) against multiples of it. Fills ``rel_l2_*``,
    ``max_abs_*`` and ``local_rel_l2_*`` (worst chunk x head; sequence x head for states) into
    ``row`` when given."""
    names = FWD_OUTPUTS if direction == "fwd" else BWD_OUTPUTS
    cu, want_ht = getattr(ref, "layout", None) or (x.cu_seqlens, x.output_final_state)
    worst, worst_loc, bad = 0.0, 0.0, []
    for n in names:
        if n not in ref or ref[n] is None:
            continue
        if n == "final_state" and not want_ht:
            continue  # not asked for: libraries return None
        if outs.get(n) is None:
            bad.append(f"{n} missing")
            continue
        rel, mx = rel_err(outs[n], ref[n])
        rounded = (getattr(ref, "rounded", None) or {}).get(n)
        # twice the largest error of the libraries on the published sweeps, or of a correct
        # bf16 kernel on this point, whichever is larger (LIMIT_MARGIN, as the limits are derived)
        lim = sweep.thresholds.get(n)
        if rounded is not None:
            lim = max(lim, LIMIT_MARGIN * rel_err(rounded, ref[n])[0])
        locs = local_checks(n, outs[n], ref[n], cu, rounded)
        if row is not None:
            row[f"rel_l2_{n}"], row[f"max_abs_{n}"] = rel, mx
            row[f"local_rel_l2_{n}"] = locs[0][1]
        worst = max(worst, rel)
        worst_loc = max([worst_loc] + [v for _, v, _ in locs])
        if not rel <= lim:
            bad.append(f"{n} rel_l2={rel:.3g} > {lim:g}")
            continue
        for what, v, f in locs:
            if not v <= f * lim:
                bad.append(f"{n} worst {what} rel_l2={v:.3g} > {f * lim:g}")
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


def refill(x: Inputs, fresh: Inputs) -> None:
    """Write ``fresh``'s values into ``x``'s own buffers (every input but ``cu_seqlens``, which
    shapes and plans depend on), through aliases that leave the tensors' version counters as
    they were: a backend sees the same tensors with other numbers in them."""
    for f in fields(Inputs):
        t, new = getattr(x, f.name), getattr(fresh, f.name)
        if f.name == "cu_seqlens" or not isinstance(t, torch.Tensor):
            continue
        t.data.copy_(new)


@dataclass
class TimedPathCheck:
    """What :func:`check_timed_path` found: the worst global relative L2 error over the calls'
    outputs (``worst``), the problems (``bad``), the rerun's time in ms per call and its number
    of calls (``rerun_ms``, ``calls``), and ``Prepared.refresh``'s time in ms (``refresh_ms``;
    None: the backend has no refresh, or it was not timed)."""

    worst: float
    bad: list[str]
    rerun_ms: float | None = None
    calls: int = 0
    refresh_ms: float | None = None


def check_timed_path(be: B.Backend, prep: B.Prepared, rerun, x: Inputs, fresh: Inputs,
                     direction: str, ref: dict, sweep: Sweep, clock=None) -> TimedPathCheck:
    """Check the timed path itself on inputs it has not seen: ``fresh`` is written into the
    buffers the timed calls read (:func:`refill`; ``prep.refresh`` re-derives a backend's own
    copies of them, timed by ``clock(f) -> (f(), ms)`` where given), then ``rerun`` runs the
    timed path once more exactly as it was timed (the timed graph replayed, or one timed-style
    call) and returns the raw outputs of every call it made and its time per call
    (:attr:`qlabench.timing.TimingResult.rerun`); each output is compared with ``ref``, the
    reference of ``fresh``. Nothing is poisoned, so the call is one the backend cannot tell from
    a timed one; an output the path left unwritten, or an answer cached from the inputs it was
    timed on, is wrong for ``fresh``. Where a graph's calls write into preallocated buffers,
    the n outputs are the same tensors and only the last call's values are compared."""
    refill(x, fresh)
    refresh_ms = None
    if prep.refresh is not None:
        if clock is None:
            prep.refresh()
        else:
            _, refresh_ms = clock(prep.refresh)
    _sync()
    raws, rerun_ms = rerun()
    _sync()
    if not raws:
        return TimedPathCheck(float("nan"), ["the timed path returned no output to check"],
                              rerun_ms, 0, refresh_ms)
    worst, bad = 0.0, []
    for i, raw in enumerate(raws):
        outs = be.outputs_to_canonical(raw, x, direction)
        w, _, b = check_outputs(outs, ref, x, direction, sweep)
        worst = max(worst, w)
        if b:
            bad.append(f"call {i + 1} of {len(raws)}: " + "; ".join(b))
            break
    return TimedPathCheck(worst, bad, rerun_ms, len(raws), refresh_ms)
