"""The backend checks are the worker's: a run's process never imports a backend's library (a
stand-in heavy library, tests/heavy_lib.py, and the real ones by name), the worker reports each
backend's availability and version, and a library that fails to import, or kills the
interpreter importing it, costs that backend's rows (``unavailable``), not the sweep. Each run
here is a subprocess, so its ``sys.modules`` is its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
#: top-level modules of the backends' libraries (and what they pull in)
LIBRARIES = ("heavy_lib", "fla", "flash_qla", "tilelang", "tvm", "qlabench_kernels", "triton",
             "transformers", "flashinfer")

CFG = {"name": "wc", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
       "seqlens": [[5], [9]], "directions": ["fwd"], "backends": ["reference", "heavy"],
       "reference": {"impl": "chunked", "dtype": "fp64"},
       "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}

#: the CLI in this interpreter; at exit, which libraries it imported, as JSON on stdout
CLI = f"""
import atexit, json, sys
def seen():
    print("IMPORTED " + json.dumps(sorted({{m.split(".")[0] for m in sys.modules}}
                                           & set({list(LIBRARIES)!r}))))
atexit.register(seen)
from qlabench.cli import app
sys.argv[0] = "qlabench"
app()
"""


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["QLABENCH_BACKENDS"] = ",".join(filter(None, [env.get("QLABENCH_BACKENDS"),
                                                      "heavy=heavy_backend:HeavyBackend"]))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("HEAVY_LIB", None)
    return {**env, **extra}


def _cli(tmp_path: Path, *args, **env) -> tuple[subprocess.CompletedProcess, list]:
    cfg = tmp_path / "wc.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    out = subprocess.run([sys.executable, "-c", CLI, "run", str(cfg), "--no-plot", *args],
                         cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("IMPORTED ")), None)
    assert line is not None, out.stdout + out.stderr
    return out, json.loads(line.split(" ", 1)[1])


def _rows(out_dir: Path):
    from qlabench import results
    return results.load(out_dir).sort_values(["backend", "point_index"])


def test_the_run_process_imports_no_backend_library(tmp_path):
    """One worker per library (forced: this host may have too few cores for that by default)."""
    out, imported = _cli(tmp_path, "--out", str(tmp_path / "r"), QLABENCH_EARLY_ROWS="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert imported == [], f"the run's own process imported {imported}"
    df = _rows(tmp_path / "r")
    assert list(df["status"]) == ["ok"] * 4
    # the version the worker found (the parent never imported heavy_lib to ask)
    assert set(df[df.backend == "heavy"]["backend_version"]) == {"7.1"}
    meta = json.loads(next((tmp_path / "r" / "_runs").glob("*.json")).read_text())
    assert meta["backend_versions"] == {"reference": meta["backend_versions"]["reference"],
                                        "heavy": "7.1"}
    tl = meta["timeline_s"]
    assert tl["worker_started"] <= tl["first_ready"] <= tl["first_row"]
    assert set(meta["worker_warm_s"]) == {"reference", "heavy"}
    for wt in meta["worker_timeline_s"].values():  # one worker per label
        assert wt["started"] <= wt["imported"] <= wt["cuda"] <= wt["warmed"] <= tl["backends_checked"] + 0.05
    # every check is in only once the last worker has warmed up (how soon after is the slow
    # import's test: here a row in flight may delay the noticing by its own length)
    last = max(wt["warmed"] for wt in meta["worker_timeline_s"].values())
    assert last - 0.05 <= tl["backends_checked"]
    logs = sorted(p.name for p in (tmp_path / "r" / "_logs").glob("worker-*.log"))
    assert len(logs) == 2, logs


def test_a_slow_import_does_not_hold_the_other_backends(tmp_path):
    """heavy_lib takes 6 s to import: the reference's rows start before heavy is checked (rows
    before every check forced: this host may have too few cores for them by default), say so in
    their reason, and heavy's rows follow once it is, from the first point on."""
    out, imported = _cli(tmp_path, "--out", str(tmp_path / "r"), HEAVY_LIB="slow",
                         QLABENCH_EARLY_ROWS="1")
    assert out.returncode == 0, out.stdout + out.stderr
    from qlabench import results
    df = results.load(tmp_path / "r").sort_values("started_at")
    assert list(df["status"]) == ["ok"] * 4
    assert list(df["backend"]) == ["reference", "reference", "heavy", "heavy"]
    assert list(df["point_index"]) == [0, 1, 0, 1]
    assert df[df.backend == "reference"]["reason"].str.contains("heavy were starting").all()
    assert not df[df.backend == "heavy"]["reason"].str.len().any()
    meta = json.loads(next((tmp_path / "r" / "_runs").glob("*.json")).read_text())
    tl = meta["timeline_s"]
    assert tl["first_row"] < tl["backends_checked"]
    assert tl["backends_checked"] <= meta["worker_timeline_s"]["heavy"]["warmed"] + 1.0


def test_with_too_few_cores_the_rows_wait_for_every_check(tmp_path):
    out, _ = _cli(tmp_path, "--out", str(tmp_path / "r"), HEAVY_LIB="slow", QLABENCH_EARLY_ROWS="0")
    assert out.returncode == 0, out.stdout + out.stderr
    from qlabench import results
    df = results.load(tmp_path / "r")
    # no row ahead of a check (a re-timing note on a loaded host may still be there)
    assert list(df["status"]) == ["ok"] * 4 and not df["reason"].str.contains("were starting").any()
    tl = json.loads(next((tmp_path / "r" / "_runs").glob("*.json")).read_text())["timeline_s"]
    assert tl["backends_checked"] <= tl["first_row"]
    # one worker imports both libraries
    assert len(list((tmp_path / "r" / "_logs").glob("worker-*.log"))) == 1


def test_dry_run_asks_the_libraries_elsewhere(tmp_path):
    out, imported = _cli(tmp_path, "--out", str(tmp_path / "r"), "--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert imported == [] and "7.1" in out.stdout and not (tmp_path / "r").exists()


def test_a_library_that_fails_to_import_costs_its_rows(tmp_path):
    out, imported = _cli(tmp_path, "--out", str(tmp_path / "r"), HEAVY_LIB="raise")
    assert out.returncode == 0, out.stdout + out.stderr
    df = _rows(tmp_path / "r")
    heavy, ref = df[df.backend == "heavy"], df[df.backend == "reference"]
    assert list(ref["status"]) == ["ok"] * 2 and list(heavy["status"]) == ["unavailable"] * 2
    assert heavy["reason"].str.contains("cannot import heavy_lib: ImportError").all()


def test_a_library_that_kills_the_worker_costs_its_rows(tmp_path):
    """The worker dies importing it before its report: each backend is then checked in an
    interpreter of its own, the one that kills it is unavailable, the fresh worker imports only
    the others."""
    out, imported = _cli(tmp_path, "--out", str(tmp_path / "r"), HEAVY_LIB="crash")
    assert out.returncode == 0, out.stdout + out.stderr
    assert imported == []
    assert "worker died while checking its backends" in out.stdout
    df = _rows(tmp_path / "r")
    heavy, ref = df[df.backend == "heavy"], df[df.backend == "reference"]
    assert list(ref["status"]) == ["ok"] * 2 and list(heavy["status"]) == ["unavailable"] * 2
    assert heavy["reason"].str.contains("fresh interpreter failed").all()
    assert heavy["reason"].str.contains("signal 6").all()


def test_the_cli_and_the_runner_import_light():
    """What `qlabench run` imports before its worker starts: no torch, pandas, pyarrow,
    matplotlib or scipy (the worker imports torch; the rest comes after)."""
    code = ("import sys, qlabench.cli, qlabench.runner, qlabench.supervisor; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'pandas', 'pyarrow', 'matplotlib', 'scipy', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
