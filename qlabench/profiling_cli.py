"""``qlabench profile``: one backend, one point, its kernels (and optionally Nsight Compute)."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rich.table import Table

NCU_METRICS = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
               "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
               "sm__warps_active.avg.pct_of_peak_sustained_active",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed",
               "launch__registers_per_thread", "launch__grid_size")


def select_point(pts, point: str, model: str | None):
    """A point by index, or by layout label (and model name or 'h_qk/h_v')."""
    if point.isdigit():
        i = int(point)
        if not 0 <= i < len(pts):
            raise ValueError(f"--point {i}: the config has points 0..{len(pts) - 1}")
        return pts[i]
    cands = [p for p in pts if p.layout_label == point
             and (model is None or model in (p.model, p.tp_label))]
    if not cands:
        raise ValueError(f"--point {point!r}{f' --model {model!r}' if model else ''}: no such point "
                         f"(layouts: {', '.join(sorted({p.layout_label for p in pts}))})")
    if len(cands) > 1:
        raise ValueError(f"--point {point!r} matches {len(cands)} models; add --model "
                         f"({', '.join(p.model for p in cands)})")
    return cands[0]


def _num(v: str):
    v = (v or "").replace(",", "")
    try:
        return float(v)
    except ValueError:
        return v


def parse_ncu_csv(text: str) -> list[dict]:
    """``ncu --csv`` output -> [{kernel, metric: value}] per launch. Takes both the long form
    (ID, Kernel Name, Metric Name, Metric Value) and the wide ``--page raw`` form (one row per
    launch, one column per metric, a units row after the header)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    rdr = csv.DictReader(io.StringIO("\n".join(lines)))
    if "Metric Name" not in (rdr.fieldnames or []):
        out = []
        for r in rdr:
            if not (r.get("ID") or "").strip().isdigit():
                continue  # the units row
            d = {"kernel": r.get("Kernel Name", "?")}
            d.update({k: _num(v) for k, v in r.items() if k in NCU_METRICS})
            out.append(d)
        return out
    launches: dict = {}
    for r in rdr:
        key = (r.get("ID"), r.get("Kernel Name"))
        d = launches.setdefault(key, {"kernel": r.get("Kernel Name", "?")})
        d[r.get("Metric Name")] = _num(r.get("Metric Value"))
    return list(launches.values())


#: NVTX range around the one call that ``--ncu`` profiles (warm-up and set-up stay outside it)
NCU_RANGE = "qlabench_ncu"


def ncu_command(exe: str, report: Path, child: list[str], ncu_set: str | None = None,
                ncu_kernel: str | None = None) -> list[str]:
    """The Nsight Compute command line: clocks left alone (the lent H200 needs that), only the
    kernels inside the NVTX range of the one profiled call, the headline metrics or a section set."""
    cmd = [exe, "--clock-control", "none", "--target-processes", "all",
           "--nvtx", "--nvtx-include", f"{NCU_RANGE}/"]
    cmd += ["--set", ncu_set] if ncu_set else ["--csv", "--metrics", ",".join(NCU_METRICS)]
    if ncu_kernel:
        cmd += ["-k", f"regex:{ncu_kernel}"]
    return cmd + ["--launch-skip", "0", "--launch-count", "200", "-o", str(report), "--force-overwrite", *child]


def profile_main(sweep, config_path, point, model, backend, direction, ncu, out, console, err,
                 ncu_set: str | None = None, ncu_kernel: str | None = None) -> int:
    import torch

    from . import backends as B
    from .profile import kernel_breakdown
    from .sweep import points
    from .workloads import make

    try:
        p = select_point(points(sweep), point, model)
    except ValueError as e:
        err.print(f"error: {e}", highlight=False)
        return 2
    labels = sweep.entries()
    if backend not in labels and backend not in B.registered():
        known = ", ".join(dict.fromkeys([*labels, *B.names()]))
        err.print(f"error: --backend {backend!r}: unknown; labels of the sweep and registry "
                  f"names: {known}", highlight=False)
        return 2
    entry = sweep.entries([backend])[backend]  # a label keeps its parameters
    be = B.get(entry.name, entry.params)
    ok, why = be.available()
    if ok:
        ok, why = be.supports(p, direction)
    if not ok:
        err.print(f"error: {backend} cannot run {p.describe()} {direction}: {why}", highlight=False)
        return 2
    if not torch.cuda.is_available():
        err.print("error: profiling needs a CUDA device", highlight=False)
        return 2
    x = make(p, "cuda", with_grads=direction != "fwd")
    prep = be.prepare(x, direction)
    if os.environ.get("QLABENCH_UNDER_NCU"):
        # the child Nsight Compute runs: warm call (JIT, autotune) outside the profiled range, then
        # exactly one call inside the NVTX range that ncu filters on (--nvtx-include NCU_RANGE/)
        prep.fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(NCU_RANGE)
        prep.fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        return 0
    rows = kernel_breakdown(prep.fn)
    out.mkdir(parents=True, exist_ok=True)
    # one file name: layout labels such as "32768/8seq" carry a slash too
    tag = f"{backend}-{direction}-{p.tp_label}-{p.layout_label}".replace("/", "_")
    t = Table(title=f"{backend} {direction} on {p.describe()}: {len(rows)} kernels per call")
    for c in ("kernel", "calls", "us/call", "share %", "grid", "block", "CTAs", "regs", "smem B"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["name"][:60], str(r["calls"]), f"{r['total_us']:.1f}", f"{r['share_pct']:.1f}",
                  str(r.get("grid")), str(r.get("block")), str(r.get("ctas")),
                  str(r.get("regs_per_thread")), str(r.get("smem_bytes")))
    console.print(t)
    (out / f"{tag}.json").write_text(json.dumps({"point": p.describe(), "backend": backend,
                                                 "direction": direction, "kernels": rows}, indent=1))
    if ncu:
        exe = shutil.which("ncu")
        if exe is None:
            err.print("--ncu: `ncu` is not on PATH; skipped", highlight=False)
            return 0
        child = [sys.executable, "-m", "qlabench.cli", "profile", str(config_path), "--point", point,
                 "--backend", backend, "--direction", direction, "--out", str(out / "under_ncu")]
        if model:
            child += ["--model", model]
        cmd = ncu_command(exe, out / tag, child, ncu_set, ncu_kernel)
        res = subprocess.run(cmd, capture_output=True, text=True,
                             env={**os.environ, "QLABENCH_UNDER_NCU": "1"}, timeout=1800)
        (out / f"{tag}.ncu.log").write_text(res.stdout[-200000:] + res.stderr[-20000:])
        imp = subprocess.run([exe, "--import", str(out / f"{tag}.ncu-rep"), "--csv", "--page", "raw",
                              "--metrics", ",".join(NCU_METRICS)], capture_output=True, text=True)
        launches = parse_ncu_csv(imp.stdout)
        (out / f"{tag}.ncu.json").write_text(json.dumps(launches, indent=1))
        if ncu_set:
            det = subprocess.run([exe, "--import", str(out / f"{tag}.ncu-rep"), "--page", "details"],
                                 capture_output=True, text=True)
            (out / f"{tag}.ncu-details.txt").write_text(det.stdout[-2_000_000:] + det.stderr[-20000:])
        console.print(f"ncu: {len(launches)} launches profiled -> {out / tag}.ncu-rep")
    return 0
