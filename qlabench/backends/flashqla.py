"""FlashQLA (TileLang, Hopper) through its low-level API, automatic context parallelism on.

Conventions equal the canonical ones (FLA's: log-space g, state [N,H_v,K,V]); ``cu_seqlens``
may be int32 or int64. Constraints (its sm90 path asserts them): K = V = 128, chunk 64,
q/k/v bf16 or fp16, B = 1 for varlen/auto-CP, compute capability 9.x here.

Low-level returns: fwd ``(g_cumsum, A_r, o, h, final_state, cp_cache)`` — six values, A_r is
*ungated* (not interchangeable with FLA's A); bwd ``(dq, dk, dv, dbeta, dg, dh0)``.
Importing ``flash_qla`` queries the GPU, so it is imported lazily and only with CUDA present.
Compilation happens per head configuration and again per new sequence layout (~20–30 s each):
that cost lands in ``compile_s``, never in latency.
"""

from __future__ import annotations

from .base import Backend, Prepared, cuda_cc


class FlashQLABackend(Backend):
    name = "flashqla"
    directions = ("fwd", "bwd", "fwdbwd")
    module = "flash_qla"
    distribution = "flash-qla"
    color = "#d62728"

    def available(self):
        cc = cuda_cc()
        if cc is None:
            return False, "no CUDA device (flash_qla queries the GPU at import)"
        if cc[0] not in (9, 10, 12):
            return False, f"FlashQLA targets SM90/SM100/SM120; this GPU is sm_{cc[0]}{cc[1]}"
        return super().available()

    def supports(self, point, direction):
        ok, why = super().supports(point, direction)
        if not ok:
            return ok, why
        if point.head_dim != 128:
            return False, f"FlashQLA asserts K = V = 128 on sm90 (head_dim={point.head_dim})"
        if point.dtype not in ("bf16", "fp16"):
            return False, f"FlashQLA takes bf16/fp16 q, k, v (dtype={point.dtype})"
        return True, ""

    def prepare(self, x, direction):
        from flash_qla import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

        cu = x.cu_seqlens

        def fwd():
            return chunk_gated_delta_rule_fwd(
                x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0,
                output_final_state=x.output_final_state, output_h=False, cu_seqlens=cu)

        if direction == "fwd":
            return Prepared(fn=fwd)

        def bwd(gc, A):
            return chunk_gated_delta_rule_bwd(
                x.q, x.k, x.v, gc, x.beta, A, x.do, x.dht, scale=x.scale,
                initial_state=x.h0, cu_seqlens=cu)

        if direction == "bwd":
            gc, A = fwd()[:2]  # saved tensors of a forward, outside the timed region

            def refresh():
                gc2, A2 = fwd()[:2]
                gc.copy_(gc2)
                A.copy_(A2)
            return Prepared(fn=lambda: bwd(gc, A), refresh=refresh)

        def fwdbwd():
            gc, A = fwd()[:2]
            return bwd(gc, A)

        return Prepared(fn=fwdbwd)

    def outputs_to_canonical(self, raw, x, direction):
        if direction == "fwd":
            return {"o": raw[2], "final_state": raw[4]}
        dq, dk, dv, db, dg, dh0 = raw[:6]
        return {"dq": dq, "dk": dk, "dv": dv, "dbeta": db, "dg": dg, "dh0": dh0}

    def path(self, names):
        """``cp`` when its automatic context parallelism ran (prepare_h / correct_h0 kernels before
        the fused walk), ``fused`` for the fused walk alone."""
        if any("prepare_h" in n or "correct_h0" in n for n in names):
            return "cp"
        return "fused" if any("fused_chunk_gdr" in n for n in names) else super().path(names)
