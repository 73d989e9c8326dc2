"""FlashInfer ``gdn_prefill.chunk_gated_delta_rule``, forward only, both SM90 generations:

- up to 0.6.13, a CUTLASS "flat" kernel;
- from 0.6.14 (0.7.x), CuTe-DSL kernels (a warp-specialised fused kernel, and a context-parallel
  pipeline it chooses with ``use_cp="auto"``).

Which one is installed is read from the function's signature (:func:`api_of`: the CuTe-DSL API
takes ``max_seqlen``), not from the version string. The CuTe-DSL call gets ``max_seqlen``, the
longest sequence as a host int read once in ``prepare``; without it the CP grid is sized for the
whole token count. The gate stays α = exp(g) (``gate_domain="linear"``, its default); its
``"log"`` domain adds an exp pass before the kernel.

Conversions (done once in ``prepare``, outside the timed region):

- q [1,T,H_qk,K] -> [T,H_qk,K]; k likewise; v [1,T,H_v,V] -> [T,H_v,V] (views, no batch dim)
- g (log-space) -> ``alpha = exp(g)`` fp32 [T,H_v] (FlashInfer's gate is linear-space)
- beta [1,T,H_v] -> [T,H_v] fp32
- state: canonical [N,H_v,K,V] -> FlashInfer [N,H_v,V,K] (``transpose(-1,-2)``) in, and back out
- ``cu_seqlens`` int64 (its SM90 launcher checks int64)
- outputs written into preallocated buffers (``Prepared.outputs``: NaN before every checked call)

Constraints: head_dim 128 only on SM90; no backward; ``use_qk_l2norm_in_kernel`` is ignored by
the kernel (our q, k are already normalised).
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from .base import Backend, Prepared, Unsupported, cuda_cc


def to_flashinfer(x) -> dict:
    """Canonical inputs -> FlashInfer's conventions (pure torch; tested on CPU)."""
    T, hq, hv, d = x.q.shape[1], x.q.shape[2], x.v.shape[2], x.q.shape[3]
    return {
        "q": x.q.reshape(T, hq, d), "k": x.k.reshape(T, hq, d), "v": x.v.reshape(T, hv, d),
        "g": x.g.reshape(T, hv).exp().contiguous(),
        "beta": x.beta.reshape(T, hv).float().contiguous(),
        "initial_state": (None if x.h0 is None else x.h0.transpose(-1, -2).contiguous()),
        "cu_seqlens": x.cu_seqlens.to(torch.int64),
        "scale": x.scale,
    }


def api_of(fn) -> str:
    """``"cute-dsl"`` (0.6.14 and later: takes ``max_seqlen``) or ``"cutlass-flat"`` (up to 0.6.13)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "cutlass-flat"
    return "cute-dsl" if "max_seqlen" in params else "cutlass-flat"


def state_from_flashinfer(st: torch.Tensor) -> torch.Tensor:
    """[N,H,V,K] -> canonical [N,H,K,V]."""
    return st.transpose(-1, -2)


class FlashInferParams(BaseModel):
    """Arguments of the CuTe-DSL API (0.6.14 and later); the CUTLASS-flat one takes neither."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: context parallelism: "auto" (the library's rule), or forced on / off
    use_cp: Literal["auto"] | bool = "auto"
    #: "linear": the gate passed as α = exp(g) (computed in prepare, outside the timed call);
    #: "log": g passed as is with gate_domain="log" (the library's exp runs inside the call)
    gate_domain: Literal["linear", "log"] = "linear"


class FlashInferBackend(Backend):
    name = "flashinfer"
    directions = ("fwd",)
    module = "flashinfer"
    distribution = "flashinfer-python"
    color = "#2ca02c"
    Params = FlashInferParams

    def available(self):
        cc = cuda_cc()
        if cc is None:
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        if cc[0] != 9:
            return False, f"FlashInfer's GDN prefill kernel here targets SM90; GPU is sm_{cc[0]}{cc[1]}"
        return super().available()

    def supports(self, point, direction):
        if direction != "fwd":
            return False, "FlashInfer has no GDN backward (gdn_prefill is forward-only)"
        if point.head_dim != 128:
            return False, f"FlashInfer's SM90 GDN kernel takes head_dim 128 only (got {point.head_dim})"
        if point.dtype not in ("bf16", "fp16"):
            return False, f"FlashInfer takes bf16/fp16 q, k, v (dtype={point.dtype})"
        return True, ""

    def prepare(self, x, direction):
        from flashinfer.gdn_prefill import chunk_gated_delta_rule

        a = to_flashinfer(x)
        T, hv, d = x.v.shape[1], x.v.shape[2], x.v.shape[3]
        out = torch.full((T, hv, d), float("nan"), dtype=x.v.dtype, device=x.v.device)
        st = torch.full((x.N, hv, d, d), float("nan"), dtype=torch.float32, device=x.v.device)
        api = api_of(chunk_gated_delta_rule)
        extra = {}
        if api == "cute-dsl":  # read once here, outside the timed calls (no host sync in them)
            extra["max_seqlen"] = int(x.cu_seqlens.diff().max()) if x.N else 0
        p = self.params
        chosen = p.model_dump(exclude_defaults=True)
        if chosen and api != "cute-dsl":
            raise Unsupported(f"parameters {', '.join(chosen)} need FlashInfer's CuTe-DSL API "
                              "(0.6.14 and later); this one is CUTLASS-flat")
        takes = inspect.signature(chunk_gated_delta_rule).parameters
        missing = [k for k in chosen if k not in takes]
        if missing:
            raise Unsupported(f"this FlashInfer's chunk_gated_delta_rule takes no {', '.join(missing)}")
        if p.use_cp != "auto":
            extra["use_cp"] = p.use_cp
        if p.gate_domain == "log":
            a["g"] = x.g.reshape(T, hv).float().contiguous()
            extra["gate_domain"] = "log"

        def fn():
            return chunk_gated_delta_rule(
                q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"], scale=a["scale"],
                initial_state=a["initial_state"], output_final_state=x.output_final_state,
                cu_seqlens=a["cu_seqlens"], output=out, output_state=st, **extra)

        def refresh():  # the converted copies, from the canonical inputs' current values
            now = to_flashinfer(x)
            if p.gate_domain == "log":
                now["g"] = x.g.reshape(T, hv).float()
            for k, t in now.items():
                if isinstance(t, torch.Tensor) and t.data_ptr() != a[k].data_ptr():
                    a[k].copy_(t)

        return Prepared(fn=fn, outputs=(out, st), notes=f"api={api}", refresh=refresh)

    def outputs_to_canonical(self, raw, x, direction):
        o, st = (raw if isinstance(raw, tuple) else (raw, None))
        T, hv, d = x.v.shape[1], x.v.shape[2], x.v.shape[3]
        return {"o": o.reshape(1, T, hv, d),
                "final_state": None if st is None else state_from_flashinfer(st)}

    def path(self, names):
        """``flat`` (the CUTLASS kernel of the releases up to 0.6.13); from 0.6.14 ``cp`` when the
        context-parallel CuTe-DSL pipeline ran (its precompute / fix-up kernels) and ``fused``
        for the warp-specialised fused kernel alone."""
        if any("FlatKernel" in n or "flat::" in n for n in names):
            return "flat"
        if any("CPDeltaRule" in n or "delta_rule_cp" in n for n in names):
            return "cp"
        if any("FullyFusedDeltaRule" in n or "delta_rule_sm90" in n for n in names):
            return "fused"
        return super().path(names)
