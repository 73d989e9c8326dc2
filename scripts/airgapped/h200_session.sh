#!/bin/bash
# One device call on the lent H200: install, GPU tests, then the sweeps named in $SWEEPS
# (config[:outdir[:extra args joined by '+']] separated by spaces), each under a time limit so that the
# results are always packed into $OUT before the call ends.
#   SWEEPS="configs/h200_fwd_quick.yaml:runs/quick" TESTS=1 bash scripts/airgapped/h200_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
# a TileLang cache filled offline (qlabench precompile), carried compressed
if [ -f .devsite/tlcache.tar.xz ] && [ -z "${TILELANG_CACHE_DIR:-}" ]; then
  [ -d /tmp/tlcache-full ] || tar -xJf .devsite/tlcache.tar.xz -C /tmp
  export TILELANG_CACHE_DIR=/tmp/tlcache-full
fi
source .devsite/setup.sh || exit 1
export FLA_FLASH_QLA=0
# Triton keeps FLA's autotune results in its cache dir (carried between calls with the other caches)
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
# the deadline for everything below: DEADLINE_S, never past MAX_DEADLINE_S (set by h200_dual.sh)
DL=${DEADLINE_S:-540}; [ -n "${MAX_DEADLINE_S:-}" ] && [ "$MAX_DEADLINE_S" -lt "$DL" ] && DL=$MAX_DEADLINE_S
# GPU=N: checks, tests and profiles run pinned to GPU N (sweeps pick theirs with --gpus)
pin() { if [ -n "${GPU:-}" ]; then CUDA_VISIBLE_DEVICES=$GPU "$@"; else "$@"; fi; }
pack() { [ -d "$1" ] && tar czf "$OUT/$(basename "$1").tgz" --exclude=logs --exclude=_logs "$1"; }
[ "${SKIP_INSTALL:-0}" = 1 ] || python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/nvidia-smi.csv" 2>&1
cat "$OUT/nvidia-smi.csv"
if [ "${TESTS:-0}" = 1 ]; then
  log "gpu tests"
  pin timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu ${TEST_FILES:-tests} -p no:cacheprovider -k "${PYTEST_K:-}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
fi
# RUN_CMD="...": any further command (e.g. tools/kernels/check_fwd.py), pinned, under RUN_TIMEOUT
if [ -n "${RUN_CMD:-}" ]; then
  log "run: $RUN_CMD"
  OUT=$OUT pin timeout ${RUN_TIMEOUT:-180} bash -c "$RUN_CMD" 2>&1 | tee "$OUT/run_cmd.log" | tail -80
fi
for spec in ${PROFILES:-}; do
  # config:point:model:backend[:direction[:ncu[:kernel regex]]]  e.g. configs/h200_fwd_quick.yaml:1x32768:2/8:fla:fwd:ncu
  # (with a kernel regex: Nsight Compute's full section set on that kernel, plus its details and
  # SASS-with-stall-samples pages as CSV, readable without Nsight Compute)
  IFS=: read -r cfg point model backend direction ncu nkern <<< "$spec"
  budget=$(( DL - ($(date +%s) - T0) ))
  [ "$budget" -lt 30 ] && { log "no time left for profile $spec"; break; }
  log "profile $spec"
  pout="$OUT/profile${nkern:+/ncu_full}"
  pin timeout --signal=INT --kill-after=10 "$budget" qlabench profile "$cfg" --point "$point" --model "$model" \
    --backend "$backend" --direction "${direction:-fwd}" ${ncu:+--ncu} ${nkern:+--ncu-set full --ncu-kernel "$nkern"} \
    --out "$pout" 2>&1 | tee -a "$OUT/profile.log"
  if [ -n "$nkern" ]; then
    for r in "$pout"/*.ncu-rep; do
      [ -f "$r" ] || continue
      timeout 60 ncu --import "$r" --page details --csv > "${r%.ncu-rep}.details.csv" 2>> "${r%.ncu-rep}.import.log" || true
      timeout 60 ncu --import "$r" --page source --csv --print-source sass > "${r%.ncu-rep}.source.csv" \
        2>> "${r%.ncu-rep}.import.log" || true
    done
  fi
done
for spec in ${SWEEPS:-}; do
  IFS=: read -r cfg dir extra <<< "$spec"
  budget=$(( DL - 10 - ($(date +%s) - T0) ))
  [ "$budget" -lt 20 ] && { log "no time left for $cfg"; break; }
  extra=${extra//+/ }   # extra args joined by '+', e.g. --gpus=1+--backends=tilelang
  log "sweep $cfg -> $dir (budget ${budget}s) $extra"
  mkdir -p "$dir"
  timeout --signal=INT --kill-after=15 "$budget" qlabench run "$cfg" --out "$dir" --resume $extra 2>&1 \
    | tee -a "$OUT/sweep.log"
  log "packing $dir"
  pack "$dir"
done
ls -la "$OUT"
