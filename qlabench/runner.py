"""The flow: Sweep -> points -> inputs -> backends -> correctness gate -> timing -> rows.

Data flows one way. For each point and direction the reference is computed once (lazily, only
if some backend will run), every backend is checked against it before it is timed, and each row
is written durably before the next one starts.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import torch

from . import backends as B
from . import metrics, poison, timing
from .config import Sweep
from .results import ResultStore, environment, git_sha, load_meta, new_run_id
from .sweep import Point, points
from .workloads import Inputs, make

FWD_OUTPUTS = ("o", "final_state")
BWD_OUTPUTS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


class RecipeMismatch(Exception):
    """--resume found rows for the same key made from a different input recipe."""


@dataclass
class RunSummary:
    run_id: str
    out_dir: Path
    counts: dict = field(default_factory=dict)
    skipped_done: int = 0
    rows: list = field(default_factory=list)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(‖out − ref‖ / ‖ref‖, max |out − ref|) computed in fp64; NaN/inf -> inf."""
    a = out.detach().to(torch.float64).reshape(-1)
    b = ref.detach().to(torch.float64).reshape(-1).to(a.device)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: got {tuple(out.shape)}, reference {tuple(ref.shape)}")
    if not torch.isfinite(a).all():
        return float("inf"), float("inf")
    diff = a - b
    denom = b.norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    return rel, diff.abs().max().item()


TOKEN_OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta")
STATE_OUTPUTS = ("final_state", "dh0")
BLOCK_TOKENS = 1024
#: a 1024-token block x head may be this many times worse than the global threshold (short
#: blocks are noisier)
BLOCK_FACTOR = 3.0
#: a (sequence, head) state may be this many times worse than the global threshold (each holds
#: K x V = 16k elements, as tight as the global norm; one sequence of 8 with a 5% error moves
#: the global norm by ~1.8%)
SEQ_FACTOR = 1.5


def _worst_rel(d2: torch.Tensor, r2: torch.Tensor) -> float:
    """max sqrt(d2 / r2) over the entries whose reference norm is not negligible."""
    if not torch.isfinite(d2).all():
        return float("inf")
    if not d2.numel():
        return 0.0
    mask = r2 > 1e-20 * max(float(r2.max()), 1e-300)
    if not mask.any():
        return 0.0
    return float((d2[mask] / r2[mask]).sqrt().max())


def worst_block_rel_err(out: torch.Tensor, ref: torch.Tensor, cu_seqlens: torch.Tensor) -> float:
    """Largest relative L2 error over (block of <= 1024 tokens of one sequence) x head, for a
    [1, T, H, D] or [1, T, H] output. A global norm hides a wrong chunk or head in a long
    sequence (one wrong 64-token chunk of 16/64 1x32768 moves the global error by ~5e-3); per
    block it stands out."""
    a = out.detach().reshape(out.shape[1], out.shape[2], -1).to(torch.float64)
    b = ref.detach().reshape(ref.shape[1], ref.shape[2], -1).to(torch.float64).to(a.device)
    T = a.shape[0]
    cu = cu_seqlens.to(a.device)
    t = torch.arange(T, device=a.device)
    seq = torch.searchsorted(cu[1:], t, right=True)
    blk = seq * (T // BLOCK_TOKENS + 2) + (t - cu[seq]) // BLOCK_TOKENS
    _, blk = torch.unique(blk, return_inverse=True)
    nb = int(blk.max()) + 1 if T else 0
    d2 = torch.zeros(nb, a.shape[1], dtype=torch.float64, device=a.device)
    r2 = torch.zeros_like(d2)
    d2.index_add_(0, blk, ((a - b) ** 2).sum(-1))
    r2.index_add_(0, blk, (b ** 2).sum(-1))
    return _worst_rel(d2, r2)


def worst_state_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest relative L2 error over (sequence, head) of an [N, H, K, V] state or gradient."""
    a = out.detach().to(torch.float64)
    b = ref.detach().to(torch.float64).to(a.device)
    return _worst_rel(((a - b) ** 2).sum((-1, -2)), (b ** 2).sum((-1, -2)))


def local_rel_err(name: str, out: torch.Tensor, ref: torch.Tensor,
                  cu_seqlens: torch.Tensor) -> tuple[float, float, str]:
    """(worst local rel L2, its factor over the global threshold, what "local" is) of an output."""
    if name in STATE_OUTPUTS:
        return worst_state_rel_err(out, ref), SEQ_FACTOR, "sequence x head"
    return (worst_block_rel_err(out, ref, cu_seqlens), BLOCK_FACTOR,
            f"{BLOCK_TOKENS}-token block x head")


def reference_outputs(x: Inputs, direction: str, impl: str, dtype: str) -> dict:
    from .backends.reference import gdn_chunked, gdn_chunked_grads, gdn_recurrent
    dt = torch.float64 if dtype == "fp64" else torch.float32
    with torch.no_grad() if direction == "fwd" else torch.enable_grad():
        if direction == "fwd":
            fn = gdn_recurrent if impl == "recurrent" else gdn_chunked
            o, ht = fn(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens, dtype=dt)
            return {"o": o, "final_state": ht}
        return gdn_chunked_grads(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens,
                                 x.do, x.dht, dtype=dt)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _gpu_index() -> int | None:
    """Physical GPU index of this process (a worker pinned by ``CUDA_VISIBLE_DEVICES``)."""
    pinned = os.environ.get("QLABENCH_GPU_INDEX")
    if pinned is not None:
        return int(pinned)
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def point_cost(p: Point, n_backends: int = 1) -> float:
    """Relative work of a point, for heaviest-first scheduling and balanced shards."""
    return float(p.total_tokens) * p.h_v * max(1, n_backends) + 1e6 * p.num_seqs


def shard_points(pts: list[Point], i: int, n: int) -> list[Point]:
    """Deterministic shard ``i`` of ``n``: points sorted heaviest first, dealt round robin
    (snake order so shards get similar work)."""
    order = sorted(pts, key=lambda p: (-point_cost(p), p.index))
    mine = []
    for rank, p in enumerate(order):
        r, k = divmod(rank, n)
        owner = k if r % 2 == 0 else n - 1 - k
        if owner == i:
            mine.append(p)
    return sorted(mine, key=lambda p: p.index)


_UUIDS: dict = {}


def device_uuid() -> str:
    """This process's device: the CUDA device's UUID (``GPU-…``, as ``nvidia-smi -L`` prints it),
    or ``cpu:<hostname>``. Rows pair as "same GPU" only when these are equal."""
    if not torch.cuda.is_available():
        import socket
        return f"cpu:{socket.gethostname()}"
    return uuid_of(torch.cuda.current_device())


def uuid_of(i: int) -> str:
    if i not in _UUIDS:
        u = str(getattr(torch.cuda.get_device_properties(i), "uuid", "") or "")
        _UUIDS[i] = u if u.startswith("GPU-") else (f"GPU-{u}" if u else f"cuda:{i}:unknown")
    return _UUIDS[i]


#: a --resume continues a campaign only within this many hours of its last run's start
CAMPAIGN_HOURS = 24.0


def campaign_for(store: ResultStore, uuids: list[str], resume: bool, sweep_dump: dict | None = None,
                 versions: dict | None = None, now: datetime | None = None) -> str:
    """The measurement campaign a run belongs to. A ``--resume`` continues the campaign of the
    newest earlier run in the directory that was measured on the same device(s), from the same
    sweep, with the same version of every backend both name, and started less than
    ``CAMPAIGN_HOURS`` ago — one sweep spread over several jobs on one GPU stays one campaign.
    Anything else (a new run, another GPU, an edited config, a changed library or kernel, a
    resume days later) starts a new campaign."""
    if resume:
        now = now or datetime.now()
        metas = sorted(load_meta(store.out).values(),
                       key=lambda m: (str(m.get("started_at", "")), str(m.get("run_id", ""))))
        for m in reversed(metas):
            if not m.get("campaign_id") or sorted(m.get("gpu_uuids") or []) != sorted(uuids):
                continue
            if sweep_dump is not None and m.get("sweep") != sweep_dump:
                break
            old = m.get("backend_versions") or {}
            if versions and any(old[b] != v for b, v in versions.items() if b in old):
                break
            try:
                age_h = (now - datetime.fromisoformat(str(m.get("started_at")))).total_seconds() / 3600
            except ValueError:
                break
            if 0 <= age_h < CAMPAIGN_HOURS:
                return m["campaign_id"]
            break
    return "c" + new_run_id()


def base_row(run_id: str, sha: str, cfg: str, p: Point, direction: str, be_name: str,
             be_version: str, gpu_name: str, campaign_id: str | None = None,
             be_lib: str | None = None, be_params: str = "{}") -> dict:
    """The identity of a row; ``be_name`` is the backend entry's label, ``be_lib`` its registry
    name (default: the label), ``be_params`` its non-default parameters (JSON)."""
    return {
        "run_id": run_id, "git_sha": sha, "config": cfg, "point_index": p.index,
        "point_key": p.key, "recipe_hash": p.recipe_hash, "model": p.model, "tp": p.tp_label,
        "h_qk": p.h_qk, "h_v": p.h_v, "head_dim": p.head_dim, "seqlens": list(p.seqlens),
        "layout": p.layout_label, "total_tokens": p.total_tokens, "num_seqs": p.num_seqs,
        "dtype": p.dtype, "gate_recipe": p.gate_label,
        "gate_zero_frac": p.gate_zero_frac, "initial_state": p.initial_state,
        "output_final_state": p.output_final_state, "direction": direction,
        "backend": be_name, "backend_name": be_lib or be_name, "backend_version": be_version,
        "backend_params": be_params,
        "gpu_name": gpu_name,
        "gpu_index": _gpu_index(), "gpu_uuid": device_uuid(), "campaign_id": campaign_id,
        "started_at": datetime.now().isoformat(timespec="milliseconds"),
        "reason": "",
    }


def check_outputs(outs: dict, ref: dict, x: Inputs, direction: str, sweep: Sweep,
                  row: dict | None = None) -> tuple[float, float, list[str]]:
    """Compare canonical outputs with the reference: (worst global rel L2, worst local rel L2,
    problems). Each output is gated twice: globally against its threshold, and per (sequence,
    head) for states / per (1024-token block, head) for the others against a multiple of it.
    Fills ``rel_l2_*`` / ``max_abs_*`` / ``local_rel_l2_*`` into ``row`` when given."""
    names = FWD_OUTPUTS if direction == "fwd" else BWD_OUTPUTS
    worst, worst_loc, bad = 0.0, 0.0, []
    for n in names:
        if n not in ref or ref[n] is None:
            continue
        if n == "final_state" and not x.output_final_state:
            continue  # not asked for: libraries return None
        if outs.get(n) is None:
            bad.append(f"{n} missing")
            continue
        rel, mx = rel_err(outs[n], ref[n])
        loc, factor, what = local_rel_err(n, outs[n], ref[n], x.cu_seqlens)
        if row is not None:
            row[f"rel_l2_{n}"], row[f"max_abs_{n}"], row[f"local_rel_l2_{n}"] = rel, mx, loc
        worst, worst_loc = max(worst, rel), max(worst_loc, loc)
        lim = sweep.thresholds.get(n)
        if not rel <= lim:
            bad.append(f"{n} rel_l2={rel:.3g} > {lim:g}")
        elif not loc <= factor * lim:
            bad.append(f"{n} worst {what} rel_l2={loc:.3g} > {factor * lim:g}")
    return worst, worst_loc, bad


def checked_call(be: B.Backend, prep: B.Prepared, x: Inputs, direction: str,
                 expected_out_bytes: int) -> tuple[dict, float]:
    """One eager call of ``prep.fn`` with every output it can write poisoned beforehand
    (``poison``): its canonical outputs and the call's seconds (poisoning excluded)."""
    poison.poison_cached_memory(2 * expected_out_bytes)
    poison.fill_nan(prep.outputs)
    _sync()
    t0 = time.perf_counter()
    with poison.PoisonAllocations():
        raw = prep.fn()
    _sync()
    return be.outputs_to_canonical(raw, x, direction), time.perf_counter() - t0


def check_replay(be: B.Backend, replay, raw, x: Inputs, direction: str, ref: dict,
                 sweep: Sweep, preallocated=()) -> tuple[float, list[str]]:
    """Check the timed path itself: ``raw`` are the outputs of the last call captured in the
    timing graph; they and the backend's ``preallocated`` output buffers are poisoned (inputs a
    library hands back are spared), the graph is replayed once, and what it wrote is compared
    with the reference."""
    n = poison.fill_nan((raw, tuple(preallocated)), keep=x.tensors().values())
    _sync()
    replay()
    _sync()
    if n == 0:
        return float("nan"), ["the captured call returned no floating-point output to check"]
    outs = be.outputs_to_canonical(raw, x, direction)
    worst, _, bad = check_outputs(outs, ref, x, direction, sweep)
    return worst, bad


def _fail(row: dict, t_wall: float, reason: str) -> dict:
    row.update(status="incorrect", latency_ms=None, reason=reason)
    row["wall_s"] = time.perf_counter() - t_wall
    return row


def measure_backend(be: B.Backend, x: Inputs, direction: str, ref: dict, sweep: Sweep,
                    row: dict, expected_out_bytes: int) -> dict:
    """Prepare, check, time one backend on one point × direction, then check the timed graph's
    own outputs and one more eager call. Fills and returns ``row``."""
    t_wall = time.perf_counter()
    try:
        prep = be.prepare(x, direction)
    except B.Unsupported as e:
        row.update(status="unsupported", reason=str(e))
        return row
    outs, row["compile_s"] = checked_call(be, prep, x, direction, expected_out_bytes)
    worst, worst_loc, bad = check_outputs(outs, ref, x, direction, sweep, row)
    del outs
    row["max_rel_l2"] = worst
    row["worst_block_rel_l2"] = worst_loc
    if bad:
        return _fail(row, t_wall, "; ".join(bad))

    gpu = torch.cuda.is_available() and sweep.timing.mode != "cpu"
    graph = None
    if gpu:
        for attempt in range(2):  # a throttled measurement is re-measured once
            c0 = metrics.clocks()
            tr, graph = timing.measure_gpu(prep.fn, sweep.timing, prep.graph_safe)
            c1 = metrics.clocks()
            row["sm_clock_mhz_before"] = c0.get("sm_clock_mhz")
            row["sm_clock_mhz_after"] = c1.get("sm_clock_mhz")
            row["throttled"] = metrics.throttled(c0.get("throttle_reasons")) or \
                metrics.throttled(c1.get("throttle_reasons"))
            if not row["throttled"]:
                break
            if attempt == 0:
                row["reason"] = "throttled (NVML clock-event reasons); re-measured once"
    else:
        tr = timing.measure_cpu(prep.fn, sweep.timing.model_copy(update={"mode": "cpu"}))
    st = tr.stats()
    row.update(latency_ms=st["latency_ms"], p10_ms=st["p10_ms"], p90_ms=st["p90_ms"],
               iqr_ms=st["iqr_ms"], mean_ms=st["mean_ms"], rse=st["rse"],
               samples_ms=tr.samples_ms, n_samples=tr.n_samples, timing_mode=tr.timing_mode,
               timing_fallback=tr.fallback_reason, stop_reason=tr.stop_reason,
               calls_per_sample=tr.calls_per_sample, l2=tr.l2)
    if graph is not None:  # what the timed graph computes, not only what an eager call does
        g_worst, bad_g = check_replay(be, graph.replay, tr.outputs, x, direction, ref, sweep,
                                      prep.outputs)
        row["graph_max_rel_l2"] = g_worst
        if bad_g:
            return _fail(row, t_wall, "the timed CUDA graph's outputs differ from the reference "
                         "(another path under capture?): " + "; ".join(bad_g))
    tr.outputs = None
    # the timed calls ran on the same inputs: check one more call (races, carried state)
    outs, _ = checked_call(be, prep, x, direction, expected_out_bytes)
    _, _, bad2 = check_outputs(outs, ref, x, direction, sweep)
    del outs
    if bad2:
        return _fail(row, t_wall, "a call after timing was wrong (race or state carried between "
                     "calls?): " + "; ".join(bad2))
    if gpu and sweep.timing.gpm:
        replay = graph.replay if graph is not None else prep.fn
        row.update(metrics.gpm_sample(replay))
    if gpu:
        try:
            from .profile import kernel_breakdown, stored_kernels
            kb = kernel_breakdown(prep.fn)
            if kb:
                top = kb[0]
                row["top_kernel"] = top["name"][:200]
                row["ctas"] = top.get("ctas")
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                row["ctas_per_sm"] = (top["ctas"] / sms) if top.get("ctas") else None
                row["kernels_per_call"] = sum(k["calls"] for k in kb)
                row["kernels"] = stored_kernels(kb)
                row["path"] = be.path([k["name"] for k in kb])
        except Exception as e:  # profiling is a bonus; never fails a row
            row["reason"] = (row.get("reason") or "") + f" profile failed: {type(e).__name__}"
    c = sweep_ceilings.get("c") or {}
    p_ = x
    row.update(metrics.derive(direction, row.get("latency_ms"), p_.T, p_.h_qk, p_.h_v, p_.N,
                              p_.q.shape[-1], row["dtype"], c.get("matmul_tflops"),
                              c.get("copy_gbps"), p_.h0 is not None, p_.output_final_state))
    if not gpu:  # the roofline is the GPU's; a CPU timing has no place on it
        row.update(roofline_ms=None, pct_roofline=None)
    row["status"] = "ok"
    row["wall_s"] = time.perf_counter() - t_wall
    return row


#: ceilings measured once per process on the GPU (set by the worker / in-process run)
sweep_ceilings: dict = {}


@dataclass
class Task:
    """One point × direction and the backends still to measure on it."""

    point: Point
    direction: str
    backends: list[str]  # labels
    ctx: dict  # run_id, sha, config, names (label -> registry name), versions, avail, gpu_name


def row_for(task: Task, backend: str) -> dict:
    c = task.ctx
    return base_row(c["run_id"], c["sha"], c["config"], task.point, task.direction, backend,
                    c["versions"][backend], c["gpu_name"], c.get("campaign_id"),
                    c.get("names", {}).get(backend), c.get("params_json", {}).get(backend, "{}"))


def measure_task(sweep: Sweep, task: Task, emit) -> None:
    """Measure every backend of ``task``; ``emit(kind, payload)`` gets ("start", backend) before
    each backend and ("row", row) after it. Runs in the worker (or in-process)."""
    p, direction = task.point, task.direction
    dev = device()
    x = ref = None
    if "c" not in sweep_ceilings:
        sweep_ceilings["c"] = task.ctx.get("ceilings") or {}
    for n in task.backends:
        emit("start", n)
        be = B.get(task.ctx.get("names", {}).get(n, n), task.ctx.get("params", {}).get(n))
        row = row_for(task, n)
        ok, why = task.ctx["avail"][n]
        if ok:
            ok, why = be.supports(p, direction)
            status = "unsupported"
        else:
            status = "unavailable"
        if not ok:
            row.update(status=status, reason=why)
        else:
            try:
                if x is None:
                    x = make(p, dev, with_grads=direction != "fwd")
                    ref = reference_outputs(x, direction, sweep.reference.impl,
                                            sweep.reference.dtype)
                out_bytes = (x.v.numel() * 2 + (x.h0.numel() * 4 if x.h0 is not None else 0)) \
                    * (1 if direction == "fwd" else 3)
                row = measure_backend(be, x, direction, ref, sweep, row, out_bytes)
            except Exception as e:
                status = "oom" if _is_oom(e) else "crashed"
                tb = traceback.format_exc(limit=4)
                row.update(status=status, reason=f"{type(e).__name__}: {str(e)[:300]} | {tb[-600:]}")
                if status == "oom":
                    x = ref = None  # free what we hold; the next backend rebuilds
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        emit("row", row)
    del x, ref
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def process_started_at() -> float | None:
    """Epoch seconds at which this process started (Linux /proc), else None."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                     if ln.startswith("btime "))
        return btime + start / ticks
    except Exception:
        return None


def run(sweep: Sweep, out_dir: str | Path, config_name: str = "", backend_names=None,
        limit: int | None = None, resume: bool = False, progress=None, log=print,
        isolate: bool | None = None, shard: tuple[int, int] | None = None,
        devices: list[str] | None = None, retry_failed: bool = False) -> RunSummary:
    """Run a sweep into ``out_dir``. With ``isolate`` (default: the sweep's ``isolate``), points
    run in a supervised worker process: a crash or a hang costs one row, not the sweep."""
    from .supervisor import deferred_signals, install_sigterm_as_interrupt

    t_run = time.time()
    tl: dict = {}  # the run's timeline (seconds from the run's start), stored in the metadata
    t_proc = process_started_at()
    if t_proc is not None:
        tl["process_start"] = round(t_proc - t_run, 3)
    if threading.current_thread() is threading.main_thread():
        install_sigterm_as_interrupt()  # SIGTERM ends a run like Ctrl-C: rows kept, metadata written

    store = ResultStore(out_dir)
    pts = points(sweep)
    if limit is not None:
        pts = pts[:limit]
    if shard is not None:
        pts = shard_points(pts, *shard)
    entries = sweep.entries(backend_names)
    names = list(entries)
    avail, versions, workers = check_backends(entries)
    tl["backends_checked"] = round(time.time() - t_run, 3)

    params_json = {n: e.params_json for n, e in entries.items()}
    done = store.done_keys(retry_failed) if resume else {}
    if resume:
        store.check_method(sweep.timing.mode, sweep.timing.l2)
        for (pk, direction), rh in store.recipes().items():
            for p in pts:
                if p.key == pk and rh != p.recipe_hash:
                    raise RecipeMismatch(
                        f"{out_dir}: rows for point {p.describe()} ({direction}) were made from "
                        f"a different input recipe ({rh} vs {p.recipe_hash}: gate, seed, dtype or "
                        "state flags changed); use a new --out directory instead of --resume")

    ceilings = {}
    if torch.cuda.is_available() and any(avail[n][0] for n in names):
        ceilings = metrics.measure_ceilings(int(devices[0]) if devices else 0)
        log(f"ceilings: {ceilings}")
    tl["ceilings_measured"] = round(time.time() - t_run, 3)
    run_id = new_run_id()
    uuids = _device_uuids(devices)
    campaign_id = campaign_for(store, uuids, resume, sweep.model_dump(mode="json"), versions)
    sha = git_sha(str(Path(__file__).resolve().parent.parent))
    gpu_name = (torch.cuda.get_device_name(int(devices[0]) if devices else 0)
                if torch.cuda.is_available() else "cpu")
    meta = {"run_id": run_id, "git_sha": sha, "config": config_name,
            "sweep": sweep.model_dump(mode="json"), "backends": names,
            "backend_names": {n: e.name for n, e in entries.items()},
            "environments": {n: {"python": w.python, **w.env} for n, w in workers.items()},
            "backend_versions": versions, "availability": {n: list(a) for n, a in avail.items()},
            "env": environment(), "started_at": datetime.now().isoformat(timespec="milliseconds"),
            "points": len(pts), "device": device(), "ceilings": ceilings,
            "campaign_id": campaign_id, "gpu_uuids": uuids}
    store.write_meta(run_id, meta)
    ctx = {"run_id": run_id, "sha": sha, "config": config_name, "versions": versions,
           "names": {n: e.name for n, e in entries.items()},
           "params": {n: e.params for n, e in entries.items() if e.params},
           "params_json": params_json,
           "avail": avail, "gpu_name": gpu_name, "campaign_id": campaign_id,
           # what the derived columns use: this run's ceilings, or where their measurement failed
           # the same-GPU runs' median in this directory (what metrics.add_derived recomputes)
           "ceilings": (metrics.run_ceilings(load_meta(out_dir), run_id, gpu_name) or {})
           if ceilings else {}}

    summary = RunSummary(run_id, Path(out_dir))
    isolate = sweep.isolate if isolate is None else isolate
    lock = threading.Lock()

    def on_row(row: dict) -> None:
        now = round(time.time() - t_run, 3)
        tl.setdefault("first_row", now)
        tl["last_row"] = now
        with lock:
            with deferred_signals():
                store.append(row)
            summary.rows.append(row)
            summary.counts[row["status"]] = summary.counts.get(row["status"], 0) + 1
        lat = row.get("latency_ms")
        log(f"[{row['status']:>11}] {Point.describe_row(row):<36} {row['direction']:<6} "
            f"{row['backend']:<10} " + (f"{lat:9.4f} ms" if lat is not None else " " * 12)
            + (f"  err={row['max_rel_l2']:.2e}" if row.get("max_rel_l2") is not None else "")
            + (f"  [{row['path']}]" if row.get("path") else "")
            + (f"  ({row['reason'][:90]})" if row.get("reason") else ""))

    tasks: list[Task] = []
    for p in pts:
        for direction in sweep.directions:
            todo = []
            for n in names:
                if (p.key, n, direction, versions[n], params_json[n]) in done:
                    summary.skipped_done += 1
                    continue
                todo.append(n)
            if todo:
                tasks.append(Task(p, direction, todo, ctx))
    try:
        if devices and len(devices) > 1:
            _run_on_devices(sweep, tasks, devices, store.logs, on_row, progress, log,
                            workers)
        else:
            execu = executor(sweep, store.logs, log, isolate, workers,
                             devices[0] if devices else None)
            try:
                for t in tasks:
                    if progress is not None:
                        progress(f"{t.point.describe()} {t.direction}")
                    execu.run_task(t, on_row)
            finally:
                execu.close()
    finally:
        meta["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        tl["finished"] = round(time.time() - t_run, 3)
        meta["timeline_s"] = tl
        meta["counts"] = _counts_on_disk(store, run_id) or summary.counts
        seen = sorted({r.get("gpu_uuid") for r in summary.rows if r.get("gpu_uuid")})
        if seen:  # the devices the rows were measured on (workers pin theirs)
            meta["gpu_uuids"] = seen
        store.write_meta(run_id, meta)
    return summary


def check_backends(entries: dict) -> tuple[dict, dict, dict]:
    """(availability, version, worker environment) per label of ``entries`` (label ->
    :class:`~qlabench.config.BackendEntry`). An entry with an environment of its own is checked
    in it (:func:`supervisor.worker_environment`), the others in this process; a label's
    ``@<version>`` suffix must prefix the version found."""
    from .config import label_version_problem
    from .supervisor import worker_environment
    avail, versions, workers = {}, {}, {}
    for n, e in entries.items():
        if e.own_environment:
            w, avail[n], versions[n] = worker_environment(e)
            if w is not None:
                workers[n] = w
        else:
            be = B.get(e.name)
            avail[n] = be.available()
            versions[n] = be.version() if avail[n][0] else "unavailable"
        why = label_version_problem(n, versions[n]) if avail[n][0] else ""
        if why:
            avail[n], versions[n] = (False, why), "unavailable"
            workers.pop(n, None)
    return avail, versions, workers


def executor(sweep: Sweep, log_dir: Path, log, isolate: bool, workers: dict,
             device: str | None = None, stop: threading.Event | None = None):
    """What runs tasks: a supervised worker (``isolate``) or this process, and a worker of its
    own for each entry in ``workers`` (label -> :class:`supervisor.WorkerEnv`); ``device``: a
    CUDA index every worker is pinned to."""
    from .supervisor import InProcess, PerEnvironment, Supervisor
    env = {"CUDA_VISIBLE_DEVICES": device, "QLABENCH_GPU_INDEX": device} if device else None
    default = Supervisor(sweep, log_dir, log=log, env=env, stop=stop) if isolate \
        else InProcess(sweep)
    if not workers:
        return default
    return PerEnvironment(default, {n: (lambda w=w: Supervisor(sweep, log_dir, log=log, env=env,
                                                                 stop=stop, worker=w))
                                    for n, w in workers.items()}, stop)


def _device_uuids(devices: list[str] | None) -> list[str]:
    """UUIDs of the devices a run uses (``devices``: CUDA indices, or the current device)."""
    if not torch.cuda.is_available():
        return [device_uuid()]
    return [uuid_of(int(d)) for d in (devices or [torch.cuda.current_device()])]


def note_timeline(out_dir: str | Path, run_id: str, **seconds: float) -> None:
    """Add entries (e.g. ``figures_s``) to a finished run's ``timeline_s`` metadata."""
    store = ResultStore(out_dir)
    p = store.runs / f"{run_id}.json"
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError):
        return
    meta.setdefault("timeline_s", {}).update({k: round(v, 3) for k, v in seconds.items()})
    store.write_meta(run_id, meta)


def _counts_on_disk(store: ResultStore, run_id: str) -> dict:
    """Status counts of this run's rows as stored (the parts are the truth)."""
    counts: dict = {}
    for f in store.parts.glob(f"{run_id}-*.parquet"):
        try:
            st = pq.read_table(f, columns=["status"]).column(0)[0].as_py()
        except Exception:
            continue
        counts[st] = counts.get(st, 0) + 1
    return counts


def _run_on_devices(sweep, tasks, devices, log_dir, on_row, progress, log, workers=None) -> None:
    """One supervised worker per GPU (and per entry with an environment of its own), each pinned
    with ``CUDA_VISIBLE_DEVICES``; tasks are taken heaviest first from one queue, so the GPUs
    finish close together."""
    q: queue.Queue = queue.Queue()
    for t in sorted(tasks, key=lambda t: -point_cost(t.point, len(t.backends))):
        q.put(t)
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve(dev: str) -> None:
        sup = executor(sweep, log_dir, log, True, workers or {}, dev, stop)
        try:
            while not stop.is_set():
                try:
                    t = q.get_nowait()
                except queue.Empty:
                    return
                if progress is not None:
                    progress(f"[gpu {dev}] {t.point.describe()} {t.direction}")
                sup.run_task(t, on_row)
        except BaseException as e:  # surfaced to the caller after the others stop
            errors.append(e)
        finally:
            sup.close()

    threads = [threading.Thread(target=serve, args=(d,), daemon=True) for d in devices]
    for th in threads:
        th.start()
    try:
        while any(th.is_alive() for th in threads):
            for th in threads:
                th.join(timeout=0.2)
    except KeyboardInterrupt:
        # take no more tasks; each worker finishes the row it is on, then stops (Ctrl-C again
        # to abandon those rows)
        stop.set()
        while not q.empty():
            try:
                q.get_nowait()
            except queue.Empty:
                break
        log("interrupted: finishing the rows in flight on each GPU (Ctrl-C again to abandon them)")
        for th in threads:
            th.join()
        raise
    if errors:
        raise errors[0]
