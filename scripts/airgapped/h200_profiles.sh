#!/bin/bash
# Issue #6 on the device: the kernel breakdown (torch.profiler) of every backend on one point,
# then Nsight Compute on the in-repo kernels, into $OUT/profile.
#   POINT=1x32768 MODEL=2/8 NCU_BACKENDS="tilelang" bash scripts/airgapped/h200_profiles.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/profile"
export FLA_FLASH_QLA=0 TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
CFG=${CFG:-configs/h200_fwd_quick.yaml}; POINT=${POINT:-1x32768}; MODEL=${MODEL:-2/8}
for b in ${BACKENDS:-fla flashinfer flashqla tilelang}; do
  timeout ${PROFILE_TIMEOUT:-60} qlabench profile "$CFG" --point "$POINT" --model "$MODEL" --backend "$b" \
    --out "$OUT/profile" 2>&1 | tee -a "$OUT/profile/profile.log"
done
for b in ${NCU_BACKENDS:-tilelang}; do
  timeout ${NCU_TIMEOUT:-90} qlabench profile "$CFG" --point "$POINT" --model "$MODEL" --backend "$b" --ncu \
    --out "$OUT/profile/ncu" 2>&1 | tee -a "$OUT/profile/profile.log"
done
# the full section set of one kernel (where its time goes: stalls, pipes, shared-memory conflicts)
if [ -n "${NCU_FULL_KERNEL:-}" ]; then
  timeout ${NCU_TIMEOUT:-90} qlabench profile "$CFG" --point "$POINT" --model "$MODEL" --backend tilelang --ncu \
    --ncu-set full --ncu-kernel "$NCU_FULL_KERNEL" --out "$OUT/profile/ncu_full" 2>&1 | tee -a "$OUT/profile/profile.log"
  # readable without Nsight Compute: every section's metrics, and the SASS with per-instruction
  # stall samples (where the warps wait)
  for r in "$OUT"/profile/ncu_full/*.ncu-rep; do
    [ -f "$r" ] || continue
    timeout 60 ncu --import "$r" --page details --csv > "${r%.ncu-rep}.details.csv" 2>> "${r%.ncu-rep}.import.log" || true
    timeout 60 ncu --import "$r" --page source --csv --print-source sass > "${r%.ncu-rep}.source.csv" \
      2>> "${r%.ncu-rep}.import.log" || true
  done
fi
