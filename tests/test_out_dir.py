"""One results directory, one sweep: `qlabench run` refuses (exit 2, one line naming what
differs, nothing written) an --out holding rows of another sweep, input recipe, GPU or timing
method unless --append-other; the same sweep on the same GPU from the same recipe runs again into it, with or
without --resume."""

from pathlib import Path

import pytest
import yaml
from synth_results import restamp
from typer.testing import CliRunner

from qlabench import config as C
from qlabench import results as R
from qlabench import runner
from qlabench.cli import app
from qlabench.sweep import points

SWEEP = {"name": "a", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
         "seqlens": [[5], [9]], "directions": ["fwd"], "backends": ["reference"],
         "reference": {"impl": "chunked", "dtype": "fp64"}, "isolate": False,
         "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}


def _cfg(tmp_path, file="a.yaml", **over) -> Path:
    p = tmp_path / file
    p.write_text(yaml.safe_dump({**SWEEP, **over}))
    return p


def _run(cfg, out, *args):
    return CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--no-plot", *args])


def _files(d: Path) -> dict:
    """Every path under ``d``: the rows' and metadata files with their modification times (a
    refused run's workers append to a worker log of this process's id: the logs' names only)."""
    return {p.relative_to(d): None if R.LOGS_DIR in p.parts else p.stat().st_mtime_ns
            for p in d.rglob("*")}


def _refused(r, out, before, *words):
    """Exit 2 with one line (`error: ...`) holding every one of ``words``; nothing written."""
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {out} holds "), r.output
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert _files(out) == before
    return lines[0]


def test_the_same_sweep_runs_again_into_its_directory(tmp_path):
    """Same sweep name, GPU and recipe: allowed without --resume (rows added) and with it
    (nothing new); an edited sweep of the same name (another point, another backend) too."""
    out = tmp_path / "o"
    cfg = _cfg(tmp_path)
    assert _run(cfg, out).exit_code == 0
    r = _run(cfg, out)
    assert r.exit_code == 0, r.output
    assert len(R.load(out)) == 4
    r = _run(cfg, out, "--resume")
    assert r.exit_code == 0 and "nothing new" in r.output, r.output
    edited = _cfg(tmp_path, "a2.yaml", seqlens=[[5], [9], [12]], backends=["reference", "fla"])
    r = _run(edited, out, "--resume")
    assert r.exit_code == 0, r.output
    df = R.latest(R.load(out))
    assert len(df) == 6 and (df["backend"] == "fla").sum() == 3


def test_another_sweep_is_refused_unless_append_other(tmp_path):
    out = tmp_path / "o"
    assert _run(_cfg(tmp_path), out).exit_code == 0
    other = _cfg(tmp_path, "b.yaml", name="b")
    before = _files(out)
    for extra in ([], ["--resume"]):
        _refused(_run(other, out, *extra), out, before,
                 f"rows of sweep 'a' ({tmp_path / 'a.yaml'}, 2 rows)",
                 f"not of this run's sweep 'b' ({other})", "--append-other")
    r = _run(other, out, "--append-other")
    assert r.exit_code == 0, r.output
    assert R.owners(out)["sweep"].value_counts().to_dict() == {"a": 2, "b": 2}


def test_another_input_recipe_is_refused_unless_append_other(tmp_path):
    """Same sweep and point keys, another gate: refused without --resume too (it used to be
    added, and the directory could then not be resumed); --append-other adds it, but a --resume
    over rows of another recipe stays refused."""
    out = tmp_path / "o"
    assert _run(_cfg(tmp_path), out).exit_code == 0
    changed = _cfg(tmp_path, "a2.yaml", gate={"zero_frac": 0.5, "seed": 0})
    old, new = ([p.recipe_hash for p in points(C.parse(s))]
                for s in (SWEEP, {**SWEEP, "gate": {"zero_frac": 0.5, "seed": 0}}))
    before = _files(out)
    line = _refused(_run(changed, out), out, before, "made from another input recipe",
                    f"recipe_hash {old[0]} vs this run's {new[0]}",
                    "gate recipe zero0.25/seed0 vs this run's zero0.5/seed0",
                    "and for 1 more of this run's points", "--append-other")
    assert "sweep" not in line.split(" holds ")[1].split(";")[0]
    _refused(_run(changed, out, "--resume"), out, before, "another input recipe",
             "a --resume never mixes input recipes")
    _refused(_run(changed, out, "--resume", "--append-other"), out, before,
             "another input recipe", "a --resume never mixes input recipes")
    seeded = _cfg(tmp_path, "a3.yaml", seed=7)
    _refused(_run(seeded, out), out, before, "the same gate recipe zero0.25/seed0: the input "
             "seed or state flags differ")
    r = _run(changed, out, "--append-other")
    assert r.exit_code == 0, r.output
    assert set(R.load(out)["recipe_hash"]) == {*old, *new}


def test_another_gpu_is_refused_unless_append_other(tmp_path):
    """Rows measured on an H200; this run on the CPU (the figures would mix them). The run's
    workers start before the check: their logs go too."""
    out = tmp_path / "o"
    cfg = _cfg(tmp_path)
    assert _run(cfg, out).exit_code == 0
    restamp(out, gpu_name="NVIDIA H200")
    before = _files(out)
    isolated = _cfg(tmp_path, "a2.yaml", isolate=True)  # the same sweep, in worker processes
    _refused(_run(isolated, out), out, before, "rows measured on NVIDIA H200 (2 rows), not on "
             "this run's cpu", "--append-other")
    _refused(_run(cfg, out, "--resume"), out, before, "NVIDIA H200")
    r = _run(cfg, out, "--append-other")
    assert r.exit_code == 0, r.output
    assert R.load(out)["gpu_name"].value_counts().to_dict() == {"NVIDIA H200": 2, "cpu": 2}


def test_another_timing_method_is_refused_unless_append_other(tmp_path):
    """Rows timed in graph-batch with a warm L2; a run of the same sweep asking for a cold L2 or
    graph-single: refused without --resume too (a --resume of either would be refused after);
    --append-other adds it, a --resume over them stays refused. A CPU run's rows (timing_mode
    cpu) and events fallback rows set no method."""
    out = tmp_path / "o"
    cfg = _cfg(tmp_path)
    assert _run(cfg, out).exit_code == 0
    assert _run(_cfg(tmp_path, "cold0.yaml", timing={**SWEEP["timing"], "l2": "cold"}),
                out).exit_code == 0  # rows of mode cpu: nothing to differ from
    restamp(out, timing_mode="graph-batch", l2="warm")
    before = _files(out)
    cold = _cfg(tmp_path, "cold.yaml", timing={**SWEEP["timing"], "l2": "cold"})
    single = _cfg(tmp_path, "single.yaml", timing={**SWEEP["timing"], "mode": "graph-single"})
    for c, mode, l2 in ((cold, "graph-batch", "cold"), (single, "graph-single", "warm")):
        line = _refused(_run(c, out), out, before,
                        "rows timed with timing_mode=graph-batch, l2=warm (4 rows)",
                        f"not with this run's timing_mode={mode}, l2={l2}", "--append-other")
        assert "sweep" not in line.split(" holds ")[1].split(";")[0]
    _refused(_run(cold, out, "--resume"), out, before, "timing_mode=graph-batch, l2=warm",
             "a --resume never mixes timing methods")
    _refused(_run(cold, out, "--resume", "--append-other"), out, before,
             "a --resume never mixes timing methods")
    assert _run(cfg, out, "--resume").exit_code == 0  # its own method: resumed
    r = _run(cold, out, "--append-other")
    assert r.exit_code == 0, r.output
    with pytest.raises(runner.OtherRows) as e:
        runner.run(C.parse({**SWEEP, "timing": {**SWEEP["timing"], "mode": "graph-single"}}),
                   out, log=lambda m: None)
    assert e.value.what == ("method",)


def test_every_difference_is_named_in_the_one_line(tmp_path):
    out = tmp_path / "o"
    assert _run(_cfg(tmp_path), out).exit_code == 0
    restamp(out, gpu_name="NVIDIA H200")
    before = _files(out)
    line = _refused(_run(_cfg(tmp_path, "b.yaml", name="b", seed=3), out), out, before,
                    "rows of sweep 'a'", "rows measured on NVIDIA H200", "another input recipe")
    assert line.count(";") == 3  # three kinds, then the hint


def test_runner_raises_before_any_row(tmp_path):
    """The library call refuses as the command does (OtherRows; RecipeMismatch for a recipe)."""
    runner.run(C.parse(SWEEP), tmp_path, log=lambda m: None)
    with pytest.raises(runner.OtherRows) as e:
        runner.run(C.parse({**SWEEP, "name": "b"}), tmp_path, log=lambda m: None)
    assert e.value.what == ("sweep",) and not isinstance(e.value, runner.RecipeMismatch)
    with pytest.raises(runner.RecipeMismatch) as e:
        runner.run(C.parse({**SWEEP, "seed": 1}), tmp_path, log=lambda m: None)
    assert e.value.what == ("recipe",)
    assert len(R.load(tmp_path)) == 2 and len(R.load_meta(tmp_path)) == 1
    s = runner.run(C.parse({**SWEEP, "name": "b"}), tmp_path, append_other=True, log=lambda m: None)
    assert len(s.rows) == 2
