#!/bin/bash
# A/B of fused-forward variants on one GPU, one device call (results/h200_fused/_notes/ab_20261202 ran it).
# A variant is a copy of kernels/ as VARIANT_DIR/pkg_<name>/qlabench_kernels (default VARIANT_DIR .run/var)
# with its fwd_fused.py edited; check its stack first (tools/kernels/res_usage.py with it on PYTHONPATH),
# then compile its kernels and the tree's into one TileLang cache directory `fused` packed as
# .tlcache/fused.tar.xz (`tar -cf - -C .tlcache --exclude=cuda-binaries fused | xz`), and carry
# .devsite .tlcache/fused.tar.xz and VARIANT_DIR. Per variant, in its own process, base (this tree) first
# and again last (base2: drift): tools/kernels/check_fused.py --cases small --fused-only [--timing TIMING];
# then trace_fused.py for TRACE (default "base"; " " for none) on TSHAPES; --cases all for FULL; the
# full check_fused timing for TIMEFULL; for each name in PREP (base or a variant) prep alone
# (tools/kernels/check_fwd.py --stage prep on PREP_CASES: its outputs against the mirror, every slicing
# timed) and the whole forward on FWD_CASES (check_fwd --quick: against the fp32 recurrence, stages,
# timings), for each name in FWD the whole forward only (a name base2, base3 ... is the tree again: drift). SMALL=0 skips the fused kernel's small checks (a variant of prep alone).
# Everything into one $OUT/ab.tgz (the device returns few files).
#   VARIANTS="A B" TRACE="base A" bash scripts/airgapped/h200_fused_ab.sh 2>&1 | tee $OUT/ab.log
set -uo pipefail
[ "${SMALL:-1}" = 1 ] && : "${VARIANTS:?VARIANTS='name ...' (each VARIANT_DIR/pkg_name/qlabench_kernels)}"
FINAL=${OUT:-/tmp/out}; OUT=/tmp/abo; rm -rf $OUT; mkdir -p "$OUT" "$FINAL"; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
source .devsite/setup.sh || exit 1
mkdir -p /tmp/tlc && tar -xJf .tlcache/fused.tar.xz -C /tmp/tlc || exit 1
export TILELANG_CACHE_DIR=/tmp/tlc/fused PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
log "cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels; commit ${QLABENCH_GIT_SHA:-$(cat .run/commit.txt 2>/dev/null)}"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.csv"
run_v() {  # name [pkg]
  local name=$1 pkg=${2:-}; mkdir -p "$OUT/$name"
  PYTHONPATH=${pkg:+$PWD/$pkg:}$PYTHONPATH OUT=$OUT/$name timeout --kill-after=10 ${CHECK_S:-150} \
    python3 -m qlabench_tools.kernels.check_fused --cases small --fused-only ${TIMING:+--timing "$TIMING"} > "$OUT/$name/log" 2>&1
  log "$name: exit $?"; grep -E "ok=|fused_ms|Error|error" "$OUT/$name/log" | sed 's/^/    /' | cut -c1-220
}
if [ "${SMALL:-1}" = 1 ]; then
  run_v base
  for v in $VARIANTS; do run_v "$v" "${VARIANT_DIR:-.run/var}/pkg_$v"; done
  run_v base2
fi
for v in ${TRACE:-base}; do
  mkdir -p "$OUT/trace_$v"; pkg=""; [ "$v" != base ] && pkg=$PWD/${VARIANT_DIR:-.run/var}/pkg_$v
  PYTHONPATH=${pkg:+$pkg:}$PYTHONPATH OUT=$OUT/trace_$v timeout --kill-after=10 90 \
    python3 -m qlabench_tools.kernels.trace_fused --shapes "${TSHAPES:-16/64 4x8192}" > "$OUT/trace_$v.log" 2>&1
  log "trace $v: exit $?"; grep -v WARNING "$OUT/trace_$v.log" | tail -30
done
for v in ${FULL:-}; do  # every correctness case, no timing
  pkg=""; [ "$v" != base ] && pkg=$PWD/${VARIANT_DIR:-.run/var}/pkg_$v; mkdir -p "$OUT/full_$v"
  PYTHONPATH=${pkg:+$pkg:}$PYTHONPATH OUT=$OUT/full_$v timeout --kill-after=10 150 \
    python3 -m qlabench_tools.kernels.check_fused --cases all --no-time > "$OUT/full_$v/log" 2>&1
  log "full $v: exit $?"; grep -E "ok=|Error" "$OUT/full_$v/log" | cut -c1-200
done
for v in ${TIMEFULL:-}; do  # the timing of check_fused with every column (fwd_o, planned, fused splits)
  pkg=""; [ "$v" != base ] && pkg=$PWD/${VARIANT_DIR:-.run/var}/pkg_$v; mkdir -p "$OUT/timefull_$v"
  PYTHONPATH=${pkg:+$pkg:}$PYTHONPATH OUT=$OUT/timefull_$v timeout --kill-after=10 200 \
    python3 -m qlabench_tools.kernels.check_fused --cases small > "$OUT/timefull_$v/log" 2>&1
  log "timefull $v: exit $?"; grep -E "shape=|Error" "$OUT/timefull_$v/log" | cut -c1-300
done
for v in ${PREP:-} ${FWD:-}; do  # prep alone (PREP names), then the whole forward (fwd_o path among the planner's picks)
  pkg=""; [[ "$v" != base* ]] && pkg=$PWD/${VARIANT_DIR:-.run/var}/pkg_$v; mkdir -p "$OUT/prep_$v" "$OUT/fwd_$v"
  if [[ " ${PREP:-} " == *" $v "* ]]; then
    PYTHONPATH=${pkg:+$pkg:}$PYTHONPATH OUT=$OUT/prep_$v timeout --kill-after=10 ${CHECK_S:-150} python3 -m qlabench_tools.kernels.check_fwd \
      --stage prep --cases "${PREP_CASES:-mixed_2_8,16_64_1x32768,16_64_4x8192,16_32_8x4096,8_24_1x32768,2_8_1x32768}" > "$OUT/prep_$v/log" 2>&1
    log "prep $v: exit $?"; grep -E "^PREP|Error" "$OUT/prep_$v/log" | cut -c1-200
  fi
  PYTHONPATH=${pkg:+$pkg:}$PYTHONPATH OUT=$OUT/fwd_$v timeout --kill-after=10 ${CHECK_S:-150} python3 -m qlabench_tools.kernels.check_fwd \
    --quick --cases "${FWD_CASES:-mixed_2_8,mixed_1_3_split512,16_64_1x32768,16_64_4x8192,8_24_1x32768}" > "$OUT/fwd_$v/log" 2>&1
  log "fwd $v: exit $?"; sed -n '/=== summary/,$p' "$OUT/fwd_$v/log" | cut -c1-200
done
log done
tar czf "$FINAL/ab.tgz" -C "$OUT" .
