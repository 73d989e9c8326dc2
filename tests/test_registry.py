"""The backend registry (entry points, the checkout's pyproject table, $QLABENCH_BACKENDS) and
backend parameters in YAML (validated by the backend, stored on the row, part of the resume key)."""

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from qlabench import backends as B
from qlabench import config as C
from qlabench import runner
from qlabench.cli import app

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "params", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
        "seqlens": [[5], [9]], "directions": ["fwd"],
        "reference": {"impl": "chunked", "dtype": "fp64"},
        "timing": {"min_samples": 5, "max_samples": 6, "budget_s": 0.05}}


def test_in_repo_backends_come_from_the_pyproject_entry_points():
    import tomllib
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][B.GROUP]
    assert list(B.names())[:len(table)] == list(table)
    for name, target in table.items():
        cls = B.backend_class(name)
        assert f"{cls.__module__}:{cls.__qualname__}" == target and cls.name == name
        assert cls.color and set(cls.directions) <= set(C.DIRECTIONS)
    assert B.backend_class("fla").distribution == "fla-core"
    # the test backend is registered by conftest through the environment, not shipped
    assert "faulty" in B.registered() and "faulty" not in table


def test_environment_registration(monkeypatch):
    monkeypatch.setenv(B.ENV, "faulty=faulty_backend:FaultyBackend,twin=faulty_backend:FaultyBackend")
    assert "twin" in B.names()
    with pytest.raises(TypeError, match="registered as 'twin' but its name is 'faulty'"):
        B.backend_class("twin")
    monkeypatch.setenv(B.ENV, "nonsense")
    with pytest.raises(ValueError, match="name=module:Class"):
        B.registered()
    monkeypatch.delenv(B.ENV)
    with pytest.raises(B.UnknownBackend, match="unknown backend 'faulty'; known: reference, fla"):
        B.backend_class("faulty")


def test_unknown_name_and_unknown_param_exit_2_naming_them(tmp_path):
    def validate(backends):
        p = tmp_path / "s.yaml"
        p.write_text(yaml.safe_dump({**BASE, "backends": backends}))
        return CliRunner().invoke(app, ["validate", str(p)])

    r = validate(["reference", "nope"])
    assert r.exit_code == 2 and "backends[1]" in r.output and "unknown backend 'nope'" in r.output
    r = validate([{"name": "tilelang", "label": "tl-bv64", "params": {"fwd_bv": 64}}])
    assert r.exit_code == 2 and "fwd_bv: unknown parameter" in r.output
    assert "fwd_block_v" in r.output  # the backend's parameters are listed
    r = validate([{"name": "tilelang", "params": {"fwd_split_tokens": 100}}])
    assert r.exit_code == 2 and "fwd_split_tokens" in r.output and "multiple of 64" in r.output
    r = validate([{"name": "flashinfer", "params": {"use_cp": "sometimes"}}])
    assert r.exit_code == 2 and "use_cp" in r.output
    assert validate([{"name": "flashinfer", "params": {"use_cp": False}},
                     {"name": "tilelang", "label": "tl-bv64", "params": {"fwd_block_v": 64}}]).exit_code == 0


def test_params_dump_and_json():
    s = C.parse({**BASE, "backends": ["reference", {"name": "tilelang", "label": "tl-bv64",
                                                    "params": {"fwd_block_v": 64, "bwd_streams": True}}]})
    e = s.entries()["tl-bv64"]
    assert e.params_json == '{"fwd_block_v": 64}'  # defaults are not stored
    assert s.entries()["reference"].params_json == "{}"
    assert s.model_dump(mode="json")["backends"][1]["params"] == {"fwd_block_v": 64, "bwd_streams": True}
    assert C.Sweep.model_validate(s.model_dump(mode="json")) == s


def test_params_reach_the_backend_are_stored_and_key_the_resume(tmp_path):
    """o_scale 2 makes the test backend wrong: the parameter reached the worker's instance. Rows
    carry the non-default parameters; a resume with other parameters measures the key again."""
    out = tmp_path / "r"

    def run(params):
        s = C.parse({**BASE, "backends": ["reference", {"name": "faulty", "label": "f",
                                                        "params": params}]})
        runner.run(s, out, resume=True, log=lambda *a, **k: None)
        return pd.read_parquet(out)

    df = run({})
    f = df[df["backend"] == "f"]
    assert len(f) == 2 and set(f["status"]) == {"ok"} and set(f["backend_params"]) == {"{}"}
    df = run({})  # same parameters: nothing new
    assert len(df) == 4
    df = run({"o_scale": 2.0})
    f = df[df["backend"] == "f"]
    assert len(df) == 6 and list(f["status"]).count("incorrect") == 2
    assert json.loads(f["backend_params"].iloc[-1]) == {"o_scale": 2.0}


def test_a_registered_backend_that_does_not_import_gives_unavailable_rows(tmp_path, monkeypatch):
    monkeypatch.setenv(B.ENV, "faulty=faulty_backend:FaultyBackend,broken=no_such_module_here:X")
    s = C.parse({**BASE, "backends": ["reference", "broken"]})
    runner.run(s, tmp_path / "r", log=lambda *a, **k: None)
    df = pd.read_parquet(tmp_path / "r")
    bad = df[df["backend"] == "broken"]
    assert len(bad) == 2 and set(bad["status"]) == {"unavailable"}
    assert bad["reason"].str.contains("does not load: ModuleNotFoundError").all()
    assert set(df.loc[df["backend"] == "reference", "status"]) == {"ok"}
    # parameters for it cannot be checked: a config error naming the field, not a traceback
    with pytest.raises(C.ConfigError, match=r"backends\[0\]: params: cannot check them"):
        C.parse({**BASE, "backends": [{"name": "broken", "params": {"a": 1}}]})


def test_a_worker_rebuilds_the_sweep_without_the_parents_registry():
    """The parent validated the sweep; a worker in another environment only rebuilds it (it
    need not register every entry's backend)."""
    s = C.parse({**BASE, "backends": ["reference", {"name": "faulty", "label": "f",
                                                    "params": {"o_scale": 2.0}}]})
    dump = s.model_dump(mode="json")
    dump["backends"][1]["name"] = "registered-elsewhere"
    with pytest.raises(Exception, match="unknown backend"):
        C.Sweep.model_validate(dump)
    assert C.Sweep.model_validate(dump, context={"validated": True}).entries()["f"].params == {"o_scale": 2.0}


def test_git_sha_outside_a_checkout_comes_from_the_environment(tmp_path, monkeypatch):
    from qlabench.results import git_sha
    monkeypatch.setenv("QLABENCH_GIT_SHA", "abc123def456")
    assert git_sha(str(tmp_path)) == "abc123def456"
    monkeypatch.delenv("QLABENCH_GIT_SHA")
    assert git_sha(str(tmp_path)) == "unknown"


def test_git_sha_named_by_the_environment_wins_inside_a_checkout(monkeypatch):
    """A tree copied onto another checkout (a device's copy of the working tree) has a .git whose
    HEAD is not the code that runs: the commit the caller names is the one rows record."""
    from qlabench.results import git_sha

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.delenv("QLABENCH_GIT_SHA", raising=False)
    inferred = git_sha(root)
    monkeypatch.setenv("QLABENCH_GIT_SHA", "0123456789ab")
    assert git_sha(root) == "0123456789ab" != inferred


def test_a_cost_table_param_must_load_and_plans_with_that_table(tmp_path, monkeypatch):
    """``cost_table``: a file that does not load is a config error naming it (exit 2); one that loads
    makes prepare pass the planners' choices under that table, not the committed one's."""
    import types

    import qlabench_kernels as qk
    import torch
    from qlabench_kernels import calibration

    from qlabench.backends.tilelang import TileLangBackend

    def validate(params):
        p = tmp_path / "s.yaml"
        p.write_text(yaml.safe_dump({**BASE, "backends": [{"name": "tilelang", "label": "tl-t", "params": params}]}))
        return CliRunner().invoke(app, ["validate", str(p)])

    r = validate({"cost_table": str(tmp_path / "missing.json")})
    assert r.exit_code == 2 and "cost_table" in r.output and "missing.json" in r.output
    d = calibration.default_table().to_json()
    d["fwd"]["costs"].pop("kernel")
    (tmp_path / "old.json").write_text(json.dumps(d))
    r = validate({"cost_table": str(tmp_path / "old.json")})
    assert r.exit_code == 2 and "missing ['kernel']" in r.output
    # a table under which the fused kernel is dear and splitting free: fwd_o, split, for one long sequence
    d = calibration.default_table().to_json()
    d["fwd"]["costs"].update(fused=100.0, fused_few=100.0, launch=0.0, fixup=1e-3)
    d["bwd"]["costs"].update(launch=0.0, fixup=1e-3)
    (tmp_path / "t.json").write_text(json.dumps(d))
    assert validate({"cost_table": str(tmp_path / "t.json")}).exit_code == 0
    table = calibration.from_json(d)
    seen = {}
    monkeypatch.setattr(qk, "chunk_gdn_fwd_lowlevel", lambda *a, **k: seen.update(fwd=k) or {"o": 0, "final_state": 0})
    monkeypatch.setattr(qk, "chunk_gdn_bwd", lambda *a, **k: seen.update(bwd=k) or (0,) * 6)
    lens = [32768]
    x = types.SimpleNamespace(q=torch.zeros(1, 1, 2, 1), k=None, v=torch.zeros(1, 1, 8, 1), g=None, beta=None,
                              scale=1.0, h0=None, output_final_state=True, do=None, dht=None,
                              cu_seqlens=torch.tensor([0, *lens]))  # fmt: skip
    b = TileLangBackend(TileLangBackend.Params(cost_table=str(tmp_path / "t.json")))
    b.prepare(x, "fwd").fn()
    assert (seen["fwd"]["block_v"], seen["fwd"]["split_tokens"]) == qk.plan_fwd(32768, 1, 8, 132, seqlens=lens, h_qk=2, costs=table.fwd)
    assert seen["fwd"]["split_tokens"] != qk.plan_fwd(32768, 1, 8, 132, seqlens=lens, h_qk=2)[1]
    b.prepare(x, "bwd").fn()
    assert seen["bwd"]["split_tokens"] == qk.plan_bwd_split(32768, 1, 8, 132, seqlens=lens, costs=table.bwd)
    # the table's content keys the resume: the same file re-measured is a new version
    v = b.version()
    assert v != TileLangBackend().version()
    d["fwd"]["costs"]["fused"] = 99.0
    (tmp_path / "t.json").write_text(json.dumps(d))
    assert b.version() != v


def test_tilelang_version_follows_the_kernels_code_not_their_comments(tmp_path, monkeypatch):
    """The resume key of ours: a comment, a docstring or a line break in a kernel source keeps
    it; a changed constant makes a new one."""
    import shutil

    import qlabench_kernels

    from qlabench.backends.tilelang import TileLangBackend

    pkg = tmp_path / "kernels"
    shutil.copytree(Path(qlabench_kernels.__file__).parent, pkg)
    monkeypatch.setattr(qlabench_kernels, "__file__", str(pkg / "__init__.py"))
    before = TileLangBackend().version()
    assert before == TileLangBackend().version() and before.startswith("src-")
    src = pkg / "bwd_dhu.py"
    text = src.read_text()
    edited = text.replace('"""Backward kernel 3:', '"""Backward kernel three:', 1).replace(
        "#: input ring depth", "#: depth of the input ring\n# (two stages)", 1)
    assert edited != text
    src.write_text(edited)
    assert TileLangBackend().version() == before
    src.write_text(text.replace("NST = 2", "NST = 3", 1))
    assert TileLangBackend().version() != before
