"""The fla backend's rows say what FLA ran: ``path`` is what FLA's own backend dispatch chose
for the call, per direction, and FLA's refusal of its Triton release on Hopper is an
``unsupported`` row with FLA's message, while any other exception stays ``crashed``.

The runs are in process, with FLA 0.6 (fla-core, a dev dependency) as installed and the
platform of the H200 image set on its modules (:func:`h200`): Hopper, Triton 3.6 (so
``CommonTileLangBackend`` is enabled by default and the Triton ``chunk_bwd_dqkwg`` refuses),
TileLang usable; the TileLang kernel itself is a stand-in (no GPU here). The backend is
tests/fla_cpu_backend.py: the fla backend with a CPU call that goes through FLA's dispatch."""

import sys
import types

import pytest

from qlabench import config as C
from qlabench import results, runner

CFG = {"name": "fla-cpu", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
       "seqlens": [[5]], "directions": ["fwd", "bwd"], "backends": ["fla-cpu"],
       "reference": {"impl": "chunked", "dtype": "fp64"},
       "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}, "isolate": False}
#: FLA 0.6.0's refusal (fla/ops/common/chunk_o.py), as its message begins
REFUSAL = "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results"


class TileLangStandIn:
    """What FLA's TileLang ``chunk_bwd_dqkwg`` is replaced by, and how many calls it got."""

    def __init__(self, error: Exception | None = None):
        self.calls, self.error = 0, error

    def __get__(self, obj, owner=None):  # a method of the backend instance
        def chunk_bwd_dqkwg(*args, **kwargs):
            self.calls += 1
            if self.error is not None:
                raise self.error
            return None, None, None, None
        return chunk_bwd_dqkwg


@pytest.fixture
def h200(monkeypatch):
    """FLA's modules as on the H200 image; the test backends registered. Returns a function
    that puts a stand-in (:class:`TileLangStandIn`) in place of FLA's TileLang kernel."""
    monkeypatch.setenv("QLABENCH_BACKENDS", "fla-cpu=fla_cpu_backend:FLAOnCPU,"
                       "fla-cpu-norefusals=fla_cpu_backend:FLAOnCPUNoRefusals")
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    from qlabench.backends.fla import import_fla_core
    import_fla_core()
    from fla.ops.common import chunk_o
    from fla.ops.common.backends.tilelang import CommonTileLangBackend as TL
    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)  # Triton 3.6.0
    monkeypatch.setattr(TL, "default_enable", True)  # IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0
    monkeypatch.setattr(TL, "is_available", classmethod(lambda cls: True))  # tilelang + nvcc

    def kernel(error=None):
        stand_in = TileLangStandIn(error)
        monkeypatch.setattr(TL, "chunk_bwd_dqkwg", stand_in)
        return stand_in
    return kernel


def _rows(tmp_path, **cfg):
    runner.run(C.parse({**CFG, **cfg}), tmp_path, log=lambda m: None)
    return results.load(tmp_path).set_index(["backend", "direction"])


def test_path_is_what_fla_dispatch_chose_per_direction(tmp_path, h200):
    kernel = h200()
    df = _rows(tmp_path)
    assert list(df["status"]) == ["ok", "ok"]
    assert kernel.calls > 0  # FLA's dispatch sent the backward's dqkwg to the TileLang kernel
    assert df.loc[("fla-cpu", "bwd"), "path"] == "triton+tilelang:chunk_bwd_dqkwg"
    assert df.loc[("fla-cpu", "fwd"), "path"] == "triton"


def test_fla_refusal_is_unsupported_and_other_errors_crash(tmp_path, h200, monkeypatch):
    kernel = h200()
    monkeypatch.setenv("FLA_TILELANG", "0")  # pure Triton: FLA refuses Triton 3.6 on Hopper
    df = _rows(tmp_path / "refused", directions=["bwd"],
               backends=["fla-cpu", "fla-cpu-norefusals"])
    refused = df.loc[("fla-cpu", "bwd")]
    assert refused["status"] == "unsupported"
    assert REFUSAL in refused["reason"] and "RuntimeError" in refused["reason"]
    assert refused["path"] == "triton" and refused["latency_ms"] != refused["latency_ms"]
    assert kernel.calls == 0
    # the same exception from a backend that does not declare it a refusal is a failure
    undeclared = df.loc[("fla-cpu-norefusals", "bwd")]
    assert undeclared["status"] == "crashed" and REFUSAL in undeclared["reason"]

    monkeypatch.delenv("FLA_TILELANG")
    h200(RuntimeError("CUDA error: an illegal memory access was encountered"))
    df = _rows(tmp_path / "crash", directions=["bwd"])
    crashed = df.loc[("fla-cpu", "bwd")]
    assert crashed["status"] == "crashed" and "illegal memory access" in crashed["reason"]
    assert crashed["path"] == "triton+tilelang:chunk_bwd_dqkwg"  # where it crashed


def test_path_is_unknown_without_fla_dispatch(tmp_path, h200, monkeypatch):
    h200()
    # an fla without backend dispatch
    monkeypatch.setitem(sys.modules, "fla.backends", types.ModuleType("fla.backends"))
    df = _rows(tmp_path, directions=["bwd"])
    assert df.loc[("fla-cpu", "bwd"), "status"] == "ok"
    assert df.loc[("fla-cpu", "bwd"), "path"] == "unknown"
