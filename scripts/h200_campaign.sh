#!/bin/bash
# The forward campaign with both FlashInfer generations, over the FlashInfer 0.7 relay
# (../shared/device/README.md): four device calls back to back on one warm machine, one GPU.
#   STEP=setup    carry .devsite .tlcache/all.tar.xz .run/prevkernels [.tlcache/fqla_fwd.tar.xz]
#                 (+ tree): /tmp/site312, the
#                 TileLang cache (ours, the previous kernels', the tests'), then in the background
#                 FlashInfer 0.6.13's JIT and FlashQLA's kernels for the sweep and the tests; in the
#                 foreground the whole GPU test suite in one job, then tilelang vs tilelang@prev.
#   STEP=fi07a    carry .fi07a: the CuTe-DSL MLIR library into /tmp.
#   STEP=campaign carry .fi07b (+ tree): /tmp/fisite, then configs/h200_fwd.yaml (fla, FlashInfer
#                 0.6.13 and 0.7.4, flashqla, tilelang) into runs/h200_fwd until the deadline.
#   STEP=finish   (+ tree): the campaign resumed to its end (same GPU: same campaign), what is
#                 left of tilelang vs tilelang@prev, the comparisons.
# Everything a call writes is under $OUT (logs, runs.tgz); /tmp/qlabench_env.sh carries the
# environment from call to call.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; REPO=$(pwd)
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${DEADLINE_S:-570} - ($(date +%s) - T0) )); }
ENVF=/tmp/qlabench_env.sh
sweep() { local b; b=$(( $(left) - ${RESERVE_S:-0} )); [ "$b" -lt 40 ] && { log "no time for $*"; return 1; }; log "run $* (budget ${b}s)"
  timeout --signal=INT --kill-after=20 $(( b - 15 )) qlabench run "$@" >> "$OUT/sweeps.log" 2>&1
  local rc=$?; tail -2 "$OUT/sweeps.log"; log "exit $rc"; }
pack() { tar czf "$OUT/runs.tgz" --exclude=logs --exclude=_logs runs 2>/dev/null; ls -la "$OUT"; log done; }
install_tree() { python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }; }
prev_vs_new() {  # tilelang vs tilelang@prev, forward then backward, each resumed where it stopped
  sweep configs/h200_fwd_kernels_prev.yaml --resume && \
  sweep configs/h200_bwd_kernels_prev.yaml --resume; }

case "${STEP:?STEP=setup|fi07a|campaign|finish}" in
setup)
  mkdir -p /tmp/tlc && tar -xJf .tlcache/all.tar.xz -C /tmp/tlc || exit 1
  if [ -f .tlcache/fqla_fwd.tar.xz ]; then  # FlashQLA's kernels of the forward sweep, compiled offline
    tar -xJf .tlcache/fqla_fwd.tar.xz -C /tmp/tlc && cp -rn /tmp/tlc/fqla_fwd/. /tmp/tlc/all/ && FQLA_CARRIED=1
  fi
  cp -r .run/prevkernels /tmp/prevkernels || exit 1
  source .devsite/setup.sh || exit 1
  cat > "$ENVF" <<EOF
export PYTHONPATH=/tmp/site312 PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/tlc/all
export FLA_FLASH_QLA=0 TRITON_CACHE_AUTOTUNING=1
export QLABENCH_PREV_KERNELS=/tmp/prevkernels
export QLABENCH_FLASHINFER07_PATH=/tmp/fisite:/tmp/fisite/nvidia_cutlass_dsl/dsl_packages
EOF
  source "$ENVF"; install_tree
  log "tilelang cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels"
  nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/nvidia-smi.csv"
  # FlashInfer 0.6.13's first GDN call JIT-compiles its CUTLASS module (~6 min on a bare machine)
  python3 -c "
import torch; from flashinfer.gdn_prefill import chunk_gated_delta_rule as f
T=64; q=torch.randn(T,2,128,device='cuda',dtype=torch.bfloat16); v=torch.randn(T,8,128,device='cuda',dtype=torch.bfloat16)
f(q=q,k=q,v=v,g=torch.rand(T,8,device='cuda'),beta=torch.rand(T,8,device='cuda'),cu_seqlens=torch.tensor([0,T],device='cuda'),output_final_state=True)
torch.cuda.synchronize(); print('flashinfer jit ready')" > /tmp/fi_jit.log 2>&1 &
  # FlashQLA's TileLang kernels: the tests' head configs first, then one process per sweep head config
  python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from precompile_flashqla import ensure_flash_qla; ensure_flash_qla(Path('/tmp/flashqla_site'))"
  ( nice -n 5 python3 scripts/precompile_flashqla.py --heads 2/8,4/12,2/2 --all-widths > "$OUT/fqla_tests.log" 2>&1
    [ -n "${FQLA_CARRIED:-}" ] && exit 0
    for h in 2/8 4/16 8/32 16/64 16/32 8/24 16/48 16/16 32/32; do
      nice -n 10 python3 scripts/precompile_flashqla.py --config configs/h200_fwd.yaml --only $h > "/tmp/fqla_${h/\//_}.log" 2>&1 &
    done; wait; cat /tmp/fqla_*.log > "$OUT/fqla_sweep.log"; echo "flashqla kernels ready" >> "$OUT/fqla_sweep.log" ) &
  log "gpu test suite"; t=$(date +%s)
  QLABENCH_TEST_TIMEOUT_S=240 timeout --signal=INT --kill-after=20 ${SUITE_S:-480} python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs \
    --durations=25 --junitxml="$OUT/junit.xml" tests/test_kernels_gpu.py tests/test_kernels_bwd_gpu.py \
    tests/test_poison_gpu.py tests/test_backends_gpu.py > "$OUT/gpu_tests.log" 2>&1
  echo "exit $? wall $(( $(date +%s) - t )) s" | tee -a "$OUT/gpu_tests.log"; tail -40 "$OUT/gpu_tests.log"
  log "tilelang kernels compiled on the device: $(find $TILELANG_CACHE_DIR -name executable.so -newer "$OUT/nvidia-smi.csv" | wc -l)"
  RESERVE_S=60 prev_vs_new  # a minute left for the compiles to finish: they die with the call
  log "waiting for the background compiles"; while [ "$(jobs -r | wc -l)" -gt 0 ] && [ "$(left)" -gt 15 ]; do sleep 5; done
  cp /tmp/fi_jit.log "$OUT/"; tail -2 "$OUT/fi_jit.log" "$OUT/fqla_sweep.log" 2>/dev/null
  pack;;
fi07a)
  cp .fi07a/ir.xz /tmp/fi07a.xz && ls -la /tmp/fi07a.xz; log done;;
campaign|finish)
  if [ "$STEP" = campaign ]; then
    cp .fi07b/rest.tar.xz /tmp/fi07b.tar.xz && source .fi07b/setup_flashinfer07.sh || exit 1
  fi
  source "$ENVF"; install_tree  # PYTHONPATH back to /tmp/site312: only the 0.7.4 entry adds /tmp/fisite
  PYTHONPATH=$QLABENCH_FLASHINFER07_PATH:$PYTHONPATH python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, flashinfer.__file__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, flashinfer.__file__)"
  tail -1 /tmp/fi_jit.log; ls ~/.cache/flashinfer 2>/dev/null | head -3
  R=""; [ "$STEP" = finish ] && R=--resume
  sweep configs/h200_fwd.yaml --out runs/h200_fwd $R ${CAMPAIGN_ARGS:-}
  if [ "$STEP" = finish ]; then
    prev_vs_new
    for c in "runs/h200_fwd flashinfer flashinfer@0.7.4" "runs/h200_fwd_kernels_prev tilelang@prev tilelang" \
             "runs/h200_bwd_kernels_prev tilelang@prev tilelang"; do
      set -- $c; qlabench compare "$1" --base-backend "$2" --new-backend "$3" --out "$1/compare_$2_vs_$3.json" \
        > "$1/compare_$2_vs_$3.txt" 2>&1; echo "exit $?" >> "$1/compare_$2_vs_$3.txt"; tail -25 "$1/compare_$2_vs_$3.txt"
    done
  fi
  pack;;
esac
