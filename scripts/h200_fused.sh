#!/bin/bash
# Device calls back to back on one warm machine: the fused forward kernel's check and timing
# (tools/kernels/check_fused.py), then the fixed-cost measurement (scripts/h200_fixed_cost.sh)
# as a background job that the next call waits for.
#   STEP=check  carry .devsite .tlcache/all.tar.xz .tlcache/fused.tar.xz .tlcache/fqla_fwd.tar.xz
#               .run/prevkernels .run/repo.tar.gz .run/repo_old.tar.gz:
#               the environment (STEP=setup JOB=none bash scripts/h200_campaign.sh), the fused
#               kernels' cache, check_fused (small cases under a timeout: a barrier hang costs
#               90 s, not the call), then the fixed-cost job started in its own session.
#   STEP=wait   until the fixed-cost job ends or the call's deadline; its files into $OUT.
# DEVICE_LEFT_S: the session's device seconds left (the fixed-cost job's deadline).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
FC=/tmp/fc_out

case "${STEP:?STEP=check|variants|sweep|wait}" in
sweep)  # carry as for check: tilelang vs tilelang@prev over the forward sweep (configs/h200_fwd_kernels_prev.yaml)
  STEP=setup JOB=none bash scripts/h200_campaign.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  tar -xJf .tlcache/fused.tar.xz -C /tmp/tlc && cp -rn /tmp/tlc/fused/. /tmp/tlc/all/
  source /tmp/job/env.sh; cd /tmp/repo
  nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.csv"
  timeout --signal=INT --kill-after=20 ${SWEEP_S:-480} qlabench run configs/h200_fwd_kernels_prev.yaml \
    --out runs/h200_fwd_kernels_prev > "$OUT/sweep.log" 2>&1; log "sweep: exit $?"; tail -30 "$OUT/sweep.log"
  qlabench compare runs/h200_fwd_kernels_prev --base-backend tilelang@prev --new-backend tilelang \
    --out runs/h200_fwd_kernels_prev/compare_prev_vs_new.json > runs/h200_fwd_kernels_prev/compare_prev_vs_new.txt 2>&1
  tail -30 runs/h200_fwd_kernels_prev/compare_prev_vs_new.txt
  tar czf "$OUT/runs.tgz" --exclude=_logs runs/h200_fwd_kernels_prev; ls -la "$OUT"; log done;;
variants)  # carry as for check: the variants' times and an ncu profile of the fused kernel per role
  STEP=setup JOB=none bash scripts/h200_campaign.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  tar -xJf .tlcache/fused.tar.xz -C /tmp/tlc && cp -rn /tmp/tlc/fused/. /tmp/tlc/all/
  source /tmp/job/env.sh; cd /tmp/repo
  timeout 200 python3 tools/kernels/check_fused.py --cases small --no-time --variants ${VARIANTS:-base} > "$OUT/variants.log" 2>&1
  log "variants: exit $?"; grep -A12 "=== variants" "$OUT/variants.log"; grep -c ok=True "$OUT/variants.log"
  for v in ${NCU_VARIANTS:-base}; do
    timeout 150 ncu --set full -k regex:gdn_fwd_fused --launch-skip 1 --launch-count 1 -f -o "$OUT/ncu_$v" \
      python3 tools/kernels/check_fused.py --once $v > "$OUT/ncu_$v.log" 2>&1; log "ncu $v: exit $?"
    timeout 60 ncu --import "$OUT/ncu_$v.ncu-rep" --page source --csv --print-source sass > /tmp/src_$v.csv 2>/dev/null
    python3 scripts/ncu_stalls.py /tmp/src_$v.csv --top 30 > "$OUT/stalls_$v.txt" 2>&1; head -70 "$OUT/stalls_$v.txt"
    timeout 60 ncu --import "$OUT/ncu_$v.ncu-rep" --page details --csv > "$OUT/details_$v.csv" 2>/dev/null
    xz -f /tmp/src_$v.csv && cp /tmp/src_$v.csv.xz "$OUT/"
  done
  log done;;
check)
  STEP=setup JOB=none bash scripts/h200_campaign.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  tail -4 "$OUT/setup.log"
  tar -xJf .tlcache/fused.tar.xz -C /tmp/tlc && cp -rn /tmp/tlc/fused/. /tmp/tlc/all/
  source /tmp/job/env.sh
  log "tilelang cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels; commit $QLABENCH_GIT_SHA"
  nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.csv"
  mkdir -p $FC && cp .run/repo_old.tar.gz $FC/
  cd /tmp/repo
  timeout --kill-after=10 90 python3 tools/kernels/check_fused.py --cases small --no-time > "$OUT/fused_small.log" 2>&1
  rc=$?; tail -25 "$OUT/fused_small.log"; log "small: exit $rc"
  if [ $rc -eq 0 ]; then
    timeout --kill-after=10 ${CHECK_S:-300} python3 tools/kernels/check_fused.py --cases all > "$OUT/fused_all.log" 2>&1
    log "all: exit $?"; tail -40 "$OUT/fused_all.log"
  fi
  # the fixed-cost job (FIXED_COST=1) outlives this call; the next call (STEP=wait) collects it
  [ "${FIXED_COST:-0}" = 1 ] || { log done; exit 0; }
  end=$(( T0 + ${DEVICE_LEFT_S:-1500} - 120 ))
  setsid nohup env OUT=$FC OLD_TGZ=$FC/repo_old.tar.gz CALL_DEADLINE=$end \
    bash scripts/h200_fixed_cost.sh > $FC/job.out 2>&1 < /dev/null &
  sleep 5; log "fixed-cost job started (deadline in $(( end - $(date +%s) ))s)";;
wait)
  left=${WAIT_S:-560}
  while pgrep -f h200_fixed_cost.sh > /dev/null && [ $(( $(date +%s) - T0 )) -lt "$left" ]; do sleep 5; done
  tail -40 $FC/job.out; cp $FC/fixed_cost* "$OUT/" 2>/dev/null; ls -la "$OUT"
  log "$(pgrep -f h200_fixed_cost.sh > /dev/null && echo 'job still running' || echo 'job done')";;
esac
