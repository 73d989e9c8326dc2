"""Real libraries on a CUDA device: each backend vs the reference on odd varlen shapes."""

import pytest
import torch

from qlabench import backends as B
from qlabench.config import Thresholds, Timing
from qlabench.correctness import reference_outputs, rel_err
from qlabench.sweep import Point
from qlabench.workloads import make

pytestmark = pytest.mark.gpu

SHAPES = [(2, 8, (1, 63, 64, 65, 1000, 4097)), (4, 12, (300, 64)), (2, 2, (129,))]


def _check(name, direction, h_qk, h_v, seqlens, h0=True):
    be = B.get(name)
    ok, why = be.available()
    if not ok:
        pytest.skip(why)
    p = Point("t", h_qk, h_v, 128, seqlens, "bf16", 0.25, 0, 0, initial_state=h0)
    ok, why = be.supports(p, direction)
    if not ok:
        pytest.skip(why)
    x = make(p, "cuda", with_grads=direction != "fwd")
    ref = reference_outputs(x, direction, "chunked", "fp32")
    prep = be.prepare(x, direction)
    out = be.outputs_to_canonical(prep.fn(), x, direction)
    th = Thresholds()
    errs = {}
    for n, r in ref.items():
        if r is None or n not in out:
            continue
        errs[n] = rel_err(out[n], r)[0]
    assert errs, "no outputs compared"
    bad = {n: e for n, e in errs.items() if not e <= th.get(n)}
    assert not bad, f"{name} {direction} {h_qk}/{h_v} {seqlens}: {errs}"
    return errs


@pytest.mark.parametrize("name", ["fla", "flashqla", "flashinfer", "tilelang"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(name, shape):
    _check(name, "fwd", *shape)


@pytest.mark.parametrize("name", ["fla", "flashqla", "tilelang"])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_backward_matches_reference(name, shape):
    _check(name, "bwd", *shape)


def test_fla_backward_captures_in_graph():
    from qlabench import timing
    be = B.get("fla")
    if not be.available()[0]:
        pytest.skip("fla unavailable")
    x = make(Point("t", 4, 8, 128, (8192,), "bf16", 0.25, 0, 0), "cuda", with_grads=True)
    prep = be.prepare(x, "bwd")
    tr, g = timing.measure_gpu(prep.fn, Timing(min_samples=3, max_samples=5))
    assert tr.timing_mode == "graph-batch" and g is not None, tr.fallback_reason


def test_cold_l2_flush_is_inside_the_graph():
    """The flush captured in a cold graph really runs on replay: its buffer is re-zeroed."""
    from qlabench import timing
    fl = timing._Flusher()
    a = torch.randn(256, 256, device="cuda")
    g = timing._capture(lambda: (fl(), a @ a))
    fl.buf.fill_(7)
    g.replay()
    torch.cuda.synchronize()
    assert int(fl.buf.abs().sum()) == 0


def test_graph_batch_vs_single_agree_on_a_long_kernel():
    from qlabench import timing
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    fn = lambda: a @ a
    tb, _ = timing.measure_gpu(fn, Timing(mode="graph-batch", min_samples=10))
    ts, _ = timing.measure_gpu(fn, Timing(mode="graph-single", min_samples=10))
    mb, ms = tb.stats()["latency_ms"], ts.stats()["latency_ms"]
    assert mb > 0.2 and abs(mb - ms) / ms < 0.1
