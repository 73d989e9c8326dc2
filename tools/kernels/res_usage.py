"""Registers and stack of the in-repo kernels as compiled for sm_90a, offline (nvcc, no GPU).

    python -m qlabench_tools.kernels.res_usage [--heads 16/64,2/8] [--kernel fwd_fused] [--bwd] [--cache DIR]

Compiles every kernel of ``qlabench_kernels.compile.default_kernels`` (forward with initial and
final state; ``--bwd`` adds the backward's) whose name contains ``--kernel``, for each head config,
one at a time into a TileLang cache (a fresh temporary one unless ``--cache``; an entry already in
``--cache`` compiles nothing and is reported as cached), and prints ``cuobjdump -res-usage``'s
REG / STACK / SHARED / LOCAL per kernel. The package is the one imported, so a variant copy of
``kernels/`` on PYTHONPATH (as ``qlabench_kernels``) is checked before a device call: a kernel with
setmaxnreg budgets launches at REG = 65536 / threads, and STACK above the kept build's is local
memory that its roles spill to (the fused kernel's variants that measured 18–38% slower on the H200
had 128–264 bytes against its 16).

cuobjdump: from $CUOBJDUMP, PATH, or the ``nvidia-cuda-cuobjdump`` wheel (``pip install
nvidia-cuda-cuobjdump``; its binary under ``nvidia/cu13/bin``). Without it: exit 2.
"""

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

FIELDS = ("REG", "STACK", "SHARED", "LOCAL")


def parse_res_usage(text: str) -> list[dict]:
    """[{"function", "REG", "STACK", "SHARED", "LOCAL"}] from ``cuobjdump -res-usage`` output."""
    out, fn = [], None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            fn = m.group(1)
            continue
        if fn is not None and "REG:" in line:
            vals = dict(re.findall(r"([A-Z]+):(\d+)", line))
            out.append({"function": fn, **{k: int(vals[k]) for k in FIELDS if k in vals}})
            fn = None
    return out


def find_cuobjdump() -> str | None:
    """$CUOBJDUMP, cuobjdump on PATH, or the one in the nvidia-cuda-cuobjdump wheel."""
    cand = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    try:
        import nvidia

        cand += [str(pathlib.Path(p) / "cu13" / "bin" / "cuobjdump") for p in nvidia.__path__]
    except ImportError:
        pass
    return next((c for c in cand if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _cubins(cache: pathlib.Path) -> set:
    return set(cache.rglob("kernel.cubin"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="16/64", help="comma-separated h_qk/h_v (default 16/64)")
    ap.add_argument("--kernel", default="fwd_fused", help="a substring of default_kernels' names ('' = all)")
    ap.add_argument("--bwd", action="store_true", help="the backward's kernels too")
    ap.add_argument("--cache", default=None, help="TileLang cache to compile into (default: a fresh temporary one)")
    args = ap.parse_args(argv)
    from qlabench_kernels._common import check_heads  # imports no TileLang (its cache is set below)

    try:
        pairs = [h.split("/") for h in args.heads.split(",") if h.strip()]
        if not pairs or any(len(h) != 2 or not all(x.strip().isdigit() for x in h) for h in pairs):
            raise ValueError("expected h_qk/h_v pairs of integers, e.g. 16/64,2/8")
        heads = [(int(a), int(b)) for a, b in pairs]
        for h in heads:
            check_heads(*h)
    except ValueError as e:
        print(f"error: --heads {args.heads!r}: {e}", file=sys.stderr)
        return 2
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print(
            "error: cuobjdump not found: set $CUOBJDUMP, put it on PATH or `pip install nvidia-cuda-cuobjdump`",
            file=sys.stderr,
        )
        return 2
    cache = pathlib.Path(args.cache or tempfile.mkdtemp(prefix="res_usage_"))
    os.environ["TILELANG_CACHE_DIR"] = str(cache)  # before TileLang is imported
    from qlabench_kernels import compile as comp

    print(f"package {pathlib.Path(comp.__file__).parent}; cache {cache}")
    print(f"{'kernel':<34} {'heads':>6} " + " ".join(f"{f:>7}" for f in FIELDS))
    found = 0
    for hq, hv in heads:
        items = comp.default_kernels(hq, hv, fwd_flags=((1, 1),), bwd_flags=((1, 1),) if args.bwd else ())
        for name, getter, gargs, kw in items:
            if args.kernel not in name:
                continue
            found += 1
            before = _cubins(cache)
            getter(*gargs, **kw)
            new = sorted(_cubins(cache) - before)
            if not new:
                print(f"{name:<34} {hq}/{hv:<4} (cached: nothing compiled)")
                continue
            text = subprocess.run(
                [cuobjdump, "-res-usage", str(new[-1])], capture_output=True, text=True, check=True
            ).stdout
            for r in parse_res_usage(text):
                print(f"{name:<34} {hq}/{hv:<4} " + " ".join(f"{r.get(f, ''):>7}" for f in FIELDS))
    if not found:
        print(f"error: --kernel {args.kernel!r} matches no kernel of default_kernels", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
