#!/bin/bash
# Issue #10 / #3 on a two-GPU machine: the quick sweep with warm caches on 1 GPU, on 2 GPUs and on
# 1 GPU again (wall time of each whole `qlabench run`, compile excluded by the warm-up run), into
# fresh directories under runs/scaleout/. Wall times go to $OUT/scaleout.txt.
#   source .devsite/setup.sh && bash scripts/airgapped/h200_scaleout.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CFG=${CFG:-configs/h200_fwd_quick.yaml}
D=runs/scaleout; rm -rf "$D"; mkdir -p "$D"
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1} FLA_FLASH_QLA=0
one() {
  local tag=$1; shift
  local t0 t1 lim=${RUN_TIMEOUT:-120}
  [ "$tag" = warm ] && lim=${WARM_TIMEOUT:-300}   # first process: FLA compiles its chosen configs
  t0=$(date +%s.%N)
  timeout --signal=INT --kill-after=5 "$lim" qlabench run "$CFG" --out "$D/$tag" "$@" > "$D/$tag.log" 2>&1
  local rc=$?
  t1=$(date +%s.%N)
  python3 -c "print(f'$tag rc=$rc wall_s={$t1 - $t0:.2f} args=$*')" | tee -a "$OUT/scaleout.txt"
  # where the wall time went (run metadata timeline_s: start-up, checks, ceilings, rows, figures)
  python3 - "$D/$tag" <<'PY' | tee -a "$OUT/scaleout.txt"
import json, pathlib, sys
from qlabench.results import meta_files
for f in meta_files(sys.argv[1]):
    print("   ", f.stem, json.loads(f.read_text()).get("timeline_s"))
PY
}
one warm --gpus all     # compiles / autotunes / loads caches; not compared
one gpu1_a --gpus 0
one gpu2 --gpus all
one gpu1_b --gpus 0
tail -n 3 "$D"/*.log
tar czf "$OUT/scaleout.tgz" "$D"
