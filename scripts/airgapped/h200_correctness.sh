#!/bin/bash
# One device call: the correctness check's acceptance on the H200. Expects carried: .devsite (bundle.sh), .tlcache/tl.tar.xz (TileLang cache of our
# kernels and FlashQLA's, filled offline), and the tree to run in $TREE (default: .).
#   1. GPU tests of the poisoning; 2. broken FLA variants must be `incorrect` (correctness_acceptance.py);
#   3. the quick forward / backward points on the published recipe (FlashInfer after its JIT,
#      which a background process starts at once); 4. the same points under the strong-decay and
#      model recipes; 5. compare against the kept runs at 2%.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; REPO=$(pwd); TREE=${TREE:-.}
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${DEADLINE_S:-560} - ($(date +%s) - T0) )); }
mkdir -p /tmp/tlc && tar -xJf .tlcache/tl.tar.xz -C /tmp/tlc && export TILELANG_CACHE_DIR=/tmp/tlc/tl
source .devsite/setup.sh || exit 1
export FLA_FLASH_QLA=0 TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
cd "$TREE" && python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
log "installed; tilelang cache: $(find $TILELANG_CACHE_DIR -name '*.so' -o -name '*.cubin' | wc -l) files"
nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
STEPS=${STEPS:-"tests accept fq bq fqr bqr fi caches compare"}  # what to run (sweeps in this order)
has() { [[ " $STEPS " == *" $1 "* ]]; }
# FlashInfer's first GDN call JIT-compiles (~6 min): start it now, in its own process
has fi && python3 -c "
import torch; from flashinfer.gdn_prefill import chunk_gated_delta_rule as f
T=64; q=torch.randn(T,2,128,device='cuda',dtype=torch.bfloat16); v=torch.randn(T,8,128,device='cuda',dtype=torch.bfloat16)
f(q=q,k=q,v=v,g=torch.rand(T,8,device='cuda'),beta=torch.rand(T,8,device='cuda'),cu_seqlens=torch.tensor([0,T],device='cuda'),output_final_state=True)
torch.cuda.synchronize(); print('flashinfer jit ready')" > "$OUT/fi_jit.log" 2>&1 &
FI=$!
sweep() { local b; b=$(left); [ "$b" -lt 25 ] && { log "no time for $*"; return; }; log "sweep $* (budget ${b}s)"
  timeout --signal=INT --kill-after=15 $(( b - 10 )) qlabench run "$@" --resume >> "$OUT/sweeps.log" 2>&1; tail -3 "$OUT/sweeps.log"; }
has tests && { log "gpu tests"; timeout 120 python3 -m pytest -q -m gpu tests/test_poison_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -5; }
has accept && { log "broken variants ${ACCEPT:-all}"; timeout $(( $(left) - 200 )) python3 scripts/airgapped/correctness_acceptance.py --fwd configs/h200_fwd_quick.yaml --bwd configs/h200_bwd_quick.yaml --out runs/correctness_acceptance ${ACCEPT:+--only $ACCEPT} ${ACCEPT_BACKEND:+--backend $ACCEPT_BACKEND} > "$OUT/acceptance.log" 2>&1; grep -E "incorrect$|^\[ " "$OUT/acceptance.log" | tail -30; }
for st in $STEPS; do case $st in  # the sweeps run in the order STEPS names them
  fq) sweep configs/h200_fwd_quick.yaml --out runs/fq --backends fla,flashqla,tilelang;;
  bq) sweep configs/h200_bwd_quick.yaml --out runs/bq;;
  bqr) sweep configs/h200_bwd_quick_recipes.yaml --out runs/bqr;;
  fqr) sweep configs/h200_fwd_quick_recipes.yaml --out runs/fqr --backends fla,flashqla,tilelang;;
esac; done
if has fi; then
  log "waiting for the FlashInfer JIT"; while kill -0 $FI 2>/dev/null && [ "$(left)" -gt 50 ]; do sleep 5; done; tail -3 "$OUT/fi_jit.log"
  sweep configs/h200_fwd_quick.yaml --out runs/fq --backends flashinfer
  sweep configs/h200_fwd_quick_recipes.yaml --out runs/fqr --backends flashinfer
fi
# caches for a later call on a fresh machine (Triton: FLA's kernels and autotune results; FlashInfer's JIT)
if has caches; then
  tar -c -C ~ .triton 2>/dev/null | xz -T0 -3 > "$OUT/triton_cache.tar.xz"
  [ -d ~/.cache/flashinfer ] && tar -c -C ~/.cache flashinfer | xz -T0 -3 > "$OUT/flashinfer_cache.tar.xz"
fi
if has compare; then
log "compare"
python3 -c "
from qlabench import results as R
for new, kept, sub in (('runs/fq', 'h200_fwd', 'kept_fq'), ('runs/bq', 'h200_bwd', 'kept_bq')):
    keys = set(R.load(new)['point_key']); d = R.latest(R.load('$REPO/results/' + kept))
    st = R.ResultStore('/tmp/' + sub); st.ensure(); R._write_rows_file(st.parts, 'kept', d[d.point_key.isin(keys)])
" 2>&1 | tail -3
for p in "/tmp/kept_fq runs/fq" "/tmp/kept_bq runs/bq"; do
  set -- $p; qlabench compare $1 $2 --threshold 0.02 --out "runs/compare_$(basename $2).json" > /tmp/cmp.log 2>&1
  echo "exit $?" >> /tmp/cmp.log; cat /tmp/cmp.log >> "$OUT/compare.log"; tail -30 /tmp/cmp.log; done
fi
tar czf "$OUT/runs.tgz" --exclude=logs --exclude=_logs runs; ls -la "$OUT"; log done
