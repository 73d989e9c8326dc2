"""Adapter conversions with pure-torch stand-ins (no GPU, no library needed)."""

import torch

from qlabench import backends as B
from qlabench.backends.flashinfer import state_from_flashinfer, to_flashinfer
from qlabench.sweep import Point
from qlabench.workloads import make


def test_flashinfer_conversions(tiny_point):
    x = make(tiny_point)
    a = to_flashinfer(x)
    T = tiny_point.total_tokens
    assert a["q"].shape == (T, 2, 16) and a["v"].shape == (T, 4, 16)
    assert torch.allclose(a["g"], x.g[0].exp()) and a["g"].dtype == torch.float32
    assert (a["g"][:, list(x.zero_gate_heads)] == 1).all()  # g = 0 -> alpha = 1
    assert a["cu_seqlens"].dtype == torch.int64
    assert a["initial_state"].shape == x.h0.shape
    assert torch.equal(a["initial_state"][1, 2, 3, 5], x.h0[1, 2, 5, 3])
    assert torch.equal(state_from_flashinfer(a["initial_state"]), x.h0)


def test_flashinfer_canonical_output_shapes(tiny_point):
    x = make(tiny_point)
    be = B.get("flashinfer")
    T = tiny_point.total_tokens
    o = torch.randn(T, 4, 16)
    st = torch.randn(5, 4, 16, 16)
    out = be.outputs_to_canonical((o, st), x, "fwd")
    assert out["o"].shape == x.v.shape and torch.equal(out["final_state"], st.transpose(-1, -2))


def test_supports_reasons():
    p = Point("m", 2, 8, 64, (10,), "bf16", 0.25, 0, 0)
    ok, why = B.get("flashinfer").supports(p, "fwd")
    assert not ok and "head_dim 128" in why
    ok, why = B.get("flashinfer").supports(p._replace() if hasattr(p, "_replace") else p, "bwd")
    assert not ok and "backward" in why
    ok, why = B.get("flashqla").supports(p, "fwd")
    assert not ok and "128" in why
    p32 = Point("m", 2, 8, 128, (10,), "fp32", 0.25, 0, 0)
    ok, why = B.get("flashqla").supports(p32, "fwd")
    assert not ok and "bf16" in why


def test_fla_and_flashqla_canonical_mapping(tiny_point):
    x = make(tiny_point)
    o, ht, A, gc = object(), object(), object(), object()
    assert B.get("fla").outputs_to_canonical((gc, o, A, ht, None, None), x, "fwd") == \
        {"o": o, "final_state": ht}
    assert B.get("flashqla").outputs_to_canonical((gc, A, o, None, ht, None), x, "fwd") == \
        {"o": o, "final_state": ht}
    grads = tuple(object() for _ in range(6))
    m = B.get("flashqla").outputs_to_canonical(grads, x, "bwd")
    assert [m[k] for k in ("dq", "dk", "dv", "dbeta", "dg", "dh0")] == list(grads)


def test_every_backend_says_why_unavailable_without_gpu():
    if torch.cuda.is_available():
        return
    for n in ("fla", "flashinfer", "flashqla", "tilelang"):
        ok, why = B.get(n).available()
        assert not ok and why
