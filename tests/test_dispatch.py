"""qlabench.dispatch: buckets where the winner changes, choose(), fallback, leave-one-out figures."""

from __future__ import annotations

import json
import math

import pytest
from test_summary import row, write
from typer.testing import CliRunner

from qlabench import dispatch, results
from qlabench.cli import app

LAYOUTS = [(1024,), (2048,), (1024, 1024), (2048, 512), (4096,), (8192,), (16384,), (4096, 4096)]


def rows_short_long(hq=4, hv=16, model="m 4/16", odd=None, base_index=0):
    """``short`` wins by 20% where max_len < 4096, ``long`` by 25% elsewhere; ``odd``: a layout
    where ``odd`` wins by 10% over ``long`` (no neighbour shares it)."""
    out = []
    for i, lay in enumerate(LAYOUTS + ([odd] if odd else [])):
        t = 1e-4 * sum(lay) + 0.01 * len(lay)
        short, long_ = (t, 1.2 * t) if max(lay) < 4096 else (1.25 * t, t)
        kw = dict(seqlens=lay, model=model, hq=hq, hv=hv, point_index=base_index + i, noise=0.001)
        out += [row("short", short, seed=3 * i, **kw), row("long", long_, seed=3 * i + 1, **kw)]
        if odd is not None and lay == odd:
            out.append(row("odd", long_ / 1.1, seed=3 * i + 2, **kw))
    return out


def table_of(tmp_path, rows, **kw):
    d = write(tmp_path / "r", rows)
    return dispatch.recommend(results.latest(results.load(d)), d, **kw), d


def test_bucket_sits_where_the_winner_changes(tmp_path):
    t, _ = table_of(tmp_path, rows_short_long())
    (h,) = t["head_configs"]
    assert (h["h_qk"], h["h_v"], h["points"]) == (4, 16, len(LAYOUTS))
    assert [b["choice"] for b in h["buckets"]] == ["short", "long"]
    assert h["buckets"][0]["bounds"]["max_len"] == [None, 2897]  # ceil(sqrt(2048 * 4096))
    assert h["buckets"][1]["bounds"]["max_len"] == [2897, None]
    b0 = h["buckets"][0]
    assert b0["margin"] == pytest.approx(1.2) and b0["runner_up"] == "long"
    assert b0["points"] == 4 and b0["winner_or_tie"] == 4
    ev = b0["evidence"][0]
    assert ev["winner"] == "short" and set(ev["latency_ms"]) == {"short", "long"}
    assert ev["point_key"].startswith("4/16/d128|")
    d = dispatch.Dispatch(t)
    assert d.choose(4, 16, [1000, 1500]).backend == "short"
    assert d.choose(4, 16, [3000]).backend == "long"
    c = d.choose(4, 16, [100])
    assert c.exact and c.bucket == 0 and "max_len < 2897" in c.reason and str(c) == "short"
    with pytest.raises(ValueError):
        d.choose(4, 16, [])


def test_held_out_all_right_when_the_rule_is_clean(tmp_path):
    t, _ = table_of(tmp_path, rows_short_long())
    ho = t["held_out"]
    assert ho["points"] == len(LAYOUTS) and ho["right"] == len(LAYOUTS)
    assert ho["accuracy"] == 1.0 and ho["geomean_regret"] == pytest.approx(1.0)
    assert ho["meets_goal"] and ho["misses"] == []


def test_held_out_counts_the_lone_odd_point_wrong(tmp_path):
    odd = (32768,)
    t, _ = table_of(tmp_path, rows_short_long(odd=odd))
    ho = t["held_out"]
    n = len(LAYOUTS) + 1
    assert ho["points"] == n and ho["right"] == n - 1
    assert ho["accuracy"] == pytest.approx((n - 1) / n)
    # held out, the odd layout gets `long` (its neighbours' winner): 10% slower than `odd`
    (m,) = ho["misses"]
    assert m["chosen"] == "long" and m["winner"] == "odd" and m["regret"] == pytest.approx(1.1)
    assert ho["geomean_regret"] == pytest.approx(math.exp(math.log(1.1) / n))
    assert ho["per_model"][0]["model"] == "m 4/16" and ho["per_model"][0]["right"] == n - 1


def test_held_out_point_is_left_out_of_the_table_that_judges_it(tmp_path):
    """Three points, one bucket (too few to split). `a` wins the first two by 10%, `b` the third
    by 50%: with every point the bucket picks `b`; without the third (held out) it picks `a`, so
    held out every point gets the other label: none right."""
    lat = {(1024,): (1.0, 1.1), (2048,): (1.0, 1.1), (4096,): (1.5, 1.0)}
    rows = []
    for i, (lay, (a, b)) in enumerate(lat.items()):
        kw = dict(seqlens=lay, model="m 4/16", hq=4, hv=16, point_index=i, noise=0.001)
        rows += [row("a", a, seed=2 * i, **kw), row("b", b, seed=2 * i + 1, **kw)]
    t, _ = table_of(tmp_path, rows)
    assert [b["choice"] for b in t["buckets"]] == ["b"] and t["buckets"][0]["winner_or_tie"] == 1
    ho = t["held_out"]
    assert ho["points"] == 3 and ho["right"] == 0 and ho["accuracy"] == 0.0
    got = {m["layout"]: (m["chosen"], m["winner"], round(m["regret"], 6)) for m in ho["misses"]}
    assert got == {"1x1024": ("b", "a", 1.1), "1x2048": ("b", "a", 1.1), "1x4096": ("a", "b", 1.5)}


def test_tie_counts_as_right_in_held_out(tmp_path):
    rows = rows_short_long()
    # on one short-side point `long` wins, but only by 0.3%: held out, that point gets `short`
    # (its neighbours' choice), not the winner, yet within the noise of it -> right
    for r in rows:
        if r["seqlens"] == [1024, 1024] and r["backend"] == "long":
            s = [x / 1.2 * 0.997 for x in r["samples_ms"]]
            r.update(samples_ms=s, latency_ms=sorted(s)[len(s) // 2])
    t, _ = table_of(tmp_path, rows)
    ev = {tuple(e["seqlens"]): e for b in t["buckets"] for e in b["evidence"]}
    assert ev[(1024, 1024)]["winner"] == "long"
    assert t["held_out"]["right"] == len(LAYOUTS) and t["held_out"]["misses"] == []


def test_unseen_head_config_falls_back_with_a_reason(tmp_path):
    rows = rows_short_long() + rows_short_long(hq=16, hv=16, model="m 16/16", base_index=50)
    t, _ = table_of(tmp_path, rows)
    d = dispatch.Dispatch(t)
    assert d.nearest(8, 32) == (4, 16) and d.nearest(16, 24) == (16, 16)
    c = d.choose(8, 32, [1024])
    assert c.backend == "short" and not c.exact and "8/32 was not measured" in c.reason
    assert "nearest measured: 4/16" in c.reason
    c = d.choose(8, 32, [1024], fallback=False)
    assert c.backend is None and "fallback off" in c.reason


def test_cli_recommend_writes_a_loadable_table(tmp_path):
    d = write(tmp_path / "r", rows_short_long())
    out = tmp_path / "o" / "dispatch.json"
    r = CliRunner().invoke(app, ["recommend", str(d), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "8/8 = 100.0% winner or tie" in r.output and "geomean regret 1.0000" in r.output
    data = json.loads(out.read_text())
    assert data["format"] == "qlabench-dispatch" and data["version"] == 1
    assert data["direction"] == "fwd" and data["source"]["dir"] == str(d)
    assert data["source"]["run_ids"] == ["20260101T000000-aaaaaa"]
    assert data["source"]["gpus"] == ["NVIDIA H200"]
    assert data["held_out"]["accuracy"] == 1.0
    tab = dispatch.load(out)
    assert tab.choose(4, 16, [512, 512]).backend == "short"
    assert tab.choose(4, 16, [8192, 8192]).backend == "long"
    r = CliRunner().invoke(app, ["recommend", str(d), "--out", str(out), "--backends", "long"])
    assert r.exit_code == 0 and dispatch.load(out).choose(4, 16, [512]).backend == "long"
    r = CliRunner().invoke(app, ["recommend", str(d), "--out", str(out), "--backends", "nope"])
    assert r.exit_code == 2 and "not in" in r.output


def test_cli_recommend_bad_input(tmp_path):
    bad = write(tmp_path / "bad", [row("fla", None, status="incorrect"),
                                   row("tilelang", None, status="crashed")])
    r = CliRunner().invoke(app, ["recommend", str(bad), "--out", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "no ok fwd rows" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.json").exists()
    (tmp_path / "empty" / "parts").mkdir(parents=True)
    r = CliRunner().invoke(app, ["recommend", str(tmp_path / "empty"), "--out", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "no result rows" in r.output


def test_load_refuses_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"format": "something", "version": 1}))
    with pytest.raises(ValueError, match="not a qlabench-dispatch version 1 table"):
        dispatch.load(p)
