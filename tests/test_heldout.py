"""The held-out forward config stays held out: none of its head configs is in the published
forward sweep (the only config the planners' constants may be fitted on), and its layouts are the
serving config's."""
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
