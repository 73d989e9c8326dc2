import json
import time
import types

import pytest

from qlabench import metrics, timing
from qlabench.config import Timing
from qlabench.profile import parse_trace


def test_cpu_timer_stops_on_rse_and_keeps_samples(monkeypatch):
    # a fake clock: each call takes 2 ms +- 1% (a loaded host's real sleeps can jump 10x)
    clock = [0.0]
    steps = iter([0.002 * (1 + 0.01 * (-1) ** i) for i in range(100)])
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    tr = timing.measure_cpu(lambda: clock.__setitem__(0, clock[0] + next(steps)),
                            Timing(warmup=0, min_samples=5, max_samples=50, rse_target=0.05,
                                   budget_s=2))
    st = tr.stats()
    assert tr.stop_reason == "rse" and tr.n_samples == 5 == len(tr.samples_ms)
    assert tr.samples_ms == pytest.approx([2.02, 1.98, 2.02, 1.98, 2.02])
    assert st["latency_ms"] == pytest.approx(2.02) and st["rse"] < 0.05
    assert st["p10_ms"] <= st["latency_ms"] <= st["p90_ms"]


@pytest.mark.parametrize("samples,opts,reason,n", [
    ([1.0] * 100, dict(min_samples=5, max_samples=50, rse_target=0.01, budget_s=60), "rse", 5),
    ([1.0, 3.0] * 50, dict(min_samples=5, max_samples=8, rse_target=1e-9, budget_s=60),
     "max_samples", 8),
    ([1.0, 3.0] * 50, dict(min_samples=4, max_samples=50, rse_target=1e-9, budget_s=1e-9),
     "budget", 4),
])
def test_stopping_rule_with_a_fake_timer(samples, opts, reason, n):
    it = iter(samples)
    got, why = timing._collect(lambda: next(it), Timing(**opts))
    assert why == reason and got == samples[:n]


def test_cpu_timer_budget():
    tr = timing.measure_cpu(lambda: time.sleep(0.01), Timing(min_samples=2, max_samples=1000,
                                                              rse_target=1e-9, budget_s=0.1))
    assert tr.stop_reason == "budget" and tr.n_samples < 30


def test_flop_model_matches_hand_counts():
    assert metrics.fwd_flops_per_token_head(128) == 180_224
    assert metrics.bwd_flops_per_token_head(128) == 507_904


def test_roofline_case_a_and_b():
    a = metrics.derive("fwd", 1.0, 32768, 16, 64, 1)
    assert abs(a["flops"] - 3.780e11) / 3.780e11 < 1e-3
    assert a["min_bytes"] == 1_367_343_104
    assert abs(a["roofline_ms"] - 0.478) < 0.002 and abs(a["pct_roofline"] - 47.8) < 0.3
    b = metrics.derive("fwd", None, 32768, 2, 8, 1)
    assert b["min_bytes"] == 170_917_888 and abs(b["roofline_ms"] - 0.0598) < 0.0005
    bw = metrics.derive("bwd", None, 32768, 16, 64, 1)
    assert bw["min_bytes"] == 2_193_620_992 and abs(bw["roofline_ms"] - 1.348) < 0.002


def test_throttle_mask():
    assert not metrics.throttled(0) and not metrics.throttled(1)  # GPU idle only
    assert metrics.throttled(0x8) and metrics.throttled(0x40)


def test_gpm_without_nvml_gives_reason(monkeypatch):
    monkeypatch.setattr(metrics, "_nvml", lambda: None)
    out = metrics.gpm_sample(lambda: None)
    assert out["sm_util_pct"] is None and "pynvml" in out["gpm_reason"]


def test_parse_trace():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k_main", "dur": 90.0,
         "args": {"grid": [64, 2, 1], "block": [512, 1, 1], "registers per thread": 168,
                  "shared memory": 0, "dynamic shared memory": 196608}},
        {"ph": "X", "cat": "kernel", "name": "k_small", "dur": 10.0,
         "args": {"grid": [4, 1, 1], "block": [128, 1, 1]}},
        {"ph": "X", "cat": "kernel", "name": "k_main", "dur": 90.0,
         "args": {"grid": [64, 2, 1], "block": [512, 1, 1]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5.0},
    ]}
    rows = parse_trace(json.loads(json.dumps(trace)), n_calls=2)
    assert rows[0]["name"] == "k_main" and rows[0]["ctas"] == 128 and rows[0]["calls"] == 1
    assert abs(rows[0]["share_pct"] - 100 * 180 / 190) < 1e-9 and rows[0]["total_us"] == 90.0
    assert rows[0]["regs_per_thread"] == 168 and rows[0]["smem_bytes"] == 196608
