#!/bin/bash
# one call: setup, split-path checks (new / prev kernels), backward split check, then the split A/B sweep
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
STEP=setup JOB=none bash scripts/h200_campaign.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
SRC=$PWD; source /tmp/job/env.sh; cd /tmp/repo
log "tilelang cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels; commit $QLABENCH_GIT_SHA"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.csv"
mkdir -p "$OUT/new" "$OUT/prev"
OUT=$OUT/new timeout --kill-after=10 ${CHECK_S:-200} python3 tools/kernels/check_fwd.py --quick --cases ${CASES:-mixed_2_8_split1024,mixed_1_3_split512,2_8_1x32768,16_16_1x32768,8_24_1x32768,4_16_1x32768} > "$OUT/new/log" 2>&1
log "check new: exit $?"; grep -E "===|RESULT|TIME|stages|vs recurrence|FAIL|Error|CRASH" "$OUT/new/log" | tail -50
if grep -q FAIL "$OUT/new/log" || grep -q CRASH "$OUT/new/log"; then log "new FAILED: no sweep"; exit 0; fi
timeout --kill-after=10 ${BWD_S:-120} python3 tools/kernels/check_bwd.py --no-time --cases split_2_8_h0only > "$OUT/new/bwd.log" 2>&1
log "check_bwd: exit $?"; grep -E "===|RESULT|rel|FAIL|PASS|Error" "$OUT/new/bwd.log" | tail -12
OUT=$OUT/prev PYTHONPATH=/tmp/prevkernels:$PYTHONPATH timeout --kill-after=10 ${PREV_S:-150} python3 tools/kernels/check_fwd.py --quick --cases ${PCASES:-2_8_1x32768,16_16_1x32768,8_24_1x32768,4_16_1x32768} > "$OUT/prev/log" 2>&1
log "check prev: exit $?"; grep -E "TIME|RESULT" "$OUT/prev/log" | tail -30
[ "${SWEEP:-1}" = 1 ] || { log done; exit 0; }
CONFIG=$SRC/.run/split.yaml; RUN=runs/split_ab
pack() { tar czf "$OUT/.runs.tgz" --warning=no-file-changed --exclude=_logs "$RUN" 2>/dev/null; [ $? -le 1 ] && mv "$OUT/.runs.tgz" "$OUT/runs.tgz"; }
(while sleep 60; do pack; done) > /dev/null 2>&1 & snap=$!
timeout --signal=INT --kill-after=20 ${SWEEP_S:-300} qlabench run "$CONFIG" --out "$RUN" > "$OUT/sweep.log" 2>&1
log "sweep: exit $?"; kill $snap 2>/dev/null; wait $snap 2>/dev/null; tail -5 "$OUT/sweep.log"
qlabench compare "$RUN" --base-backend tilelang@prev --new-backend tilelang --out "$RUN/compare_prev_vs_new.json" > "$RUN/compare_prev_vs_new.txt" 2>&1
tail -25 "$RUN/compare_prev_vs_new.txt"
pack; tar czf "$OUT/logs.tgz" -C "$OUT" new prev && rm -rf "$OUT/new" "$OUT/prev"; ls -la "$OUT"; log done
