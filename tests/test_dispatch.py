"""qlabench.dispatch: buckets where the winner changes, choose() and its input checks, buckets
without a point, the fallback, the kernel call, held-out figures (both ways) and their leaks."""

from __future__ import annotations

import json
import math
from pathlib import Path

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
    ho = t["held_out"]["leave_one_layout_out"]
    assert ho["points"] == len(LAYOUTS) and ho["right"] == len(LAYOUTS)
    assert ho["accuracy"] == 1.0 and ho["geomean_regret"] == pytest.approx(1.0)
    assert ho["meets_goal"] and ho["misses"] == []


def test_held_out_counts_the_lone_odd_point_wrong(tmp_path):
    odd = (65536,)
    t, _ = table_of(tmp_path, rows_short_long(odd=odd))
    ho = t["held_out"]["leave_one_layout_out"]
    n = len(LAYOUTS) + 1
    assert ho["points"] == n and ho["right"] == n - 1
    assert ho["accuracy"] == pytest.approx((n - 1) / n)
    # held out, the odd layout gets `long` (its neighbours' winner): 10% slower than `odd`
    (m,) = ho["misses"]
    assert m["chosen"] == "long" and m["winner"] == "odd" and m["regret"] == pytest.approx(1.1)
    assert ho["geomean_regret"] == pytest.approx(math.exp(math.log(1.1) / n))
    assert ho["per_model"][0]["model"] == "m 4/16" and ho["per_model"][0]["right"] == n - 1


def test_held_out_point_is_left_out_of_the_table_that_judges_it(tmp_path):
    """Three points. `a` wins the two short ones by 10%, `b` the long one by 50%: with every point
    the tree splits between them and each gets its winner. Held out, the long point is judged by
    a table of the two short ones only (all `a`): wrong, 1.5x; the short ones are still right."""
    lat = {(1024,): (1.0, 1.1), (1536,): (1.0, 1.1), (4096,): (1.5, 1.0)}
    rows = []
    for i, (lay, (a, b)) in enumerate(lat.items()):
        kw = dict(seqlens=lay, model="m 4/16", hq=4, hv=16, point_index=i, noise=0.001)
        rows += [row("a", a, seed=2 * i, **kw), row("b", b, seed=2 * i + 1, **kw)]
    t, _ = table_of(tmp_path, rows)
    assert [b["choice"] for b in t["buckets"]] == ["a", "b"]
    assert [b["winner_or_tie"] for b in t["buckets"]] == [2, 1]
    ho = t["held_out"]["leave_one_layout_out"]
    assert ho["points"] == 3 and ho["right"] == 2 and ho["accuracy"] == pytest.approx(2 / 3)
    (m,) = ho["misses"]
    assert (m["layout"], m["chosen"], m["winner"]) == ("1x4096", "a", "b")
    assert m["regret"] == pytest.approx(1.5)


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
    ho = t["held_out"]["leave_one_layout_out"]
    assert ho["right"] == len(LAYOUTS) and ho["misses"] == []


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
    assert data["format"] == "qlabench-dispatch" and data["version"] == 2
    assert data["direction"] == "fwd" and data["source"]["dir"] == str(d)
    assert data["source"]["run_ids"] == ["20260101T000000-aaaaaa"]
    assert data["source"]["gpus"] == ["NVIDIA H200"]
    assert data["held_out"]["leave_one_layout_out"]["accuracy"] == 1.0
    assert data["source"]["sm_count"] is None  # no run metadata: features per GPU
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
    with pytest.raises(ValueError, match="not a qlabench-dispatch version 2 table"):
        dispatch.load(p)


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("hq, hv, seqlens, named", [
    (3, 8, [1024], "h_v=8 is not a multiple of h_qk=3"),
    (0, 8, [1024], "h_qk=0"),
    (4, -16, [1024], "h_v=-16"),
    (2.5, 5, [1024], "h_qk=2.5"),
    ("4", 16, [1024], "h_qk='4'"),
    (True, 16, [1024], "h_qk=True"),
    (4, 16, [], "seqlens=[]"),
    (4, 16, [1024, 0], "length 0"),
    (4, 16, [-5], "length -5"),
    (4, 16, [1.5], "length 1.5"),
])
def test_choose_rejects_an_impossible_head_config_or_batch(tmp_path, hq, hv, seqlens, named):
    d = dispatch.Dispatch(table_of(tmp_path, rows_short_long())[0])
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        d.choose(hq, hv, seqlens)


def test_cli_choose_answers_and_refuses_bad_input(tmp_path):
    d = write(tmp_path / "r", rows_short_long())
    out = tmp_path / "dispatch.json"
    assert CliRunner().invoke(app, ["recommend", str(d), "--out", str(out)]).exit_code == 0
    r = CliRunner().invoke(app, ["choose", str(out), "--heads", "4/16", "--seqlens", "512,512"])
    assert r.exit_code == 0 and r.output.splitlines()[0] == "short" and "bucket 0" in r.output
    r = CliRunner().invoke(app, ["choose", str(out), "--heads", "3/8", "--seqlens", "512"])
    assert r.exit_code == 2 and "h_v=8 is not a multiple of h_qk=3" in r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, ["choose", str(out), "--heads", "4/16", "--seqlens", "512,0"])
    assert r.exit_code == 2 and "length 0" in r.output
    r = CliRunner().invoke(app, ["choose", str(out), "--heads", "4-16", "--seqlens", "512"])
    assert r.exit_code == 2 and "--heads '4-16'" in r.output
    r = CliRunner().invoke(app, ["choose", str(tmp_path / "nope.json"), "--heads", "4/16",
                                 "--seqlens", "512"])
    assert r.exit_code == 2 and "no such file" in r.output
    r = CliRunner().invoke(app, ["choose", str(out), "--heads", "8/32", "--seqlens", "512",
                                 "--no-fallback"])
    assert r.exit_code == 1 and r.output.splitlines()[0] == "none" and "fallback off" in r.output
    # a table that is a directory, not JSON, JSON of another shape; an empty --seqlens item
    good = json.loads(out.read_text())
    cases = {"a-dir": None, "text.json": "not json", "list.json": json.dumps([1, 2]),
             "no-tree.json": json.dumps({k: v for k, v in good.items() if k != "tree"}),
             "bad-heads.json": json.dumps({**good, "head_configs": [{"h_qk": 4}]})}
    named = {"a-dir": "Is a directory", "text.json": "Expecting value",
             "list.json": "the JSON holds a list, not an object",
             "no-tree.json": "without a tree.nodes list", "bad-heads.json": "head_configs: "}
    for name, text in cases.items():
        p = tmp_path / name
        p.mkdir() if text is None else p.write_text(text)
        r = CliRunner().invoke(app, ["choose", str(p), "--heads", "4/16", "--seqlens", "512"])
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and not r.stdout and len(lines) == 1, (name, r.output)
        assert lines[0].startswith(f"error: {p}: ") and named[name] in lines[0], (name, lines)
    for bad in ("4096,,", ",512", "512, ,512"):
        r = CliRunner().invoke(app, ["choose", str(out), "--heads", "4/16", "--seqlens", bad])
        assert r.exit_code == 2 and f"--seqlens {bad!r}: an empty item" in r.stderr, r.output


# --------------------------------------------------------------------------- buckets without a point


def test_a_bucket_without_a_point_of_the_head_config_names_no_choice(tmp_path):
    """4/16 measured at every layout, 16/16 at the short ones only: the long bucket holds no
    16/16 point, so 16/16's entry names no choice; choose() says so and answers from the bucket
    over all head configs (the 4/16 points), or gives None without the fallback."""
    short = [r for r in rows_short_long(hq=16, hv=16, model="m 16/16", base_index=50)
             if max(r["seqlens"]) < 4096]
    t, _ = table_of(tmp_path, rows_short_long() + short)
    h = {(x["h_qk"], x["h_v"]): x for x in t["head_configs"]}[(16, 16)]
    long_b = [b for b in h["buckets"] if b["points"] == 0]
    assert long_b and all(b["choice"] is None and b["fallback"] == "long" for b in long_b)
    assert all("no 16/16 point measured" in b["reason"] for b in long_b)
    d = dispatch.Dispatch(t)
    c = d.choose(16, 16, [8192])
    assert c.backend == "long" and not c.exact
    assert "16/16 has no measured point in bucket" in c.reason and "over all head configs" in c.reason
    c = d.choose(16, 16, [8192], fallback=False)
    assert c.backend is None and "fallback off" in c.reason
    assert d.choose(16, 16, [1024]).exact and d.choose(4, 16, [8192]).exact


def test_a_bucket_without_any_point_falls_back_to_its_parent_node(tmp_path):
    t, _ = table_of(tmp_path, rows_short_long())
    root = t["tree"]["nodes"][0]
    assert root["choice"] in ("short", "long") and "feature" in root
    for b in t["buckets"]:  # the long bucket as a table would hold it without points
        if b["choice"] == "long":
            b.update(choice=None, points=0, evidence=[], head_configs=[])
            t["tree"]["nodes"][b["node"]]["choice"] = None
    for h in t["head_configs"]:
        for b in h["buckets"]:
            if b["choice"] == "long":
                b.update(choice=None, points=0, evidence=[])
    d = dispatch.Dispatch(t)
    c = d.choose(4, 16, [8192])
    assert c.backend == root["choice"] and not c.exact
    assert "has no measured point: answered from its parent node 0" in c.reason
    assert d.choose(4, 16, [8192], fallback=False).backend is None


# --------------------------------------------------------------------------- the kernel


def ref_vs_tilelang(hq=4, hv=16):
    """`reference` wins the short layouts, `tilelang` the long ones."""
    return [dict(r, backend={"short": "reference", "long": "tilelang"}[r["backend"]],
                 backend_name={"short": "reference", "long": "tilelang"}[r["backend"]])
            for r in rows_short_long(hq, hv)]


def test_kernel_calls_the_chosen_backend_with_the_canonical_signature(tmp_path):
    import torch

    from qlabench.backends.reference import gdn_chunked
    from qlabench.sweep import Point
    from qlabench.workloads import make

    t, _ = table_of(tmp_path, ref_vs_tilelang())
    d = dispatch.Dispatch(t)
    cu = torch.tensor([0, 64, 160], dtype=torch.int64)
    k = d.kernel(4, 16, cu)
    assert k.label == "reference" and k.choice.backend == "reference" and k.choice.exact
    x = make(Point(model="m", h_qk=4, h_v=16, head_dim=32, seqlens=(64, 96), dtype="fp32",
                   gate_zero_frac=0.0, gate_seed=0, seed=1))
    o, ht = k(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0)
    o_ref, ht_ref = gdn_chunked(x.q, x.k, x.v, x.g, x.beta, 32 ** -0.5, x.h0, x.cu_seqlens)
    assert o.shape == (1, 160, 16, 32) and ht.shape == (2, 16, 32, 32)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    o2, none = k(x.q, x.k, x.v, x.g, x.beta, scale=0.5, initial_state=x.h0,
                 output_final_state=False, cu_seqlens=[0, 64, 160])
    assert none is None and torch.equal(o2, gdn_chunked(x.q, x.k, x.v, x.g, x.beta, 0.5, x.h0,
                                                        x.cu_seqlens)[0])
    with pytest.raises(ValueError, match="chosen for \\[64, 96\\]"):
        k(x.q, x.k, x.v, x.g, x.beta, cu_seqlens=[0, 96, 160])
    with pytest.raises(ValueError, match="q has shape"):
        k(x.q[:, :100], x.k, x.v, x.g, x.beta)
    with pytest.raises(ValueError, match="h_v=16 is not a multiple of h_qk=3"):
        d.kernel(3, 16, cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        d.kernel(4, 16, [0, 64, 64])
    if not torch.cuda.is_available():  # the long batch's choice needs a GPU: said, not crashed
        with pytest.raises(dispatch.BackendUnavailable, match="tilelang .*no CUDA device"):
            d.kernel(4, 16, [0, 8192])


def test_kernel_of_a_versioned_label_refuses_another_imported_version():
    """A table's ``flashinfer@0.7.4`` must not hand an engine the FlashInfer this environment
    imports when that is another version: the label's ``@version`` is checked, as the harness does."""
    from qlabench.backends import get

    have = get("reference").version()
    with pytest.raises(dispatch.BackendUnavailable, match="asks for version 9.9"):
        dispatch.kernel_of("reference@9.9", 2, 4, [0, 64], name="reference")
    assert dispatch.kernel_of(f"reference@{have}", 2, 4, [0, 64], name="reference").label == f"reference@{have}"


# --------------------------------------------------------------------------- held out


def two_heads(a_on_b: bool = True):
    """4/16: `a` 1.0, `b` 1.1 (a wins); 16/16 (same layouts): `b` 1.0, `a` 1.5 (b wins);
    ``a_on_b`` False: 16/16 has no `a` row and a `c` row at 1.3 instead."""
    out = []
    for i, lay in enumerate(LAYOUTS):
        kw = dict(seqlens=lay, model="m 4/16", hq=4, hv=16, point_index=i, noise=0.001)
        out += [row("a", 1.0, seed=4 * i, **kw), row("b", 1.1, seed=4 * i + 1, **kw)]
        kw = dict(seqlens=lay, model="m 16/16", hq=16, hv=16, point_index=50 + i, noise=0.001)
        out += [row("b", 1.0, seed=4 * i + 2, **kw),
                row("a" if a_on_b else "c", 1.5 if a_on_b else 1.3, seed=4 * i + 3, **kw)]
    return out


def test_leave_one_head_config_out_judges_each_with_a_table_built_without_it(tmp_path):
    """Leaving a layout out keeps the other layouts of its head config: every point right. Leaving
    the head config out leaves only the other one, whose winner is wrong here: every point
    wrong; a leak of any of its rows would make some right."""
    t, _ = table_of(tmp_path, two_heads())
    lolo, loho = t["held_out"]["leave_one_layout_out"], t["held_out"]["leave_one_head_config_out"]
    n = 2 * len(LAYOUTS)
    assert lolo["points"] == n and lolo["right"] == n and lolo["geomean_regret"] == pytest.approx(1.0)
    assert loho["points"] == n and loho["right"] == 0 and loho["accuracy"] == 0.0
    assert {(m["h_qk"], m["chosen"], round(m["regret"], 6)) for m in loho["misses"]} == \
        {(4, "b", 1.1), (16, "a", 1.5)}
    assert loho["geomean_regret"] == pytest.approx(math.sqrt(1.1 * 1.5))
    assert loho["max_regret"] == pytest.approx(1.5) and not loho["meets_goal"]
    assert {m["model"]: m["right"] for m in loho["per_model"]} == {"m 4/16": 0, "m 16/16": 0}


def test_a_choice_without_a_row_at_the_point_is_wrong_at_the_slowest_latency(tmp_path):
    t, _ = table_of(tmp_path, two_heads(a_on_b=False))
    loho = t["held_out"]["leave_one_head_config_out"]
    # 4/16 judged by 16/16 alone: `b`, while `a` wins 4/16 by 10% -> wrong, 1.1;
    # 16/16 judged by 4/16 alone: `a`, which has no row on 16/16 -> wrong at its slowest, c 1.3
    got = {(m["h_qk"], m["chosen"], round(m["regret"], 6)) for m in loho["misses"]}
    assert got == {(4, "b", 1.1), (16, "a", 1.3)} and loho["right"] == 0
    assert loho["geomean_regret"] == pytest.approx(math.sqrt(1.1 * 1.3))


@pytest.mark.parametrize("mode", ["layout", "head_config"])
def test_held_out_tables_never_see_the_held_out_rows(tmp_path, monkeypatch, mode):
    """Every table the held-out loop builds (its cross-validation included: it runs inside fit on
    the rows fit was given) lacks the rows it is then asked about."""
    d = write(tmp_path / "r", two_heads() + rows_short_long(hq=8, hv=32, model="m 8/32",
                                                            base_index=100))
    pts = dispatch.points_of(results.latest(results.load(d)))
    every = {(p["point_key"], p["model"]) for p in pts}
    seen, real = [], dispatch.fit

    def spy(train, *a, **kw):
        seen.append({(p["point_key"], p["model"]) for p in train})
        return real(train, *a, **kw)

    monkeypatch.setattr(dispatch, "fit", spy)
    ho = dispatch.held_out(pts, mode)
    assert ho["points"] == len(pts)
    left_out = [every - s for s in seen]
    if mode == "layout":
        assert sorted(len(x) for x in left_out) == [1] * len(pts)
        assert set().union(*left_out) == every
    else:
        heads = {(p["point_key"], p["model"]): (p["h_qk"], p["h_v"]) for p in pts}
        assert len(left_out) == 3
        for x in left_out:
            (h,) = {heads[k] for k in x}
            assert x == {k for k, v in heads.items() if v == h}
            assert not any(heads[k] == h for k in every - x)


def test_a_rule_in_work_per_sm_carries_to_an_unmeasured_head_config(tmp_path):
    """`small` wins below 2^18 token-heads (total_tokens x h_v), `big` above: one threshold in
    tokens_per_sm. Built without 8/32, the table chooses right for 8/32 at every length."""
    rows, lens = [], [1024 * 2 ** i for i in range(6)]
    for j, (hq, hv) in enumerate([(2, 8), (4, 16), (16, 64)]):
        for i, n in enumerate(lens):
            small = n * hv < 2 ** 18
            kw = dict(seqlens=(n,), model=f"m {hq}/{hv}", hq=hq, hv=hv, point_index=10 * j + i,
                      noise=0.001)
            rows += [row("small", 1.0 if small else 1.3, seed=20 * j + 2 * i, **kw),
                     row("big", 1.3 if small else 1.0, seed=20 * j + 2 * i + 1, **kw)]
    d = dispatch.Dispatch(table_of(tmp_path, rows)[0])
    got = [d.choose(8, 32, [n]).backend for n in lens]
    assert got == ["small" if n * 32 < 2 ** 18 else "big" for n in lens]


# --------------------------------------------------------------------------- the command's sources


def test_sm_count_comes_from_the_run_metadata(tmp_path):
    d = write(tmp_path / "r", rows_short_long())
    results.ResultStore(d).write_meta("20260101T000000-aaaaaa", {"env": {"sm_count": 132}})
    out = tmp_path / "d.json"
    r = CliRunner().invoke(app, ["recommend", str(d), "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["source"]["sm_count"] == 132
    (p,) = [e for b in data["buckets"] for e in b["evidence"] if e["seqlens"] == [1024]]
    assert dispatch.features([1024], 4, 16, 132)["waves"] == pytest.approx(16 / 132)
    other = [dict(r, run_id="20260101T000001-bbbbbb") for r in rows_short_long(hq=8, hv=32,
                                                                             base_index=50)]
    for r_ in other:
        results.ResultStore(d).append(r_)
    results.ResultStore(d).write_meta("20260101T000001-bbbbbb", {"env": {"sm_count": 114}})
    r = CliRunner().invoke(app, ["recommend", str(d), "--out", str(out)])
    assert r.exit_code == 2 and "different SM counts ([114, 132])" in r.output


def test_cli_recommend_check_judges_another_directory(tmp_path):
    d = write(tmp_path / "r", rows_short_long())
    c = write(tmp_path / "c", rows_short_long(hq=8, hv=32, model="m 8/32"))
    out = tmp_path / "d.json"
    r = CliRunner().invoke(app, ["recommend", str(d), "--out", str(out), "--check", str(c)])
    assert r.exit_code == 0, r.output
    assert f"check on {c} (8 points): 8/8 = 100.0% winner or tie" in r.output
    (chk,) = json.loads(out.read_text())["checks"]
    assert chk["dir"] == str(c) and chk["accuracy"] == 1.0 and chk["points"] == 8
    far = write(tmp_path / "far", [dict(x, gpu_name="NVIDIA B200") for x in rows_short_long()])
    r = CliRunner().invoke(app, ["recommend", str(d), "--out", str(out), "--check", str(far)])
    assert r.exit_code == 2 and "NVIDIA B200" in r.output and "Traceback" not in r.output


def test_engine_example_runs_on_a_cpu(capsys):
    """examples/engine_dispatch.py against the kept forward table: the choice, and the call made
    (through the reference where the chosen backend cannot run here)."""
    import runpy

    import torch

    root = Path(__file__).resolve().parent.parent
    main = runpy.run_path(str(root / "examples" / "engine_dispatch.py"))["main"]
    assert main(["--table", str(root / "results" / "dispatch" / "h200_fwd.json"),
                 "--heads", "2/8", "--seqlens", "64,32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2/8 [64, 32] -> ") and "bucket" in out
    if not torch.cuda.is_available():
        assert "cannot run here" in out and "reference: o (1, 96, 8, 128)" in out


@pytest.mark.parametrize("args,named", [
    (["--heads", "3/8"], "--heads '3/8': h_v=8 is not a multiple of h_qk=3"),
    (["--heads", "4-16"], "--heads '4-16': expected H_QK/H_V"),
    (["--seqlens", "1024,,"], "--seqlens '1024,,': an empty item"),
    (["--seqlens", "1024,0"], "--seqlens '1024,0': "),
    (["--table", "results"], "/results: Is a directory"),
])
def test_engine_example_refuses_bad_input_in_one_line(capsys, args, named):
    import runpy

    root = Path(__file__).resolve().parent.parent
    main = runpy.run_path(str(root / "examples" / "engine_dispatch.py"))["main"]
    table = ["--table", str(root / "results" / "dispatch" / "h200_fwd.json")]
    assert main([*table, *args] if args[0] != "--table" else [*args[:1], str(root / args[1])]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert not cap.out and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0]
