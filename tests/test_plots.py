"""Figures: each gate recipe drawn apart, the one layout order, speedup whiskers, the winner map,
readable sizes, and figures kept out of the rows' folder."""

import numpy as np
import pandas as pd
import synth_results as S
from matplotlib.figure import Figure
from PIL import Image

from qlabench import analysis, plots, results


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
    assert {"winner_fwd.png", "latency_fwd.png", "speedup_fwd.png", "roofline_fwd.png"} <= names
    assert analysis.recipe_name("zero0.25/seed0") == "published"


def test_layout_order_is_sequences_then_tokens_then_lengths():
    lens = [[4096, 28672], [32768], [1024] * 8, [28672, 4096], [2048], [4096, 4096], [8192] * 4]
    df = pd.DataFrame({"layout": [S.layout_label(x) for x in lens], "seqlens": lens,
                       "num_seqs": [len(x) for x in lens], "total_tokens": [sum(x) for x in lens]})
    want = [[2048], [32768], [4096, 4096], [4096, 28672], [28672, 4096], [8192] * 4, [1024] * 8]
    assert analysis.layout_order(df) == [S.layout_label(x) for x in want]
    assert list(plots.sort_layouts(df, by_model=False)["layout"]) == analysis.layout_order(df)


def test_speedup_whiskers_take_both_rows_spread(tmp_path):
    lat = results.latest(results.load(S.write_run(tmp_path / "r")))
    sp = plots.speedup_table(lat, "fla", "fwd")
    ok = lat.set_index(["point_key", "backend"])
    r = sp.iloc[0]
    b, o = ok.loc[(r["point_key"], "fla")], ok.loc[(r["point_key"], r["backend"])]
    assert np.isclose(r["speedup_lo"], b["p10_ms"] / o["p90_ms"])
    assert np.isclose(r["speedup_hi"], b["p90_ms"] / o["p10_ms"])
    assert (sp["speedup_lo"] <= sp["speedup"]).all() and (sp["speedup"] <= sp["speedup_hi"]).all()


def test_figures_are_readable_and_beside_the_rows_not_in_them(tmp_path):
    """Many layouts and labels: every figure fits MAX_WIDTH_PX at >= MIN_FONT_PT; figures go to
    _figures/, so pd.read_parquet of the results directory reads rows only."""
    lays = [[n] for n in (2048, 4096, 8192, 16384, 32768)] + [[a, 32768 - a] for a in
                                                              (4096, 8192, 16384, 24576)]
    lays += [[8192] * 4, [4096] * 8, [1024] * 8, [2048] * 4]
    d = S.write_run(tmp_path / "r", directions=("fwd", "bwd"), layouts=lays,
                    backends=("fla", "flashinfer", "flashinfer@0.7.4", "flashqla", "tilelang"),
                    models=[*S.MODELS, ("35B TP1", 16, 32), ("9B TP1", 16, 64), ("4B", 8, 16)])
    lat = results.latest(results.load(d))
    made = plots.run_figures(lat, d)
    assert {p.parent for p in made} == {d / plots.FIGURES_DIR}
    assert {p.name for p in made} >= {"winner_fwd.png", "speedup_fwd.png", "winner_bwd.png",
                                      "speedup_bwd.png", "latency_vs_tokens_bwd.png"}
    for p in made:
        with Image.open(p) as im:
            assert im.size[0] <= plots.MAX_WIDTH_PX, (p.name, im.size)
            assert float(im.text[plots.META_MIN_FONT]) >= plots.MIN_FONT_PT, p.name
    # pyarrow's dataset discovery (pd.read_parquet(d)) skips names starting with "_"
    assert all(p.relative_to(d).parts[0].startswith("_") for p in made)
    w = analysis.Analysis(lat).points("fwd")
    assert len(w) == 5 * 13 and set(w["winner"]) == {"flashqla"}  # 0.7x FLA; others 1x or 0.8x
    assert list(w[w["model"] == S.MODELS[0][0]]["layout"]) == analysis.layout_order(lat)


def test_each_figure_is_drawn_once_with_the_pixels_savefig_writes(tmp_path, monkeypatch):
    """Every figure is drawn once, its constrained layout included (savefig with a layout engine
    draws a figure twice: once to lay it out, once to render it); the PNG holds the pixels and
    the size savefig writes for that figure."""
    lat = results.latest(results.load(S.write_run(tmp_path / "r", directions=("fwd", "bwd"))))
    draw = Figure.draw
    drawn = []

    def counted(self, renderer):
        drawn.append(self)
        return draw(self, renderer)
    monkeypatch.setattr(Figure, "draw", counted)
    made = plots.run_figures(lat, tmp_path / "figs")
    assert len(made) >= 8 and len(drawn) == len(made)
    monkeypatch.undo()
    kept = []
    monkeypatch.setattr(plots.plt, "close", kept.append)  # keep the figure _save wrote
    p = plots.latency_figure(lat, tmp_path / "one.png", "fwd")
    kept[0].savefig(tmp_path / "savefig.png", dpi=plots.DPI)
    with Image.open(p) as a, Image.open(tmp_path / "savefig.png") as b:
        assert a.size == b.size
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_long_layout_reads_as_count_and_mean_on_every_axis(tmp_path, monkeypatch, recwarn):
    """A batch of 64 sequences (a ~300-character label) gets the terminal tables' short label
    (``64x~242``) as its tick label, and the figure is laid out (no constrained-layout warning)."""
    rng = np.random.default_rng(3)
    many = [int(x) for x in rng.integers(1, 512, 64)]
    lat = results.latest(results.load(S.write_run(tmp_path / "r", layouts=[[8192], many])))
    long = S.layout_label(many)
    assert len(long) > 200
    short = f"64x~{round(sum(many) / 64)}"
    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    for draw in (plots.latency_figure, plots.speedup_figure, plots.winner_map, plots.speedup_heatmap):
        draw(lat, tmp_path / f"{draw.__name__}.png", direction="fwd")
    assert len(figs) == 4
    for fig in figs:
        ticks = [t.get_text() for ax in fig.axes for t in (*ax.get_xticklabels(), *ax.get_yticklabels())]
        assert short in ticks and "1x8192" in ticks, ticks
        assert max(len(t) for t in ticks if "x" in t) <= len(short) and long not in ticks
    assert not [w for w in recwarn if "constrained_layout not applied" in str(w.message)]
