import textwrap

import pytest
from typer.testing import CliRunner

from qlabench import config as C
from qlabench.cli import app

GOOD = """
name: t
models: [{name: m, h_qk: 2, h_v: 8}]
seqlens: [[64]]
backends: [reference]
"""


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_good_config_parses(tmp_path):
    s = C.load(_write(tmp_path, GOOD))
    assert s.resolved_models()[0].h_v == 8
    assert s.resolved_layouts() == [[64]]


@pytest.mark.parametrize("text,needle", [
    (GOOD + "bogus: 1\n", "bogus"),
    (GOOD.replace("[[64]]", "[[64, -5]]"), "seqlens[0][1]"),
    (GOOD.replace("h_v: 8", "h_v: 7"), "h_v=7 is not a multiple of h_qk=2"),
    (GOOD.replace("[reference]", "[reference, nope]"), "unknown backend 'nope'"),
    (GOOD.replace("[[64]]", "[{count: 0, length: 8}]"), "count"),
    (GOOD + "timing: {mode: fast}\n", "timing.mode"),
    (GOOD.replace("models: [{name: m, h_qk: 2, h_v: 8}]", "models: [Qwen99]"), "Qwen99"),
    (GOOD + "thresholds: {o: -1}\n", "thresholds.o"),
    (GOOD + "thresholds: {o: .nan}\n", "thresholds.o"),
    (GOOD + "directions: [fwd, fwd]\n", "duplicate directions"),
    (GOOD + "out: 'runs/{nme}'\n", "placeholder"),
    (GOOD.replace("models: [{name: m, h_qk: 2, h_v: 8}]", "models: [qwen-fwd, '27B TP2']"),
     "appears twice"),
    (GOOD + "gate: {recipe: steep}\n", "unknown gate recipe"),
    (GOOD + "gate: {recipe: strong-decay, min_log_gate: 0.5}\n", "gate[0].min_log_gate"),
    (GOOD + "gate: {recipe: model, dt_range: [0.1, 0.001]}\n", "dt_range"),
    (GOOD + "gate: [{recipe: model}, {recipe: model}]\n", "a recipe appears twice"),
])
def test_bad_config_names_field(tmp_path, text, needle):
    p = _write(tmp_path, text)
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    msg = str(e.value)
    assert str(p) in msg and needle in msg


@pytest.mark.parametrize("text", [GOOD + "bogus: 1\n", GOOD.replace("h_v: 8", "h_v: 7"),
                                  "models: [\n", "",
                                  GOOD + "gate: {recipe: strong-decay, min_log_gate: 1}\n",
                                  GOOD + "gate: {recipe: nope}\n"])
def test_cli_bad_config_exits_2_and_writes_nothing(tmp_path, text):
    p = _write(tmp_path, text)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["run", str(p), "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert not out.exists()


def test_cli_unknown_backend_flag(tmp_path):
    r = CliRunner().invoke(app, ["run", str(_write(tmp_path, GOOD)), "--backends", "zzz",
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "zzz" in r.output


def test_missing_file_exits_2(tmp_path):
    r = CliRunner().invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 2 and "no such config file" in r.output


def test_presets_and_sets():
    s = C.parse({"name": "x", "models": ["qwen-fwd", "35B/9B/4B TP2"], "seqlens": [[8]]})
    ms = s.resolved_models()
    assert len(ms) == 10 and (ms[-1].h_qk, ms[-1].h_v) == (8, 16)


@pytest.mark.parametrize("bad,line", [
    ({"seqlens": [{"count": 0, "length": 64}]}, "seqlens[0].count: Input should be greater than 0"),
    ({"seqlens": [[-5]]}, "seqlens[0][0]: Input should be greater than 0"),
    ({"models": [{"name": "m", "h_qk": 2, "h_v": 3, "head_dim": 8}]}, "models[0]: h_v=3 is not a multiple of h_qk=2")])
def test_a_bad_value_in_a_union_field_is_one_problem(bad, line):
    """A layout or model entry that fits no form of its field is reported against the form it
    comes closest to, not every form's complaints."""
    base = {"name": "a", "models": [{"name": "m", "h_qk": 1, "h_v": 2, "head_dim": 8}], "seqlens": [[5]]}
    with pytest.raises(C.ConfigError) as e:
        C.parse({**base, **bad})
    lines = str(e.value).splitlines()
    assert lines[0].endswith("(1 problem(s))") and len(lines) == 2 and lines[1].strip().startswith(line), lines
