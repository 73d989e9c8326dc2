"""A qlabench backend in one file: the GDN forward as a token-by-token torch loop.

Registered by this package's ``pyproject.toml`` under the entry-point group ``qlabench.backends``
as ``torch-loop``; after ``pip install`` it runs in any sweep::

    backends: [reference, torch-loop, {name: torch-loop, label: loop-fp64, params: {dtype: fp64}}]

Conventions are qlabench's canonical ones (FLA's): q, k [1,T,H_qk,K]; v [1,T,H_v,V]; g the
natural-log decay [1,T,H_v]; β [1,T,H_v]; state [N,H_v,K,V]; v-head j reads q/k head j // (H_v/H_qk).
Per token: S = e^g S; S += β k (v − Sᵀk)ᵀ; o = Sᵀ (scale · q).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from qlabench.backends import Backend, Prepared


class LoopParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    #: the precision of the state and the arithmetic
    dtype: Literal["fp32", "fp64"] = "fp32"


def gdn_loop(q, k, v, g, beta, scale, h0, cu_seqlens, dtype=torch.float32):
    """(o [1,T,H_v,V] in v's dtype, final states [N,H_v,K,V] fp32)."""
    group = v.shape[2] // q.shape[2]
    qf = q[0].to(dtype).repeat_interleave(group, dim=1) * scale
    kf = k[0].to(dtype).repeat_interleave(group, dim=1)
    vf, gf, bf = v[0].to(dtype), g[0].to(dtype), beta[0].to(dtype)
    T, H, K, V = vf.shape[0], vf.shape[1], kf.shape[2], vf.shape[2]
    o = torch.empty(T, H, V, dtype=dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    states = []
    for n in range(len(bounds) - 1):
        S = (h0[n].to(dtype).clone() if h0 is not None
             else torch.zeros(H, K, V, dtype=dtype, device=v.device))
        for t in range(bounds[n], bounds[n + 1]):
            S *= gf[t].exp()[:, None, None]
            u = vf[t] - torch.einsum("hk,hkv->hv", kf[t], S)
            S += bf[t][:, None, None] * kf[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", qf[t], S)
        states.append(S.float())
    return o.to(v.dtype)[None], torch.stack(states)


class TorchLoopBackend(Backend):
    name = "torch-loop"
    directions = ("fwd",)
    color = "#17becf"
    needs_cuda = False
    Params = LoopParams

    def version(self) -> str:
        from importlib.metadata import version
        return version("qlabench-example-backend")

    def available(self):
        return True, ""

    def prepare(self, x, direction):
        dt = torch.float64 if self.params.dtype == "fp64" else torch.float32

        def fn():
            return gdn_loop(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, x.cu_seqlens, dt)

        # reads cu_seqlens on the host: never captured in a CUDA graph
        return Prepared(fn=fn, graph_safe=False, notes="token-by-token loop")

    def outputs_to_canonical(self, raw, x, direction):
        o, ht = raw
        return {"o": o, "final_state": ht if x.output_final_state else None}
