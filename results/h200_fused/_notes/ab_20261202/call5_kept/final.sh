#!/bin/bash
# the kept fused kernel: every check_fused case, the quick points under the strong-decay and model gate recipes
# (tilelang only), the per-role trace on four shapes
set -uo pipefail
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
source .devsite/setup.sh || exit 1
mkdir -p /tmp/tlc && tar -xJf .tlcache/fused.tar.xz -C /tmp/tlc || exit 1
export TILELANG_CACHE_DIR=/tmp/tlc/fused PYTHONUNBUFFERED=1 QLABENCH_GIT_SHA=$(cat .run/commit.txt)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$FINAL/install.log" 2>&1 || { tail "$FINAL/install.log"; exit 1; }
log "cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels; commit $QLABENCH_GIT_SHA"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$FINAL/gpu.csv"
mkdir -p $FINAL/check; OUT=$FINAL/check timeout --kill-after=10 200 python3 tools/kernels/check_fused.py --cases all > $FINAL/check/log 2>&1
log "check_fused all: exit $?"; grep -E "ok=|shape=|Error" $FINAL/check/log | cut -c1-260
timeout --signal=INT --kill-after=20 150 qlabench run configs/h200_fwd_quick_recipes.yaml --backends tilelang --out /tmp/rec/h200_fwd_quick_recipes > $FINAL/recipes.log 2>&1
log "recipes: exit $?"; tail -25 $FINAL/recipes.log
tar czf $FINAL/recipes.tgz -C /tmp/rec --exclude=_logs h200_fwd_quick_recipes
mkdir -p $FINAL/trace; OUT=$FINAL/trace timeout --kill-after=10 120 python3 tools/kernels/trace_fused.py > $FINAL/trace/log 2>&1
log "trace: exit $?"; grep -E "===|period" $FINAL/trace/log
log done
