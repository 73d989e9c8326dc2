"""Copy only the TileLang cache entries that some precompile runs use into a new cache directory
(for a device call's carry, which has a size limit).

    TILELANG_CACHE_DIR=/tmp/tlcache-full python scripts/airgapped/cache_subset.py /tmp/tlcache-min "tests" "bwd_sweep" ...

Each quoted argument is one ``qlabench precompile`` target list (sweep YAMLs or named sets:
tests, fwd_sweep, bwd_sweep, sweep, all), compiled in this process (one job: worker processes are
not recorded) with TileLang's cache-path lookup recorded
(entries missing from the source cache are compiled into it first). The used entries are copied
to the same relative paths under the output directory, which then works as a TILELANG_CACHE_DIR of
its own.
"""

import os
import pathlib
import shlex
import shutil
import sys

import tilelang.cache.kernel_cache as kc

from qlabench.precompile import precompile_targets


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1])
    used = set()
    orig = kc.KernelCache._get_cache_path

    def recording(self, key):
        p = orig(self, key)
        used.add(p)
        return p

    kc.KernelCache._get_cache_path = recording
    for args in sys.argv[2:]:  # a failure raises and stops here
        precompile_targets(shlex.split(args), jobs=1)
    src_root = pathlib.Path(os.environ.get("TILELANG_CACHE_DIR", pathlib.Path.home() / ".tilelang" / "cache"))
    n = 0
    for p in sorted(used):
        p = pathlib.Path(p)
        if not p.is_dir():
            continue
        dst = out / p.relative_to(src_root)
        if not dst.exists():
            shutil.copytree(p, dst)
        n += 1
    print(f"copied {n} cache entries to {out}", flush=True)


if __name__ == "__main__":
    main()
