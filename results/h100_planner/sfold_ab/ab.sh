#!/bin/bash
# One device call: base (HEAD's kernels, .run/sf/pkg_base) vs new (the tree: V folded into seg_state's chain, so
# seg_state and bwd_h). Correctness of new (check_fwd on split cases, check_bwd on split cases), then timings
# base, new, base2, new2: check_fwd on two split shapes (stage times, whole forward), check_bwd --bwd-only.
# Carry: .devsite .tlcache/sfold.tar.xz .run/sf
set -uo pipefail
FINAL=${OUT:-/tmp/out}; O=/tmp/sfo; rm -rf $O; mkdir -p $O $FINAL; T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $O/ab.log; }
source .devsite/setup.sh || exit 1
mkdir -p /tmp/tlc && { [ -d /tmp/tlc/sfold ] || tar -xJf .tlcache/sfold.tar.xz -C /tmp/tlc; } || exit 1
rm -rf /tmp/sfpkg && cp -r .run/sf /tmp/sfpkg
export TILELANG_CACHE_DIR=/tmp/tlc/sfold PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $O/install.log 2>&1 || { tail $O/install.log; exit 1; }
python3 -c "import qlabench_kernels as k; print(k.__file__)"; PYTHONPATH=/tmp/sfpkg/pkg_base:$PYTHONPATH python3 -c "import qlabench_kernels as k; print(k.__file__)"
log "cache: $(find $TILELANG_CACHE_DIR -name executable.so | wc -l) kernels"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $O/gpu.csv
pk() { case $1 in *base*) echo /tmp/sfpkg/pkg_base;; *) echo "";; esac; }
run() { local name=$1 tool=$2; shift 2; mkdir -p $O/$name; local p; p=$(pk $name)
  PYTHONPATH=${p:+$p:}$PYTHONPATH OUT=$O/$name timeout --kill-after=10 ${CHECK_S:-170} python3 -m qlabench_tools.kernels.$tool "$@" > $O/$name/log 2>&1
  log "$name: exit $?"; sed -n '/=== summary/,$p' $O/$name/log | grep -E "PASS|FAIL|CRASH|split=|^TIME|ms" | cut -c1-300 | tee -a $O/ab.log
  grep -E "^TIME|CRASH|rror" $O/$name/log | cut -c1-300 | tee -a $O/ab.log; }
[ "${SKIPCHECK:-0}" = 1 ] || run checkf_new check_fwd --quick --no-time --cases mixed_1_3_split512,mixed_2_8_split1024
[ "${SKIPCHECK:-0}" = 1 ] || run checkb_new check_bwd --quick --no-time --cases split_2_4,split_1_3_noh0,split_2_8_h0only,16_32_1x32768
FC=${FC:-8_24_1x32768,16_16_1x32768}; BC=${BC:-16_32_1x32768,16_64_8way32768,8_16_4x8192}
for r in "" 2; do
  for a in base new; do
    run fwd_$a$r check_fwd --quick --cases $FC
    run bwd_$a$r check_bwd --no-check --bwd-only --cases $BC
  done
  tar czf $FINAL/ab.tgz -C $O .
done
log done
