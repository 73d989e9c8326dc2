#!/bin/bash
# One device call on a two-GPU machine: two h200_session.sh jobs at once, one per GPU.
#   JOB0="CHECK=1 BWDCHECK=1"  JOB1="SWEEPS=configs/h200_fwd.yaml:results/h200_fwd:--gpus=1"
# JOBn are environment assignments for h200_session.sh (JOB0 pinned with CUDA_VISIBLE_DEVICES=0;
# JOB1 sees every GPU and picks its own with --gpus, so NVML reads the right one).
# Everything comes back as one archive ($OUT/call.tgz) plus the compiler caches seen
# ($OUT/caches.tar.xz), since a call returns at most 8 files.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
if [ -f .devsite/tlcache.tar.xz ] && [ -z "${TILELANG_CACHE_DIR:-}" ]; then
  [ -d /tmp/tlcache-full ] || tar -xJf .devsite/tlcache.tar.xz -C /tmp
  export TILELANG_CACHE_DIR=/tmp/tlcache-full
fi
source .devsite/setup.sh || exit 1
# library compile caches from earlier calls (FlashInfer's GDN module as an AOT .so inside the
# package, FlashQLA's TileLang kernels, Triton): AFTER setup.sh, which unpacks /tmp/site312
[ -f .devsite/libcache.tar.xz ] && [ ! -f /tmp/libcache.done ] && { tar -xJf .devsite/libcache.tar.xz -C / && touch /tmp/libcache.done; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
touch /tmp/call.start
# PRE: a command that needs the whole machine, run before the two per-GPU jobs (its files under /tmp/o0)
mkdir -p /tmp/o0 /tmp/o1
[ -n "${PRE:-}" ] && { OUT=/tmp/o0 bash -c "$PRE" > /tmp/o0/pre.log 2>&1; tail -c 3000 /tmp/o0/pre.log; }
LIMIT=$(( ${LIMIT:-545} - ($(date +%s) - T0) ))
( env CUDA_VISIBLE_DEVICES=0 OUT=/tmp/o0 SKIP_INSTALL=1 ${JOB0:-} timeout --signal=INT --kill-after=10 $LIMIT bash scripts/h200_session.sh > /tmp/o0/job.log 2>&1 ) &
( env OUT=/tmp/o1 SKIP_INSTALL=1 ${JOB1:-} timeout --signal=INT --kill-after=10 $LIMIT bash scripts/h200_session.sh > /tmp/o1/job.log 2>&1 ) &
wait
echo "[$(( $(date +%s) - T0 ))s] both jobs done"
tar czf "$OUT/jobs.tgz" -C /tmp o0 o1   # packed now, so a call cut short during POST keeps them
# POST: a whole-machine command after the two jobs (its files under /tmp/post -> $OUT/post.tgz)
if [ -n "${POST:-}" ]; then
  mkdir -p /tmp/post
  OUT=/tmp/post bash -c "$POST" > /tmp/post/post.log 2>&1
  tail -c 4000 /tmp/post/post.log
  tar czf "$OUT/post.tgz" -C /tmp post
fi
for d in /tmp/o0 /tmp/o1; do echo "=== $d"; tail -c 5000 $d/job.log; done
# compiler caches written during this call (FlashQLA's TileLang kernels, FlashInfer's JIT, Triton)
[ "${NOCACHE:-0}" = 1 ] && { ls -la "$OUT"; exit 0; }
find /tmp/tlcache-full ~/.cache/flashinfer ~/.triton/cache -newer /tmp/call.start -type f 2>/dev/null > /tmp/newcache.txt
du -ch $(cat /tmp/newcache.txt) 2>/dev/null | tail -1
[ -s /tmp/newcache.txt ] && tar cf - -T /tmp/newcache.txt 2>/dev/null | xz -T0 -6 > "$OUT/caches.tar.xz"
ls -la "$OUT"
