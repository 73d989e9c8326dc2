#!/bin/bash
# One device call: base (HEAD's kernels) vs dhu (HEAD + bwd_dhu's dh / dv_new out by a TMA store warp) vs new
# (the tree: that and bwd_h's h / v_new the same way).
# check_bwd correctness of new, timings base, new, base, new; the backward GPU suite on the tree;
# then (HO=1) the held-out backward's unmeasured points on the tree, FlashQLA and ours.
# Carry: .devsite .run/c4 and the caches in CACHES (.tlcache/NAME.tar.xz)
set -uo pipefail
FINAL=${OUT:-/tmp/out}; O=/tmp/c4o; mkdir -p $O $FINAL; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $O/ab.log; }
source .devsite/setup.sh || exit 1
mkdir -p /tmp/tlc/m
for c in ${CACHES:?}; do [ -d /tmp/tlc/$c ] || tar -xJf .tlcache/$c.tar.xz -C /tmp/tlc || exit 1; cp -rn /tmp/tlc/$c/. /tmp/tlc/m/; done
export TILELANG_CACHE_DIR=/tmp/tlc/m PYTHONUNBUFFERED=1 QLABENCH_GIT_SHA=${SHA:?}
python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install.log 2>&1 || { tail $O/install.log; exit 1; }
rm -rf /tmp/ab && cp -r .run/c4 /tmp/ab
log "cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $O/gpu.csv
pk() { case $1 in new*) echo "";; dhu*) echo /tmp/ab/pkg_dhu;; base*) echo /tmp/ab/pkg_base;; esac; }
tm() { local name=$1; shift; mkdir -p $O/$name; local p; p=$(pk $name)
  PYTHONPATH=${p:+$p:}$PYTHONPATH OUT=$O/$name timeout --kill-after=10 200 python3 -m qlabench_tools.kernels.check_bwd "$@" > $O/$name/log 2>&1
  log "$name: exit $?"; grep -E "^TIME|PASS|FAIL|CRASH|rror" $O/$name/log | cut -c1-330 | tee -a $O/ab.log; }
bad() { grep -q "CRASH\|FAIL" $O/$1/log || ! grep -q "=== summary" $O/$1/log; }
tm check_new --quick --no-time
ok=1; bad check_new && { ok=0; log "new not correct"; }
dok=1; if [ $ok = 0 ]; then tm check_dhu --quick --no-time; bad check_dhu && { dok=0; log "dhu not correct"; }; fi
for r in "" 2; do tm base$r --no-check --bwd-only; [ $dok = 1 ] && tm dhu$r --no-check --bwd-only; [ $ok = 1 ] && tm new$r --no-check --bwd-only; done
if [ $ok = 1 ]; then
  QLABENCH_TEST_TIMEOUT_S=150 timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_bwd_gpu.py -x -p no:cacheprovider > $O/pytest_bwd.log 2>&1
  log "pytest bwd exit $?"; tail -3 $O/pytest_bwd.log | tee -a $O/ab.log
fi
tar czf $FINAL/ab.tgz -C $O .
if [ "${HO:-0}" = 1 ] && [ $ok = 1 ]; then
  END=$(( T0 + ${HO_END:-560} ))
  for k in a c b; do
    left=$(( END - $(date +%s) )); [ $left -lt 40 ] && { log "ho $k: no time left"; continue; }
    timeout --kill-after=15 $left qlabench run /tmp/ab/ho_rest_$k.yaml --out $O/runs/ho_rest_$k --resume > $O/run_$k.log 2>&1
    log "ho $k exit $?"; tail -14 $O/run_$k.log | tee -a $O/ab.log
  done
  tar czf $FINAL/ab.tgz -C $O .
fi
log done
