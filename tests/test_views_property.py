"""Property tests: the views that read stored rows (``qlabench summary``, ``recommend``,
``report``, ``reproduce``, ``compare``) on random small results directories.

Each view, called through the CLI, either exits 0 with output or exits with a code of its
documented set and a one-line ``error: ...`` on stderr; never a traceback. The directories are
drawn from: 1-2 models × 1-3 layouts × 1-2 directions × 1-3 backend labels, each cell a row of
any status (``ok``, ``incorrect``, ``unavailable``, ``unsupported``, ``oom``, ``crashed``,
``timeout``, ``failed``, one not in the schema) or no row at all; ``ok`` rows with a finite, NaN
or missing latency, no / empty / partly-NaN samples, NaN correctness; 1-2 runs per directory;
``compare`` gets two runs on one grid whose timing method, l2, GPU or input recipe may differ,
or two labels of one directory. :func:`test_views_on_junk_paths` gives every view paths that are
missing, empty, not Parquet, a Parquet table of other columns, or run metadata that is not a JSON
object.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import synth_results as S
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qlabench import reproduce as R
from qlabench import results
from qlabench.cli import app

#: exit codes each view documents (``--help`` / module docstrings)
CODES = {"summary": {0, 2}, "recommend": {0, 2}, "report": {0, 2}, "reproduce": {0, 2},
         "compare": {0, 1, 2, 3}}

MODELS = [("397B/122B TP8", 2, 8), ("27B TP1", 16, 48), ("Sym h32", 32, 32)]
LAYOUTS = [(8192,), (4096, 4096), (1024,) * 4, (32768,), (100, 28000)]
LABELS = ["fla", "flashqla", "tilelang", "flashinfer", "flashinfer@0.7.4"]
DIRECTIONS = ["fwd", "bwd", "fwdbwd"]
#: "missing": no row for the cell; "failed" and "weird" are not schema statuses
STATUSES = ["ok", "ok", "ok", "incorrect", "unavailable", "unsupported", "oom", "crashed",
            "timeout", "failed", "weird", "missing"]
METHOD = {"timing_mode": "graph-batch", "l2": "warm", "gpu_name": "NVIDIA H200",
          "recipe_hash": "aaaaaaaaaaaa", "gate_recipe": "zero0.25/seed0"}
OTHER_METHOD = {"timing_mode": "events", "l2": "cold", "gpu_name": "NVIDIA H100 80GB HBM3",
                "recipe_hash": "bbbbbbbbbbbb", "gate_recipe": "zero0.5/seed0"}

#: examples per test: the same ones every run (derandomized, for CI); QLABENCH_PROPERTY_EXAMPLES=N
#: draws N fresh ones per test instead (to search further)
_N = int(os.environ.get("QLABENCH_PROPERTY_EXAMPLES") or 0)
SETTINGS = settings(max_examples=_N or 30, deadline=None, database=None, derandomize=not _N,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _layout(s) -> str:
    from qlabench.sweep import layout_label
    return layout_label(list(s))


def _key(hq: int, hv: int, seqlens) -> str:
    return f"{hq}/{hv}/d128|{' '.join(map(str, seqlens))}|bf16"


@st.composite
def grids(draw, points=None):
    """The cells of a results directory: (model, h_qk, h_v, seqlens) points × directions ×
    labels. ``points``: draw the points from these instead of MODELS × LAYOUTS."""
    if points is None:
        models = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=2, unique=True))
        lays = draw(st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=3, unique=True))
        pts = [(m, hq, hv, lay) for m, hq, hv in models for lay in lays]
    else:
        pts = draw(st.lists(st.sampled_from(points), min_size=1, max_size=4, unique=True))
    dirs = draw(st.lists(st.sampled_from(DIRECTIONS), min_size=1, max_size=2, unique=True))
    labels = draw(st.lists(st.sampled_from(LABELS), min_size=1, max_size=3, unique=True))
    return {"points": pts, "directions": dirs, "labels": labels}


def _timing(draw, mu: float, rng: np.random.Generator) -> dict:
    """Timing columns of an ``ok`` row: median ``mu``; samples none, empty, few, many or partly
    NaN; latency finite, NaN or missing."""
    kind = draw(st.sampled_from(["many", "many", "few", "one", "none", "empty", "nan"]))
    n = {"many": 30, "few": 3, "one": 1, "nan": 12}.get(kind, 0)
    s = list(mu * rng.lognormal(0.0, 0.01, n)) if n else ([] if kind == "empty" else None)
    if kind == "nan":
        s[::3] = [math.nan] * len(s[::3])
    lat = draw(st.sampled_from(["median", "median", "median", "nan", "none"]))
    fin = [x for x in (s or []) if math.isfinite(x)]
    out = {"samples_ms": s, "n_samples": len(s) if s is not None else None,
           "latency_ms": {"median": float(np.median(fin)) if fin else mu, "nan": math.nan,
                          "none": None}[lat],
           "p10_ms": float(np.quantile(fin, 0.1)) if len(fin) > 1 else None,
           "p90_ms": float(np.quantile(fin, 0.9)) if len(fin) > 1 else None,
           "max_rel_l2": draw(st.sampled_from([0.004, 0.004, math.nan, None])),
           "calls_per_sample": draw(st.sampled_from([8, 8, 32, None]))}
    return out


def _rows(draw, grid: dict, run_id: str, started_at: str, method: dict, scale: dict,
          seed: int) -> list[dict]:
    """One run's rows over ``grid``: every cell drawn a status (or no row)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, (model, hq, hv, lay) in enumerate(grid["points"]):
        for d in grid["directions"]:
            for b in grid["labels"]:
                st_ = draw(st.sampled_from(STATUSES))
                if st_ == "missing":
                    continue
                r = {"run_id": run_id, "git_sha": "abc1234", "config": "prop", "point_index": i,
                     "point_key": _key(hq, hv, lay), "model": model, "tp": f"{hq}/{hv}",
                     "h_qk": hq, "h_v": hv, "head_dim": 128, "seqlens": list(lay),
                     "layout": _layout(lay), "total_tokens": sum(lay), "num_seqs": len(lay),
                     "dtype": "bf16", "gate_zero_frac": 0.25,
                     "direction": d, "backend": b, "backend_name": b.split("@")[0],
                     "backend_version": "1.0", "started_at": started_at, "status": st_,
                     "reason": None if st_ == "ok" else draw(st.sampled_from(["", None, "why"])),
                     "gpu_uuid": draw(st.sampled_from(["GPU-1", None])),
                     "campaign_id": draw(st.sampled_from(["c1", "c2", None])),
                     "throttled": draw(st.sampled_from([False, True, None])), **method}
                if st_ == "ok":
                    mu = (0.02 + sum(lay) * hv * 2.5e-7) * (1 + 0.3 * LABELS.index(b)) \
                        * (3.0 if d != "fwd" else 1.0) * scale.get(b, 1.0)
                    r.update(_timing(draw, mu, rng))
                rows.append(r)
    return rows


def _method(draw) -> dict:
    """The run's method columns: the default, or one of them changed."""
    which = draw(st.sampled_from([None, None, None, *OTHER_METHOD]))
    return {**METHOD, **({which: OTHER_METHOD[which]} if which else {})}


def _write(d: Path, runs: list[list[dict]]) -> Path:
    """A results directory holding ``runs`` (lists of rows; one Parquet file each, in the
    stored schema) and their run metadata."""
    store = results.ResultStore(d)
    store.ensure()
    for rows in runs:
        if rows:
            pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in results.COLUMNS}
                                                 for r in rows], schema=results.SCHEMA),
                           store.parts / f"{rows[0]['run_id']}.parquet")
            store.write_meta(rows[0]["run_id"], {"run_id": rows[0]["run_id"],
                                                 "env": {"gpu_name": rows[0]["gpu_name"]}})
    return d


@st.composite
def result_dirs(draw, points=None):
    """(grid, runs): 1-2 runs over one grid, the second re-measuring it at another scale."""
    grid = draw(grids(points))
    runs = [_rows(draw, grid, "20260101T000000-aaaaaa", "2026-01-01T00:00:00", _method(draw),
                  {}, draw(st.integers(0, 99)))]
    if draw(st.booleans()):
        scale = {b: draw(st.sampled_from([0.8, 1.0, 1.25])) for b in grid["labels"]}
        runs.append(_rows(draw, grid, "20260102T000000-bbbbbb", "2026-01-02T00:00:00",
                          _method(draw), scale, draw(st.integers(0, 99))))
    return grid, runs


@contextmanager
def scratch():
    """A fresh directory per example (a pytest fixture would be shared by all examples)."""
    d = Path(tempfile.mkdtemp(prefix="qlaprop-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def invoke(view: str, args: list[str]):
    """Run ``qlabench VIEW ARGS``; assert the outcome is a documented one: exit 0 with output
    (no number printed as ``nan``), or a code of :data:`CODES` with one ``error: ...`` line on
    stderr (codes 2 and 3); never an exception. Returns the result."""
    r = CliRunner().invoke(app, [view, *args])
    out = r.stdout + r.stderr
    assert r.exception is None or isinstance(r.exception, SystemExit), (
        f"{view} {args}: {type(r.exception).__name__}: {r.exception}\n{out}")
    assert "Traceback" not in out, out
    assert r.exit_code in CODES[view], (view, args, r.exit_code, out)
    if r.exit_code == 0:
        assert r.stdout.strip(), f"{view}: exit 0 without output"
        assert not re.search(r"\bnan\b", r.stdout, re.IGNORECASE), (view, args, r.stdout)
    elif r.exit_code in (2, 3):
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (view, args, r.stderr)
    return r


def _labels(pick, grid: dict) -> str:
    """A ``--backends`` value: labels of the grid, now and then one it lacks."""
    pool = grid["labels"] + ["nope"]
    return ",".join(pick.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=2, unique=True)))


@SETTINGS
@given(data=result_dirs(), pick=st.data())
def test_summary_never_crashes(data, pick):
    grid, runs = data
    with scratch() as root:
        args = [str(_write(root / "r", runs))]
        if pick.draw(st.booleans()):
            args += ["--direction", pick.draw(st.sampled_from(grid["directions"] + ["fwdbwd"]))]
        if pick.draw(st.booleans()):
            m, hq, hv, _ = pick.draw(st.sampled_from(grid["points"]))
            args += ["--model", pick.draw(st.sampled_from([m, f"{hq}/{hv}", "9/9"]))]
        args += ["--baseline", pick.draw(st.sampled_from(["fla", "flashinfer", "nope"]))]
        invoke("summary", args)


@SETTINGS
@given(data=result_dirs(), pick=st.data())
def test_recommend_never_crashes(data, pick):
    grid, runs = data
    with scratch() as root:
        args = [str(_write(root / "r", runs)), "--out", str(root / "dispatch.json"),
                "--direction", pick.draw(st.sampled_from(grid["directions"] + ["fwdbwd"]))]
        if pick.draw(st.booleans()):
            args += ["--backends", _labels(pick, grid)]
        if invoke("recommend", args).exit_code == 0:
            assert (root / "dispatch.json").is_file()


@settings(SETTINGS, max_examples=_N or 10)
@given(data=result_dirs())
def test_report_never_crashes(data):
    _, runs = data
    with scratch() as root:
        if invoke("report", [str(_write(root / "r", runs)), "--out", str(root / "site")]).exit_code == 0:
            page = (root / "site" / "index.html").read_text()
            assert not re.search(r"\bnan\b", page, re.IGNORECASE), "a number printed as nan"


_PUB = {d: R.load_published("flashqla-h200", d) for d in ("fwd", "bwd")}
#: every 7th point of the published set (rows on them join the published table)
_PUB_POINTS = sorted({(t.model, int(t.h_qk), int(t.h_v), t.key[2])
                      for p in _PUB.values() for t in p.table.itertuples()})[::7]


@settings(SETTINGS, max_examples=_N or 20)
@given(data=result_dirs(points=_PUB_POINTS), pick=st.data())
def test_reproduce_never_crashes(data, pick):
    grid, runs = data
    with scratch() as root:
        direction = pick.draw(st.sampled_from([d for d in grid["directions"] if d in DIRECTIONS[:2]]
                                              or ["fwd"]))
        invoke("reproduce", ["flashqla-h200", "--direction", direction,
                             "--from", str(_write(root / "r", runs)), "--out", str(root / "out")])


@SETTINGS
@given(data=result_dirs(), pick=st.data())
def test_compare_never_crashes(data, pick):
    grid, runs = data
    with scratch() as root:
        base = _write(root / "base", runs[:1])
        if len(grid["labels"]) > 1 and pick.draw(st.booleans()):
            a, b = pick.draw(st.permutations(grid["labels"]))[:2]
            args = [str(_write(root / "both", runs)), "--base-backend", a, "--new-backend", b]
        else:
            scale = {b: pick.draw(st.sampled_from([0.8, 1.0, 1.25])) for b in grid["labels"]}
            new = _write(root / "new", [_rows(pick.draw, grid, "20260103T000000-cccccc",
                                              "2026-01-03T00:00:00", _method(pick.draw), scale, 7)])
            args = [str(base), str(new)]
        if pick.draw(st.booleans()):
            args += ["--out", str(root / pick.draw(st.sampled_from(["v.json", "v.csv"])))]
        if pick.draw(st.booleans()):
            args += ["--allow-incomparable"]
        invoke("compare", args)


#: what else a results path may be: missing, an empty directory, a file that is not Parquet in
#: ``parts/`` (alone or beside rows), a Parquet table of other columns (alone or beside rows),
#: run metadata that is not a JSON object, a file that is not Parquet given as the path
JUNK = ["missing", "empty", "garbage", "garbage+rows", "foreign", "foreign+rows", "meta+rows",
        "text-file"]


def _junk(root: Path, kind: str) -> Path:
    """A results path under ``root`` of :data:`JUNK` kind ``kind``."""
    d = root / "r"
    rows = _one_run() if kind.endswith("+rows") else [[]]
    if kind == "missing":
        return d
    if kind == "text-file":
        (root / "r.csv").write_text("a,b\n1,2\n")
        return root / "r.csv"
    store = results.ResultStore(_write(d, rows))
    if kind.startswith("garbage"):
        (store.parts / "zz-junk.parquet").write_bytes(b"not parquet")
    elif kind.startswith("foreign"):
        pd.DataFrame({"x": [1.0], "backend": ["fla"]}).to_parquet(store.parts / "zz-foreign.parquet")
    elif kind == "meta+rows":
        (store.runs / f"{rows[0][0]['run_id']}.json").write_text("[1, 2]")
    return d


def _one_run() -> list[list[dict]]:
    """One clean run (:mod:`synth_results`): one model, two layouts, fla and flashqla, all ok."""
    return [S.make_rows("20260101T000000-aaaaaa", "2026-01-01T00:00:00", backends=("fla", "flashqla"),
                        models=S.MODELS[:1], layouts=S.LAYOUTS[:2], n_samples=20)]


#: each view's arguments for a results path ``d`` and a scratch folder ``root``
VIEW_ARGS = {
    "summary": lambda d, root: [str(d)],
    "recommend": lambda d, root: [str(d), "--out", str(root / "dispatch.json")],
    "report": lambda d, root: [str(d), "--out", str(root / "site")],
    "reproduce": lambda d, root: ["flashqla-h200", "--from", str(d), "--out", str(root / "out")],
    "compare base": lambda d, root: [str(d), str(_write(root / "other", _one_run()))],
    "compare new": lambda d, root: [str(_write(root / "other", _one_run())), str(d)],
    "compare itself": lambda d, root: [str(d), str(d)],
    "compare labels": lambda d, root: [str(d), "--base-backend", "fla", "--new-backend", "flashqla"],
}


@pytest.mark.parametrize("kind", JUNK)
@pytest.mark.parametrize("view", list(VIEW_ARGS))
def test_views_on_junk_paths(tmp_path, view, kind):
    d = _junk(tmp_path, kind)
    invoke(view.split()[0], VIEW_ARGS[view](d, tmp_path))


#: per view: its --out kind (None: no --out) and whether it takes --alpha/--threshold, --direction
_OPTIONS = {"compare": ("file", True, False), "recommend": ("file", True, True),
            "summary": (None, True, True), "report": ("dir", False, False),
            "reproduce": ("dir", False, False)}
#: --out values no view can write: the wrong kind of existing path, a path under a file, a
#: directory that cannot be made (procfs, where there is one)
_BAD_OUTS = ["wrong-kind", "under-a-file"] + (["/proc/nope/x"] if Path("/proc/self").is_dir() else [])


@settings(SETTINGS, max_examples=_N or 40)
@given(view=st.sampled_from(sorted(_OPTIONS)), pick=st.data())
def test_views_refuse_a_bad_out_or_option_before_any_output(view, pick):
    """A bad --out (wrong kind, under a file, not creatable), --alpha outside (0, 1), --threshold
    below 0 or a --direction not fwd | bwd | fwdbwd: exit 2, one error line naming the option,
    nothing on stdout and nothing written. Good options: one of the view's documented codes."""
    kind, tie, direction = _OPTIONS[view]
    with scratch() as root:
        d = S.write_run(root / "r", extra={"gpu_uuid": "GPU-1", "campaign_id": "c1"})
        junk = root / "a-file"
        junk.write_text("x")
        args = {"compare": [str(d), str(d)], "recommend": [str(d)], "summary": [str(d)],
                "report": [str(d)], "reproduce": ["flashqla-h200", "--from", str(d)]}[view]
        bad = []
        if kind is not None:
            out = pick.draw(st.sampled_from(["good", *_BAD_OUTS]))
            path = {"good": root / "out" / ("v.json" if kind == "file" else "site"),
                    "wrong-kind": root if kind == "file" else junk,
                    "under-a-file": junk / "sub" / "v.json"}.get(out, Path(out))
            args += ["--out", str(path)]
            bad += ["--out"] * (out != "good")
        if tie:
            alpha = pick.draw(st.sampled_from([0.01, 0.01, 0.0, 1.0, 2.0, -0.5]))
            threshold = pick.draw(st.sampled_from([0.01, 0.01, 0.0, -1.0]))
            args += ["--alpha", str(alpha), "--threshold", str(threshold)]
            bad += ["--alpha"] * (not 0 < alpha < 1) + ["--threshold"] * (threshold < 0)
        if direction:
            dr = pick.draw(st.sampled_from(["fwd", "up", "FWD"]))
            args += ["--direction", dr]
            bad += ["--direction"] * (dr != "fwd")
        before = sorted(p for p in root.rglob("*"))
        r = invoke(view, args)
        if bad:
            assert r.exit_code == 2 and not r.stdout.strip(), (view, args, r.stdout)
            assert any(r.stderr.startswith(f"error: {o} ") for o in bad), (bad, r.stderr)
            assert sorted(p for p in root.rglob("*")) == before
