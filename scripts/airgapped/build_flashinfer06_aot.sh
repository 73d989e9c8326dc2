#!/bin/bash
# FlashInfer 0.6.13's SM90 GDN prefill module (CUTLASS "flat"), built offline (nvcc, no GPU) into
# the slot FlashInfer loads before it would JIT-build (flashinfer/data/aot/gdn_prefill_sm90/):
#   bash scripts/airgapped/build_flashinfer06_aot.sh      -> .tlcache/fi0613_jit.tar.xz (carried by
#                                                  scripts/airgapped/h200_campaign.sh STEP=setup, ~0.2 MB)
# On the H200 a first FlashInfer 0.6.13 call JIT-builds 64 CUTLASS instances (~340 s). The sweeps
# and tests call four of them (bf16, beta and alpha given, GVA or not, with or without h0, no
# checkpoints): those are compiled from FlashInfer's own sources; the other 60 are built as
# functions that throw "variant ... not built", so a call that needs one fails with that message
# (an error row) instead of running something else. h200_campaign.sh checks the module on the four
# before use and falls back to the JIT build when the check fails. ~5 min on 2 cores.
# Needs .devsite/site312.tar.xz (bundle.sh), pip's nvidia-ml-py and apache-tvm-ffi 0.1.12 here.
set -euo pipefail
python3 -c "import pynvml, tvm_ffi" 2> /dev/null || { echo "build_flashinfer06_aot.sh: FlashInfer's import needs pynvml and tvm_ffi here: pip install nvidia-ml-py apache-tvm-ffi==0.1.12" >&2; exit 2; }
REPO=$(cd "$(dirname "$0")/../.." && pwd)
W=${WORK:-/tmp/fi06_aot}; rm -rf "$W"; mkdir -p "$W/py" "$W/stubs" "$W/out/flashinfer/data/aot/gdn_prefill_sm90"
tar -xJf "$REPO/.devsite/site312.tar.xz" -C "$W" site312/flashinfer
ln -s "$W/site312/flashinfer" "$W/py/flashinfer"
export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$W/ws" PYTHONPATH="$W/py"
NINJA=$(python3 -c "
from flashinfer.jit.gdn import gen_gdn_prefill_sm90_module
s = gen_gdn_prefill_sm90_module(); s.write_ninja(); print(s.ninja_path)")
GEN=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_GEN_SRC_DIR / 'gdn_prefill_sm90')")
python3 - "$GEN" <<'EOF'
import itertools, pathlib, sys
gen = pathlib.Path(sys.argv[1])
used = {f"bf16_g{g}b1a1i{i}c0" for g in (0, 1) for i in (0, 1)}
stub = """// FlashInfer GDN prefill variant {suffix}: not used by qlabench's sweeps, built as a stub
#include <cstdint>
#include <stdexcept>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
namespace cutlass {{ namespace arch {{ struct Sm90; }} }}
namespace flat {{
template <bool G, bool B, bool A, bool I, bool C, typename Arch, typename TO, typename TQKV, typename TS>
void launch_delta_rule_prefill_kernel_gbai(cudaStream_t, TO*, TS*, TQKV const*, TQKV const*,
    TQKV const*, TS const*, float const*, float const*, int64_t const*, uint8_t*, int32_t, int32_t,
    int32_t, int32_t, int32_t, int32_t, int64_t, float, int32_t, float*, int64_t const*, int32_t) {{
  throw std::runtime_error("gdn_prefill_sm90 variant {suffix} not built");
}}
template void launch_delta_rule_prefill_kernel_gbai<{flags}, cutlass::arch::Sm90, {dt}, {dt}, float>(
    cudaStream_t, {dt}*, float*, {dt} const*, {dt} const*, {dt} const*, float const*, float const*,
    float const*, int64_t const*, uint8_t*, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t,
    int64_t, float, int32_t, float*, int64_t const*, int32_t);
}}
"""
for name, dt in (("half", "half"), ("bf16", "nv_bfloat16")):
    for bits in itertools.product((0, 1), repeat=5):
        suffix = name + "_g{}b{}a{}i{}c{}".format(*bits)
        if suffix not in used:
            flags = ", ".join("true" if b else "false" for b in bits)
            (gen / f"gdn_prefill_kernel_{suffix}.cu").write_text(stub.format(suffix=suffix, flags=flags, dt=dt))
EOF
# link against the toolkit's libcudart; libcuda is not referenced (an empty stub satisfies -lcuda)
CUDART=$(dirname "$(find /usr/local -name 'libcudart.so' 2>/dev/null | head -1)")
echo "" > "$W/stubs/e.c" && gcc -shared -fPIC -Wl,-soname,libcuda.so.1 "$W/stubs/e.c" -o "$W/stubs/libcuda.so"
sed -i 's#-L$cuda_home/lib64 \$#-L'"$CUDART"' -L'"$W"'/stubs $#' "$NINJA"
grep -q -- "-L$W/stubs" "$NINJA" || { echo "build.ninja: no -L\$cuda_home/lib64 line to replace"; exit 1; }
ninja -j"$(nproc)" -C "$W" -f "$NINJA"  # its .ninja_log/.ninja_deps in $W, not the tree
SO=$(dirname "$NINJA")/gdn_prefill_sm90.so
cp "$SO" "$W/out/flashinfer/data/aot/gdn_prefill_sm90/"
mkdir -p "$REPO/.tlcache" && tar -cJf "$REPO/.tlcache/fi0613_jit.tar.xz" -C "$W/out" flashinfer
ls -la "$REPO/.tlcache/fi0613_jit.tar.xz"
