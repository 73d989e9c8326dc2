#!/bin/bash
# One device call: the correctness gate's acceptance on the H200 (issue "Close the correctness
# gate's holes"). Expects carried: .devsite (bundle.sh), .tlcache/tl.tar.xz (TileLang cache of our
# kernels and FlashQLA's, filled offline), and the tree to run in $TREE (default: .).
#   1. GPU tests of the poisoning; 2. broken FLA variants must be `incorrect` (gate_acceptance.py);
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
# FlashInfer's first GDN call JIT-compiles (~6 min): start it now, in its own process
python3 -c "
import torch; from flashinfer.gdn_prefill import chunk_gated_delta_rule as f
T=64; q=torch.randn(T,2,128,device='cuda',dtype=torch.bfloat16); v=torch.randn(T,8,128,device='cuda',dtype=torch.bfloat16)
f(q=q,k=q,v=v,g=torch.rand(T,8,device='cuda'),beta=torch.rand(T,8,device='cuda'),cu_seqlens=torch.tensor([0,T],device='cuda'),output_final_state=True)
torch.cuda.synchronize(); print('flashinfer jit ready')" > "$OUT/fi_jit.log" 2>&1 &
FI=$!
log "gpu tests"; timeout 120 python3 -m pytest -q -m gpu tests/test_poison_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
log "broken variants"; timeout 200 python3 scripts/gate_acceptance.py --fwd configs/h200_fwd_quick.yaml --bwd configs/h200_bwd_quick.yaml --out runs/gate_acceptance 2>&1 | tee "$OUT/acceptance.log" | grep -v "^\[" | tail -20
sweep() { local b; b=$(left); [ "$b" -lt 25 ] && { log "no time for $*"; return; }; log "sweep $* (budget ${b}s)"
  timeout --signal=INT --kill-after=15 $(( b - 10 )) qlabench run "$@" --resume >> "$OUT/sweeps.log" 2>&1; tail -3 "$OUT/sweeps.log"; }
sweep configs/h200_fwd_quick.yaml --out runs/fq --backends fla,flashqla,tilelang
sweep configs/h200_bwd_quick.yaml --out runs/bq
sweep configs/h200_fwd_quick_recipes.yaml --out runs/fqr --backends fla,flashqla,tilelang
sweep configs/h200_bwd_quick_recipes.yaml --out runs/bqr
log "waiting for the FlashInfer JIT"; while kill -0 $FI 2>/dev/null && [ "$(left)" -gt 60 ]; do sleep 5; done; cat "$OUT/fi_jit.log" | tail -3
sweep configs/h200_fwd_quick.yaml --out runs/fq --backends flashinfer
sweep configs/h200_fwd_quick_recipes.yaml --out runs/fqr --backends flashinfer
log "compare"
python3 -c "
from qlabench import results as R; import pandas as pd, pathlib
keys=set(R.load('runs/bq')['point_key']); d=R.latest(R.load('$REPO/results/h200_bwd')); d=d[d.point_key.isin(keys)]
st=R.ResultStore('/tmp/kept_bq'); st.ensure(); [st.append(r) for r in d.to_dict('records')]" 2>&1 | tail -3
for p in "$REPO/results/h200_fwd_quick runs/fq" "/tmp/kept_bq runs/bq"; do
  set -- $p; qlabench compare $1 $2 --threshold 0.02 --out "runs/compare_$(basename $2).json" > /tmp/cmp.log 2>&1
  echo "exit $?" >> /tmp/cmp.log; cat /tmp/cmp.log >> "$OUT/compare.log"; tail -30 /tmp/cmp.log; done
tar czf "$OUT/runs.tgz" runs; ls -la "$OUT"; log done
