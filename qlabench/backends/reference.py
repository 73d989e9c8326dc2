"""Pure-torch Gated DeltaNet references (run on CPU or GPU) and the ``reference`` backend.

Recurrence per v-head (FLA's layout, state S in R^{K x V}; alpha_t = exp(g_t), g_t <= 0):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale * q_t)

Two forms that must agree:

- :func:`gdn_recurrent` — token by token (fp32/fp64). Exact but slow; tiny cases and cross-checks.
- :func:`gdn_chunked` — chunk 64 (WY / UT form, as in the chunked kernels), vectorised over
  heads and, for what does not depend on the state, over a sequence's chunks (the loop over
  chunks carries the state only), differentiable: gradients of the reference come from autograd
  through this form.

Shapes (B = 1, varlen via ``cu_seqlens``): q, k [1, T, H_qk, K]; v [1, T, H_v, V];
g, beta [1, T, H_v]; h0 [N, H_v, K, V]. GVA: v-head j reads q/k head j // (H_v / H_qk).
Returns o [1, T, H_v, V] and final state [N, H_v, K, V] in the compute dtype.
"""

from __future__ import annotations

import gc

import torch

from .base import Backend, Prepared

CHUNK = 64


def _expand_qk(x: torch.Tensor, h_v: int) -> torch.Tensor:
    """[T, H_qk, K] -> [T, H_v, K] with contiguous groups (head j <- j // G)."""
    g = h_v // x.shape[1]
    return x.repeat_interleave(g, dim=1) if g > 1 else x


def _bounds(cu_seqlens: torch.Tensor | None, T: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, T)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def gdn_recurrent(q, k, v, g, beta, scale=None, h0=None, cu_seqlens=None,
                  dtype=torch.float64):
    """Token-by-token recurrence. Returns (o [1,T,H_v,V], ht [N,H_v,K,V])."""
    T, h_v, K, V = q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    qe = _expand_qk(q[0].to(dtype), h_v)
    ke = _expand_qk(k[0].to(dtype), h_v)
    vv, gg, bb = v[0].to(dtype), g[0].to(dtype), beta[0].to(dtype)
    bounds = _bounds(cu_seqlens, T)
    o = torch.zeros(T, h_v, V, dtype=dtype, device=q.device)
    hts = []
    for n, (s, e) in enumerate(bounds):
        S = (h0[n].to(dtype).clone() if h0 is not None
             else torch.zeros(h_v, K, V, dtype=dtype, device=q.device))
        for t in range(s, e):
            kt = ke[t]                                         # [H, K]
            S = S * gg[t].exp()[:, None, None]
            err = vv[t] - torch.einsum("hk,hkv->hv", kt, S)     # v - S^T k
            S = S + bb[t][:, None, None] * kt[:, :, None] * err[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", qe[t] * scale, S)
        hts.append(S)
    return o[None], torch.stack(hts)


def _kept(t):
    return t


#: full chunks whose state-independent terms :func:`_chunked_seq` computes at once
TERMS_CHUNKS = 32


def _chunked_seq(q, k, v, g, beta, S, scale, chunk, store=_kept):
    """One sequence: q,k [L,H,K] (expanded), v [L,H,V], g,beta [L,H], S [H,K,V]. ``store`` is
    applied to every intermediate a chunked kernel keeps between its GEMMs (the WY factors and
    their operands, the state, v_new, the attention tile, the output): the identity here; a
    rounding to bf16 emulates a bf16 kernel (tests/bf16_kernel.py).

    What does not depend on the state (the WY factors w, u, the gated attention tile, the decays)
    is computed for ``TERMS_CHUNKS`` chunks at a time (the temporaries of a whole long sequence
    never coexist), a partial last chunk padded with zero tokens (k = v = beta = g = 0, which add
    nothing to it); the loop over chunks carries the state only."""
    L, H = q.shape[0], q.shape[1]
    step = TERMS_CHUNKS * chunk
    outs = []
    for s in range(0, L, step):
        steps = _chunk_terms(*(x[s : s + step] for x in (q, k, v, g, beta)), chunk, store)
        for u_c, w_c, qg_c, attn_c, gl_c, dec_c, kt_c in steps:
            Sk = store(S)
            v_new = store(u_c - w_c @ Sk)
            outs.append(store(scale * (qg_c @ Sk + attn_c @ v_new)))
            S = gl_c.exp()[:, None, None] * S + kt_c @ store(dec_c * v_new)
    o = torch.stack(outs, 0).transpose(1, 2).reshape(len(outs) * chunk, H, -1)  # [chunks*C,H,V]
    return o[:L], S


def _chunk_terms(q, k, v, g, beta, chunk, store):
    """The state-independent terms of each chunk of q,k [L,H,K], v [L,H,V], g,beta [L,H] (the
    last one padded when partial): per chunk (u, w [H,C,*], e^g ⊙ q [H,C,K], the gated
    attention tile [H,C,C], g_last [H], e^{g_last − g} [H,C,1], kᵀ [H,K,C]), unbound along the
    chunks (indexing them one by one would have autograd build a full-size gradient per chunk)."""
    L = q.shape[0]
    nc = -(-L // chunk)
    pad = nc * chunk - L

    def tiles(x):  # [L, H, *] -> [nc, H, chunk, *]
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x
        return x.reshape(nc, chunk, *x.shape[1:]).transpose(1, 2)

    qc, kc, vc = tiles(q), tiles(k), tiles(v)                            # [nc,H,C,*]
    gc = tiles(g[..., None])[..., 0].cumsum(-1)                          # [nc,H,C] inclusive cumsum
    bc = tiles(beta[..., None])[..., 0]                                  # [nc,H,C]
    diff = gc[..., :, None] - gc[..., None, :]                           # g_i - g_j
    tril_incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gamma = torch.where(tril_incl, diff, torch.full_like(diff, float("-inf"))).exp()
    kk = kc @ kc.transpose(-1, -2)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    Lm = torch.where(strict, bc[..., None] * gamma * kk, torch.zeros_like(kk))
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device).expand_as(Lm)
    A = store(torch.linalg.solve_triangular(eye + Lm, eye, upper=False, unitriangular=True))
    w = store(A @ store((bc * gc.exp())[..., None] * kc))
    u = store(A @ store(bc[..., None] * vc))
    qg = gc.exp()[..., None] * qc
    attn = store((qc @ kc.transpose(-1, -2)) * gamma)
    g_last = gc[..., -1]                                                 # [nc,H]
    decay = (g_last[..., None] - gc).exp()[..., None]                    # [nc,H,C,1]
    kt = kc.transpose(-1, -2)
    return zip(*(x.unbind(0) for x in (u, w, qg, attn, g_last, decay, kt)))


def gdn_chunked(q, k, v, g, beta, scale=None, h0=None, cu_seqlens=None,
                dtype=torch.float32, chunk: int = CHUNK, store=_kept):
    """Chunked (WY) form, differentiable. Returns (o [1,T,H_v,V], ht [N,H_v,K,V]); ``store``:
    :func:`_chunked_seq`."""
    T, h_v, K, V = q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    qe = _expand_qk(q[0].to(dtype), h_v)
    ke = _expand_qk(k[0].to(dtype), h_v)
    vv, gg, bb = v[0].to(dtype), g[0].to(dtype), beta[0].to(dtype)
    os_, hts = [], []
    for n, (s, e) in enumerate(_bounds(cu_seqlens, T)):
        S = (h0[n].to(dtype) if h0 is not None
             else torch.zeros(h_v, K, V, dtype=dtype, device=q.device))
        if e > s:
            o, S = _chunked_seq(qe[s:e], ke[s:e], vv[s:e], gg[s:e], bb[s:e], S, scale, chunk,
                                store)
            os_.append(o)
        hts.append(S)
    return torch.cat(os_, 0)[None], torch.stack(hts)


def _grads_pass(q, k, v, g, beta, scale, h0, cu_seqlens, do, dht, dtype, store, chunk):
    leaves = {n: t.detach().to(dtype).requires_grad_(True)
              for n, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("h0", h0))
              if t is not None}
    o, ht = gdn_chunked(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                        scale, leaves.get("h0"), cu_seqlens, dtype=dtype, chunk=chunk, store=store)
    loss = (o * do.to(dtype)).sum()
    if dht is not None:
        loss = loss + (ht * dht.to(dtype)).sum()
    names = list(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return {"d" + n: gr for n, gr in zip(names, grads)}


#: qk-heads per autograd pass that last fit, per (tokens, h_qk, h_v, K, V, dtype, device)
_FIT: dict[tuple, int] = {}


def gdn_chunked_grads(q, k, v, g, beta, scale, h0, cu_seqlens, do, dht,
                      dtype=torch.float32, store=_kept, chunk: int = CHUNK,
                      qk_heads: int | None = None) -> dict[str, torch.Tensor]:
    """Reference gradients by autograd through :func:`gdn_chunked` (``store``, ``chunk``: its own).

    Returns dq, dk [1,T,H_qk,K] (summed over each GVA group), dv [1,T,H_v,V], dg, dbeta
    [1,T,H_v] (dg for the raw, un-cumsummed g) and dh0 [N,H_v,K,V] (when h0 is given).

    A qk-head and its GVA group of v-heads never read another group's inputs, so the gradients
    are computed group block by block, ``qk_heads`` qk-heads per autograd pass: the same numbers
    with a graph of 1 / passes the size (a long sequence on many heads does not fit a GPU's
    memory whole). ``qk_heads=None``: all heads in one pass, and on a device out-of-memory error
    half as many per pass, down to one; the count that fit is kept for the next call on the
    same shape."""
    h_qk, h_v = q.shape[2], v.shape[2]
    grp = h_v // h_qk
    key = (q.shape[1], h_qk, h_v, q.shape[3], v.shape[3], dtype, q.device.type)
    per = max(1, min(h_qk, _FIT.get(key, h_qk) if qk_heads is None else qk_heads))
    while True:
        out: dict[str, torch.Tensor] = {}
        part = None
        try:
            for a in range(0, h_qk, per):
                b = min(h_qk, a + per)
                qs, vs = slice(a, b), slice(a * grp, b * grp)
                part = _grads_pass(
                    q[:, :, qs], k[:, :, qs], v[:, :, vs], g[:, :, vs], beta[:, :, vs], scale,
                    None if h0 is None else h0[:, vs], cu_seqlens, do[:, :, vs],
                    None if dht is None else dht[:, vs], dtype, store, chunk)
                if per == h_qk:
                    out = part
                    break
                for n, t in part.items():  # into whole-size outputs: no second copy at the end
                    dim, heads = (1, h_v) if n == "dh0" else (2, h_qk if n in ("dq", "dk") else h_v)
                    if n not in out:
                        shape = list(t.shape)
                        shape[dim] = heads
                        out[n] = t.new_empty(shape)
                    out[n].narrow(dim, a * (heads // h_qk), t.shape[dim]).copy_(t)
                part = None
            break
        except torch.OutOfMemoryError:
            if qk_heads is not None or per == 1:
                raise
        # past the handler, the failed pass's graph is no longer held by its traceback
        out = part = None
        gc.collect()
        torch.cuda.empty_cache()
        per = -(-per // 2)
    if qk_heads is None:
        _FIT[key] = per
    return out


class ReferenceBackend(Backend):
    """The torch reference as a backend: runs anywhere, measures nothing of interest on a GPU
    but proves the harness path end to end on a CPU machine."""

    name = "reference"
    directions = ("fwd", "bwd", "fwdbwd")
    color = "#7f7f7f"
    needs_cuda = False
    kind = "reference"

    def version(self) -> str:
        return f"torch-{torch.__version__}"

    def available(self):
        return True, ""

    def supports(self, point, direction):
        return True, ""

    def prepare(self, inputs, direction) -> Prepared:
        x = inputs
        if direction == "fwd":
            def fn():
                return gdn_chunked(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens)
        else:
            def fn():
                return gdn_chunked_grads(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0,
                                         x.cu_seqlens, x.do, x.dht)
        # it reads cu_seqlens on the host (a sync), so it never captures in a CUDA graph: time it
        # with events rather than attempt (and fail) a capture, which can leave the context unwell
        return Prepared(fn=fn, graph_safe=False, notes="host sync per call")

    def outputs_to_canonical(self, raw, inputs, direction):
        if direction == "fwd":
            o, ht = raw
            return {"o": o, "final_state": ht}
        return dict(raw)
