"""The held-out configs stay held out: none of their head configs is in the published sweep of
their direction (the only config that direction's planner costs may be fitted on); their layouts
are the serving config's (the backward's, plus two long ones the backward sweep lacks)."""
from pathlib import Path

from qlabench import config as C
from qlabench.sweep import points

ROOT = Path(__file__).resolve().parents[1]


def _heads(name):
    return {(p.h_qk, p.h_v) for p in points(C.load(ROOT / "configs" / name))}


def test_heldout_head_configs_are_not_in_the_published_sweep():
    held = _heads("h200_fwd_heldout.yaml")
    assert len(held) >= 10
    assert not held & _heads("h200_fwd.yaml")


def test_heldout_layouts_are_the_serving_layouts():
    def layouts(name):
        return {tuple(p.seqlens) for p in points(C.load(ROOT / "configs" / name))}
    assert layouts("h200_fwd_heldout.yaml") == layouts("h200_serving.yaml")


def test_backward_heldout_head_configs_are_not_in_the_published_backward_sweep():
    held = _heads("h200_bwd_heldout.yaml")
    assert len(held) >= 6
    assert not held & _heads("h200_bwd.yaml")
    assert list(C.load(ROOT / "configs" / "h200_bwd_heldout.yaml").directions) == ["bwd"]


def test_backward_heldout_layouts_hold_the_serving_layouts():
    def layouts(name):
        return {tuple(p.seqlens) for p in points(C.load(ROOT / "configs" / name))}

    held = layouts("h200_bwd_heldout.yaml")
    assert layouts("h200_serving.yaml") <= held
    assert not held & layouts("h200_bwd.yaml")  # its long layouts are not the sweep's either
