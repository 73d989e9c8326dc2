import json
import time

from qlabench import metrics, timing
from qlabench.config import Timing
from qlabench.profile import parse_trace


def test_cpu_timer_stops_on_rse_and_keeps_samples():
    tr = timing.measure_cpu(lambda: time.sleep(0.002), Timing(min_samples=5, max_samples=50,
                                                               rse_target=0.05, budget_s=2))
    st = tr.stats()
    assert 5 <= tr.n_samples <= 50 and len(tr.samples_ms) == tr.n_samples
    assert 1.9 < st["latency_ms"] < 10 and st["p10_ms"] <= st["latency_ms"] <= st["p90_ms"]
    assert tr.stop_reason in ("rse", "budget", "max_samples")


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
