#!/bin/bash
# One H200 session's work as one background job, fed over the FlashInfer 0.7 relay
# (../shared/device/README.md): device calls back to back on one warm machine, one GPU.
#   STEP=setup  carry .devsite .tlcache/all.tar.xz .run/prevkernels .run/repo.tar.gz (all of them built by
#               scripts/airgapped/prepare.sh) [.tlcache/fqla.tar.xz .tlcache/fqla_fwd.tar.xz .tlcache/fqla_bwd.tar.xz .tlcache/fqla_tests.tar.xz .tlcache/fi0613_jit.tar.xz
#               (scripts/airgapped/build_flashinfer06_aot.sh) .tlcache/calib.tar.xz .tlcache/{,fqla_}heldout.tar.xz
#               .tlcache/{,fqla_}bwd_heldout.tar.xz .tlcache/{,fqla_}bwd.tar.xz .tlcache/triton_autotune.tgz (FLA's Triton autotuning
#               results, a former job.tgz's triton_autotune.tgz)]:
#               /tmp/site312, the caches, the commit to run in /tmp/repo (.run/repo.tar.gz, made
#               here with `git archive HEAD -- . ':!results' | gzip`, plus the carried tree's
#               results/dispatch tables; its commit, which rows
#               record as git_sha, from the archive's header), then the job below started
#               in its own process session (it outlives the call); returns at once.
#               The tree travels with every call: it (~6 MB) and .devsite (~47 MB) fit the
#               64 MiB a call carries; .fi07a and .fi07b travel alone.
#               JOB=none: the environment only (/tmp/job/env.sh, /tmp/repo), no job, e.g. for
#               scripts/airgapped/h200_fixed_cost.sh run in the same or the next call. RESUME_TGZ: a carried
#               runs.tgz of a cut call, unpacked into /tmp/repo before the job (--resume continues it).
#   STEP=tileops carry .tileops (scripts/airgapped/bundle_tileops.sh; before fi07a, so that it is
#               unpacked when the forward steps start): /tmp/tileops_site, which the tileops entries
#               read through $QLABENCH_TILEOPS_PATH (without this call their rows are `unavailable`).
#   STEP=fi07a  carry .fi07a: the CuTe-DSL MLIR library into /tmp.
#   STEP=fi07b  carry .fi07b: /tmp/fisite (FlashInfer 0.7.4); the job starts the campaign once it is there.
#   STEP=wait   until the job ends or the call's deadline: its runs so far ($OUT/runs.tgz) and its
#               logs, test reports and checks ($OUT/job.tgz) into $OUT (write nothing else there).
#   STEP=stop   the job ended now (SIGINT to its process session, SIGKILL after 30 s: a sweep cut
#               this way resumes with --resume), then what STEP=wait brings back; e.g. when the relay's
#               calls will not come and the job would wait for FlashInfer 0.7.4 until its deadline.
# The job (STEP=job, in /tmp/repo), each step only when JOB_STEPS names it:
#   FlashInfer 0.6.13's module checked (the carried one) or JIT-built in the background, when a
#   step runs it (campaign, suite_*);
#   calibrate    python -m qlabench_tools.kernels.calibrate: the forward's and the backward's stage costs
#                on this GPU and the planners' picks under them on synthetic batches (into $J/checks: cost_table.json,
#                to commit as kernels/cost_tables/<gpu>.json, calibration_checks.json, calibration_timings.json); needs the
#                cache of `qlabench precompile calibration`;
#   tables       configs/h200_fwd_heldout.yaml, h200_fwd.yaml and h200_bwd.yaml (in this order: the forward's decision needs the first two), the in-repo kernels only, planned
#                by the committed table (`tilelang`) and by the one calibrate measured (`tl-measured`, its
#                `cost_table` parameter) side by side, into runs/<config>_tables (at most TABLES_S s, set at setup,
#                default 1000; ~4 s a row): only the points whose
#                plans differ (tools/kernels/table_points.py; the counts into $J/checks/table_points.txt);
#   fwd_prev     tilelang vs tilelang@prev on the forward sweep (configs/h200_fwd_kernels_prev.yaml; at most
#                420 s, after `tables`);
#   check_bwd    tools/kernels/check_bwd.py --quick [--cases $CHECK_BWD_CASES, set at setup]: every
#                backward stage against its emulation, the gradients against the reference, stage
#                times (into $J/checks);
#   bwd_quick    configs/h200_bwd_quick.yaml (fla, flashqla, tilelang) into runs/h200_bwd_quick
#                (no FlashInfer: it runs while the relay's calls bring FlashInfer 0.7.4);
#   serving_bwd  configs/h200_serving.yaml's backward only (fla, flashqla, tilelang: FlashInfer has none)
#                into runs/h200_serving_bwd (no FlashInfer: no relay needed);
#   verify_paths what runs where, on the device: FLA's backward with its TileLang backend off
#                (FLA_TILELANG=0: its Triton dqkwg refuses this Triton, an `unsupported` row) and on
#                (path triton+tilelang:chunk_bwd_dqkwg), 2 points of configs/h200_bwd_quick.yaml
#                into runs/fla_paths; examples/engine_dispatch.py --require on three batches (the
#                dispatch table's kernel call through the chosen backend, FlashInfer 0.7.4 first on
#                PYTHONPATH, against the reference; fails when the chosen backend cannot run);
#   bwd_prev     tilelang vs tilelang@prev on the backward sweep (configs/h200_bwd_kernels_prev.yaml);
#   bwd_splits   the backward planner's candidates side by side (configs/h200_bwd_splits.yaml);
#   fwd_recipes  the forward sweep's points under the strong-decay and model recipes (tilelang);
#   suite_kernels the in-repo kernels' GPU tests only (tests/test_kernels_gpu.py, test_kernels_bwd_gpu.py);
#   suite_fwd    the forward kernels' GPU tests only (tests/test_kernels_gpu.py: a cache of the forward's
#                kernels alone, `qlabench precompile` of the forward configs, is enough);
#   suite_first  the GPU test suite in one job (its first run on this machine);
#   bwd          the backward campaign, configs/h200_bwd.yaml (fla, flashqla, tilelang) into runs/h200_bwd
#                (no cap but the deadline: a campaign step after it gets what is left);
#   bwd_nofla    the backward sweep without FLA (flashqla, tilelang: the ratio the backward's bar is
#                set on, in a few minutes without FLA's autotuning) into runs/h200_bwd_nofla;
#   bwd_heldout  configs/h200_bwd_heldout.yaml (held-out backward head configs: fla, flashqla,
#                tilelang) into runs/h200_bwd_heldout (resumed once if cut; HELDOUT_SHARD as for fwd_heldout;
#                BWD_HELDOUT_BACKENDS, set at setup, e.g. flashqla,tilelang: those labels only);
#   campaign     the forward campaign, configs/h200_fwd.yaml (fla, FlashInfer 0.6.13 and 0.7.4,
#                flashqla, tilelang) into runs/h200_fwd, once /tmp/fisite is ready;
#   campaign_nofla the forward sweep without FLA (never the fastest library there: the best-library
#                ratio in one run at two thirds of the time; FLA's ratio then pairs another run's
#                rows) into runs/h200_fwd_nofla, once /tmp/fisite is ready, after fwd_heldout: shard 0
#                of 2 (half the points, balanced over head configs and layouts), then the rest; both
#                with --resume, so a cut campaign carried back (RESUME_TGZ) is finished, not re-measured;
#   suite_warm   the GPU test suite again, every cache warm, when the session's deadline allows;
#   correctness_tests   the correctness check's GPU tests (the fp32 reference against the fp64 recurrence, poisoning);
#   correctness_accept  scripts/airgapped/correctness_acceptance.py on FLA: every broken variant must be `incorrect`
#                (CORRECTNESS_ONLY, set at setup: the variants to run, comma-separated; default all);
#   last_tokens  tools/correctness/last_tokens.py: the error of a sequence's last tokens per backend;
#   fwd_quick    configs/h200_fwd_quick.yaml (FlashInfer 0.6.13 and 0.7.4, TileOPs among them), once
#                /tmp/fisite is ready, into runs/h200_fwd_quick;
#   serving      configs/h200_serving.yaml, every backend, into runs/h200_serving (resumed once
#                if cut);
#   fwd_heldout  configs/h200_fwd_heldout.yaml (held-out head configs, every backend), once
#                /tmp/fisite is ready, into runs/h200_fwd_heldout (resumed once if cut; HELDOUT_SHARD,
#                set at setup, e.g. 0/2: that shard of its points only, the rest by a later --resume;
#                HELDOUT_BACKENDS, set at setup, e.g. flashinfer,flashinfer@0.7.4,flashqla,tilelang:
#                those labels only, as `--backends`);
# then the comparisons of the runs it made.
# JOB_DEADLINE (epoch seconds, set at setup from DEVICE_LEFT_S) stops the job's steps in time to pack.
# ROW_TIMEOUT_S (set at setup, default 300): the sweeps' --row-timeout-s, so that one row that
# stands does not take the rest of the call (a backend whose last two rows timed out is
# `skipped` for the rest of that run; a step's resume tries it once more); a step cut by the
# deadline prints the row in flight and its worker's stack, and the last 20 kB of every worker log
# come back in job.tgz (worker_logs/).
# JOB_STEPS (set at setup; default "bwd_prev suite_first campaign suite_warm") names the steps to run,
# e.g. JOB_STEPS="campaign suite_warm" for the forward campaign and one GPU suite after it.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
J=/tmp/job; ENVF=$J/env.sh

snapshot() {  # what the job has so far, into $OUT as two files (a call brings back at most 8
  # files); small: no kernel caches, and of the worker logs (runs/*/_logs) the last 20 kB each
  tar czf "$OUT/runs.tgz" -C /tmp/repo --exclude=_logs runs 2>/dev/null
  rm -rf "$J/worker_logs"; mkdir -p "$J/worker_logs"
  for f in /tmp/repo/runs/*/_logs/*; do
    [ -f "$f" ] && tail -c 20000 "$f" > "$J/worker_logs/$(basename "$(dirname "$(dirname "$f")")")__$(basename "$f")"
  done
  (cd /tmp/triton_cache 2>/dev/null && find . -name '*.autotune.json' -print0 \
    | tar czf "$J/triton_autotune.tgz" --null -T - 2>/dev/null)  # to carry next time (setup)
  (cd "$J" && shopt -s nullglob && f=(*.log *.xml *.csv *.tgz worker_logs) && { [ ! -d checks ] || f+=(checks); } \
    && tar czf "$OUT/job.tgz" "${f[@]}")
  ls -la "$OUT"; }

case "${STEP:?STEP=setup|tileops|fi07a|fi07b|wait|stop|job}" in
setup)
  case "${JOB:-campaign}" in campaign|none) ;; *) echo "JOB=${JOB}: campaign (default) or none; the steps are JOB_STEPS" >&2; exit 2;; esac
  mkdir -p "$J" /tmp/tlc
  tar -xJf .tlcache/all.tar.xz -C /tmp/tlc || exit 1
  # FlashQLA's kernels (the sweeps, tests, held-out heads) and ours for the calibration and the held-out
  # heads, compiled offline
  for f in fqla fqla_fwd fqla_bwd fqla_tests fqla_heldout fqla_bwd_heldout calib heldout bwd_heldout bwd; do
    [ -f .tlcache/$f.tar.xz ] && tar -xJf .tlcache/$f.tar.xz -C /tmp/tlc && cp -rn /tmp/tlc/$f/. /tmp/tlc/all/
  done
  if [ -d .run/prevkernels ]; then cp -r .run/prevkernels /tmp/prevkernels || exit 1; fi
  source .devsite/setup.sh || exit 1
  # FlashInfer 0.6.13's GDN module built offline (the bf16 variants the sweeps and tests call) in
  # its precompiled slot; the job checks it and falls back to the JIT build when it fails
  if [ -f .tlcache/fi0613_jit.tar.xz ]; then tar -xJf .tlcache/fi0613_jit.tar.xz -C /tmp/site312 && echo "flashinfer 0.6.13 module: carried"; fi
  # FLA's Triton autotuning results from an earlier job on this GPU model (its job.tgz's
  # triton_autotune.tgz): the chosen configs are read back instead of compiling and timing every one
  mkdir -p /tmp/triton_cache
  if [ -f .tlcache/triton_autotune.tgz ]; then tar -xzf .tlcache/triton_autotune.tgz -C /tmp/triton_cache \
    && echo "triton autotuning: $(find /tmp/triton_cache -name '*.autotune.json' | wc -l) results carried"; fi
  rm -rf /tmp/repo && mkdir /tmp/repo && tar -xzf .run/repo.tar.gz -C /tmp/repo || exit 1
  mkdir -p /tmp/repo/results/dispatch && cp results/dispatch/*.json /tmp/repo/results/dispatch/
  SHA=$(gzip -dc .run/repo.tar.gz | git get-tar-commit-id 2>/dev/null | cut -c1-12)
  cat > "$ENVF" <<EOF
export PYTHONPATH=/tmp/site312 PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/tlc/all
export FLA_FLASH_QLA=0 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/triton_cache
export QLABENCH_PREV_KERNELS=/tmp/prevkernels
export QLABENCH_FLASHINFER07_PATH=/tmp/fisite:/tmp/fisite/nvidia_cutlass_dsl/dsl_packages
export QLABENCH_TILEOPS_PATH=/tmp/tileops_site
export JOB_DEADLINE=$(( $(date +%s) + ${DEVICE_LEFT_S:-1500} ))
export QLABENCH_GIT_SHA=${SHA:-unknown}
export JOB_STEPS="${JOB_STEPS:-bwd_prev suite_first campaign suite_warm}"
export CHECK_BWD_CASES="${CHECK_BWD_CASES:-}"
export CORRECTNESS_ONLY="${CORRECTNESS_ONLY:-}"
export TABLES_S="${TABLES_S:-1000}"
export HELDOUT_SHARD="${HELDOUT_SHARD:-}"
export BWD_HELDOUT_BACKENDS="${BWD_HELDOUT_BACKENDS:-}"
export HELDOUT_BACKENDS="${HELDOUT_BACKENDS:-}"
export ROW_TIMEOUT_S="${ROW_TIMEOUT_S:-300}"
EOF
  source "$ENVF"
  (cd /tmp/repo && python3 -m pip install -q --no-deps --no-build-isolation -e . > "$J/install.log" 2>&1) \
    || { tail -20 "$J/install.log"; exit 1; }
  log "tilelang cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels"
  nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$J/nvidia-smi.csv"
  if [ "${JOB:-campaign}" = none ]; then log "set up; no job started (JOB=none)"; exit 0; fi
  if [ -n "${RESUME_TGZ:-}" ]; then tar -xzf "$RESUME_TGZ" -C /tmp/repo || exit 1; fi  # a carried runs.tgz of a cut call
  # the redirections on the subshell itself: one that kept this call's stdout (`| tee $OUT/log`)
  # would hold the call open until the job ends
  (cd /tmp/repo && exec setsid nohup env STEP=job bash scripts/airgapped/h200_campaign.sh) > "$J/job.log" 2>&1 < /dev/null &
  echo $! > "$J/job.sid"  # the job's session (setsid in place: its id is this pid), for STEP=stop
  sleep 20; cat "$J/job.log"; log "job started";;
tileops)
  source .tileops/setup.sh || exit 1
  ls /tmp/tileops_site | head; tail -5 "$J/job.log"; log done;;
fi07a)
  cp .fi07a/ir.xz /tmp/fi07a.xz && ls -la /tmp/fi07a.xz; tail -5 "$J/job.log"; log done;;
fi07b)
  cp .fi07b/rest.tar.xz /tmp/fi07b.tar.xz && source .fi07b/setup_flashinfer07.sh || exit 1
  source "$ENVF"
  PYTHONPATH=$QLABENCH_FLASHINFER07_PATH:$PYTHONPATH python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, flashinfer.__file__)" \
    && touch /tmp/fisite.ready
  tail -5 "$J/job.log"; log done;;
wait)
  left=${WAIT_S:-560}
  while [ ! -f "$J/done" ] && [ $(( $(date +%s) - T0 )) -lt "$left" ]; do  # a snapshot a minute:
    sleep 5; [ $(( ($(date +%s) - T0) % 60 )) -lt 5 ] && snapshot > /dev/null  # the call may be cut
  done
  tail -30 "$J/job.log" 2>/dev/null; snapshot; log "$( [ -f "$J/done" ] && echo 'job done' || echo 'job still running')";;
stop)
  sid=$(cat "$J/job.sid" 2>/dev/null)
  if [ -n "$sid" ] && pgrep -s "$sid" > /dev/null; then  # by session: each step's `timeout` has its own process group
    pkill -INT -s "$sid"; for _ in $(seq 30); do pgrep -s "$sid" > /dev/null || break; sleep 1; done
    pkill -KILL -s "$sid"; log "job stopped"
  fi
  tail -30 "$J/job.log" 2>/dev/null; snapshot; log stopped;;
job)
  source "$ENVF"
  left() { echo $(( JOB_DEADLINE - $(date +%s) )); }
  step() {  # step NAME NEED MAX CMD...: CMD for at most MAX s (0: no cap) and the deadline less a minute
    local name=$1 need=$2 max=$3; shift 3; local b=$(( $(left) - 60 ))
    [[ " $JOB_STEPS " == *" ${name%_resume} "* ]] || { log "skip $name: not in JOB_STEPS"; return 1; }
    [ "$max" -gt 0 ] && [ "$b" -gt "$max" ] && b=$max
    if [ "$b" -lt "$need" ]; then log "skip $name: ${b}s left"; return 1; fi
    log "start $name (budget ${b}s)"; local t=$(date +%s)
    timeout --signal=INT --kill-after=20 "$b" "$@" > "$J/$name.log" 2>&1; local rc=$?
    tail -3 "$J/$name.log"; log "end $name: exit $rc, $(( $(date +%s) - t )) s"; return $rc; }
  suite() { echo env QLABENCH_TEST_TIMEOUT_S=240 python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs \
    --durations=25 --junitxml="$J/$1.xml" tests/test_kernels_gpu.py \
    $([ "$1" = suite_fwd ] || echo tests/test_kernels_bwd_gpu.py) \
    $([ "$1" = suite_kernels ] || [ "$1" = suite_fwd ] || echo tests/test_poison_gpu.py tests/test_backends_gpu.py); }
  # FlashInfer 0.6.13 on the head shapes of the sweeps and tests (GVA or not, with and without h0)
  fi_calls="
import torch; from flashinfer.gdn_prefill import chunk_gated_delta_rule as f
T=64; dev='cuda'
for hq, hv in ((2, 8), (2, 2)):
    for h0 in (None, torch.zeros(1, hv, 128, 128, device=dev)):
        q=torch.randn(T,hq,128,device=dev,dtype=torch.bfloat16); v=torch.randn(T,hv,128,device=dev,dtype=torch.bfloat16)
        f(q=q,k=q,v=v,g=torch.rand(T,hv,device=dev),beta=torch.rand(T,hv,device=dev),initial_state=h0,
          cu_seqlens=torch.tensor([0,T],device=dev,dtype=torch.int64),output_final_state=True)
torch.cuda.synchronize(); print('flashinfer ready')"
  wants() { [[ " $JOB_STEPS " == *" $1 "* ]]; }
  # the campaigns' rows: every kernel is compiled offline, so a row that gives nothing for
  # ROW_TIMEOUT_S (set at setup, default 300) is a `timeout` row and the sweep goes on
  RT="--row-timeout-s ${ROW_TIMEOUT_S:-300}"
  AOT=/tmp/site312/flashinfer/data/aot/gdn_prefill_sm90/gdn_prefill_sm90.so
  if wants campaign || wants suite_first || wants suite_warm || wants fwd_quick || wants serving || wants fwd_heldout; then
    if [ -f "$AOT" ] && ! timeout 120 python3 -c "$fi_calls" > "$J/fi_aot.log" 2>&1; then
      tail -5 "$J/fi_aot.log"; log "carried flashinfer module failed: JIT build instead"; rm -f "$AOT"
    fi
    if [ ! -f "$AOT" ]; then python3 -c "$fi_calls" > "$J/fi_jit.log" 2>&1 & FI_PID=$!; else log "flashinfer: carried module ok"; fi
  fi
  mkdir -p "$J/checks"
  step calibrate 60 300 python3 -m qlabench_tools.kernels.calibrate --out "$J/checks/cost_table.json" \
    --timings "$J/checks/calibration_timings.json" \
    --checks "$J/checks/calibration_checks.json"
  if wants tables && [ -f "$J/checks/cost_table.json" ]; then  # the points whose plans differ under the two tables
    rm -rf "$J/tables"
    for n in h200_fwd_heldout h200_fwd h200_bwd; do
      python3 -m qlabench_tools.kernels.table_points configs/$n.yaml --table "$J/checks/cost_table.json" \
        --out-dir "$J/tables" | tee -a "$J/checks/table_points.txt"
    done
  fi
  step tables 120 "${TABLES_S:-1000}" bash -c 'for n in h200_fwd_heldout h200_fwd h200_bwd; do
    for f in /tmp/job/tables/${n}_tables_[0-9]*.yaml; do [ -f "$f" ] || continue; qlabench run "$f" --resume || exit 1; done
  done'
  step fwd_prev 120 420 qlabench run configs/h200_fwd_kernels_prev.yaml --resume
  step check_bwd 60 240 env OUT="$J/checks" python3 -m qlabench_tools.kernels.check_bwd --quick ${CHECK_BWD_CASES:+--cases "$CHECK_BWD_CASES"}
  step bwd_quick 120 600 qlabench run configs/h200_bwd_quick.yaml --out runs/h200_bwd_quick --resume
  step serving_bwd 120 700 qlabench run configs/h200_serving.yaml --direction bwd --backends fla,flashqla,tilelang \
    --out runs/h200_serving_bwd --resume
  step verify_paths 90 300 bash -c '
    FLA_TILELANG=0 qlabench run configs/h200_bwd_quick.yaml --backends fla --limit 2 --out runs/fla_paths/triton_only
    qlabench run configs/h200_bwd_quick.yaml --backends fla --limit 2 --out runs/fla_paths/dispatched
    rc=0
    while [ ! -f /tmp/fisite.ready ] && [ $SECONDS -lt 300 ]; do sleep 5; done  # FlashInfer 0.7.4 (relay)
    for b in "4/16 1024,512" "16/64 8192,8192,8192,8192" "2/8 32768"; do
      set -- $b
      PYTHONPATH=$QLABENCH_FLASHINFER07_PATH:$PYTHONPATH python3 examples/engine_dispatch.py --require \
        --table results/dispatch/h200_fwd.json --heads "$1" --seqlens "$2" || rc=1
    done; exit $rc'
  step suite_kernels 120 300 $(suite suite_kernels)
  step suite_fwd 120 300 $(suite suite_fwd)
  step bwd_prev 120 360 qlabench run configs/h200_bwd_kernels_prev.yaml --resume
  step bwd_splits 120 420 qlabench run configs/h200_bwd_splits.yaml --resume
  step fwd_recipes 120 360 qlabench run configs/h200_fwd_recipes.yaml --resume
  step suite_first 200 420 $(suite suite_first)
  step bwd 300 0 qlabench run configs/h200_bwd.yaml --out runs/h200_bwd --resume
  step bwd_nofla 300 0 qlabench run configs/h200_bwd.yaml --out runs/h200_bwd_nofla --backends flashqla,tilelang --resume $RT
  heldout_b="qlabench run configs/h200_bwd_heldout.yaml --out runs/h200_bwd_heldout --resume $RT ${HELDOUT_SHARD:+--shard $HELDOUT_SHARD} ${BWD_HELDOUT_BACKENDS:+--backends $BWD_HELDOUT_BACKENDS}"
  step bwd_heldout "$([ -n "$HELDOUT_SHARD" ] && echo 120 || echo 300)" 0 $heldout_b
  [ $? -ne 0 ] && [ "$(left)" -gt 150 ] && step bwd_heldout_resume 90 0 $heldout_b
  if wants campaign; then
    while [ -n "${FI_PID:-}" ] && kill -0 "$FI_PID" 2>/dev/null && [ "$(left)" -gt 400 ]; do sleep 5; done
    tail -1 "$J/fi_jit.log" 2>/dev/null
    log "waiting for /tmp/fisite"; while [ ! -f /tmp/fisite.ready ] && [ "$(left)" -gt 300 ]; do sleep 5; done
    step campaign 300 0 qlabench run configs/h200_fwd.yaml --out runs/h200_fwd $RT
    [ $? -ne 0 ] && [ "$(left)" -gt 150 ] && step campaign_resume 90 0 qlabench run configs/h200_fwd.yaml --out runs/h200_fwd --resume $RT
  fi
  step correctness_tests 60 240 python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs \
    --junitxml="$J/correctness_tests.xml" tests/test_reference.py tests/test_poison_gpu.py
  step correctness_accept 120 420 python3 scripts/airgapped/correctness_acceptance.py --fwd configs/h200_fwd_quick.yaml \
    --bwd configs/h200_bwd_quick.yaml --out runs/correctness_acceptance ${CORRECTNESS_ONLY:+--only "$CORRECTNESS_ONLY"}
  step last_tokens 60 240 python3 -m qlabench_tools.correctness.last_tokens --out "$J/checks"
  if wants fwd_quick || wants serving || wants fwd_heldout || wants campaign_nofla; then
    while [ -n "${FI_PID:-}" ] && kill -0 "$FI_PID" 2>/dev/null && [ "$(left)" -gt 400 ]; do sleep 5; done
    log "waiting for /tmp/fisite"; while [ ! -f /tmp/fisite.ready ] && [ "$(left)" -gt 300 ]; do sleep 5; done
  fi
  step fwd_quick 120 420 qlabench run configs/h200_fwd_quick.yaml --out runs/h200_fwd_quick --resume
  step serving 300 0 qlabench run configs/h200_serving.yaml --out runs/h200_serving --resume
  [ $? -ne 0 ] && [ "$(left)" -gt 150 ] && step serving_resume 90 0 qlabench run configs/h200_serving.yaml --out runs/h200_serving --resume
  heldout="qlabench run configs/h200_fwd_heldout.yaml --out runs/h200_fwd_heldout --resume $RT ${HELDOUT_SHARD:+--shard $HELDOUT_SHARD} ${HELDOUT_BACKENDS:+--backends $HELDOUT_BACKENDS}"
  step fwd_heldout "$([ -n "$HELDOUT_SHARD" ] && echo 120 || echo 300)" 0 $heldout
  [ $? -ne 0 ] && [ "$(left)" -gt 150 ] && step fwd_heldout_resume 90 0 $heldout
  # shard 0 of 2 first (half the points, balanced by work over every head config and layout), then the rest
  step campaign_nofla 300 0 qlabench run configs/h200_fwd.yaml --out runs/h200_fwd_nofla \
    --backends flashinfer,flashinfer@0.7.4,flashqla,tilelang --shard 0/2 --resume $RT
  step campaign_nofla_resume 90 0 qlabench run configs/h200_fwd.yaml \
    --out runs/h200_fwd_nofla --backends flashinfer,flashinfer@0.7.4,flashqla,tilelang --resume $RT
  step suite_warm 240 480 $(suite suite_warm)
  for c in "runs/h200_fwd flashinfer flashinfer@0.7.4" "runs/h200_bwd_kernels_prev tilelang@prev tilelang" \
      "runs/h200_fwd_kernels_prev tilelang@prev tilelang" \
      "runs/h200_fwd_tables tilelang tl-measured" "runs/h200_bwd_tables tilelang tl-measured" \
      "runs/h200_fwd_heldout_tables tilelang tl-measured"; do
    set -- $c; [ -d "$1" ] || continue
    qlabench compare "$1" --base-backend "$2" --new-backend "$3" --out "$1/compare_$2_vs_$3.json" \
      > "$1/compare_$2_vs_$3.txt" 2>&1; echo "exit $?" >> "$1/compare_$2_vs_$3.txt"; tail -25 "$1/compare_$2_vs_$3.txt"
  done
  log "job done"; touch "$J/done";;
esac
