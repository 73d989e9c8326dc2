"""The tileops backend on CPU: registered, declaring what its kernels serve, converting to the
contract of tileops' ``GDNFwdOp`` (a stand-in that holds that contract and computes the reference
answer), checked by the correctness check like any other backend, and an absent tileops or an
unset environment as ``unavailable`` rows."""

import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch

from qlabench import backends as B
from qlabench import config as C
from qlabench import runner
from qlabench.backends.reference import gdn_chunked
from qlabench.correctness import check_outputs, reference_outputs, rel_err
from qlabench.sweep import Point
from qlabench.workloads import make

ROOT = Path(__file__).resolve().parents[1]
SWEEP = {"name": "tileops-cpu", "models": [{"name": "m", "h_qk": 2, "h_v": 4, "head_dim": 64}],
         "seqlens": [[1, 63, 64, 65, 130], [9]], "directions": ["fwd", "bwd"],
         "reference": {"impl": "chunked", "dtype": "fp32"}, "isolate": False,
         "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}


def _point(h_qk=2, h_v=8, d=128, dtype="bf16") -> Point:
    return Point("m", h_qk, h_v, d, (64, 100), dtype, 0.25, 0, 0)


class _Contract(TypeError):
    """What tileops' signature check raises (its CheckError) for a call outside its contract."""


def _fake_tileops(monkeypatch, calls: list):
    """A stand-in ``tileops.linear_attention`` whose ``GDNFwdOp`` checks tileops 0.1.0's call
    contract (g and beta in q's dtype, an fp32 initial state, int64 device offsets and the same
    offsets on the host, B = 1 when packed) and answers with the reference, honouring its own
    ``scale`` and ``state_v_first``."""

    class GDNFwdOp:
        def __init__(self, scale=None, use_qk_l2norm_in_kernel=False,
                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                     state_v_first=False, use_gate_in_kernel=False, *, validate_inputs=False,
                     target=None):
            self.scale, self.state_v_first = scale, state_v_first
            assert not (use_qk_l2norm_in_kernel or use_beta_sigmoid_in_kernel or use_gate_in_kernel)

        def __call__(self, q, k, v, g, beta, initial_state=None, cu_seqlens=None,
                     cu_seqlens_cpu=None, A_log=None, dt_bias=None):
            calls.append(dict(g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                              cu_seqlens_cpu=cu_seqlens_cpu, scale=self.scale,
                              state_v_first=self.state_v_first))
            for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
                if t.dtype != q.dtype:
                    raise _Contract(f"GDNFwdOp: {name} dtype differs from T")
            if initial_state is not None and initial_state.dtype != torch.float32:
                raise _Contract("GDNFwdOp: initial_state dtype differs from float32")
            if cu_seqlens is not None:
                if cu_seqlens.dtype != torch.int64 or q.shape[0] != 1:
                    raise _Contract("GDNFwdOp: cu_seqlens must be int64 with B == 1")
                if cu_seqlens_cpu is not None and (cu_seqlens_cpu.device.type != "cpu"
                                                   or not torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())):
                    raise _Contract("GDNFwdOp: cu_seqlens_cpu must be cu_seqlens on the CPU")
            h0 = initial_state
            if h0 is not None and self.state_v_first:
                h0 = h0.transpose(-1, -2)
            o, ht = gdn_chunked(q, k, v, g.float(), beta.float(), self.scale, h0, cu_seqlens)
            return o.to(q.dtype), (ht.transpose(-1, -2) if self.state_v_first else ht).contiguous()

    class OpNotAvailableError(RuntimeError):
        """tileops.backend's: no kernel of tileops serves the call on this device."""

    pkg = types.ModuleType("tileops")
    mod = types.ModuleType("tileops.linear_attention")
    backend = types.ModuleType("tileops.backend")
    mod.GDNFwdOp = pkg.GDNFwdOp = GDNFwdOp
    backend.OpNotAvailableError = OpNotAvailableError
    pkg.linear_attention, pkg.backend = mod, backend
    monkeypatch.setitem(sys.modules, "tileops", pkg)
    monkeypatch.setitem(sys.modules, "tileops.linear_attention", mod)
    monkeypatch.setitem(sys.modules, "tileops.backend", backend)


def test_tileops_is_registered_as_a_forward_library():
    assert "tileops" in B.names()
    cls = B.backend_class("tileops")
    assert cls.directions == ("fwd",) and cls.kind == "library" and cls.needs_cuda
    assert cls.distribution == "tileops" and cls.module == "tileops.linear_attention"


def test_tileops_declares_what_its_kernels_serve():
    be = B.get("tileops")
    for p in (_point(), _point(2, 8, 64), _point(1, 2), _point(16, 64, dtype="fp16")):
        assert be.supports(p, "fwd") == (True, ""), p
    cases = [(_point(), "bwd", "no GDN backward"), (_point(), "fwdbwd", "no GDN backward"),
             (_point(d=96), "fwd", "64 or 128 (head_dim=96)"),
             (_point(d=256), "fwd", "64 or 128 (head_dim=256)"),
             (_point(1, 3), "fwd", "even head count or a single head (h_v=3)"),
             (_point(3, 6), "fwd", "even head count or a single head (h_qk=3)"),
             (_point(4, 6), "fwd", "h_v a multiple of h_qk")]
    for p, direction, why in cases:
        ok, reason = be.supports(p, direction)
        assert not ok and why in reason, (p, direction, reason)


@pytest.mark.parametrize("host_offsets", [True, False])
def test_tileops_conversion_meets_its_contract_and_the_reference(tiny_point, monkeypatch,
                                                                  host_offsets):
    calls: list = []
    _fake_tileops(monkeypatch, calls)
    x = make(tiny_point)
    be = B.get("tileops", {"host_offsets": host_offsets})
    prep = be.prepare(x, "fwd")
    assert calls == []  # nothing runs in prepare
    out = be.outputs_to_canonical(prep.fn(), x, "fwd")
    c = calls[0]
    # log-space g and post-sigmoid beta, rounded to q's dtype; the state as it is (key-major)
    assert c["g"].dtype == c["beta"].dtype == torch.bfloat16
    assert torch.equal(c["g"], x.g.to(torch.bfloat16)) and torch.equal(c["beta"], x.beta.to(torch.bfloat16))
    assert c["initial_state"] is x.h0 and not c["state_v_first"] and c["scale"] == x.scale
    assert c["cu_seqlens"].dtype == torch.int64
    if host_offsets:
        assert c["cu_seqlens_cpu"].device.type == "cpu"
        assert c["cu_seqlens_cpu"].tolist() == x.cu_seqlens.tolist()
    else:
        assert c["cu_seqlens_cpu"] is None
    # the canonical outputs are the library's answer on those inputs, with nothing else changed
    o, ht = gdn_chunked(x.q, x.k, x.v, x.g.to(torch.bfloat16).float(),
                        x.beta.to(torch.bfloat16).float(), x.scale, x.h0, x.cu_seqlens)
    assert rel_err(out["o"], o.to(torch.bfloat16))[0] == 0.0
    assert rel_err(out["final_state"], ht)[0] == 0.0
    # and that answer passes the check against the fp32 reference of the canonical inputs
    sweep = C.parse({**SWEEP, "backends": ["reference"]})
    _, _, bad = check_outputs(out, reference_outputs(x, "fwd", "chunked", "fp32"), x, "fwd", sweep)
    assert bad == []


def test_refresh_carries_fresh_gate_and_beta_into_the_converted_copies(tiny_point, monkeypatch):
    calls: list = []
    _fake_tileops(monkeypatch, calls)
    x = make(tiny_point)
    prep = B.get("tileops").prepare(x, "fwd")
    fresh = make(tiny_point, seed=7)
    x.g.copy_(fresh.g)
    x.beta.copy_(fresh.beta)
    prep.refresh()
    prep.fn()
    assert torch.equal(calls[-1]["g"], fresh.g.to(torch.bfloat16))
    assert torch.equal(calls[-1]["beta"], fresh.beta.to(torch.bfloat16))


def test_tileops_rows_are_checked_like_any_other_backend(tmp_path, monkeypatch):
    """A sweep with tileops (its library stood in, its availability granted on this CPU):
    forward rows judged by the correctness check and timed, backward rows `unsupported`."""
    _fake_tileops(monkeypatch, [])
    monkeypatch.setattr(B.backend_class("tileops"), "available", lambda self: (True, ""))
    s = C.parse({**SWEEP, "backends": ["tileops"]})
    runner.run(s, tmp_path / "r", log=lambda *a, **k: None)
    t = pd.read_parquet(tmp_path / "r")
    fwd, bwd = t[t["direction"] == "fwd"], t[t["direction"] == "bwd"]
    assert len(fwd) == 2 and set(fwd["status"]) == {"ok"}
    assert (fwd["rel_l2_o"] > 0).all() and (fwd["rel_l2_o"] < s.thresholds.o).all()
    assert (fwd["rel_l2_final_state"] < s.thresholds.final_state).all()
    assert fwd["latency_ms"].notna().all()
    assert len(bwd) == 2 and set(bwd["status"]) == {"unsupported"}
    assert bwd["reason"].str.contains("no GDN backward").all()


def test_a_state_layout_slip_is_incorrect(tmp_path, monkeypatch):
    """The same sweep with the op asked for a value-major state while the canonical (key-major)
    one is passed: the check turns it into `incorrect` rows."""
    _fake_tileops(monkeypatch, [])
    cls = B.backend_class("tileops")
    monkeypatch.setattr(cls, "available", lambda self: (True, ""))
    op = sys.modules["tileops.linear_attention"].GDNFwdOp
    init = op.__init__
    monkeypatch.setattr(op, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "state_v_first": True}))
    s = C.parse({**SWEEP, "directions": ["fwd"], "backends": ["reference", "tileops"]})
    runner.run(s, tmp_path / "r", log=lambda *a, **k: None)
    df = pd.read_parquet(tmp_path / "r")
    assert set(df.loc[df["backend"] == "tileops", "status"]) == {"incorrect"}


@pytest.mark.parametrize("raised, status", [("OpNotAvailableError", "unsupported"),
                                             ("RuntimeError", "crashed")])
def test_a_call_tileops_refuses_is_unsupported_any_other_failure_crashed(tmp_path, monkeypatch,
                                                                        raised, status):
    """Its op's OpNotAvailableError (none of its kernels serves the call here) is a refusal:
    `unsupported` rows with its message; another exception from the call is `crashed`."""
    _fake_tileops(monkeypatch, [])
    monkeypatch.setattr(B.backend_class("tileops"), "available", lambda self: (True, ""))
    exc = (sys.modules["tileops.backend"].OpNotAvailableError if raised == "OpNotAvailableError"
           else RuntimeError)

    def call(self, *a, **k):
        raise exc("GDNFwdOp's in-tree kernels do not serve this call")

    monkeypatch.setattr(sys.modules["tileops.linear_attention"].GDNFwdOp, "__call__", call)
    s = C.parse({**SWEEP, "directions": ["fwd"], "backends": ["tileops"]})
    runner.run(s, tmp_path / "r", log=lambda *a, **k: None)
    df = pd.read_parquet(tmp_path / "r")
    assert len(df) == 2 and set(df["status"]) == {status}
    assert df["reason"].str.contains("do not serve this call").all()
    if status == "unsupported":
        assert df["reason"].str.startswith("tileops refuses this configuration: OpNotAvailableError").all()


def test_an_absent_tileops_is_unavailable_naming_the_import(monkeypatch):
    mod = sys.modules[B.backend_class("tileops").__module__]
    monkeypatch.setitem(sys.modules, "tileops", None)  # import tileops -> ImportError
    monkeypatch.setattr(mod, "cuda_cc", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ok, why = B.get("tileops").available()
    assert not ok and why.startswith("cannot import tileops.linear_attention")
    monkeypatch.setattr(mod, "cuda_cc", lambda: (8, 0))
    ok, why = B.get("tileops").available()
    assert not ok and "SM90 and SM89; this GPU is sm_80" in why


def test_the_forward_campaigns_tileops_entry_without_its_environment(tmp_path, monkeypatch):
    """configs/h200_fwd.yaml's tileops entry, its environment variable unset: `unavailable` rows
    naming the variable, and the other backends run."""
    entry = C.load(ROOT / "configs/h200_fwd.yaml").entries()["tileops"]
    assert entry.name == "tileops" and entry.own_environment
    monkeypatch.delenv("QLABENCH_TILEOPS_PATH", raising=False)
    s = C.parse({**SWEEP, "directions": ["fwd"],
                 "backends": ["reference", entry.model_dump(exclude_defaults=True)]})
    runner.run(s, tmp_path / "r", log=lambda *a, **k: None)
    df = pd.read_parquet(tmp_path / "r")
    t = df[df["backend"] == "tileops"]
    assert len(t) == 2 and set(t["status"]) == {"unavailable"}
    assert t["reason"].str.contains("QLABENCH_TILEOPS_PATH is not set").all()
    assert set(df.loc[df["backend"] == "reference", "status"]) == {"ok"}
