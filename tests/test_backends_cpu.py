"""Adapter conversions with pure-torch stand-ins (no GPU, no library needed)."""

import ast
import inspect
import sys
import textwrap
import types

import pytest
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


#: the libraries' low-level calls, and the names of what they return, in order (FLA's are checked
#: against its installed source below; FlashQLA's are from its 0.1.3 source)
LIBS = {
    "fla": {"module": "fla.ops.gated_delta_rule.chunk",
            "fwd": ("g", "o", "A", "final_state", "initial_state", "g_input"),
            "bwd": ("dq", "dk", "dv", "db", "dg", "dh0", "dA_log", "ddt_bias")},
    "flashqla": {"module": "flash_qla",
                 "fwd": ("g_cumsum", "A", "o", "h", "final_state", "cp_cache"),
                 "bwd": ("dq", "dk", "dv", "dbeta", "dg", "dh0")},
}


def _fake_library(name, x, ref_fwd, ref_bwd):
    """Stand-in modules for a library's low-level fwd/bwd: they return the reference answer in
    the library's order, with look-alikes elsewhere (the initial state beside the final state,
    dq beside dk, dbeta beside dg), and check they get the canonical inputs and, in the backward,
    the forward's own g-cumsum and A tensors."""
    g_cumsum, A = x.g.cumsum(1), torch.randn(*x.g.shape, 64)
    fwd_vals = {"g": g_cumsum, "g_cumsum": g_cumsum, "A": A, "o": ref_fwd["o"],
                "final_state": ref_fwd["final_state"], "initial_state": x.h0, "g_input": x.g,
                "h": None, "cp_cache": None}
    bwd_vals = {**ref_bwd, "db": ref_bwd["dbeta"], "dA_log": None, "ddt_bias": None}
    ci = object()

    def fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            chunk_indices=None, output_h=False):
        assert q is x.q and k is x.k and v is x.v and g is x.g and beta is x.beta
        assert initial_state is x.h0 and cu_seqlens is x.cu_seqlens and scale == x.scale
        assert name != "fla" or chunk_indices is ci
        return tuple(fwd_vals[n] for n in LIBS[name]["fwd"])

    def bwd(q, k, v, g, beta, A, do, dht, scale, initial_state, cu_seqlens, chunk_indices=None):
        assert g is g_cumsum and A is fwd_vals["A"], "bwd must get the forward's g-cumsum and A"
        assert q is x.q and do is x.do and dht is x.dht and initial_state is x.h0
        return tuple(bwd_vals[n] for n in LIBS[name]["bwd"])

    lib = types.ModuleType(LIBS[name]["module"])
    lib.chunk_gated_delta_rule_fwd, lib.chunk_gated_delta_rule_bwd = fwd, bwd
    mods = {LIBS[name]["module"]: lib}
    if name == "fla":
        utils = types.ModuleType("fla.ops.utils")
        utils.prepare_chunk_indices = lambda cu, chunk: ci
        mods["fla.ops.utils"] = utils
    return mods


@pytest.mark.parametrize("name", ["fla", "flashqla"])
@pytest.mark.parametrize("direction", ["fwd", "bwd", "fwdbwd"])
def test_fla_and_flashqla_canonical_mapping(tiny_point, monkeypatch, name, direction):
    """prepare + outputs_to_canonical over a library that computes the right answer give the
    reference's outputs (a wrong slot would pick a look-alike or the wrong shape)."""
    from qlabench.correctness import reference_outputs, rel_err

    x = make(tiny_point, with_grads=True)
    ref_fwd = reference_outputs(x, "fwd", "chunked", "fp32")
    ref_bwd = reference_outputs(x, "bwd", "chunked", "fp32")
    for mod, m in _fake_library(name, x, ref_fwd, ref_bwd).items():
        monkeypatch.setitem(sys.modules, mod, m)
    be = B.get(name)
    out = be.outputs_to_canonical(be.prepare(x, direction).fn(), x, direction)
    ref = ref_fwd if direction == "fwd" else ref_bwd
    assert set(out) >= set(ref)
    for n, r in ref.items():
        assert rel_err(out[n], r)[0] < 1e-6, f"{name} {direction}: {n} is not the library's {n}"


def _return_names(fn) -> tuple[str, ...]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    rets = [n for n in ast.walk(tree) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    return tuple(e.id for e in rets[-1].value.elts)


@pytest.mark.parametrize("name", ["fla", "flashqla"])
def test_return_orders_are_the_installed_librarys(name):
    import importlib
    try:
        mod = importlib.import_module(LIBS[name]["module"])
    except Exception as e:  # not installed, or (flash_qla) no GPU to query at import
        pytest.skip(f"{LIBS[name]['module']}: {type(e).__name__}")
    for d in ("fwd", "bwd"):
        assert _return_names(getattr(mod, f"chunk_gated_delta_rule_{d}")) == LIBS[name][d]


def test_every_backend_says_why_unavailable_without_gpu():
    if torch.cuda.is_available():
        return
    for n in ("fla", "flashinfer", "flashqla", "tilelang"):
        ok, why = B.get(n).available()
        assert not ok and why


def _fake_flashinfer(monkeypatch, cute_dsl: bool, calls: list):
    """A stand-in ``flashinfer.gdn_prefill`` with one API generation's signature; it records the
    keyword arguments of each call and writes NaN-free outputs into the given buffers."""
    def flat(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
             cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None, output_state=None):
        calls.append({"cu_seqlens": cu_seqlens})
        output.zero_()
        output_state.zero_()
        return output, output_state

    def cute(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
             cu_seqlens=None, use_qk_l2norm_in_kernel=False, output=None, output_state=None,
             use_cp="auto", max_seqlen=None, *, gate_domain="linear"):
        calls.append({"max_seqlen": max_seqlen, "gate_domain": gate_domain})
        output.zero_()
        output_state.zero_()
        return output, output_state

    mod = types.ModuleType("flashinfer.gdn_prefill")
    mod.chunk_gated_delta_rule = cute if cute_dsl else flat
    pkg = types.ModuleType("flashinfer")
    pkg.gdn_prefill = mod
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill", mod)
    return mod.chunk_gated_delta_rule


@pytest.mark.parametrize("cute_dsl", [False, True])
def test_flashinfer_api_generation_is_read_from_the_signature(tiny_point, monkeypatch, cute_dsl):
    from qlabench.backends.flashinfer import api_of
    calls: list = []
    fn = _fake_flashinfer(monkeypatch, cute_dsl, calls)
    assert api_of(fn) == ("cute-dsl" if cute_dsl else "cutlass-flat")
    x = make(tiny_point)
    be = B.get("flashinfer")
    prep = be.prepare(x, "fwd")
    assert calls == []  # nothing runs in prepare
    out = be.outputs_to_canonical(prep.fn(), x, "fwd")
    assert out["o"].shape == x.v.shape and out["final_state"].shape == x.h0.shape
    if cute_dsl:  # the longest sequence, as a host int; the gate stays linear (alpha = exp(g))
        assert calls[0] == {"max_seqlen": max(tiny_point.seqlens), "gate_domain": "linear"}
        assert isinstance(calls[0]["max_seqlen"], int)
    else:
        assert "max_seqlen" not in calls[0] and calls[0]["cu_seqlens"].dtype == torch.int64
