"""Figures from rows of several gate recipes in one results directory draw each recipe apart."""

import synth_results as S

from qlabench import plots, results


def test_recipes_are_drawn_apart(tmp_path):
    d = tmp_path / "r"
    S.write_run(d)
    rows = S.make_rows("r2", "2025-01-02T00:00:00", seed=1, scale={"fla": 2.0})
    for r in rows:  # the same shapes under another recipe: other keys, side by side
        r.update(point_key=r["point_key"] + "|gate=strong-decay",
                 gate_recipe="strong-decay:floor=1e-06/seed0")
    S.write_rows(d, rows)
    lat = results.latest(results.load(d))
    assert len(lat) == 48
    sp = plots.speedup_table(lat, "fla", "fwd")
    assert len(sp) == 32
    models = set(sp["model"])
    assert {m.rsplit(" [", 1)[1] for m in models} == {"published]", "strong-decay]"}
    by = sp.assign(k=sp["point_key"].str.replace("|gate=strong-decay", ""),
                   strong=sp["point_key"].str.endswith("strong-decay"))
    wide = by.pivot_table(index=["k", "backend"], columns="strong", values="speedup")
    assert len(wide) == 16 and ((wide[True] / wide[False]).between(1.9, 2.1)).all()  # FLA 2x slower
    names = {p.name for p in plots.run_figures(lat, tmp_path / "figs")}
    assert {"latency_fwd.png", "speedup_fwd.png", "roofline_fwd.png"} <= names
    assert plots.recipe_name("zero0.25/seed0") == "published"
