#!/bin/bash
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
STEP=setup JOB=none bash scripts/h200_campaign.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
SRC=$PWD; source /tmp/job/env.sh; cd /tmp/repo
log "tilelang cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels; commit $QLABENCH_GIT_SHA"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.csv"
mkdir -p "$OUT/new"
OUT=$OUT/new timeout --kill-after=10 ${CHECK_S:-200} python3 tools/kernels/check_fwd.py --quick ${CASES:+--cases $CASES} > "$OUT/new/log" 2>&1
log "check new: exit $?"; grep -E "===|RESULT|TIME|stages|vs recurrence|FAIL|Error|CRASH" "$OUT/new/log" | tail -70
if grep -q "FAIL\|CRASH" "$OUT/new/log"; then log "new FAILED: no sweep"; tar czf "$OUT/logs.tgz" -C "$OUT" new; exit 0; fi
[ "${SWEEP:-1}" = 1 ] || { tar czf "$OUT/logs.tgz" -C "$OUT" new; log done; exit 0; }
CONFIG=${CONFIG:-configs/h200_fwd_kernels_prev.yaml}; RUN=runs/$(basename $CONFIG .yaml)
pack() { tar czf "$OUT/.runs.tgz" --warning=no-file-changed --exclude=_logs "$RUN" 2>/dev/null; [ $? -le 1 ] && mv "$OUT/.runs.tgz" "$OUT/runs.tgz"; }
(while sleep 60; do pack; done) > /dev/null 2>&1 & snap=$!
resume=(); if [ -n "${RESUME_TGZ:-}" ]; then tar -xzf "$SRC/$RESUME_TGZ" -C /tmp/repo && resume=(--resume); fi
timeout --signal=INT --kill-after=20 ${SWEEP_S:-330} qlabench run "$CONFIG" --out "$RUN" ${resume[@]+"${resume[@]}"} > "$OUT/sweep.log" 2>&1
log "sweep: exit $?"; kill $snap 2>/dev/null; wait $snap 2>/dev/null; tail -3 "$OUT/sweep.log"
qlabench compare "$RUN" --base-backend tilelang@prev --new-backend tilelang --out "$RUN/compare_prev_vs_new.json" > "$RUN/compare_prev_vs_new.txt" 2>&1
grep -E "points —" "$RUN/compare_prev_vs_new.txt" | tail -12
pack; tar czf "$OUT/logs.tgz" -C "$OUT" new && rm -rf "$OUT/new"; ls -la "$OUT"; log done
