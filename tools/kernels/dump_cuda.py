"""Dump the generated CUDA source of every kernel the default paths compile, without nvcc.

    python -m qlabench_tools.kernels.dump_cuda OUTDIR [--heads 2/8,1/3,...] [--quick]

Patches ``tilelang.compile`` so that each getter only lowers its program (TileLang's passes and
CUDA codegen under the same pass configs, no nvcc): writes OUTDIR/<hqk>_<hv>/<name>.cu and
OUTDIR/<hqk>_<hv>/manifest.json ({name: {"script_sha256": sha of the TIR script TileLang's cache key hashes,
"pass_configs": ..., "cuda_sha256": ...}}). Two dumps compare with ``--compare OLD NEW``
(identical TIR scripts mean identical TileLang disk-cache keys too).
"""

import argparse
import hashlib
import json
import pathlib
import re
import sys
import time

#: (h_qk, h_v) of the tests and both sweeps (configs/h200_fwd.yaml, configs/h200_bwd.yaml)
TEST_HEADS = [(2, 2), (2, 4), (1, 3), (2, 8)]
SWEEP_HEADS = [(2, 8), (16, 64), (4, 16), (8, 32), (16, 32), (8, 24), (16, 48), (16, 16), (32, 32),
               (8, 16), (4, 8), (2, 4)]  # fmt: skip
BWD_SWEEP_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]


class _Lowered:
    def __init__(self, src, script_sha, pass_configs):
        self.src, self.script_sha, self.pass_configs = src, script_sha, pass_configs

    def get_kernel_source(self):
        return self.src


def _patch_tilelang(record):
    import tilelang
    import tvm
    from tilelang.engine.lower import lower

    def lowered(func, target=None, execution_backend=None, pass_configs=None, **_kw):
        sha = hashlib.sha256(func.script(show_meta=True).encode()).hexdigest()
        with tvm.transform.PassContext(opt_level=3, config=pass_configs or {}), tvm.target.Target(target):
            art = lower(func, target=target)
        out = _Lowered(art.kernel_source, sha, pass_configs or {})
        record.append(out)
        return out

    tilelang.compile = lowered


def default_kernels(h_qk, h_v, fwd_flags, bwd_flags, bwd=True):
    """[(name, getter, args, kwargs)]: what the default forward and backward compile for these heads."""
    from qlabench_kernels import compile as comp

    if hasattr(comp, "default_kernels"):
        items = comp.default_kernels(h_qk, h_v, fwd_flags=fwd_flags, bwd_flags=bwd_flags if bwd else ())
    else:  # the tree before the variants were removed (tag kernels-variants-2026-11-30)
        from qlabench_kernels.prep import get_prep_kernel

        items = comp.variant_kernels(h_qk, h_v, "default", flags=fwd_flags, h0s=(1, 0), split=True)
        if bwd:
            items += comp.bwd_variant_kernels(h_qk, h_v, "default", flags=bwd_flags, bvs=(32,), split=True)
            items.append(("prep_noP", get_prep_kernel, (h_qk, h_v), {"method": "rt"}))
    return [(_canon(getter, args, kw), getter, args, kw) for _name, getter, args, kw in items]


def _canon(getter, args, kw):
    """A file name for one getter call: the getter and its arguments."""
    parts = [str(int(a)) if isinstance(a, bool) else str(a) for a in args]
    parts += [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(kw.items())]
    return getter.__name__.removeprefix("get_").removesuffix("_kernel") + "[" + ",".join(parts) + "]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--heads", default="", help="h_qk/h_v pairs, comma-separated (default: tests + sweeps)")
    ap.add_argument("--sweep-heads", default="", help="h_qk/h_v pairs compiled with initial + final state only")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two dumps' manifests")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("OUTDIR is required (or --compare OLD NEW)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    all4 = ((1, 1), (1, 0), (0, 1), (0, 0))
    if args.heads or args.sweep_heads:
        plan = [(tuple(int(x) for x in hh.split("/")), all4, all4) for hh in args.heads.split(",") if hh]
        plan += [(tuple(int(x) for x in hh.split("/")), ((1, 1),), ((1, 1),)) for hh in args.sweep_heads.split(",") if hh]
    else:
        plan = [(hh, all4, all4) for hh in TEST_HEADS]
        plan += [(hh, ((1, 1),), ((1, 1),)) for hh in SWEEP_HEADS if hh not in TEST_HEADS]
    record = []
    _patch_tilelang(record)
    from qlabench_kernels._common import target_key

    tk = target_key(None)
    for (hq, hv), ff, bf in plan:
        bwd = (hq, hv) in TEST_HEADS or (hq, hv) in BWD_SWEEP_HEADS
        d = out / f"{hq}_{hv}"
        d.mkdir(exist_ok=True)
        manifest_path = d / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        t0 = time.time()
        seen = set()
        for name, getter, gargs, kw in default_kernels(hq, hv, ff, bf, bwd):
            key = (getter.__module__, getter.__name__, gargs, tuple(sorted(kw.items())))
            if key in seen:
                continue
            seen.add(key)
            full = f"{hq}_{hv}/{name}"
            if full in manifest:
                continue
            record.clear()
            src = getter(*gargs, target_k=tk, **kw).get_kernel_source()
            lw = record[-1] if record else None
            (d / f"{name}.cu").write_text(src)
            manifest[full] = {
                "script_sha256": lw.script_sha if lw else None,
                "pass_configs": lw.pass_configs if lw else None,
                "cuda_sha256": hashlib.sha256(src.encode()).hexdigest(),
            }
            manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        print(f"{hq}/{hv}: {time.time() - t0:.0f} s", flush=True)
    return 0


def _normalise(src: str) -> str:
    """The CUDA source with TileLang's reduction workspaces (equal-sized shared buffers, one per
    reduction) renamed in order of use: which reduction gets which (workspace, workspace_1, ...)
    differs from one lowering of the same TIR to the next. Their declarations keep their offsets."""
    src = re.sub(r"void\* workspace(_\d+)? = ", "void* workspace_decl = ", src)
    names = {}
    return re.sub(r"\bworkspace(_\d+)?\b", lambda m: names.setdefault(m.group(0), f"ws{len(names)}"), src)


def compare(old, new):
    """Match kernels by head config and generated CUDA (names may change with the getters'
    arguments; reduction workspaces renamed, see :func:`_normalise`): report new kernels whose CUDA
    no old kernel has, same CUDA from a different TIR script (a new cache key), and old ones gone."""
    def load(root):
        m = {}
        for f in sorted(pathlib.Path(root).glob("*/manifest.json")):
            for name, rec in json.loads(f.read_text()).items():
                src = (pathlib.Path(root) / f"{name}.cu").read_text()
                m[name] = dict(rec, cuda_sha256=hashlib.sha256(_normalise(src).encode()).hexdigest())
        return m

    a, b = load(old), load(new)

    def index(m):
        return {(k.split("/")[0], v["cuda_sha256"]): (k, v["script_sha256"]) for k, v in m.items()}

    ia, ib = index(a), index(b)
    bad = 0
    for key, (name, tir) in sorted(ib.items(), key=lambda kv: kv[1][0]):
        if key not in ia:
            print(f"NEW CUDA  {name}")
            bad += 1
        elif ia[key][1] != tir:
            print(f"same CUDA, TIR script differs (new cache key): {name} (old {ia[key][0]})")
        elif ia[key][0] != name:
            print(f"same      {name} = old {ia[key][0]}")
    for key, (name, _) in sorted(ia.items(), key=lambda kv: kv[1][0]):
        if key not in ib:
            print(f"GONE      {name}")
    print(f"{len(b)} kernels in {new}, {len(a)} in {old}; {bad} with CUDA no old kernel has")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
