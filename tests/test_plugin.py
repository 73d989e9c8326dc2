"""An outside backend is one file and one entry point: examples/plugin_backend, installed into a
temporary directory, runs in a sweep next to the reference (CPU), parameters included."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugin_backend"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target, src = tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("src") / "plugin"
    shutil.copytree(PLUGIN, src)  # the build leaves its files beside the sources
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--target", str(target), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return target


def _env(site):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return env


def test_installed_plugin_runs_in_a_sweep_next_to_reference(site, tmp_path):
    cfg = tmp_path / "plugin.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "plugin", "models": [{"name": "tiny", "h_qk": 1, "h_v": 2, "head_dim": 16}],
        "seqlens": [[7], [3, 12]], "directions": ["fwd"],
        "reference": {"impl": "recurrent", "dtype": "fp64"},
        "backends": ["reference", "torch-loop",
                     {"name": "torch-loop", "label": "loop-fp64", "params": {"dtype": "fp64"}}],
        "timing": {"min_samples": 3, "max_samples": 5, "budget_s": 0.05}}))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "qlabench.cli", "run", str(cfg), "--out", str(out)],
                       capture_output=True, text=True, env=_env(site), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    df = pd.read_parquet(out)
    assert sorted(df["backend"].unique()) == ["loop-fp64", "reference", "torch-loop"]
    assert (df["status"] == "ok").all(), df[["backend", "status", "reason"]]
    loop = df[df["backend_name"] == "torch-loop"]
    assert set(loop["backend_version"]) == {"0.1.0"}
    assert set(loop["backend_params"]) == {"{}", json.dumps({"dtype": "fp64"})}
    assert (loop["max_rel_l2"] < 5e-3).all()  # o is stored in v's dtype (bf16)


def test_plugin_params_are_validated_and_unknown_names_listed(site, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "bad", "models": [{"name": "tiny", "h_qk": 1, "h_v": 2, "head_dim": 16}],
        "seqlens": [[7]], "backends": [{"name": "torch-loop", "params": {"dtype": "fp16"}}]}))
    r = subprocess.run([sys.executable, "-m", "qlabench.cli", "validate", str(cfg)],
                       capture_output=True, text=True, env=_env(site))
    assert r.returncode == 2 and "backends[0]: params: dtype" in r.stdout + r.stderr
    # without the package on the path the name is unknown, and the known ones are listed
    r = subprocess.run([sys.executable, "-m", "qlabench.cli", "validate", str(cfg)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown backend 'torch-loop'" in r.stdout + r.stderr
