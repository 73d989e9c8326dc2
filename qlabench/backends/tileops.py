"""TileOPs ``GDNFwdOp`` (``tileops.linear_attention``; TileLang kernels), forward only.

tileops 0.1.0 pins Python >= 3.12, torch 2.13 and tilelang 0.1.12, so it usually runs in an
environment of its own: a ``backends:`` entry with ``pythonpath:`` (``docs/backends.md``;
``scripts/airgapped/bundle_tileops.sh`` builds one).

Conventions (converted once in ``prepare``, outside the timed region):

- q, k [1,T,H_qk,K]; v [1,T,H_v,V]: as canonical (views); ``cu_seqlens`` int64 [N+1] on the
  device, B = 1 (packed varlen)
- g [1,T,H_v]: log-space decay like canonical, but in q's dtype (its signature check refuses an
  fp32 g): ``g.to(q.dtype)``, a bf16 rounding of the gate that no other backend makes
- beta [1,T,H_v]: post-sigmoid like canonical, in q's dtype: ``beta.to(q.dtype)``
- state: fp32 [N,H_v,K,V], key-major (``state_v_first=False``): canonical, no transpose, in and
  out; ``final_state`` is always returned
- ``scale`` passed as the canonical inputs' (its default is K^-1/2 too)
- ``cu_seqlens_cpu``: the offsets on the host, read once here (``host_offsets``, default on).
  Its planner reads the lengths from them: the one-kernel prefill when the sequences' walks
  fill most SMs, a warp-group solve for rows of one length, and sequences cut into partitions
  (warm-up, state and correction passes before the walk) when few long walks would leave SMs
  idle. Without them every call is a solve pass and a whole-sequence walk.

Returns ``(o [1,T,H_v,V] in q's dtype, final_state fp32 [N,H_v,K,V])``, both allocated by the
call. Constraints (its kernels' refusals): K = V, 64 or 128; H_v a multiple of H_qk; each head
count even or 1; bf16/fp16; prefill on SM90 (and SM89). No backward.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from .base import Backend, Prepared, cuda_cc

#: compute capabilities tileops' GDN prefill kernels are built for (dense prefill SM90, chunked
#: prefill SM89)
PREFILL_CCS = ((9, 0), (8, 9))


def to_tileops(x, host_offsets: bool = True) -> dict:
    """Canonical inputs -> ``GDNFwdOp``'s arguments (pure torch; tested on CPU)."""
    return {
        "q": x.q, "k": x.k, "v": x.v,
        "g": x.g.to(x.q.dtype).contiguous(),
        "beta": x.beta.to(x.q.dtype).contiguous(),
        "initial_state": x.h0,
        "cu_seqlens": x.cu_seqlens.to(torch.int64),
        "cu_seqlens_cpu": x.cu_seqlens.to("cpu", torch.int64) if host_offsets else None,
    }


class TileOpsParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    #: pass the offsets on the host too (``cu_seqlens_cpu``): the planner chooses its route
    #: from the lengths; False: device offsets only (a solve pass and a whole-sequence walk)
    host_offsets: bool = True


class TileOpsBackend(Backend):
    name = "tileops"
    directions = ("fwd",)
    module = "tileops.linear_attention"
    distribution = "tileops"
    color = "#e377c2"
    Params = TileOpsParams

    def available(self):
        cc = cuda_cc()
        if cc is None:
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        if cc not in PREFILL_CCS:
            return False, (f"tileops' GDN prefill kernels target SM90 and SM89; this GPU is "
                           f"sm_{cc[0]}{cc[1]}")
        return super().available()

    def supports(self, point, direction):
        if direction != "fwd":
            return False, "tileops has no GDN backward (GDNFwdOp is an inference forward)"
        if point.head_dim not in (64, 128):
            return False, f"tileops' GDN prefill takes K = V of 64 or 128 (head_dim={point.head_dim})"
        if point.dtype not in ("bf16", "fp16"):
            return False, f"tileops takes bf16/fp16 q, k, v (dtype={point.dtype})"
        if point.h_v % point.h_qk:
            return False, f"tileops needs h_v a multiple of h_qk (h_qk={point.h_qk}, h_v={point.h_v})"
        odd = [f"{n}={c}" for n, c in (("h_qk", point.h_qk), ("h_v", point.h_v)) if c != 1 and c % 2]
        if odd:
            return False, (f"tileops' linear-attention kernels take an even head count or a single "
                           f"head ({', '.join(odd)})")
        return True, ""

    def prepare(self, x, direction):
        from tileops.linear_attention import GDNFwdOp

        a = to_tileops(x, self.params.host_offsets)
        op = GDNFwdOp(scale=x.scale, state_v_first=False)

        def fn():
            return op(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                      cu_seqlens=a["cu_seqlens"], cu_seqlens_cpu=a["cu_seqlens_cpu"])

        def refresh():  # the gate and beta copies, from the canonical inputs' current values
            for k in ("g", "beta"):
                src = getattr(x, k)
                if src.data_ptr() != a[k].data_ptr():
                    a[k].copy_(src)

        return Prepared(fn=fn, refresh=refresh,
                        notes=f"host_offsets={self.params.host_offsets}")

    def refusal(self, exc):
        """Besides :class:`Unsupported`: tileops' ``OpNotAvailableError``, which its op raises
        when none of its kernels serves the call on this device (an ``unsupported`` row with its
        message); any other exception is a failure."""
        why = super().refusal(exc)
        if why is not None:
            return why
        try:
            from tileops.backend import OpNotAvailableError
        except Exception:
            return None
        if isinstance(exc, OpNotAvailableError):
            return f"tileops refuses this configuration: OpNotAvailableError: {str(exc)[:300]}"
        return None

    def outputs_to_canonical(self, raw, x, direction):
        o, st = raw
        return {"o": o, "final_state": st}

    def path(self, names):
        """``split`` when the sequences were cut into partitions (warm-up / prepare_h /
        correct_h0 kernels before the walk), ``fused`` for the one-kernel prefill, ``direct``
        for a solve pass and the whole-sequence walk."""
        if any("correct_h0" in n or "prepare_h" in n or "warmup_chunks" in n for n in names):
            return "split"
        if any("fused_gdr_prefill" in n for n in names):
            return "fused"
        if any("fused_chunk_gdr_fwd" in n for n in names):
            return "direct"
        return super().path(names)
