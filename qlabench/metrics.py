"""FLOP/byte model, derived throughput columns, NVML GPM utilisation and SM clocks.

FLOP model (matmul FLOPs = 2·M·N·K, per token per v-head, chunk C = 64, K = V = d):

- forward (FLA's chunked algorithm): KKᵀ 2Cd, w = A·(βe^gK) 2Cd, u = A·(βV) 2Cd, w·h 2d², Kᵀ·v_new
  2d², Q·h 2d², QKᵀ 2Cd, P·v_new 2Cd  →  ``2(5Cd + 3d²)`` = 180,224 at d = 128.
- backward (FLA's kernel sequence): recompute w,u,h 98,304 + dv_local 32,768 + dhu 98,304 +
  dqkwg 147,456 + WY backward 131,072 = 507,904 at d = 128; in general
  ``recompute 2(2Cd + 2d²) + dv_local 2(2Cd) + dhu 2(3d²) + dqkwg 2(3Cd + 3d²) + wy 2(8Cd)``.

One algorithm's count is used for every backend of a direction, so TFLOP/s compare like with like
("useful" FLOPs at FLA's algebra), not each library's own arithmetic.

Minimum bytes = API inputs and outputs touched once: q, k (per qk-head) and v, o (per v-head) in
the operand dtype; g, β fp32 per v-head; h0 and the final state fp32 d² per (sequence, v-head).
The backward reads q, k, v, dO, g, β, h0, dht and writes dq, dk, dv, dg, dβ, dh0.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

CHUNK = 64
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Ceilings measured on the lent H200 (a large bf16 matmul ~790 TFLOP/s, a device-to-device copy
# ~4300 GB/s; the datasheet's dense bf16 989 TFLOP/s and 4800 GB/s are not reached), used only when
# no run of a row's GPU model has measured its own (``measure_ceilings``).
H200_PEAK_TFLOPS = 790.0
H200_PEAK_GBPS = 4300.0


def fwd_flops_per_token_head(d: int = 128, c: int = CHUNK) -> int:
    return 2 * (5 * c * d + 3 * d * d)


def bwd_flops_per_token_head(d: int = 128, c: int = CHUNK) -> int:
    recompute = 2 * (2 * c * d + 2 * d * d)
    dv_local = 2 * (2 * c * d)
    dhu = 2 * (3 * d * d)
    dqkwg = 2 * (3 * c * d + 3 * d * d)
    wy = 2 * (8 * c * d)
    return recompute + dv_local + dhu + dqkwg + wy


def flops(direction: str, total_tokens: int, h_v: int, d: int = 128) -> float:
    per = {"fwd": fwd_flops_per_token_head(d),
           "bwd": bwd_flops_per_token_head(d),
           "fwdbwd": fwd_flops_per_token_head(d) + bwd_flops_per_token_head(d)}[direction]
    return float(per) * total_tokens * h_v


def min_bytes(direction: str, total_tokens: int, h_qk: int, h_v: int, num_seqs: int,
              d: int = 128, dtype: str = "bf16", initial_state: bool = True,
              final_state: bool = True) -> float:
    e = DTYPE_BYTES[dtype]
    T = total_tokens
    qk = 2 * T * h_qk * d * e
    vo = 2 * T * h_v * d * e
    gb = 2 * T * h_v * 4
    st = num_seqs * h_v * d * d * 4
    fwd = qk + vo + gb + st * (int(initial_state) + int(final_state))
    if direction == "fwd":
        return float(fwd)
    # backward: read q,k,v,dO,g,beta,h0,dht; write dq,dk,dv,dg,dbeta,dh0
    bwd = (qk + vo + gb + st * (int(initial_state) + int(final_state))) + \
          (qk + T * h_v * d * e + gb + st * int(initial_state))
    if direction == "bwd":
        return float(bwd)
    return float(fwd + bwd)


def derive(direction: str, latency_ms: float | None, total_tokens: int, h_qk: int, h_v: int,
           num_seqs: int, d: int = 128, dtype: str = "bf16", peak_tflops: float | None = None,
           peak_gbps: float | None = None, initial_state: bool = True,
           final_state: bool = True) -> dict:
    """TFLOP/s, GB/s, arithmetic intensity and % of the roofline bound for one row."""
    f = flops(direction, total_tokens, h_v, d)
    b = min_bytes(direction, total_tokens, h_qk, h_v, num_seqs, d, dtype, initial_state,
                  final_state)
    pt = peak_tflops or H200_PEAK_TFLOPS
    pb = peak_gbps or H200_PEAK_GBPS
    bound_ms = max(f / (pt * 1e12), b / (pb * 1e9)) * 1e3
    out = {"flops": f, "min_bytes": b, "intensity_flop_per_byte": f / b,
           "roofline_ms": bound_ms, "tflops": None, "gbps": None, "pct_roofline": None}
    if latency_ms and latency_ms > 0:
        s = latency_ms * 1e-3
        out["tflops"] = f / s / 1e12
        out["gbps"] = b / s / 1e9
        out["pct_roofline"] = 100.0 * bound_ms / latency_ms
    return out


# ----------------------------------------------------------------------------- NVML


def _nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _handle(nv, index: int | None):
    """NVML handle of this process's GPU: the physical index a pinned worker was given
    (``QLABENCH_GPU_INDEX``), else the UUID of torch's current device, else ``index``."""
    import os
    pinned = os.environ.get("QLABENCH_GPU_INDEX")
    if pinned is not None:
        return nv.nvmlDeviceGetHandleByIndex(int(pinned))
    try:
        import torch
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return nv.nvmlDeviceGetHandleByIndex(index or 0)


def clocks(index: int = 0) -> dict:
    """Current SM clock (MHz) and throttle reason bitmask; empty dict without NVML."""
    nv = _nvml()
    if nv is None:
        return {}
    try:
        h = _handle(nv, index)
        mhz = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
        try:
            reasons = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
        except Exception:
            reasons = nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        return {"sm_clock_mhz": int(mhz), "throttle_reasons": int(reasons)}
    except Exception:
        return {}


# Reasons that mean the clock was pulled down by heat or power (not idle / app settings).
THROTTLE_MASK = 0x0000000000000004 | 0x0000000000000008 | 0x0000000000000020 | \
    0x0000000000000040 | 0x0000000000000080   # SW power cap, HW slowdown, SW/HW thermal, power brake


def throttled(reasons: int | None) -> bool:
    return bool(reasons) and bool(int(reasons) & THROTTLE_MASK)


GPM_FIELDS = ("sm_util_pct", "sm_occupancy_pct", "tensor_util_pct", "dram_bw_util_pct")


def gpm_sample(replay, min_window_s: float = 0.12, index: int = 0) -> dict:
    """NVML GPM metrics over a window of at least ``min_window_s`` of ``replay()`` calls.

    Returns the four GPM fields, ``gpm_window_ms`` and ``gpm_reason`` (why the fields are null,
    when they are)."""
    out: dict = {f: None for f in GPM_FIELDS}
    out["gpm_window_ms"] = None
    nv = _nvml()
    if nv is None:
        out["gpm_reason"] = "nvidia-ml-py (pynvml) not importable or NVML init failed"
        return out
    try:
        import torch
        h = _handle(nv, index)
        sup = nv.nvmlGpmQueryDeviceSupport(h)
        if not sup.isSupportedDevice:
            out["gpm_reason"] = "NVML GPM not supported on this device"
            return out
        s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
        torch.cuda.synchronize()
        nv.nvmlGpmSampleGet(h, s1)
        t0 = time.perf_counter()
        while True:
            replay()
            torch.cuda.synchronize()
            if time.perf_counter() - t0 >= min_window_s:
                break
        nv.nvmlGpmSampleGet(h, s2)
        window = time.perf_counter() - t0
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        ids = [nv.NVML_GPM_METRIC_SM_UTIL, nv.NVML_GPM_METRIC_SM_OCCUPANCY,
               nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL, nv.NVML_GPM_METRIC_DRAM_BW_UTIL]
        mg.numMetrics = len(ids)
        mg.sample1, mg.sample2 = s1, s2
        for i, m in enumerate(ids):
            mg.metrics[i].metricId = m
        nv.nvmlGpmMetricsGet(mg)
        for i, f in enumerate(GPM_FIELDS):
            out[f] = float(mg.metrics[i].value)
        out["gpm_window_ms"] = window * 1e3
        out["gpm_reason"] = ""
        try:
            nv.nvmlGpmSampleFree(s1)
            nv.nvmlGpmSampleFree(s2)
        except Exception:
            pass
    except Exception as e:
        out["gpm_reason"] = f"GPM failed: {type(e).__name__}: {str(e)[:160]}"
    return out


# ----------------------------------------------------------------------------- ceilings


def measure_ceilings(device_index: int = 0) -> dict:
    """Measured once per run on the GPU that runs the sweep (``device_index``; with ``--gpus`` the
    first listed one — an idle GPU, not one another job may be using): a large bf16 matmul
    (TFLOP/s) and a device-to-device copy (GB/s, bytes read + written). These, not datasheet
    figures, are the roofline's roof."""
    import torch
    out: dict = {"device_index": int(device_index)}
    dev = torch.device("cuda", int(device_index))
    try:
        torch.cuda.set_device(dev)
        n = 8192
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        e0.record()
        for _ in range(reps):
            a @ b
        e1.record()
        e1.synchronize()
        out["matmul_tflops"] = 2 * n ** 3 * reps / (e0.elapsed_time(e1) * 1e-3) / 1e12
        del a, b
        src = torch.empty(2 * 1024 ** 3 // 2, dtype=torch.bfloat16, device=dev).normal_()
        dst = torch.empty_like(src)
        for _ in range(2):
            dst.copy_(src)
        torch.cuda.synchronize()
        e0.record()
        for _ in range(reps):
            dst.copy_(src)
        e1.record()
        e1.synchronize()
        out["copy_gbps"] = 2 * src.numel() * 2 * reps / (e0.elapsed_time(e1) * 1e-3) / 1e9
        del src, dst
        torch.cuda.empty_cache()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


#: cached ceilings older than this are measured again
CEILINGS_MAX_AGE_H = 24.0 * 7


def ceilings_key(device_index: int = 0) -> str | None:
    """What makes two ceiling measurements interchangeable: the GPU (UUID), its driver and its
    maximum SM and memory clocks (NVML); None without NVML."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        h = nv.nvmlDeviceGetHandleByIndex(int(device_index))
        uuid = nv.nvmlDeviceGetUUID(h)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        drv = nv.nvmlSystemGetDriverVersion()
        drv = drv.decode() if isinstance(drv, bytes) else drv
        sm = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)
        mem = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM)
        return f"{uuid}|driver {drv}|sm {sm} MHz|mem {mem} MHz"
    except Exception:
        return None


def ceilings_cache_path() -> Path:
    """``$QLABENCH_CACHE_DIR/ceilings.json`` (default ``~/.cache/qlabench``)."""
    base = os.environ.get("QLABENCH_CACHE_DIR") or Path.home() / ".cache" / "qlabench"
    return Path(base) / "ceilings.json"


def cached_ceilings(device_index: int = 0, key: str | None = None, measure=None,
                    path=None, now: float | None = None) -> tuple[dict, str]:
    """(ceilings, source) for GPU ``device_index``: the cached measurement of the same
    :func:`ceilings_key` when younger than :data:`CEILINGS_MAX_AGE_H` (source ``cache``), else
    a new :func:`measure_ceilings`, cached when it succeeded (source ``measured``)."""
    key = ceilings_key(device_index) if key is None else key
    measure = measure or measure_ceilings
    path = ceilings_cache_path() if path is None else path
    now = time.time() if now is None else now
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(key) if key else None
    if hit and 0 <= now - float(hit.get("measured_at_s", -1e18)) < CEILINGS_MAX_AGE_H * 3600:
        return {**hit["ceilings"], "device_index": int(device_index)}, "cache"
    out = measure(device_index)
    if key and isinstance(out.get("matmul_tflops"), (int, float)) and "error" not in out:
        cache[key] = {"ceilings": out, "measured_at_s": now}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # an unwritable cache only costs the next run a measurement
    return out, "measured"


def run_ceilings(metas: dict, run_id: str, gpu_name: str | None = None) -> dict | None:
    """Measured ceilings for a row: its run's own (run metadata), else — for runs recorded before
    ceilings were measured — the median over the other runs in ``metas`` on the same GPU model
    (``env.gpu_name``), else None (the caller falls back to its ``ceilings`` or the H200 leads)."""
    def measured(c):  # a failed measurement stores only an error (and the device index)
        return bool(c) and any(isinstance(c.get(k), (int, float)) for k in ("matmul_tflops", "copy_gbps"))

    own = (metas.get(run_id) or {}).get("ceilings")
    if measured(own):
        return own
    same = [m["ceilings"] for m in metas.values() if measured(m.get("ceilings")) and gpu_name
            and (m.get("env") or {}).get("gpu_name") == gpu_name]
    return median_ceilings(same) or None


def median_ceilings(ceilings: list[dict]) -> dict:
    """Per-key median (upper) of several runs' measured ceilings; keys nobody measured are left out."""
    out = {}
    for k in ("matmul_tflops", "copy_gbps"):
        vals = sorted(c[k] for c in ceilings if isinstance(c.get(k), (int, float)))
        if vals:
            out[k] = vals[len(vals) // 2]
    return out


DERIVED = ("flops", "min_bytes", "intensity_flop_per_byte", "roofline_ms", "tflops", "gbps",
           "pct_roofline")


def add_derived(df, ceilings: dict | None = None, metas: dict | None = None):
    """Recompute the :data:`DERIVED` columns from stored ones (so old runs get them without a
    re-run), as the runner writes them: :func:`derive` for ``ok`` rows, null for the others, and no
    roofline (``roofline_ms``, ``pct_roofline``) for CPU-timed rows (``timing_mode == "cpu"``).
    Ceilings come from each row's run metadata (``metas[run_id]["ceilings"]``) when present, else
    from the other runs of ``metas`` on the same GPU model (``run_ceilings``), else ``ceilings``,
    else the H200 leads. A results directory stores exactly these values
    (``scripts/rederive.py`` rewrites them; ``tests/test_stored_derived.py`` checks)."""
    import pandas as pd
    if df.empty:
        return df
    df = df.copy()
    rows = []
    for r in df.itertuples():
        if getattr(r, "status", "ok") != "ok":
            rows.append(dict.fromkeys(DERIVED))
            continue
        c = run_ceilings(metas or {}, r.run_id, getattr(r, "gpu_name", None)) or ceilings or {}
        d = derive(r.direction, r.latency_ms if pd.notna(r.latency_ms) else None,
                   int(r.total_tokens), int(r.h_qk), int(r.h_v), int(r.num_seqs),
                   int(r.head_dim), r.dtype, c.get("matmul_tflops"), c.get("copy_gbps"),
                   bool(r.initial_state), bool(r.output_final_state))
        if getattr(r, "timing_mode", None) == "cpu":  # the roofline is the GPU's
            d.update(roofline_ms=None, pct_roofline=None)
        rows.append(d)
    for k in DERIVED:
        df[k] = pd.array([d[k] for d in rows], dtype="Float64").astype(float)
    return df
