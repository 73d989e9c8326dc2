"""Backends that cheat or are subtly wrong, for the correctness check's tests (CPU) and its GPU acceptance.

Each wraps an honest backend (``base``: the torch reference by default) and breaks one thing the
gate must catch. ``Noisy`` adds bf16-sized noise to an honest answer first, so that the limits
are tested as a kernel meets them (an exact answer would fail every injected bug on the global
norm alone, whatever the local checks do). ``SavedForward`` is honest too: a refresh that
re-derives a forward's outputs, as the library backward backends' do.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from qlabench.backends.base import Prepared
from qlabench.backends.reference import ReferenceBackend

#: relative RMS of the noise ``Noisy`` adds: where bf16 kernels land (~4e-3 on o and the state)
NOISE = 4e-3


def noisy(t: torch.Tensor, seed: int) -> torch.Tensor:
    """``t`` with noise of relative RMS ``NOISE`` on every element, relative to the element (as
    rounding is): a small sequence beside large ones is as accurate as they are."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    n = torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32)
    return t + (NOISE * t.float() * n).to(t.dtype)


class Noisy(ReferenceBackend):
    """The reference plus noise of relative RMS ``NOISE`` on every output: passes the correctness check."""

    name = "noisy"

    def damage(self, out: dict, x) -> dict:
        return out

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        be = self

        def fn():
            raw = inner.fn()
            out = ReferenceBackend.outputs_to_canonical(be, raw, x, direction)
            out = {k: (None if v is None else noisy(v, i)) for i, (k, v) in enumerate(out.items())}
            return be.damage(out, x)
        return Prepared(fn=fn, graph_safe=False)

    def outputs_to_canonical(self, raw, inputs, direction):
        return raw


def _seq_bounds(x):
    cu = x.cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


class LastTokenZeroed(Noisy):
    """The last token of every sequence zeroed (o; dq, dk, dv, dg, dbeta)."""

    name = "last-token-zeroed"

    def damage(self, out, x):
        for k in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            if out.get(k) is not None:
                for _, e in _seq_bounds(x):
                    out[k][0, e - 1] = 0
        return out


class ChunkScaled(Noisy):
    """One 64-token chunk of one head x 1.2 (the middle chunk of the first sequence, head 1)."""

    name = "chunk-scaled"

    def damage(self, out, x):
        s, e = _seq_bounds(x)[0]
        c = ((e - s) // 64 // 2) * 64 + s
        for k in ("o", "dv"):
            if out.get(k) is not None:
                out[k][0, c:c + 64, 1] *= 1.2
        return out


class HeadScaled(Noisy):
    """One v-head: o x 1.055 and the final state x 1.028 (dv and dh0 in the backward)."""

    name = "head-scaled"

    def damage(self, out, x):
        for k in ("o", "dv"):
            if out.get(k) is not None:
                out[k][0, :, 1] *= 1.055
        for k in ("final_state", "dh0"):
            if out.get(k) is not None:
                out[k][:, 1] *= 1.028
        return out


class AllScaled(Noisy):
    """Every output x 1.019."""

    name = "all-scaled"

    def damage(self, out, x):
        return {k: (None if v is None else v * 1.019) for k, v in out.items()}


class Cached(ReferenceBackend):
    """Computes its answer once, in ``prepare``; every call copies it into its output buffers."""

    name = "cached"

    def prepare(self, x, direction):
        if direction != "fwd":
            raise NotImplementedError
        inner = super().prepare(x, direction)
        o, ht = inner.fn()
        bufs = (torch.empty_like(o), torch.empty_like(ht))

        def fn():
            bufs[0].copy_(o)
            bufs[1].copy_(ht)
            return bufs
        return Prepared(fn=fn, graph_safe=False, outputs=bufs)


class HungOnInputs(ReferenceBackend):
    """Computes its answer in ``prepare`` and hangs it on the inputs object (an attribute beside
    the input tensors); every call returns it without computing."""

    name = "hung-on-inputs"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        x.answer = inner.fn()
        return Prepared(fn=lambda: x.answer, graph_safe=False)


class NanLazy(ReferenceBackend):
    """Computes only when its preallocated output holds NaN — what a poisoned, checked call looks
    like; otherwise returns its buffers as they are, at no cost."""

    name = "nan-lazy"

    def prepare(self, x, direction):
        if direction != "fwd":
            raise NotImplementedError
        inner = super().prepare(x, direction)
        T, hv, d = x.v.shape[1], x.v.shape[2], x.v.shape[3]
        bufs = (torch.empty(1, T, hv, d, dtype=torch.float32, device=x.v.device),
                torch.empty(x.N, hv, d, d, dtype=torch.float32, device=x.v.device))

        def fn():
            if torch.isnan(bufs[0]).any():
                o, ht = inner.fn()
                bufs[0].copy_(o)
                bufs[1].copy_(ht)
            return bufs
        return Prepared(fn=fn, graph_safe=False, outputs=bufs)


class ModeLazy(ReferenceBackend):
    """Computes only while a dispatch mode is active (the correctness check's poisoning of allocations);
    otherwise returns its last answer."""

    name = "mode-lazy"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        last: list = []

        def fn():
            if _get_current_dispatch_mode() is not None or not last:
                last[:] = [inner.fn()]
            return last[0]
        return Prepared(fn=fn, graph_safe=False)


def _copy(raw):
    """A copy of a backend's raw outputs (a tuple, or a dict for the backward)."""
    if isinstance(raw, dict):
        return {k: (None if v is None else v.clone()) for k, v in raw.items()}
    return tuple(None if v is None else v.clone() for v in raw)


class InputWatch(ReferenceBackend):
    """Recomputes only when a cheap fingerprint of its inputs (the sum of q) changes, else
    returns its last answer. The timing repeats the same inputs, so its timed calls cost a sum;
    the check's rerun on fresh inputs computes, and is right."""

    name = "input-watch"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        last: dict = {}

        def fn():
            key = float(x.q.float().sum())
            if last.get("key") != key:
                last["key"], last["out"] = key, inner.fn()
            return last["out"]
        return Prepared(fn=fn, graph_safe=False)


class WatchThenHonest(ReferenceBackend):
    """InputWatch until its inputs first change, honest on every call after that: lazy through
    the timed samples, right and at full cost on every call of the check. Timed again on the
    point's own inputs, it is timed at its honest cost."""

    name = "watch-then-honest"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        st: dict = {"honest": False}

        def fn():
            key = float(x.q.float().sum())
            if st["honest"] or st.get("key", key) != key:
                st["honest"] = True
                return inner.fn()
            if "key" not in st:
                st["key"], st["out"] = key, inner.fn()
            return _copy(st["out"])
        return Prepared(fn=fn, graph_safe=False)


class OwnInputsPrecomputed(ReferenceBackend):
    """Computes the answer of the inputs it is prepared on in ``prepare`` (untimed) and returns a
    copy of it whenever those inputs are back; any other inputs it computes, and right."""

    name = "own-inputs-precomputed"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        key, ans = float(x.q.float().sum()), inner.fn()

        def fn():
            return _copy(ans) if float(x.q.float().sum()) == key else inner.fn()
        return Prepared(fn=fn, graph_safe=False)


class TamperedLayout(ReferenceBackend):
    """Turns its inputs' ``output_final_state`` off and merges their sequences into one in
    ``prepare`` (the check must not read them from the backend's inputs), then returns the
    reference's o and a zero final state."""

    name = "tampered-layout"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        cu = x.cu_seqlens.clone()

        def fn():
            x.cu_seqlens.copy_(cu)
            o, ht = inner.fn()
            x.output_final_state = False
            x.cu_seqlens[1:-1] = x.cu_seqlens[-1]
            return o, torch.zeros_like(ht)
        return Prepared(fn=fn, graph_safe=False)


class LazyAfterRefresh(ReferenceBackend):
    """Computes in ``prepare`` and on the first call after each ``Prepared.refresh`` (which only
    marks its answer stale); every other call returns a copy of its last answer."""

    name = "lazy-after-refresh"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        ans, stale = [inner.fn()], [False]

        def refresh():
            stale[0] = True

        def fn():
            if stale[0]:
                ans[0], stale[0] = inner.fn(), False
            return _copy(ans[0])
        return Prepared(fn=fn, graph_safe=False, refresh=refresh)


class WrongAfterRerun(ReferenceBackend):
    """Right on every call up to the first after ``Prepared.refresh`` (the check's rerun of the
    timed path); every later call's o (dv in the backward) is 10% off."""

    name = "wrong-after-rerun"

    def prepare(self, x, direction):
        inner = super().prepare(x, direction)
        since = [None]  # calls since the refresh

        def refresh():
            since[0] = 0

        def fn():
            raw = inner.fn()
            if since[0] is None:
                return raw
            since[0] += 1
            if since[0] == 1:
                return raw
            if isinstance(raw, dict):
                return {**raw, "dv": raw["dv"] * 1.1}
            return (raw[0] * 1.1, *raw[1:])
        return Prepared(fn=fn, graph_safe=False, refresh=refresh)


class SavedForward(ReferenceBackend):
    """Honest: a backward that keeps a forward's outputs from ``prepare`` (as the library
    backward backends keep a forward's intermediates) and re-derives them in ``refresh`` — a
    forward, about a third of its call — then computes its gradients on every call."""

    name = "saved-forward"

    def prepare(self, x, direction):
        if direction != "bwd":
            raise NotImplementedError
        fwd = ReferenceBackend.prepare(self, x, "fwd")
        inner = super().prepare(x, direction)
        saved = [t.clone() for t in fwd.fn()]

        def refresh():
            for t, now in zip(saved, fwd.fn()):
                t.copy_(now)
        return Prepared(fn=inner.fn, graph_safe=False, refresh=refresh)


CHEATS = {c.name: c for c in (LastTokenZeroed, ChunkScaled, HeadScaled, AllScaled, Cached,
                              HungOnInputs, NanLazy, ModeLazy, InputWatch, WatchThenHonest,
                              OwnInputsPrecomputed, TamperedLayout, LazyAfterRefresh,
                              WrongAfterRerun)}
