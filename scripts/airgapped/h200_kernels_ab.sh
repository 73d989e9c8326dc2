#!/bin/bash
# A/B of the in-repo kernels, forward and backward, in one device call: base (a copy of kernels/ as
# BASE_PKG/qlabench_kernels, e.g. `git archive REF kernels`, default .run/ab/pkg_base) against new (the
# tree, or NEW_PKG laid out the same way, e.g. a branch's `prepare.sh ab` package). Correctness of new
# (check_fwd on split cases, check_bwd on split cases; SKIPCHECK=1 skips it), then timings base, new,
# base2, new2 (REPS=1: base, new): check_fwd --quick on FC (stage times, whole forward) and
# check_bwd --no-check --bwd-only on BC. CHECKF / CHECKB name the correctness cases; an empty FC, BC,
# CHECKF or CHECKB skips that part. Everything into $OUT/ab.tgz.
# Cache: both arms' kernels compiled offline into .tlcache/$CACHE (default ab), packed as
# .tlcache/$CACHE.tar.xz without cuda-binaries. Carry: .devsite .tlcache/$CACHE.tar.xz, BASE_PKG's folder
# (and NEW_PKG's).
#   FC=8_24_1x32768,16_16_1x32768 BC=16_32_1x32768 bash scripts/airgapped/h200_kernels_ab.sh
set -uo pipefail
FINAL=${OUT:-/tmp/out}; O=/tmp/abo; rm -rf $O; mkdir -p $O $FINAL; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $O/ab.log; }
source .devsite/setup.sh || exit 1
CACHE=${CACHE:-ab}; BASE_PKG=${BASE_PKG:-.run/ab/pkg_base}
mkdir -p /tmp/tlc && { [ -d /tmp/tlc/$CACHE ] || tar -xJf .tlcache/$CACHE.tar.xz -C /tmp/tlc; } || exit 1
rm -rf /tmp/abpkg && cp -r "$BASE_PKG" /tmp/abpkg  # a carried folder may be gone by the next call
NEW_PKG=${NEW_PKG:-}; rm -rf /tmp/abnew; [ -z "$NEW_PKG" ] || cp -r "$NEW_PKG" /tmp/abnew || exit 1
export TILELANG_CACHE_DIR=/tmp/tlc/$CACHE PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install.log 2>&1 || { tail $O/install.log; exit 1; }
pk() { case $1 in *base*) echo /tmp/abpkg;; *) [ -z "$NEW_PKG" ] || echo /tmp/abnew;; esac; }
for a in base new; do p=$(pk $a); PYTHONPATH=${p:+$p:}$PYTHONPATH python3 -c "import qlabench_kernels as k; print('$a', k.__file__)"; done
log "cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $O/gpu.csv
run() { local name=$1 tool=$2; shift 2; mkdir -p $O/$name; local p; p=$(pk $name)
  PYTHONPATH=${p:+$p:}$PYTHONPATH OUT=$O/$name timeout --kill-after=10 ${CHECK_S:-170} python3 -m qlabench_tools.kernels.$tool "$@" > $O/$name/log 2>&1
  log "$name: exit $?"; sed -n '/=== summary/,$p' $O/$name/log | grep -E "PASS|FAIL|CRASH|split=|^TIME|ms" | cut -c1-300 | tee -a $O/ab.log
  grep -E "^TIME|CRASH|rror" $O/$name/log | cut -c1-300 | tee -a $O/ab.log; }
FC=${FC-8_24_1x32768,16_16_1x32768}; BC=${BC-16_32_1x32768,16_64_8way32768,8_16_4x8192}
CHECKF=${CHECKF-mixed_1_3_split512,mixed_2_8_split1024}; CHECKB=${CHECKB-split_2_4,split_1_3_noh0,split_2_8_h0only,16_32_1x32768}
[ "${SKIPCHECK:-0}" = 1 ] || [ -z "$CHECKF" ] || run checkf_new check_fwd --quick --no-time --cases $CHECKF
[ "${SKIPCHECK:-0}" = 1 ] || [ -z "$CHECKB" ] || run checkb_new check_bwd --quick --no-time --cases $CHECKB
for r in "" $([ "${REPS:-2}" -ge 2 ] && echo 2); do  # REPS=1: base and new once
  for a in base new; do
    [ -z "$FC" ] || run fwd_$a$r check_fwd --quick --cases $FC
    [ -z "$BC" ] || run bwd_$a$r check_bwd --no-check --bwd-only --cases $BC
  done
  tar czf $FINAL/ab.tgz -C $O .
done
log done
