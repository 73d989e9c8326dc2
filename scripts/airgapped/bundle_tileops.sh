#!/bin/bash
# The tileops backend's environment for the lent H200 (Python 3.12, x86_64, no network) as one
# ignored folder a device call carries: tileops 0.1.0 and, by default, the TileLang it pins.
#   usage: bash scripts/airgapped/bundle_tileops.sh [OUTDIR]        (default OUTDIR: .tileops)
#   TILELANG=0.1.12 (default): tileops + tilelang 0.1.12 + apache-tvm-ffi 0.1.11 (~29 MiB): every
#                   route of its planner builds (checked offline for sm_90a, docs/backends.md)
#   TILELANG=none:  tileops alone (~1 MiB), over .devsite's tilelang 0.1.15, on which its
#                   partitioned route does not build (use the entry's params {host_offsets: false})
# On the device, in the call that carries OUTDIR (with TILELANG=0.1.12 it travels alone: beside
# .devsite it would pass the 64 MiB a call carries), once per machine:
#   source .tileops/setup.sh        # unpacks into /tmp/tileops_site
# and in every call that runs a sweep, after .devsite/setup.sh:
#   export QLABENCH_TILEOPS_PATH=/tmp/tileops_site
# The sweeps' entry {name: tileops, pythonpath: "${QLABENCH_TILEOPS_PATH}"} puts it before
# .devsite's packages in that backend's worker only; the other backends keep tilelang 0.1.15.
set -euo pipefail
OUTDIR=${1:-.tileops}
TILELANG=${TILELANG:-0.1.12}
case "$TILELANG" in
  0.1.12) PINS="tileops==0.1.0 tilelang==0.1.12 apache-tvm-ffi==0.1.11" ;;
  none) PINS="tileops==0.1.0" ;;
  *) echo "TILELANG=$TILELANG: 0.1.12 (tileops' pin, the default) or none" >&2; exit 2 ;;
esac
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/wheels" "$OUTDIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
  -d "$WORK/wheels" $PINS
python3 -m pip install -q --no-deps --no-compile --ignore-requires-python --target "$WORK/tileops_site" --python-version 3.12 \
  --implementation cp --only-binary=:all: $PLAT "$WORK"/wheels/*.whl
# Drop what the device never uses: console scripts, TileLang's non-CUDA backend sources.
rm -rf "$WORK/tileops_site/bin" "$WORK/tileops_site/tilelang/src/ascend"
rm -f "$OUTDIR/tileops_site.tar.xz"
tar -cf - -C "$WORK" tileops_site | xz -T0 -6 > "$OUTDIR/tileops_site.tar.xz"
echo "$PINS" > "$OUTDIR/PINS"
cat > "$OUTDIR/setup.sh" <<'EOF'
# Source on the device: unpacks tileops (and the TileLang bundled with it, PINS) once per machine
# into /tmp/tileops_site and points the tileops entries' ${QLABENCH_TILEOPS_PATH} at it.
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -d /tmp/tileops_site ]; then
  tar -xJf "$_here/tileops_site.tar.xz" -C /tmp || return 1
fi
export QLABENCH_TILEOPS_PATH=/tmp/tileops_site
EOF
ls -la "$OUTDIR"
