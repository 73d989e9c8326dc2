"""Copy only the TileLang cache entries that some precompile runs use into a new cache directory
(for a device call's carry, which has a size limit).

    TILELANG_CACHE_DIR=/tmp/tlcache-full python scripts/cache_subset.py /tmp/tlcache-min "tests" "bwd_sweep" ...

Each quoted argument is one ``scripts/precompile_cache.py`` argument list, run in this process
(``--jobs`` stays 1: worker processes are not recorded) with TileLang's cache-path lookup recorded
(entries missing from the source cache are compiled into it first). The used entries are copied
to the same relative paths under the output directory, which then works as a TILELANG_CACHE_DIR of
its own.
"""

import os
import pathlib
import runpy
import shlex
import shutil
import sys

import tilelang.cache.kernel_cache as kc


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
    script = str(pathlib.Path(__file__).with_name("precompile_cache.py"))
    for args in sys.argv[2:]:
        sys.argv = [script, *shlex.split(args)]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:  # the script's main() exits; a failure stops here
            if e.code:
                raise
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
