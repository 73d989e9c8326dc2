"""Synthetic results directories for compare/report/notebook tests (CPU, no timing).

Rows go through :meth:`qlabench.results.ResultStore.append`, so they carry the real schema.
Latencies: a deterministic per-point, per-backend value times lognormal noise (sigma ~1%), like
graph-batch replays of one H200 run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from qlabench import results

MODELS = [("397B/122B TP8", 2, 8), ("27B TP1", 16, 48)]
LAYOUTS = [[8192], [4096, 4096], [1024] * 8, [32768]]
BACKENDS = {"fla": 1.0, "flashqla": 0.7, "tilelang": 0.8}


def layout_label(s: list[int]) -> str:
    from qlabench.sweep import layout_label as label
    return label(s)


def point_key(hq: int, hv: int, seqlens: list[int]) -> str:
    return f"{hq}/{hv}/d128|{' '.join(map(str, seqlens))}|bf16"


def base_latency_ms(hv: int, seqlens: list[int], backend: str) -> float:
    tokens = sum(seqlens)
    return (0.02 + tokens * hv * 2.5e-7 + 0.004 * len(seqlens)) * BACKENDS.get(backend, 1.0)


def make_rows(run_id: str, started_at: str, git_sha: str = "abc123", config: str = "synth",
              directions=("fwd",), backends=tuple(BACKENDS), n_samples: int = 60,
              noise: float = 0.01, seed: int = 0, scale: dict | None = None,
              timing_mode: str = "graph-batch", gpu_name: str = "NVIDIA H200",
              status: dict | None = None, models=MODELS, layouts=LAYOUTS,
              extra: dict | None = None) -> list[dict]:
    """One row per model × layout × direction × backend. ``scale``: backend -> latency factor;
    ``status``: backend -> status (non-ok rows get no timing); ``extra``: columns set on every
    row (e.g. ``gpu_uuid``, ``campaign_id``, ``calls_per_sample``)."""
    rng = np.random.default_rng(seed)
    rows = []
    idx = 0
    for m, hq, hv in models:
        for lay in layouts:
            for d in directions:
                for b in backends:
                    st = (status or {}).get(b, "ok")
                    row = {
                        "run_id": run_id, "git_sha": git_sha, "config": config,
                        "point_index": idx, "point_key": point_key(hq, hv, lay),
                        "recipe_hash": hashlib.sha1(b"zero0.25/seed0").hexdigest()[:12],
                        "model": m, "tp": f"{hq}/{hv}", "h_qk": hq, "h_v": hv, "head_dim": 128,
                        "seqlens": list(lay), "layout": layout_label(lay),
                        "total_tokens": sum(lay), "num_seqs": len(lay), "dtype": "bf16",
                        "gate_recipe": "zero0.25/seed0", "gate_zero_frac": 0.25,
                        "direction": d, "backend": b, "backend_version": "1.0",
                        "gpu_name": gpu_name, "started_at": started_at, "status": st,
                        "reason": "" if st == "ok" else f"synthetic {st}", "timing_mode": timing_mode,
                        "l2": "warm", **(extra or {}),
                    }
                    if st == "ok":
                        mu = base_latency_ms(hv, lay, b) * (3.0 if d == "bwd" else 1.0)
                        mu *= (scale or {}).get(b, 1.0)
                        s = mu * rng.lognormal(0.0, noise, n_samples)
                        row.update(samples_ms=[float(x) for x in s], n_samples=n_samples,
                                   latency_ms=float(np.median(s)),
                                   p10_ms=float(np.quantile(s, 0.1)),
                                   p90_ms=float(np.quantile(s, 0.9)), mean_ms=float(s.mean()))
                    rows.append(row)
            idx += 1
    return rows


def write_rows(out: Path, rows: list[dict], meta: dict | None = None) -> Path:
    store = results.ResultStore(out)
    for r in rows:
        store.append(r)
    if rows:
        r0 = rows[0]
        store.write_meta(r0["run_id"], {
            "run_id": r0["run_id"], "git_sha": r0["git_sha"], "config": r0["config"],
            "started_at": r0["started_at"], "finished_at": r0["started_at"],
            "env": {"hostname": "synth-host", "gpu_name": r0["gpu_name"], "torch": "2.11.0",
                    "cuda": "13.0", "driver": "580.00", "triton": "3.5.0"},
            "counts": {"ok": sum(r["status"] == "ok" for r in rows)}, **(meta or {})})
    return out


def write_run(out: Path, run_id: str = "20250101T000000-aaaaaa",
              started_at: str = "2025-01-01T00:00:00", **kw) -> Path:
    return write_rows(Path(out), make_rows(run_id, started_at, **kw))


def copy_scaled(src: Path, dst: Path, factors: dict[str, float], run_id: str = "20250102T000000-bbbbbb",
                started_at: str = "2025-01-02T00:00:00", **overrides) -> Path:
    """A copy of ``src``'s latest rows as a new run, samples of ``factors``' backends scaled."""
    df = results.latest(results.load(src))
    rows = []
    for r in df.to_dict("records"):
        r = {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
        r = {**r, "run_id": run_id, "started_at": started_at, **overrides}
        if r["status"] == "ok" and r["samples_ms"] is not None:
            s = np.asarray(r["samples_ms"], float) * factors.get(r["backend"], 1.0)
            r["samples_ms"] = [float(x) for x in s]
            r["latency_ms"] = float(np.median(s))
        r["seqlens"] = [int(x) for x in r["seqlens"]]
        rows.append(r)
    return write_rows(Path(dst), rows)


def restamp(out: Path, **columns) -> None:
    """Set ``columns`` on every stored row of a results directory, in place (rows as if measured
    on another GPU, with another backend version, ...)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    for f in sorted((Path(out) / results.PARTS_DIR).glob("*.parquet")):
        rows = pq.read_table(f).to_pylist()
        for r in rows:
            r.update(columns)
        pq.write_table(pa.Table.from_pylist(rows, schema=results.SCHEMA), f)
