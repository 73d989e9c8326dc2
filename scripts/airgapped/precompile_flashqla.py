"""Fill a TileLang cache offline (no GPU, nvcc only) with FlashQLA's Hopper kernels for the H200.

    TILELANG_CACHE_DIR=/tmp/tlcache-full python scripts/airgapped/precompile_flashqla.py \
        --config configs/h200_fwd.yaml --config configs/h200_bwd.yaml [--only 2/8,4/16] [--list]
    TILELANG_CACHE_DIR=... python scripts/airgapped/precompile_flashqla.py --heads 2/8 --dirs fwd,bwd

How the cache key is reproduced (tilelang 0.1.15, tilelang/cache/kernel_cache.py::_generate_key):
sha256(json{func: sha256(PrimFunc.script(show_meta=True)), out_idx, args_repr: () (jit passes none),
target: str(Target), target_host, execution_backend, pass_configs (normalised), compile_flags,
version, platform.machine()}). FlashQLA's @tilelang.jit leaves target/backend at their defaults,
so the H200 resolves target "auto" through tilelang/cuda/target.py -> torch capability (9, 0) ->
nvcc.get_target_arch -> Target({"kind": "cuda", "arch": "sm_90a"}) (the same string as the
explicit sm_90a target of our own kernels) and execution backend "auto" -> tvm_ffi. Here the CUDA
target detector is overridden to return exactly that Target; everything else is left alone.

Which kernels: FlashQLA's host code (pure Python) is run on the CPU/meta device for every
(head config, layout, direction) of the sweeps, exactly like qlabench/backends/flashqla.py calls
it (low-level fwd with output_final_state, h0 fp32, cu_seqlens int64; bwd = fwd + bwd with
dht), with torch.cuda.get_device_properties patched to an H200 (132 SMs) so the autocp / block_DV
launch rules decide as on the device. Every @tilelang.jit factory is replaced by a recorder;
the distinct recorded calls are then compiled through the real factories (cache miss -> compile
-> saved under $TILELANG_CACHE_DIR/<version>/linux-x86_64/kernels/<key>).

The FlashQLA sources come from .devsite/site312.tar.xz (extracted to /tmp/flashqla_site once);
tilelang is the local install (must be the same 0.1.15 build the device uses).
"""
from __future__ import annotations

import argparse
import os
import sys
import tarfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SITE_TAR = REPO / ".devsite" / "site312.tar.xz"
H200_SMS = 132
DEFAULT_LAYOUTS_NOTE = "layouts of configs/h200_fwd.yaml (fwd) and configs/h200_bwd.yaml (bwd)"


def ensure_flash_qla(dest: Path) -> Path:
    """Extract site312/flash_qla from the carried tarball (only that package) to ``dest``."""
    pkg = dest / "site312" / "flash_qla"
    if not (pkg / "__init__.py").exists():
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(SITE_TAR, "r:xz") as tf:
            members = [m for m in tf.getmembers() if m.name.startswith("site312/flash_qla/")]
            tf.extractall(dest, members=members)
    return dest / "site312"


# ---------------------------------------------------------------------------------------------
# patches: make this CPU-only machine look like the H200 to flash_qla and to tilelang's "auto"
# ---------------------------------------------------------------------------------------------
def patch_environment():
    import tilelang  # noqa: F401  (local install; import before flash_qla's path is added)
    import torch
    from tilelang.backend.target import register_target_detector
    from tilelang.contrib import nvcc
    from tvm.target import Target

    props = types.SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, multi_processor_count=H200_SMS,
        total_memory=150_000_000_000, is_integrated=False, is_multi_gpu_board=False,
        max_threads_per_multi_processor=2048, warp_size=32, L2_cache_size=50 * 2**20,
        gcnArchName="", uuid="offline")
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

    orig_ctv = nvcc.get_target_compute_version

    def get_target_compute_version(target=None):
        if target is None and Target.current(allow_none=True) is None:
            return "9.0"
        return orig_ctv(target)

    nvcc.get_target_compute_version = get_target_compute_version
    # target="auto" on the H200: tilelang/cuda/target.py::_detect_cuda_target ->
    # Target({"kind": "cuda", "arch": "sm_" + nvcc.get_target_arch((9, 0))}) = sm_90a
    arch = "sm_" + nvcc.get_target_arch((9, 0))
    register_target_detector("cuda", lambda: Target({"kind": "cuda", "arch": arch}), override=True)
    return arch


class _SimCuda:
    """torch.cuda.is_available / stream-capture queries that flash_qla's tensor_cache asserts,
    on only while FlashQLA's host code is simulated (never while tilelang compiles)."""

    def __enter__(self):
        import torch
        self._saved = (torch.cuda.is_available, torch.cuda.is_current_stream_capturing)
        torch.cuda.is_available = lambda: True
        torch.cuda.is_current_stream_capturing = lambda: False

    def __exit__(self, *exc):
        import torch
        torch.cuda.is_available, torch.cuda.is_current_stream_capturing = self._saved


class Recorder:
    def __init__(self, name, impl, calls):
        self.name, self.impl, self.calls = name, impl, calls

    def __call__(self, *args, **kwargs):
        key = (self.name, repr(args), repr(sorted(kwargs.items())))
        if key not in self.calls:
            self.calls[key] = (self, args, dict(kwargs))
        return lambda *a, **k: None  # the kernel launch: a no-op here


def install_recorders(calls):
    import flash_qla  # noqa: F401  (imports every hopper module + ops.utils)
    from tilelang.jit import JITImpl

    n = 0
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("flash_qla") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            if isinstance(val, JITImpl):
                setattr(mod, attr, Recorder(attr, val, calls))
                n += 1
            elif isinstance(val, Recorder):
                val.calls = calls
                n += 1
    return n


# ---------------------------------------------------------------------------------------------
# simulate the adapter (qlabench/backends/flashqla.py) for one point
# ---------------------------------------------------------------------------------------------
def simulate(hq, hv, seqlens, direction, d=128, dtype="bf16", initial_state=True,
             output_final_state=True):
    import torch
    from flash_qla import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    T, N = sum(seqlens), len(seqlens)
    meta = torch.device("meta")
    q = torch.empty(1, T, hq, d, dtype=dt, device=meta)
    k = torch.empty(1, T, hq, d, dtype=dt, device=meta)
    v = torch.empty(1, T, hv, d, dtype=dt, device=meta)
    g = torch.empty(1, T, hv, dtype=torch.float32, device=meta)
    beta = torch.empty(1, T, hv, dtype=torch.float32, device=meta)
    h0 = torch.empty(N, hv, d, d, dtype=torch.float32, device=meta) if initial_state else None
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    cu = torch.tensor(cu, dtype=torch.int64)  # the host-side tolist()s need real values
    scale = d ** -0.5
    gc, A = chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale=scale, initial_state=h0,
        output_final_state=output_final_state, output_h=False, cu_seqlens=cu)[:2]
    if direction in ("bwd", "fwdbwd"):
        do = torch.empty(1, T, hv, d, dtype=dt, device=meta)
        dht = torch.empty(N, hv, d, d, dtype=torch.float32, device=meta) if output_final_state else None
        chunk_gated_delta_rule_bwd(q, k, v, gc, beta, A, do, dht, scale=scale,
                                   initial_state=h0, cu_seqlens=cu)


def sweep_plan(config_paths, heads_filter, heads_extra, dirs):
    """[(hq, hv, seqlens, direction, dtype, h0, ht)] from sweep configs and/or --heads."""
    sys.path.insert(0, str(REPO))
    from qlabench import config as qc

    plan = []
    cfgs = list(config_paths)
    if heads_extra and not cfgs:
        cfgs = [REPO / "configs/h200_fwd.yaml", REPO / "configs/h200_bwd.yaml"]
    for path in cfgs:
        s = qc.load(path)
        models = [(m.h_qk, m.h_v) for m in s.resolved_models()]
        if heads_extra:  # --heads: these head configs with this config's layouts
            models = heads_extra
        for hq, hv in models:
            if heads_filter and (hq, hv) not in heads_filter:
                continue
            for lens in s.resolved_layouts():
                for direction in s.directions:
                    if dirs and direction not in dirs:
                        continue
                    plan.append((hq, hv, tuple(lens), direction, s.dtype, s.initial_state,
                                 s.output_final_state))
    return plan


def describe(name, args, kwargs):
    import torch
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
             torch.int32: "i32", torch.int64: "i64"}
    f = lambda x: short.get(x, x) if not isinstance(x, float) else f"{x:.6g}"  # noqa: E731
    a = ",".join(str(f(x)) for x in args)
    kw = ",".join(f"{k}={f(v)}" for k, v in sorted(kwargs.items()))
    return f"{name}({a}{';' if a and kw else ''}{kw})"


def binaries_size():
    from tilelang.cache.cuda_binary_cache import CUDABinaryCache
    return dir_size(CUDABinaryCache._get_cache_root())


def dir_size(p):
    if not os.path.isdir(p):
        return 0
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[], help="sweep YAML (repeatable)")
    ap.add_argument("--heads", default="", help="comma list h_qk/h_v: use these head configs "
                    "with the configs' layouts (default configs: " + DEFAULT_LAYOUTS_NOTE + ")")
    ap.add_argument("--only", default="", help="comma list h_qk/h_v: restrict the configs' models")
    ap.add_argument("--dirs", default="", help="comma list of directions to keep (fwd,bwd)")
    ap.add_argument("--list", action="store_true", help="enumerate only, compile nothing")
    ap.add_argument("--all-widths", action="store_true", help="also every fused_fwd launch "
                    "width the hopper rule can pick (block_DV 32/64/128 x is_cp), for layouts "
                    "outside the configs")
    ap.add_argument("--site", default="/tmp/flashqla_site", help="where flash_qla is extracted")
    a = ap.parse_args()

    parse_heads = lambda s: [tuple(int(x) for x in h.split("/")) for h in s.split(",") if h]  # noqa: E731
    heads_extra, heads_filter = parse_heads(a.heads), parse_heads(a.only)
    dirs = [x for x in a.dirs.split(",") if x]
    if not a.config and not heads_extra:
        ap.error("give --config and/or --heads")

    import tilelang
    from tilelang import env
    arch = patch_environment()
    sys.path.append(str(ensure_flash_qla(Path(a.site))))  # appended: local tilelang wins
    print(f"tilelang {tilelang.__version__} | cache {env.TILELANG_CACHE_DIR} | auto target -> "
          f"cuda {arch} | SMs {H200_SMS}", flush=True)

    plan = sweep_plan(a.config, heads_filter, heads_extra, dirs)
    by_head: dict[tuple[int, int], dict] = {}
    with _SimCuda():
        for hq, hv, lens, direction, dtype, h0, ht in plan:
            calls = by_head.setdefault((hq, hv), {})
            install_recorders(calls)
            simulate(hq, hv, lens, direction, dtype=dtype, initial_state=h0, output_final_state=ht)

    if a.all_widths:  # autocp/launch.py: hopper fused_fwd widths (32, 64, 128), CP on or off
        for calls in by_head.values():
            for rec, args, kwargs in list(calls.values()):
                if rec.name != "tilelang_fused_chunk_gdr_fwd":
                    continue
                for bdv in (32, 64, 128):
                    for cp in (False, True):
                        kw = dict(kwargs, block_DV=bdv, is_cp=cp)
                        calls.setdefault((rec.name, repr(args), repr(sorted(kw.items()))),
                                         (rec, args, kw))

    from tilelang.cache.kernel_cache import KernelCache
    grand_t, grand_n = time.time(), 0
    for (hq, hv), calls in by_head.items():
        print(f"== {hq}/{hv}: {len(calls)} kernel variants", flush=True)
        t_head, size_head, bin0 = time.time(), 0, binaries_size()
        for rec, args, kwargs in calls.values():
            desc = describe(rec.name, args, kwargs)
            if a.list:
                print(f"   {desc}", flush=True)
                continue
            t0 = time.time()
            kernel = rec.impl(*args, **kwargs)  # lazy-mode JIT: compile or load from disk cache
            key = getattr(kernel, "_tilelang_cache_key", None)
            path = getattr(kernel, "_tilelang_cache_path", None)
            sz = dir_size(path) if path and os.path.isdir(path) else 0
            size_head += sz
            grand_n += 1
            print(f"   {time.time() - t0:6.1f} s {sz / 2**20:6.2f} MiB {key or '(cached)'} {desc}",
                  flush=True)
        if not a.list:
            print(f"== {hq}/{hv}: {time.time() - t_head:.0f} s, {size_head / 2**20:.1f} MiB of kernels/ "
                  f"entries + {(binaries_size() - bin0) / 2**20:.1f} MiB new in cuda-binaries/",
                  flush=True)
    if not a.list:
        print(f"total: {grand_n} kernels, {time.time() - grand_t:.0f} s; cache root "
              f"{KernelCache._get_cache_root()}", flush=True)


if __name__ == "__main__":
    main()
