#!/bin/bash
# device: the LPT order A/B. Tree = fwd-lpt; main's kernels in .run/var/pkg_main.
set -uo pipefail
FINAL=${OUT:-/tmp/out}; OUT=/tmp/abo; rm -rf $OUT; mkdir -p "$OUT" "$FINAL"; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
source .devsite/setup.sh || exit 1
mkdir -p /tmp/tlc && tar -xJf .tlcache/fused.tar.xz -C /tmp/tlc || exit 1
export TILELANG_CACHE_DIR=/tmp/tlc/fused PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
log "cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.csv"
QLABENCH_TEST_TIMEOUT_S=200 timeout 300 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "tables or longest_first or recurrence" -x > "$OUT/pytest.log" 2>&1
log "pytest: exit $?"; tail -5 "$OUT/pytest.log"
TIMING="2/8 64x~242,4/16 64x~242,1/4 64x~242,8/24 64x~242,16/32 64x~242,2/8 8x1024,16/64 4x8192"
run_v() {  # name [pkg]
  local name=$1 pkg=${2:-}; mkdir -p "$OUT/$name"
  PYTHONPATH=${pkg:+$PWD/$pkg:}$PYTHONPATH OUT=$OUT/$name timeout --kill-after=10 150 \
    python3 -m qlabench_tools.kernels.check_fused --cases small --fused-only --timing "$TIMING" > "$OUT/$name/log" 2>&1
  log "$name: exit $?"; grep -E "ok=|fused_ms|Error|error" "$OUT/$name/log" | sed 's/^/    /' | cut -c1-220
}
run_v main .run/var/pkg_main
run_v lpt
run_v main2 .run/var/pkg_main
run_v lpt2
for v in main lpt; do
  pkg=""; [ $v = main ] && pkg=$PWD/.run/var/pkg_main; mkdir -p "$OUT/fwd_$v"
  PYTHONPATH=${pkg:+$pkg:}$PYTHONPATH OUT=$OUT/fwd_$v timeout --kill-after=10 150 python3 -m qlabench_tools.kernels.check_fwd \
    --quick --cases "mixed_2_8,16_64_4x8192,2_8_8x1024" > "$OUT/fwd_$v/log" 2>&1
  log "fwd $v: exit $?"; sed -n '/=== summary/,$p' "$OUT/fwd_$v/log" | cut -c1-200
done
log done
tar czf "$FINAL/ab.tgz" -C "$OUT" .
