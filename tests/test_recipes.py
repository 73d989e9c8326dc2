"""Gate recipes: their inputs, the reference on them, and a recipe as part of a point's identity;
the campaign a resume continues."""

from datetime import datetime, timedelta

import pytest
import torch

from qlabench import config as C
from qlabench import measure, results, runner
from qlabench.backends.reference import gdn_chunked, gdn_recurrent
from qlabench.sweep import points
from qlabench.workloads import make

CFG = {"name": "rc", "models": [{"name": "m", "h_qk": 1, "h_v": 4, "head_dim": 16}],
       "seqlens": [[70, 5]], "backends": ["reference"], "isolate": False,
       "reference": {"impl": "chunked", "dtype": "fp64"},
       "timing": {"min_samples": 2, "max_samples": 3, "budget_s": 0.05},
       "gate": [{"recipe": "published"}, {"recipe": "strong-decay"}, {"recipe": "model"}]}


def _pts(cfg=CFG):
    return points(C.parse(cfg))


def test_recipes_reach_their_ends_of_the_gate_range():
    pub, strong, model = (make(p) for p in _pts())
    assert (pub.g <= 0).all() and (pub.g == 0).any()  # published: some heads never decay
    assert strong.g.min() < -13.0 and (strong.g < 0).all()  # per-token gates near log(1e-6)
    # the model's gate: -exp(A_log) softplus(a + dt_bias), per-head scale, mostly small
    assert (model.g < 0).all() and -1.0 < model.g.median() < -1e-3
    assert make(_pts()[1]).g.equal(strong.g)  # seeded


@pytest.mark.parametrize("i", [1, 2])
def test_chunked_reference_equals_recurrence_on_each_recipe(i):
    x = make(_pts()[i])
    o1, h1 = gdn_recurrent(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens)
    o2, h2 = gdn_chunked(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens,
                         dtype=torch.float64)
    for a, b in ((o2, o1), (h2, h1)):
        assert torch.isfinite(a).all()
        assert ((a - b).norm() / b.norm()).item() < 1e-10


def test_recipe_is_part_of_the_key_and_rows_of_recipes_live_side_by_side(tmp_path):
    pts = _pts()
    assert len({p.key for p in pts}) == 3 and "|gate=" not in pts[0].key
    assert pts[1].key.endswith("|gate=strong-decay") and "[model]" in pts[2].describe()
    runner.run(C.parse(CFG), tmp_path, log=lambda m: None)
    lat = results.latest(results.load(tmp_path))
    assert len(lat) == 3 and set(lat["status"]) == {"ok"}
    assert sorted(lat["gate_recipe"].str.split(":").str[0]) == ["model", "strong-decay",
                                                                 "zero0.25/seed0"]
    # a resume skips all three; one recipe alone resumes into the same directory
    s = runner.run(C.parse(CFG), tmp_path, resume=True, log=lambda m: None)
    assert s.skipped_done == 3 and not s.rows
    one = {**CFG, "gate": {"recipe": "strong-decay", "min_log_gate": -5.0}}
    with pytest.raises(runner.RecipeMismatch):  # same key, other parameters: refused
        runner.run(C.parse(one), tmp_path, resume=True, log=lambda m: None)


def test_resume_on_the_same_device_continues_the_campaign(tmp_path):
    cfg = C.parse({**CFG, "gate": {"recipe": "published"}, "seqlens": [[70, 5], [33], [12]]})
    r1 = runner.run(cfg, tmp_path, limit=1, log=lambda m: None)
    r2 = runner.run(cfg, tmp_path, limit=2, resume=True, log=lambda m: None)
    df = results.load(tmp_path)
    assert r1.run_id != r2.run_id and len(df) == 2 and df["campaign_id"].nunique() == 1
    assert df["gpu_uuid"].iloc[0] == measure.device_uuid() and df["campaign_id"].notna().all()
    camp = df["campaign_id"].iloc[0]
    r3 = runner.run(cfg, tmp_path / "other", log=lambda m: None)  # not a resume
    assert r3.rows[0]["campaign_id"] != camp
    # an edited sweep, or a run on another device last, starts a new campaign
    edited = C.parse({**CFG, "gate": {"recipe": "published"}, "seqlens": [[70, 5], [33], [13]]})
    assert runner.campaign_for(results.ResultStore(tmp_path), [measure.device_uuid()], True,
                               edited.model_dump(mode="json")) != camp
    meta = results.load_meta(tmp_path)[r2.run_id]
    assert runner.campaign_for(results.ResultStore(tmp_path), [measure.device_uuid()], True,
                               cfg.model_dump(mode="json"), meta["backend_versions"]) == camp
    assert runner.campaign_for(results.ResultStore(tmp_path), [measure.device_uuid()], True,
                               cfg.model_dump(mode="json"), {"reference": "other"}) != camp
    later = datetime.fromisoformat(meta["started_at"]) + timedelta(hours=runner.CAMPAIGN_HOURS + 1)
    assert runner.campaign_for(results.ResultStore(tmp_path), [measure.device_uuid()], True,
                               cfg.model_dump(mode="json"), now=later) != camp
    for rid, m in results.load_meta(tmp_path).items():  # the earlier runs were on another GPU
        results.ResultStore(tmp_path).write_meta(rid, {**m, "gpu_uuids": ["GPU-elsewhere"]})
    r4 = runner.run(cfg, tmp_path, resume=True, log=lambda m: None)
    assert r4.rows[0]["campaign_id"] != camp
