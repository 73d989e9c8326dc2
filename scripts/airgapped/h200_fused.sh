#!/bin/bash
# Device calls on one warm machine for the fused forward kernel (kernels/fwd_fused.py), one GPU.
# Every step carries .devsite .tlcache/all.tar.xz .tlcache/fused.tar.xz .tlcache/fqla_fwd.tar.xz
# .run/prevkernels .run/repo.tar.gz (`git archive HEAD -- . ':!results' | gzip`; its commit is what
# rows record) and sets up with STEP=setup JOB=none bash scripts/airgapped/h200_campaign.sh, plus the fused
# kernels' TileLang cache (.tlcache/fused.tar.xz).
#   STEP=check    tools/kernels/check_fused.py: the small cases under a timeout (a barrier hang
#                 costs 90 s, not the call), then every case and the timing; with FIXED_COST=1 (and
#                 .run/repo_old.tar.gz carried) the fixed-cost job (scripts/airgapped/h200_fixed_cost.sh)
#                 starts in its own session afterwards and STEP=wait, the next call, collects it.
#   STEP=profile  an ncu profile of the fused kernel on 16/64 4x8192 and its stalls per role
#                 (qlabench_tools.kernels.ncu_stalls).
#   STEP=sweep    CONFIG (default configs/h200_fwd_kernels_prev.yaml: tilelang vs tilelang@prev over
#                 the forward sweep, and their comparison; configs/h200_fwd_paths.yaml and
#                 configs/h200_bwd_splits.yaml: the planners' candidates, for qlabench_tools.kernels.plan_refit)
#                 into runs/<config name>, packed into $OUT/runs.tgz; SWEEP_S caps the run; PRECOMPILE=TARGET
#                 first compiles `qlabench precompile $PRECOMPILE` there (bwd_sweep: ~60 kernels);
#                 RESUME_TGZ=FILE (a carried runs.tgz of an earlier call) goes on from its rows (--resume).
#   STEP=trace    tools/kernels/trace_fused.py: the fused kernel's per-role timeline (SM clock stamps)
#                 on its shapes, the traced kernels from the carried .tlcache/trace.tar.xz (built
#                 offline with --compile-only; directory trace).
#   STEP=stages   tools/kernels/check_fwd.py --quick (FWD_CASES: its case names, default all; every
#                 output against the reference, every stage against its emulation, then the timed
#                 cases' graph and per-stage times); with BWD_CASES, check_bwd.py --no-time on those;
#                 with RECIPES=1, configs/h200_fwd_quick_recipes.yaml's tilelang rows (strong-decay and
#                 model gates) into runs/recipes, packed into $OUT/recipes.tgz.
#   STEP=wait     until the fixed-cost job ends or the call's deadline; its files into $OUT.
# DEVICE_LEFT_S: the session's device seconds left (the fixed-cost job's deadline).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
FC=/tmp/fc_out
setup_fused() {  # the environment and the commit to run (scripts/airgapped/h200_campaign.sh), plus the fused kernels' cache
  STEP=setup JOB=none bash scripts/airgapped/h200_campaign.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  tar -xJf .tlcache/fused.tar.xz -C /tmp/tlc && cp -rn /tmp/tlc/fused/. /tmp/tlc/all/
}
log_machine() {  # the kernels in the TileLang cache, the commit and the GPU (into $OUT/gpu.csv); after env.sh
  log "tilelang cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels; commit $QLABENCH_GIT_SHA"
  nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.csv"
}

case "${STEP:?STEP=check|stages|profile|trace|sweep|wait}" in
stages)  # carry as for check
  setup_fused
  source /tmp/job/env.sh; cd /tmp/repo
  log_machine
  timeout --kill-after=10 ${CHECK_S:-240} python3 -m qlabench_tools.kernels.check_fwd --quick ${FWD_CASES:+--cases "$FWD_CASES"} > "$OUT/check_fwd.log" 2>&1
  log "check_fwd: exit $?"; grep -E "===|RESULT|TIME|stages|vs recurrence|FAIL|Error" "$OUT/check_fwd.log" | tail -60
  if [ -n "${BWD_CASES:-}" ]; then
    timeout --kill-after=10 ${BWD_S:-150} python3 -m qlabench_tools.kernels.check_bwd --no-time --cases "$BWD_CASES" > "$OUT/check_bwd.log" 2>&1
    log "check_bwd: exit $?"; grep -E "===|RESULT|rel|FAIL|Error" "$OUT/check_bwd.log" | tail -40
  fi
  if [ "${RECIPES:-0}" = 1 ]; then
    timeout --signal=INT --kill-after=20 ${RECIPES_S:-150} qlabench run configs/h200_fwd_quick_recipes.yaml \
      --backends tilelang --out runs/recipes > "$OUT/recipes.log" 2>&1
    log "recipes: exit $?"; tail -20 "$OUT/recipes.log"
    tar czf "$OUT/recipes.tgz" --exclude=_logs runs/recipes
  fi
  log done;;
sweep)  # carry as for check: CONFIG (default configs/h200_fwd_kernels_prev.yaml: tilelang vs tilelang@prev
  # over the forward sweep, then their comparison) into runs/<its name>, packed into $OUT/runs.tgz
  CONFIG=${CONFIG:-configs/h200_fwd_kernels_prev.yaml}; RUN=runs/$(basename "$CONFIG" .yaml)
  setup_fused
  SRC=$PWD; source /tmp/job/env.sh; cd /tmp/repo
  log_machine
  if [ -n "${PRECOMPILE:-}" ]; then  # kernels not in the carried cache, compiled here (8 head configs at a time)
    qlabench precompile $PRECOMPILE --jobs 8 > "$OUT/precompile.log" 2>&1; log "precompile $PRECOMPILE: exit $?"
  fi
  resume=()
  if [ -n "${RESUME_TGZ:-}" ]; then
    case $RESUME_TGZ in /*) tgz=$RESUME_TGZ;; *) tgz=$SRC/$RESUME_TGZ;; esac
    tar -xzf "$tgz" -C /tmp/repo || { log "cannot unpack RESUME_TGZ=$RESUME_TGZ"; exit 1; }
    resume=(--resume)
  fi
  # the rows so far into $OUT/runs.tgz every minute (a file being written may change under tar:
  # its exit status 1), so a call cut at the device's limit keeps them
  pack() { tar czf "$OUT/.runs.tgz" --warning=no-file-changed --exclude=_logs "$RUN" 2>/dev/null; [ $? -le 1 ] && mv "$OUT/.runs.tgz" "$OUT/runs.tgz"; }
  (while sleep 60; do pack; done) > /dev/null 2>&1 &
  snap=$!
  timeout --signal=INT --kill-after=20 ${SWEEP_S:-480} qlabench run "$CONFIG" --out "$RUN" ${resume[@]+"${resume[@]}"} > "$OUT/sweep.log" 2>&1
  log "sweep: exit $?"; pkill -P $snap 2>/dev/null; kill $snap 2>/dev/null; wait $snap 2>/dev/null; tail -30 "$OUT/sweep.log"
  if grep -q "tilelang@prev" "$CONFIG"; then
    qlabench compare "$RUN" --base-backend tilelang@prev --new-backend tilelang \
      --out "$RUN/compare_prev_vs_new.json" > "$RUN/compare_prev_vs_new.txt" 2>&1
    tail -30 "$RUN/compare_prev_vs_new.txt"
  fi
  pack; ls -la "$OUT"; log done;;
trace)  # carry as for check, plus .tlcache/trace.tar.xz
  setup_fused
  tar -xJf .tlcache/trace.tar.xz -C /tmp/tlc && cp -rn /tmp/tlc/trace/. /tmp/tlc/all/
  source /tmp/job/env.sh; cd /tmp/repo
  log_machine
  timeout --kill-after=10 ${TRACE_S:-240} python3 -m qlabench_tools.kernels.trace_fused ${SHAPES:+--shapes "$SHAPES"} > "$OUT/trace.log" 2>&1
  log "trace: exit $?"; grep -v WARNING "$OUT/trace.log" | tail -40; log done;;
profile)  # carry as for check: an ncu profile of the fused kernel (16/64 4x8192), its stalls per role
  setup_fused
  source /tmp/job/env.sh; cd /tmp/repo
  timeout 150 ncu --set full -k regex:gdn_fwd_fused --launch-skip 1 --launch-count 1 -f -o "$OUT/ncu_fused" \
    python3 -m qlabench_tools.kernels.check_fused --once > "$OUT/ncu.log" 2>&1; log "ncu: exit $?"
  timeout 60 ncu --import "$OUT/ncu_fused.ncu-rep" --page source --csv --print-source sass > /tmp/src.csv 2>/dev/null
  python3 -m qlabench_tools.kernels.ncu_stalls /tmp/src.csv --top 30 > "$OUT/stalls.txt" 2>&1; head -70 "$OUT/stalls.txt"
  timeout 60 ncu --import "$OUT/ncu_fused.ncu-rep" --page details --csv > "$OUT/details.csv" 2>/dev/null
  xz -f /tmp/src.csv && cp /tmp/src.csv.xz "$OUT/"; log done;;
check)
  setup_fused; tail -4 "$OUT/setup.log"
  source /tmp/job/env.sh
  log_machine
  mkdir -p $FC && cp .run/repo_old.tar.gz $FC/
  cd /tmp/repo
  timeout --kill-after=10 90 python3 -m qlabench_tools.kernels.check_fused --cases small --no-time > "$OUT/fused_small.log" 2>&1
  rc=$?; tail -25 "$OUT/fused_small.log"; log "small: exit $rc"
  if [ $rc -eq 0 ]; then
    timeout --kill-after=10 ${CHECK_S:-300} python3 -m qlabench_tools.kernels.check_fused --cases all > "$OUT/fused_all.log" 2>&1
    log "all: exit $?"; tail -40 "$OUT/fused_all.log"
  fi
  # the fixed-cost job (FIXED_COST=1) outlives this call; the next call (STEP=wait) collects it
  [ "${FIXED_COST:-0}" = 1 ] || { log done; exit 0; }
  end=$(( T0 + ${DEVICE_LEFT_S:-1500} - 120 ))
  setsid nohup env OUT=$FC OLD_TGZ=$FC/repo_old.tar.gz CALL_DEADLINE=$end \
    bash scripts/airgapped/h200_fixed_cost.sh > $FC/job.out 2>&1 < /dev/null &
  sleep 5; log "fixed-cost job started (deadline in $(( end - $(date +%s) ))s)";;
wait)
  left=${WAIT_S:-560}
  while pgrep -f h200_fixed_cost.sh > /dev/null && [ $(( $(date +%s) - T0 )) -lt "$left" ]; do sleep 5; done
  tail -40 $FC/job.out; cp $FC/fixed_cost* "$OUT/" 2>/dev/null; ls -la "$OUT"
  log "$(pgrep -f h200_fixed_cost.sh > /dev/null && echo 'job still running' || echo 'job done')";;
esac
