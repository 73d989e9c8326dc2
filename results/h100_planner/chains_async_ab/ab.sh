#!/bin/bash
# One device call: base (HEAD) vs dhu (HEAD + the asynchronous bwd_dhu step) vs new (the tree: that plus
# bwd_h / seg_state's asynchronous chain step). check_bwd correctness of dhu and new, then timings
# base, dhu, new twice; check_fwd (split cases) base/new; the GPU suites on the tree; ncu of new.
# Carry: .devsite .tlcache/dhuab.tar.xz .tlcache/c3new.tar.xz .run/c3
set -uo pipefail
FINAL=${OUT:-/tmp/out}; O=$FINAL; T0=$(date +%s); mkdir -p $O
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $O/ab.log; }
source .devsite/setup.sh || exit 1
mkdir -p /tmp/tlc
for c in dhuab c3new; do [ -d /tmp/tlc/$c ] || tar -xJf .tlcache/$c.tar.xz -C /tmp/tlc || exit 1; done
mkdir -p /tmp/tlc/m && cp -rn /tmp/tlc/dhuab/. /tmp/tlc/m/ && cp -rn /tmp/tlc/c3new/. /tmp/tlc/m/
export TILELANG_CACHE_DIR=/tmp/tlc/m PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install.log 2>&1 || { tail $O/install.log; exit 1; }
rm -rf /tmp/ab && cp -r .run/c3 /tmp/ab
log "cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $O/gpu.csv
pk() { case $1 in new*) echo "";; dhu*) echo /tmp/ab/pkg_dhu;; base*) echo /tmp/ab/pkg_base;; esac; }
for a in base dhu new; do PYTHONPATH=$(pk $a)${PYTHONPATH:+:$PYTHONPATH} python3 -c "import qlabench_kernels as k; print('$a', k.__file__)" | tee -a $O/ab.log; done
tm() { local name=$1 tool=$2; shift 2; mkdir -p $O/$name; local p; p=$(pk $name)
  PYTHONPATH=${p:+$p:}$PYTHONPATH OUT=$O/$name timeout --kill-after=10 ${CHECK_S:-200} python3 -m qlabench_tools.kernels.$tool "$@" > $O/$name/log 2>&1
  log "$name: exit $?"; grep -E "^TIME|PASS|FAIL|CRASH|Error|rror:" $O/$name/log | cut -c1-330 | tee -a $O/ab.log; }
tm check_dhu check_bwd --quick --no-time
tm check_new check_bwd --quick --no-time
bad() { grep -q "CRASH\|FAIL" $O/$1/log || ! grep -q "=== summary" $O/$1/log; }
arms=""; bad check_dhu && log "dhu not correct" || arms="$arms dhu"
bad check_new && log "new not correct" || arms="$arms new"
for r in "" 2; do
  tm base$r check_bwd --no-check --bwd-only
  for a in $arms; do tm $a$r check_bwd --no-check --bwd-only; done
done
FC=mixed_2_8_split1024,mixed_1_3_split512,2_8_1x32768,16_64_1x32768,2_8_1x8192
tm basefwd check_fwd --quick --cases 2_8_1x32768,16_64_1x32768,2_8_1x8192
tm newfwd check_fwd --quick --cases $FC
left=$(( 560 - $(date +%s) + T0 )); log "pytest bwd + fwd split (the tree) with ${left}s"
QLABENCH_TEST_TIMEOUT_S=150 timeout $(( left > 200 ? 200 : left )) python3 -m pytest -q -m gpu tests/test_kernels_bwd_gpu.py -x -p no:cacheprovider > $O/pytest_bwd.log 2>&1; log "pytest bwd exit $?"; tail -3 $O/pytest_bwd.log | tee -a $O/ab.log
left=$(( 570 - $(date +%s) + T0 ))
[ $left -gt 30 ] && { QLABENCH_TEST_TIMEOUT_S=150 timeout $left python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "1024 and 64" -x -p no:cacheprovider > $O/pytest_fwd.log 2>&1; log "pytest fwd exit $?"; tail -3 $O/pytest_fwd.log | tee -a $O/ab.log; }
log done
