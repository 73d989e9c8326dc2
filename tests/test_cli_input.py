"""Bad input to the commands that write (``--out``) or judge (``--alpha``, ``--threshold``,
``--direction``): one ``error: ...`` line on stderr, exit 2, nothing on stdout and nothing
written; `merge` keeps one sweep timed one way per directory unless --mix-sweeps."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import synth_results as S
import yaml
from typer.testing import CliRunner

from qlabench import paths
from qlabench import results as R
from qlabench.cli import app

SWEEP = {"name": "a", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}],
         "seqlens": [[5]], "directions": ["fwd"], "backends": ["reference"],
         "reference": {"impl": "chunked", "dtype": "fp64"}, "isolate": False,
         "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05}}
SAME = {"gpu_uuid": "GPU-1", "campaign_id": "c1"}


def _tree(d: Path) -> list:
    return sorted(p for p in d.rglob("*"))


def _one_error(r, *words) -> str:
    """Exit 2, stdout empty, one stderr line starting ``error: `` holding ``words``."""
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert not r.stdout.strip(), r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def world(tmp_path):
    """A results directory, a sweep YAML, a plain file and an existing directory."""
    d = S.write_run(tmp_path / "r", extra=SAME)
    cfg = tmp_path / "a.yaml"
    cfg.write_text(yaml.safe_dump(SWEEP))
    f = tmp_path / "a-file"
    f.write_text("x")
    (tmp_path / "a-dir").mkdir()
    return {"rows": d, "cfg": cfg, "file": f, "dir": tmp_path / "a-dir", "root": tmp_path}


#: every command with --out: its arguments before --out and the kind of path --out is
COMMANDS = {
    "run": (lambda w: ["run", str(w["cfg"]), "--no-plot"], "dir"),
    "merge": (lambda w: ["merge", str(w["rows"])], "dir"),
    "submit": (lambda w: ["submit", str(w["cfg"]), "--shards", "1", "--executor", "debug"], "dir"),
    "profile": (lambda w: ["profile", str(w["cfg"]), "--backend", "reference"], "dir"),
    "compare": (lambda w: ["compare", str(w["rows"]), str(w["rows"])], "file"),
    "recommend": (lambda w: ["recommend", str(w["rows"])], "file"),
    "report": (lambda w: ["report", str(w["rows"])], "dir"),
    "reproduce": (lambda w: ["reproduce", "--from", str(w["rows"])], "dir"),
}


def _commands_with_out() -> list[str]:
    """Every command of the CLI that takes --out (each needs an entry in COMMANDS)."""
    import typer.main
    cmd = typer.main.get_command(app)
    return sorted(n for n, c in cmd.commands.items() if any("--out" in p.opts for p in c.params))


@pytest.mark.parametrize("name", _commands_with_out())
@pytest.mark.parametrize("bad", ["wrong-kind", "under-a-file", "not-creatable"])
def test_a_bad_out_is_one_line_and_exit_2(world, name, bad):
    if bad == "not-creatable" and not Path("/proc/self").is_dir():
        pytest.skip("no procfs: no directory that cannot be made")
    args, kind = COMMANDS[name]
    out = {"wrong-kind": world["file"] if kind == "dir" else world["dir"],
           "under-a-file": world["file"] / "sub" / ("x.json" if kind == "file" else "x"),
           "not-creatable": Path("/proc/nope") / ("x.json" if kind == "file" else "x")}[bad]
    before = _tree(world["root"])
    r = CliRunner().invoke(app, [*args(world), "--out", str(out)])
    line = _one_error(r, f"--out {out}: ")
    assert {"wrong-kind": "is a file, not a directory" if kind == "dir" else "is a directory",
            "under-a-file": f"{world['file']} is a file, not a directory",
            "not-creatable": "cannot write in /proc"}[bad] in line
    assert _tree(world["root"]) == before


def test_check_out_accepts_what_can_be_written(tmp_path):
    assert paths.check_out(tmp_path / "new" / "deeper", "dir") == tmp_path / "new" / "deeper"
    assert paths.check_out(tmp_path / "new" / "t.json", "file") == tmp_path / "new" / "t.json"
    assert paths.check_out(tmp_path, "dir") == tmp_path
    assert list(tmp_path.iterdir()) == []  # the check leaves nothing behind


@pytest.mark.parametrize("name", ["report", "recommend", "compare"])
def test_an_oserror_while_writing_is_one_line_and_exit_2(world, monkeypatch, name):
    """A write that fails after the check (a disk full): one line naming the file, exit 2."""
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", "/x/index.html")
    target = {"report": ("qlabench.report.build", None),
              "recommend": ("qlabench.dispatch.recommend", None),
              "compare": ("qlabench.compare.compare_frames", None)}[name][0]
    monkeypatch.setattr(target, full)
    args, kind = COMMANDS[name]
    out = world["root"] / "out" / ("v.json" if kind == "file" else "site")
    r = CliRunner().invoke(app, [*args(world), "--out", str(out)])
    _one_error(r, "/x/index.html: No space left on device")


@pytest.mark.parametrize("args,named", [
    (["--alpha", "2"], "--alpha 2.0: must be in (0, 1)"),
    (["--alpha", "0"], "--alpha 0.0: must be in (0, 1)"),
    (["--threshold", "-1"], "--threshold -1.0: must be >= 0"),
    (["--direction", "up"], "--direction 'up': use one of fwd | bwd | fwdbwd"),
])
@pytest.mark.parametrize("view", ["summary", "recommend"])
def test_summary_and_recommend_check_their_options(world, view, args, named):
    out = world["root"] / "t.json"
    extra = ["--out", str(out)] if view == "recommend" else []
    _one_error(CliRunner().invoke(app, [view, str(world["rows"]), *args, *extra]), named)
    assert not out.exists()


# --------------------------------------------------------------------------- merge


def _sweep_dir(path: Path, sweep: str, run_id: str, **kw) -> Path:
    rows = S.make_rows(run_id, f"2025-01-0{run_id[7]}T00:00:00", config=f"configs/{sweep}.yaml",
                       **kw)
    return S.write_rows(path, rows, meta={"sweep": {"name": sweep}})


def test_merge_refuses_two_sweeps_unless_mix_sweeps(tmp_path):
    a = _sweep_dir(tmp_path / "a", "fwd", "20250101T000000-aaaaaa")
    b = _sweep_dir(tmp_path / "b", "bwd", "20250102T000000-bbbbbb", directions=("bwd",))
    m = tmp_path / "m"
    r = CliRunner().invoke(app, ["merge", str(a), str(b), "--out", str(m)])
    _one_error(r, "rows of 2 sweeps: 'bwd' (", "'fwd' (", "--mix-sweeps")
    assert not m.exists()
    r = CliRunner().invoke(app, ["merge", str(a), str(b), "--out", str(m), "--mix-sweeps"])
    assert r.exit_code == 0, r.output
    n = len(R.load(a))
    assert R.owners(m)["sweep"].value_counts().to_dict() == {"fwd": n, "bwd": n}
    # the --out's own rows count: a third sweep --force'd into it is refused too
    c = _sweep_dir(tmp_path / "c", "other", "20250103T000000-cccccc")
    r = CliRunner().invoke(app, ["merge", str(c), "--out", str(m), "--force"])
    _one_error(r, "rows of 3 sweeps", "--mix-sweeps")


def test_merge_refuses_two_timing_methods_and_takes_shards_of_one(tmp_path):
    a = _sweep_dir(tmp_path / "a", "fwd", "20250101T000000-aaaaaa")
    b = _sweep_dir(tmp_path / "b", "fwd", "20250102T000000-bbbbbb", timing_mode="graph-single")
    r = CliRunner().invoke(app, ["merge", str(a), str(b), "--out", str(tmp_path / "m")])
    _one_error(r, "rows timed 2 ways", "timing_mode=graph-batch, l2=warm (",
               "timing_mode=graph-single, l2=warm (", "--mix-sweeps")
    # an events fallback row among graph-batch rows sets no method of its own
    e = _sweep_dir(tmp_path / "e", "fwd", "20250103T000000-cccccc", timing_mode="events")
    r = CliRunner().invoke(app, ["merge", str(a), str(e), "--out", str(tmp_path / "m2")])
    assert r.exit_code == 0, r.output


def test_a_config_that_is_not_text_an_empty_backends_list_and_a_long_label(tmp_path):
    """A binary file as the config, ``--backends ,`` and a label too long to name a file: one
    line each, exit 2, nothing written."""
    binary = tmp_path / "rows.parquet"
    binary.write_bytes(b"PAR1\x15\x04\xff\xfe\x00\x80" * 20)
    for cmd in (["validate", str(binary)], ["list", str(binary)], ["run", str(binary), "--out", str(tmp_path / "o")]):
        _one_error(CliRunner().invoke(app, cmd), "not a text")
    cfg = tmp_path / "a.yaml"
    cfg.write_text(yaml.safe_dump(SWEEP))
    _one_error(CliRunner().invoke(app, ["run", str(cfg), "--backends", ",", "--out", str(tmp_path / "o")]),
               "--backends")
    assert not (tmp_path / "o").exists()
    cfg.write_text(yaml.safe_dump({**SWEEP, "backends": [{"name": "reference", "label": "r" * 300}]}))
    r = CliRunner().invoke(app, ["validate", str(cfg)])
    assert r.exit_code == 2 and "at most 100" in r.stderr, r.stderr


def test_rows_judged_under_other_limits_are_not_resumed_over(tmp_path):
    """A verdict is only as good as the limits it was judged under: a run (``--resume`` or not)
    into a directory whose rows were judged under other thresholds is refused, naming them."""
    out = tmp_path / "o"
    loose = tmp_path / "loose.yaml"
    loose.write_text(yaml.safe_dump({**SWEEP, "thresholds": {"o": 5.0}}))
    assert CliRunner().invoke(app, ["run", str(loose), "--out", str(out), "--no-plot"]).exit_code == 0
    cfg = tmp_path / "a.yaml"
    cfg.write_text(yaml.safe_dump(SWEEP))
    before = _tree(out)
    for extra in ([], ["--resume"], ["--resume", "--append-other"]):
        r = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out), "--no-plot", *extra])
        assert r.exit_code == 2 and "correctness limits" in r.stderr, (extra, r.stderr)
        assert _tree(out) == before


def test_direction_runs_one_of_the_configs_directions(tmp_path):
    """``run --direction bwd`` writes the config's backward rows only; a direction the config
    does not run is one line, exit 2, nothing written."""
    cfg = tmp_path / "a.yaml"
    cfg.write_text(yaml.safe_dump({**SWEEP, "directions": ["fwd", "bwd"]}))
    _one_error(CliRunner().invoke(app, ["run", str(cfg), "--direction", "fwdbwd", "--out", str(tmp_path / "x")]),
               "--direction", "fwd | bwd")
    assert not (tmp_path / "x").exists()
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["run", str(cfg), "--direction", "bwd", "--out", str(out), "--no-plot"])
    assert r.exit_code == 0, r.stderr
    assert set(R.load(out)["direction"]) == {"bwd"}
