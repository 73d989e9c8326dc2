#!/bin/bash
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
STEP=setup JOB=none bash scripts/h200_campaign.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
SRC=$PWD; source /tmp/job/env.sh; cd /tmp/repo
log "tilelang cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels; commit $QLABENCH_GIT_SHA"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.csv"
RUN=runs/plan_ab
pack() { tar czf "$OUT/.runs.tgz" --warning=no-file-changed --exclude=_logs "$RUN" 2>/dev/null; [ $? -le 1 ] && mv "$OUT/.runs.tgz" "$OUT/runs.tgz"; }
(while sleep 60; do pack; done) > /dev/null 2>&1 & snap=$!
for c in plan1 plan2; do
  timeout --signal=INT --kill-after=20 ${SWEEP_S:-240} qlabench run "$SRC/.run/$c.yaml" --out "$RUN" > "$OUT/sweep_$c.log" 2>&1
  log "sweep $c: exit $?"; tail -3 "$OUT/sweep_$c.log"
done
kill $snap 2>/dev/null; wait $snap 2>/dev/null
qlabench compare "$RUN" --base-backend tilelang@prev --new-backend tilelang --out "$RUN/compare_prev_vs_new.json" > "$RUN/compare_prev_vs_new.txt" 2>&1
grep -E "IMPROVEMENT|REGRESSION|points —" "$RUN/compare_prev_vs_new.txt" | tail -40
pack; ls -la "$OUT"; log done
