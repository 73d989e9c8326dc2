import csv
from pathlib import Path

import pytest

from qlabench import config as C
from qlabench.sweep import points

ROOT = Path(__file__).resolve().parents[1]
ANCHORS = ROOT.parent / "shared" / "anchors"


def _rows(name):
    with open(ANCHORS / name) as fh:
        return list(csv.DictReader(line for line in fh if not line.startswith("#")))


def test_fwd_sweep_is_171_points():
    pts = points(C.load(ROOT / "configs/h200_fwd.yaml"))
    assert len(pts) == 171
    assert len({p.key for p in pts}) == 171


def test_bwd_sweep_is_32_points():
    assert len(points(C.load(ROOT / "configs/h200_bwd.yaml"))) == 32


@pytest.mark.skipif(not ANCHORS.exists(), reason="shared/anchors not beside the checkout")
def test_fwd_points_match_published_table():
    pts = {(p.h_qk, p.h_v, p.seqlens) for p in points(C.load(ROOT / "configs/h200_fwd.yaml"))}
    pub = {(int(r["h_qk"]), int(r["h_v"]), tuple(int(x) for x in r["seqlens"].split()))
           for r in _rows("flashqla_h200_fwd_published.csv")}
    assert pts == pub


@pytest.mark.skipif(not ANCHORS.exists(), reason="shared/anchors not beside the checkout")
def test_random_split_reproduces_published_backward_lengths():
    pts = {(p.h_qk, p.h_v, p.seqlens) for p in points(C.load(ROOT / "configs/h200_bwd.yaml"))}
    pub = {(int(r["h_qk"]), int(r["h_v"]), tuple(int(x) for x in r["seqlens"].split()))
           for r in _rows("flashqla_h200_bwd_published.csv")}
    assert pts == pub


def test_equal_batch_and_labels():
    s = C.parse({"name": "x", "models": [{"name": "m", "h_qk": 1, "h_v": 2}],
                 "seqlens": [{"count": 4, "length": 8192}, [28672, 4096], [7]]})
    pts = points(s)
    assert pts[0].seqlens == (8192,) * 4 and pts[0].layout_label == "4x8192"
    assert pts[1].layout_label == "2x[28672,4096]" and pts[2].layout_label == "1x7"
    assert pts[0].recipe_hash != points(s.model_copy(update={"seed": 1}))[0].recipe_hash
