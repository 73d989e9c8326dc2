"""CPU test of the TileLang backward's algorithm: the pure-torch emulation of each backward
kernel (kernels/dev/emulate_bwd.py) against autograd through the chunked fp32 reference, and
the launch glue of ``chunk_gdn_bwd`` with the kernels swapped for their emulations."""

import importlib
import importlib.util
import pathlib

import pytest
import torch
from kernel_helpers import kernels_pkg as _kernels_pkg

from qlabench.backends.reference import gdn_chunked_grads

ROOT = pathlib.Path(__file__).resolve().parents[1]
D = 128
TOL = {"dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dbeta": 2e-2, "dh0": 2e-2, "dg": 4e-2}




def _inputs(seqlens, h_qk, h_v, with_h0, with_dht, seed=0):
    _kernels_pkg()
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
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
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
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
    _kernels_pkg()
    eb = importlib.import_module("qlabench_kernels.dev.emulate_bwd")
    x = _inputs(seqlens, h_qk, h_v, with_h0, with_dht)
    r = eb.emu_bwd_pipeline(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], x["dht"], None, x["h0"], x["cu"])
    _check(r, _ref(x), with_h0)


@pytest.mark.parametrize("seqlens,with_h0,with_dht", [((1, 63, 64, 65, 300), True, True), ((129, 70), False, False)])
def test_dhu_uw_algebra_matches_reference(seqlens, with_h0, with_dht):
    """The S-independent form of bwd_dhu's chain (Y = Y₀ + W' dH, the next kernel step in
    kernels/NOTES.md) at bf16 rounding points: the gradients stay within the thresholds and
    within bf16 noise of today's algebra."""
    _kernels_pkg()
    eb = importlib.import_module("qlabench_kernels.dev.emulate_bwd")
    x = _inputs(seqlens, 2, 4, with_h0, with_dht, seed=17)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], x["dht"], None, x["h0"], x["cu"])
    new, old = eb.emu_bwd_pipeline(*args, uw=True), eb.emu_bwd_pipeline(*args)
    _check(new, _ref(x), with_h0)
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    for n in ("dq", "dk", "dv", "dg", "dbeta"):
        assert emu.rel_l2(new[n].float(), old[n].float()) < 1e-2, n


def _patch_kernels(monkeypatch):
    """Swap the backward launchers (and the forward) for their torch emulations."""
    pkg = _kernels_pkg()
    ag = importlib.import_module("qlabench_kernels.autograd")
    eb = importlib.import_module("qlabench_kernels.dev.emulate_bwd")
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    bf = torch.bfloat16

    def fake_h(k, v, gcs, a_beta, stab, h_init, h_all=None, vnew=None, block_v=64, target=None):
        ha, vn = eb.emu_bwd_h(k, v, gcs, a_beta, stab, h_init, gcs.shape[1] // 64)
        if h_all is None:
            return ha.to(bf), vn.to(bf)
        h_all.copy_(ha)
        vnew.copy_(vn)
        return h_all, vnew

    def fake_dhu(
        q, k, gcs, a_beta, do, dht, stab, scale, dh0, dh_all=None, dvnew=None, block_v=64, target=None,
        rowexp=False, split="", stages=0, pt=None, w=None,
    ):  # fmt: skip
        N = int(stab[:, 2].max()) + 1
        dha, dvn, d0 = eb.emu_bwd_dhu(q, k, gcs, a_beta, do, dht, stab, scale, gcs.shape[1] // 64, N, split=split)
        if dh0 is not None:
            dh0.copy_(d0[: dh0.shape[0]])
        if split == "seg":  # pass 1 writes only F
            return dh_all, dvnew, dh0
        if dh_all is None:
            return dha.to(bf), dvn.to(bf), dh0
        dh_all.copy_(dha)
        dvnew.copy_(dvn)
        return dh_all, dvnew, dh0

    def fake_seg_state(k, v, gcs, a_beta, stab, e_end, m_tr, **kw):
        e, m = emu.emu_seg_state(k, v, gcs, a_beta, stab)
        e_end.copy_(e)
        m_tr.copy_(m.to(m_tr.dtype))
        return e_end, m_tr

    def fake_fixup(m_tr, e_end, cu_segs, h0, h_start, **kw):
        h_start.copy_(emu.emu_fixup(m_tr, e_end, cu_segs, h0))
        return h_start

    def fake_rfixup(m_tr, f_start, cu_segs, dht, d_end, **kw):
        d_end.copy_(eb.emu_rfixup(m_tr, f_start, cu_segs, dht))
        return d_end

    def fake_dqkwg(
        q, k, do, gcs, ctab, h_all, dh_all, vnew, dvnew, scale, target=None, threads=128, rsum=False, bf16_out=False,
        grp=False,
    ):  # fmt: skip
        dq_v, dk_v, dw, dg_p = eb.emu_bwd_dqkwg(q, k, do, gcs, h_all, dh_all, vnew, dvnew, ctab, scale)
        if grp:  # summed over each GVA group in the kernel
            dq_v, dk_v = eb.group_sum(dq_v, q.shape[2]), eb.group_sum(dk_v, q.shape[2])
        if bf16_out:  # the kernels' bf16 per-v-head intermediates
            dq_v, dk_v = dq_v.to(bf), dk_v.to(bf)
        return dq_v, dk_v, dw.to(bf), dg_p

    def fake_wy(k, v, beta, gcs, a_beta, ctab, dw, dvnew, dg_part, dk_v, target=None, threads=128, grp=False):
        dk, dv, dg, db = eb.emu_bwd_wy(k, v, beta, gcs, a_beta, dw, dvnew, dk_v, dg_part, ctab)
        dk_v.copy_(dk)
        return dk_v, dv.to(bf), dg, db

    monkeypatch.setattr(ag, "run_bwd_h", fake_h)
    monkeypatch.setattr(ag, "run_bwd_h_ws", fake_h)  # bwd_ws=1 (default): same outputs as bwd_h
    monkeypatch.setattr(ag, "run_bwd_dhu", fake_dhu)
    monkeypatch.setattr(ag, "run_bwd_dhu_ws", fake_dhu)  # same call and outputs
    monkeypatch.setattr(ag, "run_bwd_dqkwg", fake_dqkwg)
    monkeypatch.setattr(ag, "run_bwd_wy", fake_wy)
    # the persistent warp-specialised forms (defaults): the group forms' outputs
    monkeypatch.setattr(ag, "run_bwd_dqkwg_ws", lambda *a, target=None: fake_dqkwg(*a, rsum=True, bf16_out=True, grp=True))
    monkeypatch.setattr(ag, "run_bwd_wy_ws", lambda *a, target=None: fake_wy(*a, grp=True))
    monkeypatch.setattr(importlib.import_module("qlabench_kernels.seg_state"), "run_seg_state", fake_seg_state)
    fx = importlib.import_module("qlabench_kernels.fixup")
    monkeypatch.setattr(fx, "run_fixup", fake_fixup)
    monkeypatch.setattr(fx, "run_rfixup", fake_rfixup)
    monkeypatch.setattr(
        importlib.import_module("qlabench_kernels.bwd_pw"), "run_bwd_pw",
        lambda q, k, gcs, a_beta, ctab, scale, target=None: tuple(x.to(bf) for x in eb.emu_bwd_pw(q, k, gcs, a_beta, ctab, scale)),
    )  # fmt: skip

    def fake_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None, **kw):
        r = emu.emu_pipeline(q, k, v, g, beta, scale, initial_state, cu_seqlens)
        r["o"] = r["o"].to(bf)
        r["final_state"] = r["final_state"] if output_final_state else None
        return r

    monkeypatch.setattr(pkg, "chunk_gdn_fwd_lowlevel", fake_fwd)
    return pkg


def test_chunk_gdn_bwd_glue_with_emulated_kernels(monkeypatch):
    """chunk_gdn_bwd's tables, buffers, GVA group sums and dtypes, kernels replaced by emulations."""
    pkg = _patch_kernels(monkeypatch)
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
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
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
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


def test_bf16_intermediates_with_emulated_kernels(monkeypatch):
    """bwd_bf16=1: dq / dk per v-head rounded to bf16 before the group sum stay within the thresholds."""
    pkg = _patch_kernels(monkeypatch)
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    common = importlib.import_module("qlabench_kernels._common")
    x = _inputs((1, 63, 64, 65, 300), 2, 4, True, True, seed=13)
    T, N = 493, 5
    ctab, _ = common.chunk_table(x["cu"].long(), T, N)
    gcs, a_beta = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
    dq, dk, dv, dg, db, dh0 = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab, variant="bwd_bf16=1",
    )  # fmt: skip
    assert dq.dtype == dk.dtype == torch.bfloat16
    _check(dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db, dh0=dh0), _ref(x), True)


@pytest.mark.parametrize("spec", ["bwd_grp=0", "bwd_grp=0,bwd_bf16=0", "bwd_grp=1,bwd_bf16=0"])
def test_group_forms_with_emulated_kernels(monkeypatch, spec):
    """bwd_grp=0 (per-v-head dq / dk summed by ``_group_sum``, bf16 or fp32 partials) and bwd_grp=1
    with fp32 partials give the reference gradients in the inputs' dtype."""
    pkg = _patch_kernels(monkeypatch)
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    common = importlib.import_module("qlabench_kernels._common")
    x = _inputs((1, 63, 64, 65, 300), 2, 4, True, True, seed=17)
    ctab, _ = common.chunk_table(x["cu"].long(), 493, 5)
    gcs, a_beta = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
    dq, dk, dv, dg, db, dh0 = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab, variant=spec,
    )  # fmt: skip
    assert dq.shape == x["q"].shape and dk.shape == x["k"].shape and dq.dtype == dk.dtype == x["q"].dtype
    _check(dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db, dh0=dh0), _ref(x), True)


def test_dhu_ws_variant_takes_the_same_glue(monkeypatch):
    """bwd_dhu_ws=1 routes every bwd_dhu launch (unsplit, split pass 1 and 2) to the warp-specialised
    launcher with the same arguments, and no rowexp / stages keywords."""
    pkg = _patch_kernels(monkeypatch)
    ag = importlib.import_module("qlabench_kernels.autograd")
    seen = []
    base = ag.run_bwd_dhu_ws

    def spy(*a, **kw):
        seen.append((kw.get("split", ""), sorted(kw)))
        return base(*a, **kw)

    monkeypatch.setattr(ag, "run_bwd_dhu_ws", spy)
    monkeypatch.setattr(ag, "run_bwd_dhu", lambda *a, **kw: pytest.fail("bwd_dhu launched under bwd_dhu_ws=1"))
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    common = importlib.import_module("qlabench_kernels._common")
    x = _inputs((5, 700, 300), 2, 4, True, True, seed=19)
    ctab, _ = common.chunk_table(x["cu"].long(), 1005, 3)
    gcs, a_beta = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
    for split in (0, 256):
        got = pkg.chunk_gdn_bwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
            cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab, split_tokens=split, variant="bwd_dhu_ws=1",
            return_intermediates=True,
        )  # fmt: skip
        _check(got, _ref(x), True)
    assert [s for s, _ in seen] == ["", "seg", "carry"]
    assert all("rowexp" not in kws and "stages" not in kws for _, kws in seen)


def test_split_tokens_bad_value():
    pkg = _kernels_pkg()
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
    with pytest.raises(ValueError, match="bwd_stages=2 needs rowexp=1"):
        pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], cu_seqlens=x["cu"],
                          gcs=torch.zeros(1, 128), a_beta=torch.zeros(1, 128, 64),
                          variant="bwd_stages=2,rowexp=0")  # fmt: skip


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


def test_ws_launchers_check_dk_before_compiling():
    """The persistent wy launcher refuses a dk partial it cannot complete (fp32, or per v-head) and
    G = 1 with a message naming them, before any compile; a bad variant value names the knob."""
    _kernels_pkg()
    wy = importlib.import_module("qlabench_kernels.bwd_wy_ws")
    k = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16)
    ctab = torch.zeros(2, 4, dtype=torch.int32)
    for dk in (torch.zeros(1, 64, 2, 128), torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="dk_v must be bf16 \\[1, 64, 2, 128\\]"):
            wy.run_bwd_wy_ws(k, v, None, None, None, ctab, None, None, None, dk)
    with pytest.raises(ValueError, match="GVA group of 2 or more v-heads \\(Hv=2, Hqk=2\\)"):  # G = 1
        wy.run_bwd_wy_ws(k, k, None, None, None, ctab, None, None, None, torch.zeros_like(k))
    common = importlib.import_module("qlabench_kernels._common")
    with pytest.raises(ValueError, match="bwd_wy_ws='2' not in"):
        common.parse_variant("bwd_wy_ws=2")
    with pytest.raises(ValueError, match="bwd_dqkwg_ws='yes' not in"):
        common.parse_variant("bwd_dqkwg_ws=yes")


@pytest.mark.parametrize("h_qk,h_v,want", [(2, 4, "ws"), (1, 3, "ws"), (2, 2, "group")])
def test_wy_routing_by_group_size(monkeypatch, h_qk, h_v, want):
    """The default runs the persistent wy for GVA groups of 2+ v-heads and the group wy for G = 1
    (the persistent kernel's per-item dk hand-off needs G >= 2); both give the reference gradients."""
    pkg = _patch_kernels(monkeypatch)
    ag = importlib.import_module("qlabench_kernels.autograd")
    seen = []
    ws, group = ag.run_bwd_wy_ws, ag.run_bwd_wy
    monkeypatch.setattr(ag, "run_bwd_wy_ws", lambda *a, **kw: (seen.append("ws"), ws(*a, **kw))[1])
    monkeypatch.setattr(ag, "run_bwd_wy", lambda *a, **kw: (seen.append("group"), group(*a, **kw))[1])
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    common = importlib.import_module("qlabench_kernels._common")
    x = _inputs((63, 65, 200), h_qk, h_v, True, True, seed=23)
    ctab, _ = common.chunk_table(x["cu"].long(), 328, 3)
    gcs, a_beta = emu.emu_prep(x["k"], x["g"], x["beta"], ctab)
    dq, dk, dv, dg, db, dh0 = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], gcs=gcs, a_beta=a_beta, ctab=ctab,
    )  # fmt: skip
    assert seen == [want]
    _check(dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db, dh0=dh0), _ref(x), True)
    comp = importlib.import_module("qlabench_kernels.compile")
    names = [n for n, *_ in comp.bwd_variant_kernels(h_qk, h_v, "default")]
    assert ("bwd_wy_ws" in names) == (want == "ws")
