"""The points of a sweep config on which two cost tables plan the in-repo kernels differently.

    python -m qlabench_tools.kernels.table_points CONFIG --table FILE [--base FILE] [--sms N]
        --out-dir DIR [--name NAME] [--label LABEL]

For every (model, layout) of CONFIG and each of its directions, the in-repo kernels' plan on
``--sms`` SMs (default: the GPU's, else the default table's) under ``--base`` (default: the table ``tilelang``
plans with here, the GPU model's committed one or the default GPU's) and under ``--table``: what the ``tilelang`` backend plans under a table
(:func:`qlabench.backends.tilelang.table_plans`). A point whose plans are the same runs the
same kernels under both tables, so only the others need timing: DIR/NAME_<k>.yaml, one config per
model holding that model's differing layouts and directions, all named NAME (one sweep: their runs share one
results directory), each with two backends, ``tilelang`` (the GPU's committed table) and LABEL
(``tilelang`` with parameter ``cost_table`` = FILE), out ``runs/NAME``. Prints per direction on how
many (model, layout) pairs the plans differ and writes DIR/NAME_plans.json (every point's plans). Exit 2 on a config or
table that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import yaml


def differing(sweep, raw: dict, base, table, sms: int):
    """([(model entry, [layout entries], [directions])] whose plans differ, [per (model, layout)
    plan records]); ``sweep`` the loaded config, ``raw`` its YAML."""
    from qlabench.backends.tilelang import table_plans
    from qlabench.config import MODEL_PRESETS, Model

    keep, records = [], []
    for m in sweep.resolved_models():  # a preset by its name, any other head config in full
        preset = MODEL_PRESETS.get(m.name)
        m_raw = m.name if preset and m == Model(name=m.name, h_qk=preset[0], h_v=preset[1]) else m.model_dump()
        layouts, dirs = [], set()
        for l_raw, lens in zip(raw["seqlens"], sweep.resolved_layouts()):
            rec = dict(model=m.name, heads=f"{m.h_qk}/{m.h_v}", seqlens=list(lens), differs=[])
            for d in sweep.directions:
                a, b = (table_plans(lens, m.h_qk, m.h_v, sms, d, t) for t in (base, table))
                rec[d] = dict(base=a, table=b)
                if a != b:
                    rec["differs"].append(d)
            records.append(rec)
            if rec["differs"]:
                layouts.append(l_raw)
                dirs.update(rec["differs"])
        if layouts:
            keep.append((m_raw, layouts, [d for d in sweep.directions if d in dirs]))
    return keep, records


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qlabench_tools.kernels.table_points", description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--table", required=True, help="the cost table file to set beside the committed one")
    ap.add_argument("--base", help="the table `tilelang` plans with (default: this GPU model's committed one)")
    ap.add_argument("--sms", type=int, help="SM count (default: the GPU's, else the default table's)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--name", help="the sweep name (default: the config's name + '_tables')")
    ap.add_argument("--label", default="tl-measured")
    a = ap.parse_args(argv)

    from qlabench_kernels import calibration

    from qlabench.config import ConfigError, load

    try:
        sweep = load(a.config)
        raw = yaml.safe_load(pathlib.Path(a.config).read_text())
        table = calibration.from_file(a.table)
        base = calibration.from_file(a.base) if a.base else calibration.for_device(_device())
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.sms is None:
        from qlabench_kernels.plan import sm_count

        a.sms = sm_count(_device())
    if a.sms <= 0:
        print(f"error: --sms {a.sms}: must be positive", file=sys.stderr)
        return 2
    name = a.name or f"{sweep.name}_tables"
    keep, records = differing(sweep, raw, base, table, a.sms)
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{name}_[0-9]*.yaml"):
        old.unlink()
    backends = ["tilelang", {"name": "tilelang", "label": a.label, "params": {"cost_table": str(pathlib.Path(a.table).resolve())}}]
    for k, (m_raw, layouts, dirs) in enumerate(keep):
        d = dict(raw, name=name, models=[m_raw], seqlens=layouts, directions=dirs, backends=backends,
                 out=f"runs/{name}")
        (out / f"{name}_{k}.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
    (out / f"{name}_plans.json").write_text(json.dumps(records, indent=1))
    for d in sweep.directions:
        n = sum(d in r["differs"] for r in records)
        print(f"{name} {d}: plans differ on {n} of {len(records)} (model, layout) pairs")
    print(f"{name}: {len(keep)} config(s) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
