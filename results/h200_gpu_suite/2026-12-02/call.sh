#!/bin/bash
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP=setup JOB=none bash scripts/h200_campaign.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
source /tmp/job/env.sh; cd /tmp/repo; tail -3 "$OUT/setup.log"
timeout --signal=INT --kill-after=15 ${SUITE_S:-200} python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --durations=15 \
  --junitxml="$OUT/suite.xml" tests/test_kernels_gpu.py tests/test_kernels_bwd_gpu.py > "$OUT/suite.log" 2>&1
echo "pytest exit $?" >> "$OUT/suite.log"; tail -45 "$OUT/suite.log"
