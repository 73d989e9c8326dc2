"""Point -> canonical input tensors, in one convention (FLA's).

Shapes (B = 1, varlen through ``cu_seqlens``; T = total tokens, N = sequences, K = V = head_dim):

- ``q``, ``k``: [1, T, H_qk, K], bf16 (the point's dtype), L2-normalised over K
- ``v``: [1, T, H_v, V], bf16
- ``g``: [1, T, H_v] fp32, natural-log decay, by the point's gate recipe (``gate_g``): published
  ``logsigmoid(randn) / 16`` with a seeded ``zero_frac`` share of v-heads at g = 0 (no decay);
  ``strong-decay`` uniform in [min_log_gate, 0]; ``model`` ``-exp(A_log)·softplus(a + dt_bias)``
- ``beta``: [1, T, H_v] fp32, ``sigmoid(randn)``
- ``h0``: [N, H_v, K, V] fp32 (K x V, FLA's state layout) or None
- ``cu_seqlens``: [N+1] int64 (the one tensor every backend reuses)
- ``do``: [1, T, H_v, V], ``dht``: [N, H_v, K, V] — upstream gradients for the backward
- GVA: v-head j reads q/k head j // (H_v / H_qk)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .sweep import Point

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    h0: torch.Tensor | None
    cu_seqlens: torch.Tensor
    scale: float
    output_final_state: bool
    do: torch.Tensor | None = None
    dht: torch.Tensor | None = None
    zero_gate_heads: tuple[int, ...] = ()
    #: the sweep position of the point these inputs were made for (-1: none)
    point_index: int = -1

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def N(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def h_qk(self) -> int:
        return self.q.shape[2]

    @property
    def h_v(self) -> int:
        return self.v.shape[2]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}


def l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf / xf.norm(dim=-1, keepdim=True).clamp_min(1e-6)).to(x.dtype)


def zero_gate_heads(h_v: int, frac: float, seed: int) -> list[int]:
    n = int(round(h_v * frac))
    if n == 0:
        return []
    gen = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(h_v, generator=gen)[:n].tolist())


def gate_g(point: Point, randn) -> tuple[torch.Tensor, list[int]]:
    """The log-gate g [1, T, H_v] of the point's recipe (draws from ``randn``, the point's
    generator) and the v-heads held at g = 0. Every recipe gives g <= 0."""
    T, hv = point.total_tokens, point.h_v
    p = dict(point.gate_params)
    zh: list[int] = []
    if point.gate_recipe == "published":
        g = F.logsigmoid(randn(1, T, hv)) / 16
        zh = zero_gate_heads(hv, point.gate_zero_frac, point.gate_seed)
        if zh:
            g[:, :, zh] = 0.0
    elif point.gate_recipe == "strong-decay":
        u = torch.special.ndtr(randn(1, T, hv))  # uniform in (0, 1) from the same generator
        g = u * p["min_log_gate"]
    elif point.gate_recipe == "model":
        gen = torch.Generator().manual_seed(point.gate_seed)
        lo, hi = p["a_range_lo"], p["a_range_hi"]
        a_log = torch.log(lo + (hi - lo) * torch.rand(hv, generator=gen, dtype=torch.float64))
        dlo, dhi = math.log(p["dt_range_lo"]), math.log(p["dt_range_hi"])
        dt = torch.exp(dlo + (dhi - dlo) * torch.rand(hv, generator=gen, dtype=torch.float64))
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(dt)
        a = randn(1, T, hv)
        g = -(a_log.exp().float().to(a.device) * F.softplus(a + dt_bias.float().to(a.device)))
    else:
        raise ValueError(f"gate recipe {point.gate_recipe!r}: unknown")
    if not bool((g <= 0).all()):
        raise ValueError(f"gate recipe {point.gate_recipe!r} gave a log-gate > 0 "
                         f"(max {float(g.max()):.3g}); log-gates must be <= 0")
    return g.contiguous(), zh


def cu_seqlens_of(seqlens, device="cpu") -> torch.Tensor:
    cu = [0]
    for s in seqlens:
        cu.append(cu[-1] + int(s))
    return torch.tensor(cu, dtype=torch.int64, device=device)


def make(point: Point, device: str | torch.device = "cpu", with_grads: bool = False,
         seed: int | None = None) -> Inputs:
    """Seeded, reproducible inputs for ``point``, drawn directly on ``device`` (the same numbers
    for every backend on that device; CPU and CUDA generators differ from each other)."""
    seed = point.seed if seed is None else seed
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    T, hq, hv, d = point.total_tokens, point.h_qk, point.h_v, point.head_dim
    dt = DTYPES[point.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=dev)

    q = l2norm(randn(1, T, hq, d)).to(dt)
    k = l2norm(randn(1, T, hq, d)).to(dt)
    v = randn(1, T, hv, d).to(dt)
    g, zh = gate_g(point, randn)
    beta = randn(1, T, hv).sigmoid()
    h0 = randn(point.num_seqs, hv, d, d) if point.initial_state else None
    do = dht = None
    if with_grads:
        do = randn(1, T, hv, d).to(dt)
        dht = randn(point.num_seqs, hv, d, d) / 8 if point.output_final_state else None
    return Inputs(q=q, k=k, v=v, g=g, beta=beta, h0=h0,
                  cu_seqlens=cu_seqlens_of(point.seqlens, dev), scale=d ** -0.5,
                  output_final_state=point.output_final_state, do=do, dht=dht,
                  zero_gate_heads=tuple(zh), point_index=int(point.index))
