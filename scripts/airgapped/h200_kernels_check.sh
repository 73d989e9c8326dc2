#!/bin/bash
# The kernel GPU tests in one device call: install, unpack the carried TileLang cache, then
# `pytest -m gpu` on tests/test_kernels_gpu.py and tests/test_kernels_bwd_gpu.py, each test under a
# watchdog ($QLABENCH_TEST_TIMEOUT_S, default 150 s) and the whole run under $DEADLINE_S (default 500 s).
# Logs under $OUT: nvidia-smi.csv, install.log, gpu_tests.log, junit.xml.
#   bash scripts/airgapped/h200_kernels_check.sh          (carry .devsite and .tlcache/tests.tar.xz)
# The cache: TILELANG_CACHE_DIR=.tlcache/tests qlabench precompile tests --jobs 2, then
#   tar -cf - -C .tlcache --exclude=cuda-binaries --exclude=.staging tests | xz -T2 -6 > .tlcache/tests.tar.xz
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -f .tlcache/tests.tar.xz ] && [ -z "${TILELANG_CACHE_DIR:-}" ]; then
  [ -d /tmp/tlcache/tests ] || { mkdir -p /tmp/tlcache && tar -xJf .tlcache/tests.tar.xz -C /tmp/tlcache; }
  export TILELANG_CACHE_DIR=/tmp/tlcache/tests
fi
source .devsite/setup.sh || exit 1
echo "TILELANG_CACHE_DIR=$TILELANG_CACHE_DIR ($(find "$TILELANG_CACHE_DIR" -name executable.so 2>/dev/null | wc -l) kernels)" | tee "$OUT/cache.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$OUT/nvidia-smi.csv" 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
export QLABENCH_TEST_TIMEOUT_S=${QLABENCH_TEST_TIMEOUT_S:-150}
timeout --signal=INT --kill-after=20 "${DEADLINE_S:-500}" \
  python3 -m pytest -m gpu -p no:cacheprovider -q -rfE --durations=15 --junitxml="$OUT/junit.xml" \
  tests/test_kernels_gpu.py tests/test_kernels_bwd_gpu.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -45
rc=${PIPESTATUS[0]}
# TileLang may have compiled what the carried cache lacked: list it for the next cache build
find "$TILELANG_CACHE_DIR" -name executable.so -newer "$OUT/cache.txt" 2>/dev/null | wc -l | sed 's/^/kernels compiled on the device: /' | tee -a "$OUT/cache.txt"
exit "$rc"
