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


def test_chunked_across_term_blocks_and_a_partial_chunk_matches_the_recurrence():
    """A sequence of more full chunks than the chunked form computes its state-independent terms
    for at once (``TERMS_CHUNKS``), then a partial chunk, beside a short one: outputs and every
    gradient (autograd through each form, fp64) agree with the token-by-token recurrence."""
    from qlabench.backends.reference import TERMS_CHUNKS
    from qlabench.sweep import Point

    chunk = 2
    x = make(Point("blocks", 1, 2, 8, (2 * TERMS_CHUNKS * chunk + 3, 5), "fp32", 0.5, 0, 0), with_grads=True)

    def grads(fn, **kw):
        leaves = [t.double().requires_grad_(True) for t in (x.q, x.k, x.v, x.g, x.beta, x.h0)]
        o, ht = fn(*leaves[:5], x.scale, leaves[5], x.cu_seqlens, dtype=torch.float64, **kw)
        loss = (o * x.do.double()).sum() + (ht * x.dht.double()).sum()
        return [o, ht, *torch.autograd.grad(loss, leaves)]

    for a, b in zip(grads(gdn_chunked, chunk=chunk), grads(gdn_recurrent)):
        assert _rel(a, b) < 1e-10


def test_grads_group_summed_shapes(tiny_point):
    x = make(tiny_point, with_grads=True)
    gr = gdn_chunked_grads(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens, x.do, x.dht)
    assert gr["dq"].shape == x.q.shape and gr["dk"].shape == x.k.shape
    assert gr["dv"].shape == x.v.shape and gr["dg"].shape == x.g.shape
    assert gr["dh0"].shape == x.h0.shape and all(torch.isfinite(t).all() for t in gr.values())


def test_grads_by_head_blocks_equal_one_pass(tiny_point):
    """Gradients over GVA-group blocks, one qk-head per pass, are the one-pass gradients (fp64)."""
    from dataclasses import replace
    x = make(replace(tiny_point, h_qk=2, h_v=4), with_grads=True)
    args = (x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens, x.do, x.dht)
    whole = gdn_chunked_grads(*args, dtype=torch.float64, qk_heads=2)
    blocks = gdn_chunked_grads(*args, dtype=torch.float64, qk_heads=1)
    assert whole.keys() == blocks.keys() == {"dq", "dk", "dv", "dg", "dbeta", "dh0"}
    for n in whole:
        assert blocks[n].shape == whole[n].shape and _rel(blocks[n], whole[n]) < 1e-12, n


def test_grads_halve_head_blocks_on_oom(tiny_point, monkeypatch):
    """A pass that does not fit the device is retried with half the heads: the same gradients,
    and the count that fit is kept for the shape; a count the caller fixed is not changed."""
    from dataclasses import replace

    import qlabench.backends.reference as R
    x = make(replace(tiny_point, h_qk=4, h_v=8), with_grads=True)
    args = (x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens, x.do, x.dht)
    want = gdn_chunked_grads(*args, dtype=torch.float64, qk_heads=1)
    real, tried = R._grads_pass, []

    def fits_one(q, *a):
        tried.append(q.shape[2])
        if q.shape[2] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(q, *a)

    monkeypatch.setattr(R, "_grads_pass", fits_one)
    monkeypatch.setattr(R, "_FIT", {})
    got = gdn_chunked_grads(*args, dtype=torch.float64)
    assert tried == [4, 2, 1, 1, 1, 1]
    for n in want:
        assert torch.equal(got[n], want[n]), n
    tried.clear()
    gdn_chunked_grads(*args, dtype=torch.float64)
    assert tried == [1, 1, 1, 1]  # the fitted count first
    with pytest.raises(torch.OutOfMemoryError):
        gdn_chunked_grads(*args, dtype=torch.float64, qk_heads=2)


@pytest.fixture
def one_thread():
    """One torch thread: the token-by-token recurrence and its autograd are thousands of small
    fp64 ops, slower on two threads of a shared machine than on one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("h_qk,h_v,head_dim,seqlens,device", [
    (2, 4, 32, (1, 65, 129, 1, 257), "cpu"),
    (1, 2, 128, (1, 1024, 1, 383), "cpu"),
    pytest.param(2, 4, 32, (1, 4097, 1, 1025, 64), "cuda", marks=pytest.mark.gpu),
])
def test_fp32_chunked_reference_against_fp64_recurrence_every_output(h_qk, h_v, head_dim, seqlens,
                                                                     device, one_thread):
    """The correctness check's reference (chunked, fp32; gradients by autograd through it) against the fp64
    token-by-token recurrence (gradients by autograd through the recurrence) on short serving
    layouts — single tokens, lengths of 1 mod 64, a tail of one token; head dims 32 and 128 (the
    models') — every output far inside the check's limits (1% of the tightest)."""
    from qlabench import config as C
    from qlabench import correctness
    from qlabench.backends.reference import gdn_recurrent
    from qlabench.sweep import Point
    from qlabench.workloads import make

    p = Point("serving", h_qk, h_v, head_dim, seqlens, "bf16", 0.25, 0, 0)
    x = make(p, device, with_grads=True)
    fwd = correctness.reference_outputs(x, "fwd", "chunked", "fp32")
    bwd = correctness.reference_outputs(x, "bwd", "chunked", "fp32")
    leaves = {n: getattr(x, n).detach().to(torch.float64).requires_grad_(True)
              for n in ("q", "k", "v", "g", "beta", "h0")}
    o, ht = gdn_recurrent(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), x.scale,
                          leaves["h0"], x.cu_seqlens, dtype=torch.float64)
    loss = (o * x.do.double()).sum() + (ht * x.dht.double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    exact = {"o": o.detach(), "final_state": ht.detach(),
             **{"d" + n: gr for n, gr in zip(leaves, grads)}}
    tightest = min(C.Thresholds().model_dump().values())
    for name, ours in {**fwd, **bwd}.items():
        rel, _ = correctness.rel_err(ours, exact[name])
        loc = (correctness.worst_state_rel_err(ours, exact[name]) if name in correctness.STATE_OUTPUTS
               else correctness.token_local_err(ours, exact[name], x.cu_seqlens))
        assert max(rel, loc) < tightest / 100, (name, rel, loc)
