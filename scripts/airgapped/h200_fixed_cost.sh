#!/bin/bash
# Issue #26 on one GPU: the fixed cost of configs/h200_fixed_cost.yaml (the quick forward config
# with fla, flashqla and tilelang) at the old commit and the new one, back to back in one job.
#
# Runs inside a device job environment already set up by
#   STEP=setup JOB=none bash scripts/airgapped/h200_campaign.sh     (carry .devsite .tlcache/all.tar.xz
#   .tlcache/fqla_fwd.tar.xz .run/prevkernels .run/repo.tar.gz .run/repo_old.tar.gz)
# which leaves /tmp/job/env.sh (PYTHONPATH=/tmp/site312, TILELANG_CACHE_DIR, TRITON_CACHE_AUTOTUNING,
# QLABENCH_GIT_SHA of the new tree ...) and the new commit in /tmp/repo, installed editable.
# Called from the call's repo root:  bash scripts/airgapped/h200_fixed_cost.sh
#
# The two trees (both the package `qlabench`):
#   NEW=/tmp/repo      the new commit (its editable install is the one pip knows);
#   OLD=/tmp/repo_old  the old commit, extracted here from $OLD_TGZ (.run/repo_old.tar.gz, made
#                      with `git archive 7a7503c -- . ':!results' | gzip > .run/repo_old.tar.gz`),
#                      never pip-installed.
# Each run starts in its own tree with that tree first on PYTHONPATH:
#   cd $TREE && PYTHONPATH=$TREE:$PYTHONPATH python3 -c "$CLI" run CONFIG --out DIR
# `python3 -m qlabench` does not work at either commit (no qlabench/__main__.py), and the
# `qlabench` console script would import whichever tree is on sys.path anyway, so both runs use
# the same launcher, CLI below (qlabench.cli:app, what the console script calls). A PYTHONPATH
# entry comes before the editable install's finder (setuptools appends it to sys.meta_path), and
# the spawned worker gets the parent's sys.path, so parent and worker import the tree's own
# qlabench; the backend registry reads the tree's own pyproject.toml. The in-repo kernels
# (`qlabench_kernels`, the directory kernels/ mapped by the install) are the installed ones when
# the two trees' kernels/ are identical (they are between 7a7503c and the fixed-cost commits);
# otherwise the old runs get a shim directory whose qlabench_kernels links to $OLD/kernels.
# Both trees are byte-compiled first, so no run pays for writing .pyc files.
#
# ONLY_NEW=1: only the new commit, twice (01_new, 02_new), e.g. to re-measure it after a change.
# Order: the ceilings cache of the new commit filled (metrics.cached_ceilings; the old commit
# measures them every run), one warm-up run at the old commit (Triton/FLA autotune, TileLang and
# FlashQLA caches; its rows are not counted), then old, new, old, new, each into a fresh --out
# and with QLABENCH_GIT_SHA set to its commit (the old commit does not read it: its rows say
# git_sha "unknown", the label and commit are in each run's shell.json). The shell measures each
# run's wall time around the process. Last, where time is left, 05_new_importtime: the new commit
# once more with PYTHONPROFILEIMPORTTIME=1 (its worker inherits it), not a sample of the fixed cost
# (import profiling slows the imports) but the seconds each package takes to import, in the worker
# and in the run's own process (fixed_cost_report.py prints them; the lines stay in that run's logs). Each run is capped (RUN_CAP_S, WARM_CAP_S) and the whole
# by CALL_DEADLINE (epoch s; default now + BUDGET_S), leaving PACK_S to pack; a run cut by its cap
# ends like Ctrl-C (rows and metadata kept).
#
# Back in $OUT (at most 8 files come back, 2 folders down, so everything else is in one tarball):
#   fixed_cost.log       this script's output, every run's output tee'd into it (PYTHONUNBUFFERED=1)
#   fixed_cost.txt       qlabench_tools.fixed_cost_report's table over the runs
#   fixed_cost.csv       the same table
#   fixed_cost_meta.json every run's metadata (run dir name -> run_id -> the _runs/*.json)
#   fixed_cost_runs.tgz  the run dirs (parts, _runs, _logs, _figures, shell.json, <run>.log)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")/../.." && pwd)
ENVF=${ENVF-/tmp/job/env.sh}   # ENVF= (empty) runs in the current environment
if [ -n "$ENVF" ]; then
  [ -f "$ENVF" ] || { echo "no $ENVF: run STEP=setup JOB=none bash scripts/airgapped/h200_campaign.sh first"; exit 1; }
  source "$ENVF"
fi
export PYTHONUNBUFFERED=1
NEW=${NEW:-/tmp/repo}; OLD=${OLD:-/tmp/repo_old}
OLD_TGZ=${OLD_TGZ:-$HERE/.run/repo_old.tar.gz}
RES=${RES:-/tmp/fixed_cost}
CONFIG=${CONFIG:-$NEW/configs/h200_fixed_cost.yaml}
RUN_CAP_S=${RUN_CAP_S:-150}; WARM_CAP_S=${WARM_CAP_S:-240}; MIN_RUN_S=${MIN_RUN_S:-45}
PACK_S=${PACK_S:-40}
DEADLINE=${CALL_DEADLINE:-$(( $(date +%s) + ${BUDGET_S:-540} ))}
CLI='import sys; from qlabench.cli import app; sys.argv[0] = "qlabench"; app()'
T0=$(date +%s); log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }

tar_sha() {  # the commit git archive wrote into the archive's header
  python3 - "$1" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    print((t.pax_headers.get("comment") or "unknown")[:12])
EOF
}

one_run() {  # one_run NAME TREE SHA CAP [EXTRA_PYTHONPATH]
  local name=$1 tree=$2 sha=$3 cap=$4 extra=${5:-} d=$RES/$1
  local left=$(( DEADLINE - $(date +%s) - PACK_S ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt "$MIN_RUN_S" ]; then log "skip $name: ${left}s left"; return 1; fi
  rm -rf "$d"; log "start $name ($tree, $sha, cap ${cap}s${PROFILE_IMPORTS:+, -X importtime})"
  local t0 t1 rc
  t0=$(date +%s%N)
  if [ -z "${PROFILE_IMPORTS:-}" ]; then
    (cd "$tree" && PYTHONPATH="$tree${extra:+:$extra}${PYTHONPATH:+:$PYTHONPATH}" QLABENCH_GIT_SHA="$sha" \
       timeout --signal=INT --kill-after=20 "$cap" python3 -c "$CLI" run "$CONFIG" --out "$d") \
      2>&1 | tee "$RES/$name.log"
    rc=${PIPESTATUS[0]}
  else  # the import-time lines stay in the run's own log (and its worker's), out of this one
    (cd "$tree" && PYTHONPATH="$tree${extra:+:$extra}${PYTHONPATH:+:$PYTHONPATH}" QLABENCH_GIT_SHA="$sha" \
       PYTHONPROFILEIMPORTTIME=1 timeout --signal=INT --kill-after=20 "$cap" python3 -c "$CLI" run \
       "$CONFIG" --out "$d") > "$RES/$name.log" 2>&1
    rc=$?
    grep -v '^import time:' "$RES/$name.log"
  fi
  t1=$(date +%s%N)
  mkdir -p "$d"; mv "$RES/$name.log" "$d/$name.log"
  local wall; wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", (b - a) / 1e9 }')
  printf '{"label": "%s", "commit": "%s", "tree": "%s", "config": "%s", "wall_s": %s, "rc": %d}\n' \
    "$name" "$sha" "$tree" "$CONFIG" "$wall" "$rc" > "$d/shell.json"
  log "end $name: exit $rc, wall ${wall}s"; return "$rc"
}

pack() {
  log "pack"
  local dirs=(); for d in "$RES"/[0-9]*_*/; do [ -d "$d" ] && dirs+=("${d%/}"); done
  if [ ${#dirs[@]} -gt 0 ]; then
    python3 "$HERE/scripts/fixed_cost_report.py" --csv "$OUT/fixed_cost.csv" "${dirs[@]}" \
      2>&1 | tee "$OUT/fixed_cost.txt"
    python3 - "$OUT/fixed_cost_meta.json" "${dirs[@]}" <<'EOF'
import json, sys
from pathlib import Path
out = {}
for d in map(Path, sys.argv[2:]):
    out[d.name] = {f.stem: json.loads(f.read_text()) for f in sorted((d / "_runs").glob("*.json"))}
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
EOF
    tar czf "$OUT/fixed_cost_runs.tgz" -C "$RES" "${dirs[@]#$RES/}"
  fi
  ls -la "$OUT"
}

main() {
  log "new: $NEW (${QLABENCH_GIT_SHA:-no QLABENCH_GIT_SHA}), old: $OLD from $OLD_TGZ; config $CONFIG; deadline in $(( DEADLINE - $(date +%s) ))s"
  if [ ! -f "$CONFIG" ] && [ -f "$HERE/configs/h200_fixed_cost.yaml" ]; then
    log "no $CONFIG: the call's own $HERE/configs/h200_fixed_cost.yaml instead"
    CONFIG=$HERE/configs/h200_fixed_cost.yaml
  fi
  [ -f "$CONFIG" ] || { log "no $CONFIG"; return 1; }
  case "$OLD" in /tmp/?*) ;; *) log "OLD=$OLD: a directory under /tmp, please"; return 1;; esac
  if [ ! -f "$OLD/pyproject.toml" ]; then
    [ -f "$OLD_TGZ" ] || { log "no $OLD_TGZ"; return 1; }
    rm -rf "$OLD" && mkdir -p "$OLD" && tar -xzf "$OLD_TGZ" -C "$OLD" || return 1
  fi
  local old_sha=${OLD_SHA:-$( [ -f "$OLD_TGZ" ] && tar_sha "$OLD_TGZ" || echo unknown)}
  local new_sha=${NEW_SHA:-${QLABENCH_GIT_SHA:-unknown}}
  if [ "$new_sha" = unknown ] && [ -f "$HERE/.run/repo.tar.gz" ]; then new_sha=$(tar_sha "$HERE/.run/repo.tar.gz"); fi
  mkdir -p "$RES"; rm -rf "$RES"/[0-9]*_*
  local shim=""
  if ! diff -rq -x __pycache__ "$OLD/kernels" "$NEW/kernels" > /dev/null; then
    shim=$RES/old_shim; mkdir -p "$shim"; ln -sfn "$OLD/kernels" "$shim/qlabench_kernels"
    log "kernels/ differ between the trees: the old runs import $OLD/kernels through $shim"
  fi
  python3 -m compileall -q "$OLD/qlabench" "$OLD/kernels" "$NEW/qlabench" "$NEW/kernels" > /dev/null
  for t in "$OLD" "$NEW"; do  # which qlabench each tree's runs import (not timed)
    local ex=""; [ "$t" = "$OLD" ] && ex=$shim
    (cd "$t" && PYTHONPATH="$t${ex:+:$ex}${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
      "import qlabench, qlabench_kernels; print('$t:', qlabench.__file__, qlabench_kernels.__file__)")
  done
  log "old $old_sha, new $new_sha"
  if [ "$old_sha" = "$new_sha" ] && [ "$old_sha" != unknown ]; then  # e.g. .run/repo.tar.gz still the old commit's archive
    log "the old and the new tree are the same commit: rebuild .run/repo.tar.gz from the new one"; return 1
  fi
  (cd "$NEW" && PYTHONPATH="$NEW${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    "from qlabench import metrics; c, s = metrics.cached_ceilings(0); print('new commit ceilings:', s, c)") \
    || log "new commit's ceilings cache not filled"
  if [ "${ONLY_NEW:-0}" = 1 ]; then  # the new commit alone, twice (its first run pays FLA's autotune)
    one_run 01_new "$NEW" "$new_sha" "$RUN_CAP_S"
    one_run 02_new "$NEW" "$new_sha" "$RUN_CAP_S"
  else
    one_run 00_old_warmup "$OLD" "$old_sha" "$WARM_CAP_S" "$shim"
    one_run 01_old "$OLD" "$old_sha" "$RUN_CAP_S" "$shim"
    one_run 02_new "$NEW" "$new_sha" "$RUN_CAP_S"
    one_run 03_old "$OLD" "$old_sha" "$RUN_CAP_S" "$shim"
    one_run 04_new "$NEW" "$new_sha" "$RUN_CAP_S"
    PROFILE_IMPORTS=1 one_run 05_new_importtime "$NEW" "$new_sha" "$RUN_CAP_S"
  fi
  pack
  log "done"
}

main 2>&1 | tee "$OUT/fixed_cost.log"
exit "${PIPESTATUS[0]}"
