"""Kernel breakdown of one call with torch.profiler (names, share of time, grid, block, regs).

The Kineto trace carries each kernel's launch geometry (``args.grid``, ``args.block``,
``args.registers per thread``, ``args.shared memory``); we export it as JSON and aggregate by
kernel name. :func:`parse_trace` is pure so it is tested on CPU with a stored trace.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict


def parse_trace(trace: dict, n_calls: int = 1) -> list[dict]:
    """Aggregate kernel events of a Chrome/Kineto trace. Returns rows sorted by total time:
    name, calls (per call of the op), total_us (per call), share_pct, grid, block, ctas,
    regs_per_thread, smem_bytes."""
    agg: OrderedDict[str, dict] = OrderedDict()
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel" or ev.get("ph") != "X":
            continue
        a = ev.get("args", {})
        name = ev.get("name", "?")
        r = agg.setdefault(name, {"name": name, "calls": 0, "total_us": 0.0,
                                  "grid": a.get("grid"), "block": a.get("block"),
                                  "regs_per_thread": a.get("registers per thread"),
                                  "smem_bytes": (a.get("shared memory") or 0)
                                  + (a.get("dynamic shared memory") or 0) or None})
        r["calls"] += 1
        r["total_us"] += float(ev.get("dur", 0.0))
    rows = list(agg.values())
    total = sum(r["total_us"] for r in rows) or 1.0
    for r in rows:
        r["share_pct"] = 100.0 * r["total_us"] / total
        g = r.get("grid")
        r["ctas"] = int(g[0] * g[1] * g[2]) if isinstance(g, list) and len(g) == 3 else None
        r["calls"] = max(1, round(r["calls"] / n_calls))
        r["total_us"] /= n_calls
    rows.sort(key=lambda r: -r["total_us"])
    return rows


def short_name(name: str) -> str:
    """A kernel's name without return type, namespaces, template arguments or parameters:
    ``void cutlass::device_kernel<flat::kernel::FlatKernel...<...>>(...)`` -> ``FlatKernel...``
    (the innermost class template when the outer one is a generic launcher)."""
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    head = s.split("(", 1)[0]
    outer = head.split("<", 1)[0].rsplit("::", 1)[-1]
    if outer in ("device_kernel", "kernel", "Kernel", "launch") and "<" in head:
        inner = head.split("<", 1)[1].split("<", 1)[0].split(",", 1)[0]
        outer = inner.rsplit("::", 1)[-1] or outer
    return outer or s[:40]


def stored_kernels(kb: list[dict], limit: int = 24) -> str:
    """The breakdown of one call as the row's ``kernels`` column: a JSON list, by time, of
    {name, calls, share_pct, grid, block, regs_per_thread, smem_bytes} (names cut at 300 chars)."""
    keep = ("calls", "share_pct", "grid", "block", "regs_per_thread", "smem_bytes")
    out = [{"name": k["name"][:300], **{f: k.get(f) for f in keep}} for k in kb[:limit]]
    for k in out:
        if k["share_pct"] is not None:
            k["share_pct"] = round(float(k["share_pct"]), 2)
    return json.dumps(out, separators=(",", ":"))


def generic_path(names: list[str]) -> str:
    """A short label of the kernels one call launched: the short names of the three that take
    the most time, joined by ``+``, and ``+N`` for the rest."""
    stems = [short_name(n) for n in names]
    head = "+".join(dict.fromkeys(stems[:3]))
    return head + (f"+{len(stems) - 3}" if len(stems) > 3 else "")


def kernel_breakdown(fn, n_calls: int = 3) -> list[dict]:
    """Profile ``n_calls`` eager calls of ``fn`` (after one warm call) on the GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n_calls):
            fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace = json.load(fh)
    finally:
        os.unlink(path)
    return parse_trace(trace, n_calls)
