"""Stage costs of the kernels on one GPU model: the tables the planners (:mod:`.plan`) price from.

A table (``cost_tables/<gpu>.json``, one per GPU model, committed so that offline tools plan as the
GPU will) holds, per direction, the per-step costs the planners multiply by their schedule of a
grid on the SMs, and where they come from. The forward's (µs when measured; the planner compares
candidates in whatever unit a table has):

    fwd_o        one 64-token chunk of one fwd_o CTA, two CTAs resident per SM
    fwd_o_alone  the same with one CTA per SM (grids of at most one CTA per SM)
    fused        one chunk of one fused-kernel CTA (one per SM)
    prep         prep's SM time per (chunk, v-head) ...
    prep_qk      ... and per (chunk, q/k head)
    seg_state    one chunk of one seg_state CTA, two per SM
    fixup        one segment of the serial fix-up
    launch       the split path's fixed cost: seg_state's and the fix-up's kernels, its tables
    fwd_o_few    fwd_o's chunk step when its grid holds at most 1/8 as many CTAs as SMs (less
                 contention for memory: between 1/8 and one CTA per SM the step is interpolated
                 to ``fwd_o_alone``)
    fused_few    the same for the fused kernel
    seg_state_alone, seg_state_few  seg_state's steps alone and in few-CTA grids (as fwd_o's)
    cta_fwd_o    what one fwd_o CTA costs beyond its chunk steps (its state loads and stores), alone
                 on its SM (two resident: scaled as its step)
    cta_fused    the same for the fused kernel
    cta_seg_state  the same for seg_state
    kernel       one kernel's fixed cost in a CUDA graph (prep's, the final kernel's)

Overheads (``launch``, ``cta_*``, ``kernel``) may be 0; step costs are positive.

The backward's: ``dhu`` and ``bwd_h`` (the two chains' steps per (segment, v-head) item),
``seg_state``, ``fixup`` (per serial segment, each of the two fix-ups) and ``launch``. The
micro-benchmark that measures them on a GPU: ``python -m qlabench_tools.kernels.calibrate``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import re
import warnings

__all__ = ["FwdCosts", "BwdCosts", "CostTable", "from_json", "from_file", "table_path", "load", "for_device",
           "default_table"]

TABLES = pathlib.Path(__file__).resolve().parent / "cost_tables"
#: the head configs the calibration micro-benchmark compiles and times: G = 1 everywhere, G = 4 for
#: prep's per-q/k-head part (``qlabench precompile calibration`` compiles them offline)
HEADS = ((1, 1), (1, 4))
#: the table offline tools (no GPU) plan with, and the one a GPU without a table of its own falls back to
DEFAULT_GPU = "NVIDIA H200"


@dataclasses.dataclass(frozen=True)
class FwdCosts:
    """The forward planner's step costs (module docstring); ``unit`` as stored."""

    fwd_o: float
    fwd_o_alone: float
    fused: float
    prep: float
    prep_qk: float
    seg_state: float
    fixup: float
    launch: float
    fwd_o_few: float
    fused_few: float
    seg_state_alone: float
    seg_state_few: float
    cta_fwd_o: float
    cta_fused: float
    cta_seg_state: float
    kernel: float
    unit: str = "us"


#: the forward's costs that may be 0 (overheads); every other must be positive
FWD_OVERHEADS = ("launch", "cta_fwd_o", "cta_fused", "cta_seg_state", "kernel")


@dataclasses.dataclass(frozen=True)
class BwdCosts:
    """The backward split planner's step costs: bwd_dhu's and bwd_h's chunk step per (segment,
    v-head) item, seg_state's, one serial fix-up segment, the split path's fixed cost."""

    dhu: float
    bwd_h: float
    seg_state: float
    fixup: float
    launch: float
    unit: str = "us"


@dataclasses.dataclass(frozen=True)
class CostTable:
    gpu: str
    sms: int
    fwd: FwdCosts
    bwd: BwdCosts
    #: where each direction's costs come from (a measurement: GPU, date, commit; or what they were fitted to)
    source: tuple = ()

    def to_json(self) -> dict:
        src = dict(self.source)
        out = {"gpu": self.gpu, "sms": self.sms}
        for name, c in (("fwd", self.fwd), ("bwd", self.bwd)):
            d = dataclasses.asdict(c)
            unit = d.pop("unit")
            out[name] = {"unit": unit, "source": src.get(name, ""), "costs": d}
        return out


def _section(cls, d: dict, where: str):
    fields = [f.name for f in dataclasses.fields(cls) if f.name != "unit"]
    costs = d.get("costs", {})
    missing = [f for f in fields if f not in costs]
    extra = [k for k in costs if k not in fields]
    if missing or extra:
        raise ValueError(f"{where}: costs must be exactly {fields}; missing {missing}, unknown {extra}")
    zero_ok = FWD_OVERHEADS if cls is FwdCosts else tuple(fields)  # the backward's: least squares, any may be 0

    def ok(k):
        v = costs[k]
        return isinstance(v, int | float) and math.isfinite(v) and (v >= 0 if k in zero_ok else v > 0)

    bad = [k for k in fields if not ok(k)]
    if bad:
        what = "non-negative" if all(k in zero_ok for k in bad) else "positive"
        raise ValueError(f"{where}: costs {bad} must be {what} finite numbers, got {[costs[k] for k in bad]}")
    if cls is BwdCosts and costs["dhu"] + costs["bwd_h"] <= 0:
        raise ValueError(f"{where}: dhu + bwd_h must be positive (the chains' step), got {costs['dhu'] + costs['bwd_h']}")
    return cls(**{k: float(costs[k]) for k in fields}, unit=str(d.get("unit", "us")))


def from_json(d: dict, where: str = "cost table") -> CostTable:
    """A :class:`CostTable` from its JSON form; ValueError naming the field that is wrong."""
    for key in ("gpu", "sms", "fwd", "bwd"):
        if key not in d:
            raise ValueError(f"{where}: no '{key}'")
    if not isinstance(d["sms"], int) or d["sms"] <= 0:
        raise ValueError(f"{where}: sms must be a positive int, got {d['sms']!r}")
    return CostTable(
        gpu=str(d["gpu"]), sms=d["sms"],
        fwd=_section(FwdCosts, d["fwd"], f"{where}: fwd"), bwd=_section(BwdCosts, d["bwd"], f"{where}: bwd"),
        source=(("fwd", str(d["fwd"].get("source", ""))), ("bwd", str(d["bwd"].get("source", "")))),
    )  # fmt: skip


def slug(gpu: str) -> str:
    """File stem of a GPU model's table: 'NVIDIA H200' -> 'nvidia_h200'."""
    return re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")


def table_path(gpu: str) -> pathlib.Path:
    return TABLES / f"{slug(gpu)}.json"


def from_file(path) -> CostTable:
    """The table in the JSON file ``path``; ValueError naming the file when it cannot be read or
    the field that is wrong."""
    path = pathlib.Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read cost table {path}: {e}") from None
    return from_json(d, where=str(path))


@functools.lru_cache(maxsize=16)
def load(gpu: str = DEFAULT_GPU) -> CostTable:
    """The committed table of ``gpu`` (a CUDA device name); FileNotFoundError when there is none."""
    path = table_path(gpu)
    if not path.is_file():
        have = sorted(p.stem for p in TABLES.glob("*.json"))
        raise FileNotFoundError(f"no cost table for GPU {gpu!r} ({path.name}); tables: {have}")
    return from_file(path)


def default_table() -> CostTable:
    return load(DEFAULT_GPU)


@functools.lru_cache(maxsize=16)
def _for_name(name: str) -> CostTable:
    try:
        return load(name)
    except FileNotFoundError:
        warnings.warn(
            f"no cost table for {name!r}: the planners price with the {DEFAULT_GPU}'s "
            f"(measure one: python -m qlabench_tools.kernels.calibrate --out {table_path(name)})", stacklevel=3)
        return default_table()


def for_device(device) -> CostTable:
    """The table of ``device``'s GPU model (the default one off CUDA, or with a warning for a GPU
    that has none)."""
    if getattr(device, "type", None) != "cuda":
        return default_table()
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _for_name(torch.cuda.get_device_name(idx))
