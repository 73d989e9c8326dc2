import pytest
import torch

from qlabench.backends.reference import gdn_chunked, gdn_chunked_grads, gdn_recurrent
from qlabench.workloads import make


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_recurrent_equals_chunked_fp64(tiny_point):
    x = make(tiny_point)
    o1, h1 = gdn_recurrent(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens)
    o2, h2 = gdn_chunked(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens,
                         dtype=torch.float64)
    assert _rel(o2, o1) < 1e-10 and _rel(h2, h1) < 1e-10


def test_zero_gate_heads_present(tiny_point):
    x = make(tiny_point)
    assert len(x.zero_gate_heads) == 1
    assert (x.g[..., list(x.zero_gate_heads)] == 0).all()
    assert (x.g[..., [h for h in range(4) if h not in x.zero_gate_heads]] < 0).all()


def test_without_state(tiny_point):
    from dataclasses import replace
    p = replace(tiny_point, initial_state=False)
    x = make(p)
    o1, h1 = gdn_recurrent(x.q, x.k, x.v, x.g, x.beta, x.scale, None, x.cu_seqlens)
    o2, h2 = gdn_chunked(x.q, x.k, x.v, x.g, x.beta, x.scale, None, x.cu_seqlens,
                         dtype=torch.float64)
    assert _rel(o2, o1) < 1e-10 and _rel(h2, h1) < 1e-10


def test_matches_fla_naive(tiny_point):
    """Cross-check with FLA's own pure-torch recurrence (no varlen/GVA: loop and expand)."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive").naive_recurrent_gated_delta_rule
    x = make(tiny_point)
    G = x.h_v // x.h_qk
    cu = x.cu_seqlens.tolist()
    os_, hs = [], []
    for n, (s, e) in enumerate(zip(cu, cu[1:])):
        q = x.q[:, s:e].float().repeat_interleave(G, 2)
        k = x.k[:, s:e].float().repeat_interleave(G, 2)
        o, h = naive(q, k, x.v[:, s:e].float(), x.beta[:, s:e], x.g[:, s:e], x.scale,
                     x.h0[n:n + 1], True)
        os_.append(o)
        hs.append(h)
    o_ref, h_ref = gdn_recurrent(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens)
    assert _rel(torch.cat(os_, 1), o_ref) < 1e-5
    assert _rel(torch.cat(hs, 0), h_ref) < 1e-5


def test_chunked_gradients_vs_finite_differences():
    from qlabench.sweep import Point
    x = make(Point("fd", 1, 2, 4, (3, 5), "fp32", 0.5, 0, 0), with_grads=True)
    args = [t.double().requires_grad_(True) for t in (x.q, x.k, x.v, x.g, x.beta, x.h0)]

    def f(q, k, v, g, beta, h0):
        o, ht = gdn_chunked(q, k, v, g, beta, x.scale, h0, x.cu_seqlens, dtype=torch.float64,
                            chunk=2)
        return o, ht

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7)


def test_grads_group_summed_shapes(tiny_point):
    x = make(tiny_point, with_grads=True)
    gr = gdn_chunked_grads(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens, x.do, x.dht)
    assert gr["dq"].shape == x.q.shape and gr["dk"].shape == x.k.shape
    assert gr["dv"].shape == x.v.shape and gr["dg"].shape == x.g.shape
    assert gr["dh0"].shape == x.h0.shape and all(torch.isfinite(t).all() for t in gr.values())
