#!/bin/bash
# Call 1: base stage times (check_bwd --no-check --bwd-only) and ncu source profiles of bwd_dhu, bwd_h,
# bwd_dqkwg, bwd_wy on 16/64 over eight sequences (EIGHT, unsplit). Carry: .devsite .tlcache/dhuab.tar.xz .run/c3
set -uo pipefail
FINAL=${OUT:-/tmp/out}; T0=$(date +%s); mkdir -p $FINAL
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $FINAL/log; }
source .devsite/setup.sh || exit 1
mkdir -p /tmp/tlc && { [ -d /tmp/tlc/dhuab ] || tar -xJf .tlcache/dhuab.tar.xz -C /tmp/tlc || exit 1; }
export TILELANG_CACHE_DIR=/tmp/tlc/dhuab PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { tail /tmp/install.log; exit 1; }
log "cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $FINAL/gpu.csv
cat > /tmp/once.py <<'PY'
import sys, torch
from qlabench_tools.kernels.check_bwd import make_inputs, run_fwd, run_bwd, EIGHT, _import_pkg
pkg, _ = _import_pkg()
lens = {"e": EIGHT, "l": (32768,)}[sys.argv[1]]
hq, hv = int(sys.argv[2]), int(sys.argv[3])
x = make_inputs(lens, hq, hv); r = run_fwd(pkg, x)
for _ in range(2):
    run_bwd(pkg, x, r, split=int(sys.argv[4]) if len(sys.argv) > 4 else None)
torch.cuda.synchronize(); print("done")
PY
python3 /tmp/once.py e 16 64 > $FINAL/warm.log 2>&1; log "warm exit $?"
for kname in gdn_bwd_dhu gdn_bwd_h gdn_bwd_wy_ws; do
  timeout 120 ncu --set full -k regex:$kname --launch-skip 1 --launch-count 1 -f -o /tmp/ncu_$kname python3 /tmp/once.py e 16 64 0 > $FINAL/ncu_$kname.log 2>&1
  log "ncu $kname exit $?"
  timeout 60 ncu --import /tmp/ncu_$kname.ncu-rep --page source --csv --print-source sass > /tmp/src_$kname.csv 2>/dev/null
  python3 -m qlabench_tools.kernels.ncu_stalls /tmp/src_$kname.csv --top 40 > $FINAL/stalls_$kname.txt 2>&1
  timeout 60 ncu --import /tmp/ncu_$kname.ncu-rep --page details --csv > $FINAL/details_$kname.csv 2>/dev/null
  xz -T0 -c /tmp/src_$kname.csv > /tmp/src_$kname.csv.xz
  head -30 $FINAL/stalls_$kname.txt
done
tar cf $FINAL/prof.tar -C /tmp $(cd /tmp && ls src_*.csv.xz) ; log done
