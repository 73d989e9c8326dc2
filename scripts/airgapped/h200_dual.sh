#!/bin/bash
# One device call on a two-GPU machine: two h200_session.sh jobs at once, one per GPU.
#   JOB0="TESTS=1"  JOB1="SWEEPS='configs/h200_fwd.yaml:results/h200_fwd:--gpus=1 other.yaml:dir'"
# JOBn are shell assignments for h200_session.sh (evaluated: quote values with spaces, ";" or "|",
# e.g. PICK='prep=rt;rowexp=1'). JOB0 runs
# pinned with CUDA_VISIBLE_DEVICES=0; JOB1 sees every GPU so that its sweeps pick theirs with --gpus
# (NVML then reads the right one), and its checks, tests and profiles run with GPU=1 (pinned).
# Every job's deadline is capped below the call's LIMIT so it always packs its results; PRE (whole
# machine, before the jobs) and POST (after them) are bounded by the rest of the call.
# Everything comes back as archives ($OUT/jobs.tgz, $OUT/post.tgz) plus the compiler caches seen
# ($OUT/caches.tar.xz unless NOCACHE=1), since a call returns at most 8 files.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
CALL_S=${CALL_S:-570}   # what this call may use in all, start-up to packing
if [ -f .devsite/tlcache.tar.xz ] && [ -z "${TILELANG_CACHE_DIR:-}" ]; then
  [ -d /tmp/tlcache-full ] || tar -xJf .devsite/tlcache.tar.xz -C /tmp
  export TILELANG_CACHE_DIR=/tmp/tlcache-full
fi
source .devsite/setup.sh || exit 1
# library compile caches from earlier calls (FlashInfer's GDN module as an AOT .so inside the
# package, FLA's Triton autotune results): AFTER setup.sh, which unpacks /tmp/site312
[ -f .devsite/libcache.tar.xz ] && [ ! -f /tmp/libcache.done ] && { tar -xJf .devsite/libcache.tar.xz -C / && touch /tmp/libcache.done; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
touch /tmp/call.start
left() { echo $(( CALL_S - ($(date +%s) - T0) )); }
mkdir -p /tmp/o0 /tmp/o1 /tmp/post
if [ -n "${PRE:-}" ]; then
  OUT=/tmp/o0 timeout --signal=INT --kill-after=10 $(( $(left) - 60 )) bash -c "$PRE" > /tmp/o0/pre.log 2>&1
  tail -c 3000 /tmp/o0/pre.log
fi
LIMIT=$(( ${LIMIT:-545} < $(left) - 20 ? ${LIMIT:-545} : $(left) - 20 ))
[ "$LIMIT" -lt 30 ] && LIMIT=30
CAP=$(( LIMIT - 25 ))   # the session packs its sweep dirs before this
job() {  # job N GPUVAR JOBSPEC
  ( set -a; eval "$3"; set +a
    export OUT=/tmp/o$1 SKIP_INSTALL=1 MAX_DEADLINE_S=$CAP
    if [ "$2" = pin ]; then export CUDA_VISIBLE_DEVICES=$1; else export GPU=$1; fi
    timeout --signal=INT --kill-after=10 "$LIMIT" bash scripts/airgapped/h200_session.sh > /tmp/o$1/job.log 2>&1 )
}
job 0 pin "${JOB0:-}" &
job 1 free "${JOB1:-}" &
wait
echo "[$(( $(date +%s) - T0 ))s] both jobs done"
tar czf "$OUT/jobs.tgz" -C /tmp o0 o1   # packed now, so a call cut short during POST keeps them
if [ -n "${POST:-}" ]; then
  OUT=/tmp/post timeout --signal=INT --kill-after=10 $(( $(left) - 15 > 20 ? $(left) - 15 : 20 )) \
    bash -c "$POST" > /tmp/post/post.log 2>&1
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
