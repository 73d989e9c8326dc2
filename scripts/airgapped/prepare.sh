#!/bin/bash
# Everything a session on the lent H200 carries, built on this CPU machine (docs/airgapped.md), in
# one command; each part is skipped when its output is there (FORCE=1 rebuilds):
#   bash scripts/airgapped/prepare.sh [PART ...]       (default: every part, in this order)
#   devsite  .devsite/            GPU-side packages ($SHARED/device/bundle.sh; ~3 min)
#   fi07     .fi07a/ .fi07b/      FlashInfer 0.7.4 for the relay ($SHARED/device/bundle_flashinfer07.sh; ~6 min)
#   tileops  .tileops/            tileops 0.1.0 (scripts/airgapped/bundle_tileops.sh)
#   fi0613   .tlcache/fi0613_jit.tar.xz   FlashInfer 0.6.13's GDN module (build_flashinfer06_aot.sh; ~5 min)
#   ours     .tlcache/all.tar.xz  the in-repo kernels of every configs/h200_*.yaml, the GPU tests and
#                                 the calibration (`qlabench precompile`, JOBS worker processes)
#   fqla     .tlcache/fqla.tar.xz FlashQLA's kernels for those configs (precompile_flashqla.py)
#   (only when named) ours_fwd  .tlcache/all.tar.xz of the forward sweep's and the held-out forward
#            config's kernels alone: what fits the 64 MiB of STEP=setup's carry beside .devsite and FlashQLA's
#   (only when named) fqla_heldout  .tlcache/fqla_heldout.tar.xz: FlashQLA's for the held-out forward config
#   (only when named) fqla_fwd  .tlcache/fqla_fwd.tar.xz: FlashQLA's for the forward sweep alone (beside
#            ours_fwd and fqla_heldout: the forward campaign's carry)
#   (only when named) bwd_heldout, fqla_bwd_heldout  .tlcache/bwd_heldout.tar.xz, .tlcache/fqla_bwd_heldout.tar.xz:
#            ours and FlashQLA's kernels for the held-out backward config (beside a slim all.tar.xz)
#   (only when named) bwd, fqla_bwd  .tlcache/bwd.tar.xz, .tlcache/fqla_bwd.tar.xz: the same for the backward
#            sweep (configs/h200_bwd.yaml; the job's steps bwd and bwd_nofla)
#   (only when named) fwd_campaign  the forward campaign's whole carry, as two chains side by side (the
#            packages: devsite fi07 fi0613; the kernels: ours_fwd fqla_heldout fqla_fwd; ~33 min on 2
#            cores, each chain's log in .run/prepare_*.log), then repo
#   repo     .run/repo.tar.gz     the commit to run (HEAD, results/ left out); with PREV=<git ref>
#                                 also .run/prevkernels/qlabench_kernels (the `tilelang@prev` label)
#   ab       (only when named, with AB="NAME=REF ...") the kernel variants of an A/B
#            (scripts/airgapped/h200_fused_ab.sh): .run/var/pkg_NAME/qlabench_kernels = kernels/ of
#            git REF and qlabench_tools = its tools/ (the checks that call the variant's kernels), each compiled with the tree's for AB_HEADS (the kernels AB_KERNELS names, default
#            fwd_fused prep tables; AB_BWD=1 adds the backward's, e.g. AB_KERNELS="_ fixup tables prep" for
#            every kernel of a backward A/B; tools/kernels/res_usage.py, which prints their registers and stack and
#            needs cuobjdump) into .tlcache/fused.tar.xz (h200_kernels_ab.sh: CACHE=fused BASE_PKG=.run/var/pkg_NAME)
# $SHARED: the shared folder beside the repository (default ../shared). Caches travel packed without
# nvcc's cuda-binaries/, which loading does not need. Ends by listing what each device call would
# carry against its 64 MiB.
set -uo pipefail
cd "$(dirname "$0")/../.."
SHARED=${SHARED:-../shared}
JOBS=${JOBS:-2}
PARTS=${*:-devsite fi07 tileops fi0613 ours fqla repo}
T0=$(date +%s); log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
have() { [ -z "${FORCE:-}" ] && [ -e "$1" ] && { log "$2: $1 is there (FORCE=1 rebuilds)"; return 0; }; return 1; }
pack() {  # pack .tlcache/NAME (a TileLang cache directory) as .tlcache/NAME.tar.xz
  tar -cf - -C .tlcache --exclude=cuda-binaries "$1" | xz -T0 > ".tlcache/$1.tar.xz" || return 1
  log "$1: $(find ".tlcache/$1" -name executable.so | wc -l) kernels, $(du -h ".tlcache/$1.tar.xz" | cut -f1)"; }
ours_cache() {  # NAME ARG...: `qlabench precompile ARG...` (our kernels) into .tlcache/NAME, packed
  local name=$1; shift
  TILELANG_CACHE_DIR=$PWD/.tlcache/$name qlabench precompile "$@" --jobs "$JOBS" && pack "$name"; }
fqla_cache() {  # NAME CONFIG...: FlashQLA's kernels for the configs into .tlcache/NAME, packed
  local name=$1 args=(); shift
  for c in "$@"; do args+=(--config "$c"); done
  TILELANG_CACHE_DIR=$PWD/.tlcache/$name python3 scripts/airgapped/precompile_flashqla.py "${args[@]}" && pack "$name"; }
CONFIGS=$(ls configs/h200_*.yaml)
mkdir -p .tlcache .run
rc=0
for part in $PARTS; do
  log "== $part"
  case $part in
    fwd_campaign)
      bash "$0" devsite fi07 fi0613 > .run/prepare_packages.log 2>&1 & a=$!
      bash "$0" ours_fwd fqla_heldout fqla_fwd > .run/prepare_kernels.log 2>&1 & b=$!
      wait $a || { rc=1; tail -5 .run/prepare_packages.log; }
      wait $b || { rc=1; tail -5 .run/prepare_kernels.log; }
      bash "$0" repo || rc=1 ;;
    devsite) have .devsite/setup.sh "$part" || bash "$SHARED/device/bundle.sh" .devsite || rc=1 ;;
    fi07) have .fi07b/setup_flashinfer07.sh "$part" || bash "$SHARED/device/bundle_flashinfer07.sh" || rc=1 ;;
    tileops) have .tileops/setup.sh "$part" || bash scripts/airgapped/bundle_tileops.sh || rc=1 ;;
    fi0613) have .tlcache/fi0613_jit.tar.xz "$part" || bash scripts/airgapped/build_flashinfer06_aot.sh || rc=1 ;;
    # shellcheck disable=SC2086
    ours) have .tlcache/all.tar.xz "$part" || ours_cache all all $CONFIGS || rc=1 ;;
    ours_fwd)
      have .tlcache/all.tar.xz "$part" || {
        rm -rf .tlcache/all && ours_cache all configs/h200_fwd.yaml configs/h200_fwd_heldout.yaml; } || rc=1 ;;
    bwd_heldout) have .tlcache/bwd_heldout.tar.xz "$part" || ours_cache bwd_heldout configs/h200_bwd_heldout.yaml || rc=1 ;;
    bwd) have .tlcache/bwd.tar.xz "$part" || ours_cache bwd configs/h200_bwd.yaml || rc=1 ;;
    fqla_bwd) have .tlcache/fqla_bwd.tar.xz "$part" || fqla_cache fqla_bwd configs/h200_bwd.yaml || rc=1 ;;
    fqla_bwd_heldout)
      have .tlcache/fqla_bwd_heldout.tar.xz "$part" || fqla_cache fqla_bwd_heldout configs/h200_bwd_heldout.yaml || rc=1 ;;
    fqla_heldout) have .tlcache/fqla_heldout.tar.xz "$part" || fqla_cache fqla_heldout configs/h200_fwd_heldout.yaml || rc=1 ;;
    fqla_fwd) have .tlcache/fqla_fwd.tar.xz "$part" || fqla_cache fqla_fwd configs/h200_fwd.yaml || rc=1 ;;
    fqla) have .tlcache/fqla.tar.xz "$part" || fqla_cache fqla $CONFIGS || rc=1 ;;
    repo)
      git archive HEAD -- . ':!results' | gzip > .run/repo.tar.gz || rc=1
      log "repo: $(git rev-parse --short=12 HEAD), $(du -h .run/repo.tar.gz | cut -f1)"
      if [ -n "${PREV:-}" ]; then
        rm -rf .run/prevkernels && mkdir -p .run/prevkernels/qlabench_kernels \
          && git archive "$PREV" kernels | tar -x -C .run/prevkernels/qlabench_kernels --strip-components=1 \
          && log "prevkernels: kernels/ of $(git rev-parse --short=12 "$PREV")" || rc=1
      fi ;;
    ab)
      [ -n "${AB:-}" ] || { echo "part ab: AB=\"NAME=REF ...\" names the variants" >&2; exit 2; }
      heads=$(echo ${AB_HEADS:-2/8 1/3 16/64 4/16 8/32 32/32 16/32 8/24} | tr ' ' ,)
      ab_compile() {  # [PYTHONPATH]: the kernels AB_KERNELS name, for AB_HEADS, with their registers and stack
        for k in ${AB_KERNELS:-fwd_fused prep tables}; do
          PYTHONPATH=${1:+$1:}${PYTHONPATH:-} python3 -m qlabench_tools.kernels.res_usage --heads "$heads" \
            --kernel "$k" ${AB_BWD:+--bwd} --cache "$PWD/.tlcache/fused" || return 1
        done; }
      ab_compile || rc=1
      for v in $AB; do
        name=${v%%=*} ref=${v#*=}
        rm -rf ".run/var/pkg_$name" && mkdir -p ".run/var/pkg_$name/qlabench_kernels" ".run/var/pkg_$name/qlabench_tools" \
          && git archive "$ref" kernels | tar -x -C ".run/var/pkg_$name/qlabench_kernels" --strip-components=1 \
          && git archive "$ref" tools | tar -x -C ".run/var/pkg_$name/qlabench_tools" --strip-components=1 \
          && ab_compile "$PWD/.run/var/pkg_$name" \
          && log "ab: pkg_$name = kernels/ and tools/ of $(git rev-parse --short=12 "$ref")" || rc=1
      done
      pack fused || rc=1 ;;
    *) echo "unknown part '$part' (devsite fi07 tileops fi0613 ours fqla repo ab ours_fwd fqla_fwd fqla_heldout fwd_campaign bwd_heldout fqla_bwd_heldout bwd fqla_bwd)" >&2; exit 2 ;;
  esac
done
mib() { du -smc "$@" 2>/dev/null | tail -1 | cut -f1; }
tree=$(git ls-files -z | du -smc --files0-from=- 2>/dev/null | tail -1 | cut -f1)
log "carried per call (MiB, limit 64): setup $(( tree + $(mib .devsite .tlcache/*.tar.xz .run) )), \
tileops $(( tree + $(mib .tileops) )), fi07a $(( tree + $(mib .fi07a) )), fi07b $(( tree + $(mib .fi07b) ))"
exit $rc
