"""tools/kernels/table_points.py: the points two cost tables plan differently, as runnable configs."""

import json

import yaml
from qlabench_kernels import calibration, plan
from qlabench_tools.kernels import table_points

from qlabench.config import load
from qlabench.sweep import points


def _write_table(path, **fwd):
    d = calibration.default_table().to_json()
    d["fwd"]["costs"].update(fwd)
    path.write_text(json.dumps(d))
    return path


def test_the_same_table_leaves_no_point(tmp_path, capsys):
    same = _write_table(tmp_path / "same.json")
    out = tmp_path / "out"
    assert table_points.main(["configs/h200_fwd_heldout.yaml", "--table", str(same), "--base", str(same),
                              "--sms", "132", "--out-dir", str(out)]) == 0
    assert "plans differ on 0 of 40 (model, layout) pairs" in capsys.readouterr().out
    assert not list(out.glob("*_tables_[0-9]*.yaml"))


def test_the_configs_hold_exactly_the_points_whose_plans_differ(tmp_path, capsys):
    dear = _write_table(tmp_path / "dear.json", fused=100.0, fused_few=100.0)  # never the fused kernel
    out = tmp_path / "out"
    assert table_points.main(["configs/h200_fwd.yaml", "--table", str(dear), "--sms", "132",
                              "--out-dir", str(out), "--label", "tl-dear"]) == 0
    base, table = calibration.default_table(), calibration.from_file(dear)
    want = set()
    for p in points(load("configs/h200_fwd.yaml")):
        a = plan.plan_fwd(sum(p.seqlens), len(p.seqlens), p.h_v, 132, seqlens=list(p.seqlens), h_qk=p.h_qk, costs=base.fwd)
        b = plan.plan_fwd(sum(p.seqlens), len(p.seqlens), p.h_v, 132, seqlens=list(p.seqlens), h_qk=p.h_qk, costs=table.fwd)
        if a != b:
            assert a[0] == 128 and b[0] == 64
            want.add((p.model, p.seqlens))
    assert want and f"plans differ on {len(want)} of 171 (model, layout) pairs" in capsys.readouterr().out
    got = set()
    files = sorted(out.glob("h200_fwd_tables_[0-9]*.yaml"))
    for f in files:
        sweep = load(f)  # each a valid config of one model, the sweep's name, both labels
        raw = yaml.safe_load(f.read_text())
        assert raw["name"] == "h200_fwd_tables" and len(sweep.resolved_models()) == 1
        assert [b if isinstance(b, str) else b["label"] for b in raw["backends"]] == ["tilelang", "tl-dear"]
        got |= {(p.model, p.seqlens) for p in points(sweep)}
    assert got == want
    recs = json.loads((out / "h200_fwd_tables_plans.json").read_text())
    assert len(recs) == 171 and sum(bool(r["differs"]) for r in recs) == len(want)


def test_a_table_that_cannot_be_read_exits_2(tmp_path, capsys):
    assert table_points.main(["configs/h200_fwd.yaml", "--table", str(tmp_path / "none.json"),
                              "--out-dir", str(tmp_path)]) == 2
    assert "none.json" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    d = calibration.default_table().to_json()
    del d["fwd"]["costs"]["fused"]
    bad.write_text(json.dumps(d))
    assert table_points.main(["configs/h200_fwd.yaml", "--table", str(bad), "--out-dir", str(tmp_path)]) == 2
    assert "fused" in capsys.readouterr().err


def test_fwdbwd_rows_differ_only_by_the_backward_plan_and_a_nameless_config_takes_its_stem(tmp_path, capsys):
    """Under fwdbwd the backend plans the forward with the GPU's table (only the backward's split
    follows the parameter): a table that changes only forward plans leaves no fwdbwd point."""
    cfg = tmp_path / "fb.yaml"
    raw = yaml.safe_load(open("configs/h200_fwd.yaml"))
    raw.pop("name")
    raw.update(directions=["fwd", "fwdbwd"], seqlens=[[8192] * 4, [2048] * 8])
    cfg.write_text(yaml.safe_dump(raw))
    dear = _write_table(tmp_path / "dear.json", fused=100.0, fused_few=100.0)
    assert table_points.main([str(cfg), "--table", str(dear), "--sms", "132", "--out-dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "fb_tables fwdbwd: plans differ on 0 of 18" in out and "fb_tables fwd: plans differ on 0 of 18" not in out
    for f in (tmp_path / "o").glob("fb_tables_[0-9]*.yaml"):
        assert yaml.safe_load(f.read_text())["directions"] == ["fwd"]
