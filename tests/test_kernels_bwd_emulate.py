"""CPU test of the TileLang backward's algorithm: the pure-torch emulation of each backward
kernel (tools/kernels/emulate_bwd.py) against autograd through the chunked fp32 reference, and
the launch glue of ``chunk_gdn_bwd`` with the kernels swapped for their emulations."""

import importlib

import pytest
import qlabench_kernels
import torch
from qlabench_tools.kernels import emulate, emulate_bwd

from qlabench.backends.reference import gdn_chunked_grads

D = 128
TOL = {"dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dbeta": 2e-2, "dh0": 2e-2, "dg": 4e-2}




def _inputs(seqlens, h_qk, h_v, with_h0, with_dht, seed=0):
    emu = emulate
    x = emu.make_inputs(seqlens, h_qk, h_v, seed=seed, with_h0=with_h0)
    gen = torch.Generator().manual_seed(seed + 7)
    T, N = sum(seqlens), len(seqlens)
    x["do"] = torch.randn(1, T, h_v, D, generator=gen).to(torch.bfloat16)
    x["dht"] = torch.randn(N, h_v, D, D, generator=gen) * 0.1 if with_dht else None
    return x


def _ref(x):
    return gdn_chunked_grads(
        x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, x["h0"], x["cu"], x["do"], x["dht"]
    )  # fmt: skip


def _check(got, ref, with_h0):
    emu = emulate
    names = ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if with_h0 else [])
    for n in names:
        assert torch.isfinite(got[n].float()).all(), n
        err = emu.rel_l2(got[n].float(), ref[n])
        assert err < TOL[n], f"{n}: rel L2 {err:.3e}"


@pytest.mark.parametrize(
    "seqlens,h_qk,h_v,with_h0,with_dht",
    [((1, 63, 64, 65, 130), 2, 4, True, True), ((70, 0, 129), 1, 3, False, False), ((65, 200), 2, 2, True, False)],
)
def test_emulated_backward_matches_reference(seqlens, h_qk, h_v, with_h0, with_dht):
    eb = emulate_bwd
    x = _inputs(seqlens, h_qk, h_v, with_h0, with_dht)
    r = eb.emu_bwd_pipeline(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], x["dht"], None, x["h0"], x["cu"])
    _check(r, _ref(x), with_h0)


@pytest.mark.parametrize("seqlens,with_h0,with_dht", [((1, 63, 64, 65, 300), True, True), ((129, 70), False, False)])
def test_dhu_uw_algebra_matches_reference(seqlens, with_h0, with_dht):
    """bwd_dhu's algebra (Y = Y₀ + W' dH, with its bf16 rounding points): the gradients stay within
    the thresholds and within bf16 noise of the direct form Y = A_βᵀ dv_new."""
    eb = emulate_bwd
    x = _inputs(seqlens, 2, 4, with_h0, with_dht, seed=17)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], x["dht"], None, x["h0"], x["cu"])
    new, old = eb.emu_bwd_pipeline(*args, uw=True), eb.emu_bwd_pipeline(*args)
    _check(new, _ref(x), with_h0)
    emu = emulate
    for n in ("dq", "dk", "dv", "dg", "dbeta"):
        assert emu.rel_l2(new[n].float(), old[n].float()) < 1e-2, n


def _patch_kernels(monkeypatch):
    """Swap the backward launchers (and the forward) for their torch emulations."""
    pkg = qlabench_kernels
    bw = importlib.import_module("qlabench_kernels.backward")
    ag = importlib.import_module("qlabench_kernels.autograd")
    eb = emulate_bwd
    emu = emulate
    bf = torch.bfloat16

    def fake_h(k, v, gcs, a_beta, stab, h_init, h_all=None, vnew=None, target=None):
        ha, vn = eb.emu_bwd_h(k, v, gcs, a_beta, stab, h_init, gcs.shape[1] // 64)
        h_all.copy_(ha)
        vnew.copy_(vn)
        return h_all, vnew

    def fake_dhu(q, k, gcs, a_beta, do, dht, stab, scale, dh0, dh_all=None, dvnew=None, target=None, split=""):
        N = int(stab[:, 2].max()) + 1
        dha, dvn, d0 = eb.emu_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, gcs.shape[1] // 64, N, split=split)
        if dh0 is not None:
            dh0.copy_(d0[: dh0.shape[0]])
        if split == "seg":  # pass 1 writes only F
            return dh_all, dvnew, dh0
        dh_all.copy_(dha)
        dvnew.copy_(dvn)
        return dh_all, dvnew, dh0

    def fake_seg_state(k, v, gcs, a_beta, stab, cu_segs, e_end, m_tr, **kw):
        e, m = emu.emu_seg_state(k, v, gcs, a_beta, stab, cu_segs)
        e_end.copy_(e)
        m_tr.copy_(m.to(m_tr.dtype))
        return e_end, m_tr

    def fake_fixup(m_tr, add, cu_segs, init, out, reverse=False, **kw):
        out.copy_((eb.emu_rfixup if reverse else emu.emu_fixup)(m_tr, add, cu_segs, init))
        return out

    def fake_dqkwy(q, k, v, beta, do, gcs, a_beta, ctab, h_all, dh_all, vnew, dvnew, scale, target=None):
        dq, dk, dv, dg, db = eb.emu_bwd_dqkwy(q, k, v, beta, do, gcs, a_beta, h_all, dh_all, vnew, dvnew, ctab, scale)
        return dq.to(bf), dk.to(bf), dv.to(bf), dg, db  # dq, dk, dv stored in bf16 by the kernel

    for name, fn in [("run_bwd_h", fake_h), ("run_bwd_dhu", fake_dhu), ("run_bwd_dqkwy", fake_dqkwy),
                     ("run_seg_state", fake_seg_state), ("run_fixup", fake_fixup)]:  # fmt: skip
        monkeypatch.setattr(bw, name, fn)

    def fake_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None, **kw):
        r = emu.emu_pipeline(q, k, v, g, beta, scale, initial_state, cu_seqlens)
        r["o"] = r["o"].to(bf)
        r["final_state"] = r["final_state"] if output_final_state else None
        return r

    monkeypatch.setattr(ag, "chunk_gdn_fwd_lowlevel", fake_fwd)
    return pkg


def test_chunk_gdn_bwd_glue_with_emulated_kernels(monkeypatch):
    """chunk_gdn_bwd's tables, buffers, GVA group sums and dtypes, kernels replaced by emulations."""
    pkg = _patch_kernels(monkeypatch)
    emu = emulate
    bf = torch.bfloat16
    common = importlib.import_module("qlabench_kernels._common")
    seqlens, h_qk, h_v = (1, 63, 64, 65, 130), 2, 6
    x = _inputs(seqlens, h_qk, h_v, True, True, seed=3)
    T, N = sum(seqlens), len(seqlens)
    ctab, _ = common.chunk_table(x["cu"].long(), T, N)
    gcs, a_beta = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
    dq, dk, dv, dg, db, dh0 = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab,
    )  # fmt: skip
    assert dq.shape == dk.shape == (1, T, h_qk, D) and dq.dtype == bf
    assert dv.shape == (1, T, h_v, D) and dg.shape == db.shape == (1, T, h_v) and dg.dtype == torch.float32
    assert dh0.shape == (N, h_v, D, D) and dh0.dtype == torch.float32
    _check(dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db, dh0=dh0), _ref(x), True)


@pytest.mark.parametrize(
    "seqlens,split,with_h0,with_dht",
    [((1, 63, 64, 65, 300), 64, True, True), ((200, 130), 128, False, True), ((257,), 64, True, False),
     ((0, 190, 3), 128, False, False)],
)  # fmt: skip
def test_split_backward_with_emulated_kernels(monkeypatch, seqlens, split, with_h0, with_dht):
    """The split chains (seg_state + fixup start states, bwd_dhu pass 1, the reverse fix-up,
    pass 2) give the unsplit gradients: kernels replaced by emulations, against the reference."""
    pkg = _patch_kernels(monkeypatch)
    emu = emulate
    common = importlib.import_module("qlabench_kernels._common")
    x = _inputs(seqlens, 2, 4, with_h0, with_dht, seed=11)
    T, N = sum(seqlens), len(seqlens)
    ctab, _ = common.chunk_table(x["cu"].long(), T, N)
    gcs, a_beta = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
    r = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab, split_tokens=split, return_intermediates=True,
    )  # fmt: skip
    assert r["split_tokens"] == split and r["d_end"].shape[0] == r["stab"].shape[0]
    assert int(r["stab"][:, 2].ge(0).sum()) > N  # some sequence really was cut
    _check({n: r[n] for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0")}, _ref(x), with_h0)


def test_split_backward_warm_ups(monkeypatch):
    """The split backward where the gates decay (about -1.9 nats a chunk, segments of 16 chunks; one
    g = 0 head): seg_state's warm-ups (M = 0) and pass 1's (F from each segment's first chunks alone)
    keep every segment-end gradient within rounding of the exact walks' and the gradients at the
    reference's error; a warm-up cut at e^-2 is caught (kernels replaced by emulations)."""
    pkg = _patch_kernels(monkeypatch)
    seg_state = importlib.import_module("qlabench_kernels.seg_state")
    common = importlib.import_module("qlabench_kernels._common")
    x = _inputs((3000, 200), 1, 4, True, True, seed=13)
    ctab, _ = common.chunk_table(x["cu"].long(), 3200, 2)
    gcs, a_beta = emulate.emu_prep(x["k"], x["g"], x["beta"], ctab)

    def run(thr):
        monkeypatch.setattr(seg_state, "WARMUP_LOG_DECAY", thr)
        return pkg.chunk_gdn_bwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
            cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab, split_tokens=1024, return_intermediates=True,
        )  # fmt: skip

    r, exact, cut = run(seg_state.WARMUP_LOG_DECAY), run(float("-inf")), run(-2.0)
    s1 = int(r["stab"][1, 3])  # the second segment's chunk slot: 16 chunks, warmed up on the 3 decaying heads
    assert bool((emulate.warmup_len(gcs, s1, 16, from_first=True)[:3] < 16).all())
    used = exact["d_end"].isfinite().flatten(1).all(1)
    assert emulate.rel_l2(r["d_end"][used], exact["d_end"][used]) < 1e-3
    assert emulate.rel_l2(cut["d_end"][used], exact["d_end"][used]) > 1e-2
    _check({n: r[n] for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0")}, _ref(x), True)


def test_split_tokens_bad_value():
    pkg = qlabench_kernels
    x = _inputs((100,), 1, 1, False, False)
    with pytest.raises(ValueError, match="split_tokens=100 must be a multiple of 64"):
        pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], cu_seqlens=x["cu"],
                          gcs=torch.zeros(1, 128), a_beta=torch.zeros(1, 128, 64), split_tokens=100)  # fmt: skip
    with pytest.raises(ValueError, match="seqlens"):
        pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], cu_seqlens=x["cu"],
                          gcs=torch.zeros(1, 128), a_beta=torch.zeros(1, 128, 64), seqlens=[50])  # fmt: skip
    with pytest.raises(ValueError, match="seqlens"):  # not an integer length
        pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], cu_seqlens=x["cu"],
                          gcs=torch.zeros(1, 128), a_beta=torch.zeros(1, 128, 64), seqlens=[99.5])  # fmt: skip


def test_autograd_function_with_emulated_kernels(monkeypatch):
    """chunk_gdn + loss.backward() (ChunkGDNFunction's save / backward plumbing) on CPU."""
    pkg = _patch_kernels(monkeypatch)
    x = _inputs((1, 63, 64, 65, 130), 1, 2, True, True, seed=5)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0")}
    o, ht = pkg.chunk_gdn(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["h0"],
        output_final_state=True, cu_seqlens=x["cu"],
    )  # fmt: skip
    ((o.float() * x["do"].float()).sum() + (ht * x["dht"]).sum()).backward()
    _check({"d" + n: t.grad for n, t in leaves.items()}, _ref(x), True)
    # host lengths plan both passes' splits; a wrong list is an error naming seqlens
    with pytest.raises(ValueError, match="seqlens"):
        pkg.chunk_gdn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], cu_seqlens=x["cu"],
                      seqlens=[1, 2])  # fmt: skip
    o2, ht2 = pkg.chunk_gdn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], cu_seqlens=x["cu"],
                            seqlens=[1, 63, 64, 65, 130])  # fmt: skip
    assert ht2 is None
    (o2.float() * x["do"].float()).sum().backward()


@pytest.mark.parametrize("h_qk,h_v", [(2, 4), (1, 3), (2, 2)])
def test_every_group_size_runs_the_persistent_kernels(monkeypatch, h_qk, h_v):
    """One path for every GVA group size, G = 1 included: the persistent launcher once per call, and
    the gradients of the reference."""
    pkg = _patch_kernels(monkeypatch)
    bw = importlib.import_module("qlabench_kernels.backward")
    seen = []
    fn = bw.run_bwd_dqkwy
    monkeypatch.setattr(bw, "run_bwd_dqkwy", lambda *a, **kw: (seen.append("run_bwd_dqkwy"), fn(*a, **kw))[1])
    emu = emulate
    common = importlib.import_module("qlabench_kernels._common")
    x = _inputs((63, 65, 200), h_qk, h_v, True, True, seed=23)
    ctab, _ = common.chunk_table(x["cu"].long(), 328, 3)
    gcs, a_beta = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
    dq, dk, dv, dg, db, dh0 = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab,
    )  # fmt: skip
    assert seen == ["run_bwd_dqkwy"]
    _check(dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db, dh0=dh0), _ref(x), True)


class _Streams:
    """The two CUDA streams of ``chunk_gdn_bwd`` on the CPU. While the chains are forked (from
    ``side.wait_stream(main)`` to ``main.wait_stream(side)``), every launch and every NaN fill of a
    poisoned allocation is queued on the stream current at that time; the join runs the queues in
    the order ``pick`` chooses among the streams that can go on (events respected), as the GPU may."""

    def __init__(self, pick):
        self.main, self.side = _Stream(self, "main"), _Stream(self, "side")
        self.current, self.forked, self.running, self.pick = self.main, False, False, pick

    def launch(self, fn):
        if self.forked and not self.running:
            self.current.ops.append(("run", fn))
        else:
            fn()

    def join(self):
        self.running = True
        streams = (self.main, self.side)
        while any(s.ops for s in streams):
            ready = [s for s in streams if s.ops and (s.ops[0][0] != "wait" or s.ops[0][1].done)]
            assert ready, "the streams wait on each other"
            kind, x = self.pick(ready).ops.pop(0)
            if kind == "run":
                x()
            elif kind == "record":
                x.done = True
        self.running = self.forked = False


class _Event:
    def __init__(self, sim):
        self.sim, self.done = sim, False

    def record(self, stream):
        stream.ops.append(("record", self))


class _Stream:
    def __init__(self, sim, name):
        self.sim, self.name, self.ops = sim, name, []

    def wait_event(self, ev):
        self.ops.append(("wait", ev))

    def wait_stream(self, other):
        ev = _Event(self.sim)
        ev.record(other)
        self.wait_event(ev)
        if self is self.sim.side:
            self.sim.forked = True
        else:
            self.sim.join()


def _on_two_streams(monkeypatch, sim):
    """Run chunk_gdn_bwd's kernels (emulated) and its poison fills on ``sim``'s streams."""
    import contextlib

    pkg = _patch_kernels(monkeypatch)
    bw = importlib.import_module("qlabench_kernels.backward")
    for name in ("run_bwd_h", "run_seg_state", "run_fixup"):  # dqkwy: after the join
        fn = getattr(bw, name)
        monkeypatch.setattr(bw, name, lambda *a, _fn=fn, **kw: sim.launch(lambda: _fn(*a, **kw)))
    fake_dhu = bw.run_bwd_dhu

    def lazy_dhu(*a, **kw):  # the driver passes dh0, dh_all, dvnew positionally
        sim.launch(lambda: fake_dhu(*a, **kw))
        return a[9], a[10], a[8]

    @contextlib.contextmanager
    def on(stream):
        prev, sim.current = sim.current, stream
        try:
            yield
        finally:
            sim.current = prev

    monkeypatch.setattr(bw, "run_bwd_dhu", lazy_dhu)
    monkeypatch.setattr(bw, "_side_stream", lambda dev: sim.side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: sim.current)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: _Event(sim))
    return pkg


def _poison_on(sim):
    from qlabench.poison import PoisonAllocations

    class Poison(PoisonAllocations):
        """PoisonAllocations whose NaN fill is a launch on the current stream (a CUDA fill kernel)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func.overloadpacket.__name__ in ("empty", "empty_like", "new_empty", "empty_strided"):
                for t in [out] if isinstance(out, torch.Tensor) else []:
                    if t.is_floating_point() and t.numel():
                        sim.launch(lambda t=t: t.fill_(float("nan")))
            return out

    return Poison()


@pytest.mark.parametrize("order", ["side_first", "main_first", 0, 1, 2, 3])
def test_split_backward_poisoned_on_two_streams(monkeypatch, order):
    """The split path under NaN-poisoned allocations with the state side (seg_state, fixup, bwd_h)
    on a second stream that runs ahead of, behind or interleaved with the main one: the gradients
    are those of the reference only if every buffer the side stream writes is poisoned before the
    fork (a fill queued on the main stream after it may land on e_end / m_tr / h_start after the
    side stream wrote them)."""
    import random

    if isinstance(order, int):
        rng = random.Random(order)
        pick = rng.choice
    else:
        pick = (lambda r: r[-1]) if order == "side_first" else (lambda r: r[0])
    sim = _Streams(pick)
    pkg = _on_two_streams(monkeypatch, sim)
    emu = emulate
    common = importlib.import_module("qlabench_kernels._common")
    seqlens = (130, 455)  # 128-token segments: 2 and 4 per sequence
    x = _inputs(seqlens, 2, 4, True, True, seed=29)
    T, N = sum(seqlens), len(seqlens)
    ctab, _ = common.chunk_table(x["cu"].long(), T, N)
    gcs, a_beta = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
    with _poison_on(sim) as mode:
        r = pkg.chunk_gdn_bwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
            cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab, split_tokens=128, seqlens=list(seqlens),
        )  # fmt: skip
    assert mode.filled >= 10 and not sim.forked and not (sim.main.ops or sim.side.ops)
    _check(dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), r)), _ref(x), True)
