"""GPU test of the in-repo TileLang GDN backward (qlabench_kernels.chunk_gdn_bwd / chunk_gdn).

Gradients against autograd through the chunked fp32 reference
(``qlabench.backends.reference.gdn_chunked_grads``): rel L2 < 4e-2 for dq, dk, dv, dβ, dh0 and
< 8e-2 for dg. One batch mixes lengths 1, 63, 64, 65, 1000, 4097; Hv/Hqk in {1, 2, 3, 4};
25% of v-heads (at least one) have g = 0; with and without h0 and d(final state).
"""

import importlib
import importlib.util
import pathlib

import pytest
import torch
from kernel_helpers import kernels_pkg as _kernels_pkg

from qlabench.backends.reference import gdn_chunked_grads

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
D = 128
SEQLENS = (1, 63, 64, 65, 1000, 4097)
HEADS = [(2, 2), (2, 4), (1, 3), (2, 8)]
TOL = {"dq": 4e-2, "dk": 4e-2, "dv": 4e-2, "dbeta": 4e-2, "dh0": 4e-2, "dg": 8e-2}




def make_inputs(seqlens, h_qk, h_v, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T, N = sum(seqlens), len(seqlens)
    q = torch.nn.functional.normalize(torch.randn(1, T, h_qk, D, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, h_qk, D, generator=gen), dim=-1)
    v = torch.randn(1, T, h_v, D, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, h_v, generator=gen) + 3.0) * 0.5
    g[..., h_v - max(1, h_v // 4) :] = 0.0  # 25% (at least one) v-heads never decay
    beta = torch.sigmoid(torch.randn(1, T, h_v, generator=gen))
    h0 = torch.randn(N, h_v, D, D, generator=gen) * 0.1
    do = torch.randn(1, T, h_v, D, generator=gen)
    dht = torch.randn(N, h_v, D, D, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(seqlens), 0).tolist()], dtype=torch.int32)
    dev = "cuda"
    bf = torch.bfloat16
    return dict(
        q=q.to(dev, bf), k=k.to(dev, bf), v=v.to(dev, bf), g=g.to(dev), beta=beta.to(dev), h0=h0.to(dev),
        do=do.to(dev, bf), dht=dht.to(dev), cu=cu.to(dev),
    )  # fmt: skip


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


_CACHE = {}


def _case(h_qk, h_v, with_h0, with_dht):
    key = (h_qk, h_v, with_h0, with_dht)
    if key not in _CACHE:
        x = make_inputs(SEQLENS, h_qk, h_v)
        ref = gdn_chunked_grads(
            x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, x["h0"] if with_h0 else None, x["cu"],
            x["do"], x["dht"] if with_dht else None,
        )  # fmt: skip
        _CACHE[key] = (x, {n: t.detach() for n, t in ref.items()})
    return _CACHE[key]


def _assert_close(got, ref, names):
    errs = {}
    for n in names:
        assert got[n] is not None, n
        assert torch.isfinite(got[n].float()).all(), f"{n}: non-finite values"
        errs[n] = rel_l2(got[n].float(), ref[n])
    bad = {n: e for n, e in errs.items() if e >= TOL[n]}
    assert not bad, f"rel L2 over threshold: {bad} (all: {errs})"


@pytest.mark.parametrize("with_dht", [True, False])
@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("h_qk,h_v", HEADS)
def test_chunk_gdn_bwd_matches_reference(h_qk, h_v, with_h0, with_dht):
    pkg = _kernels_pkg()
    x, ref = _case(h_qk, h_v, with_h0, with_dht)
    h0 = x["h0"] if with_h0 else None
    r = pkg.chunk_gdn_fwd_lowlevel(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=True, cu_seqlens=x["cu"]
    )
    dq, dk, dv, dg, db, dh0 = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"] if with_dht else None,
        initial_state=h0, cu_seqlens=x["cu"], gcs=r["gcs"], a_beta=r["a_beta"], ctab=r["ctab"],
    )  # fmt: skip
    torch.cuda.synchronize()
    T = x["q"].shape[1]
    assert dq.shape == dk.shape == (1, T, h_qk, D)
    assert dv.shape == (1, T, h_v, D) and dg.shape == db.shape == (1, T, h_v)
    got = dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db, dh0=dh0)
    names = ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if with_h0 else [])
    if not with_h0:
        assert dh0 is None
    _assert_close(got, ref, names)


def test_block_v_32_and_recomputed_prep():
    """bwd_h / bwd_dhu with 32-column V blocks, and gcs / A_β recomputed inside chunk_gdn_bwd."""
    pkg = _kernels_pkg()
    x, ref = _case(1, 3, True, True)
    dq, dk, dv, dg, db, dh0 = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], block_v=32,
    )  # fmt: skip
    _assert_close(dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=db, dh0=dh0), ref, list(TOL))


@pytest.mark.parametrize("h_qk,h_v", [(2, 8), (1, 3)])
@pytest.mark.parametrize("with_h0", [True, False])
def test_backward_variant_ws_rowexp_matches_reference(h_qk, h_v, with_h0):
    """variant bwd_ws=1,rowexp=1: the warp-specialised bwd_h (h and v_new from the forward's chain)
    and bwd_dhu's per-row exps give the reference gradients, and the same h / v_new as bwd_h."""
    pkg = _kernels_pkg()
    x, ref = _case(h_qk, h_v, with_h0, True)
    h0 = x["h0"] if with_h0 else None
    kw = dict(dht=x["dht"], initial_state=h0, cu_seqlens=x["cu"], return_intermediates=True)
    got = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], variant="bwd_ws=1,rowexp=1", **kw)
    base = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], variant="bwd_ws=0,rowexp=0", **kw)
    torch.cuda.synchronize()
    _assert_close(got, ref, ["dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if with_h0 else []))
    valid = (got["ctab"][:, 2] >= 0).nonzero().flatten()
    assert rel_l2(got["h_all"][:, valid].float(), base["h_all"][:, valid].float()) < 1e-2
    rows = valid[:, None] * 64 + torch.arange(64, device=valid.device)
    assert rel_l2(got["vnew"][:, rows.flatten()].float(), base["vnew"][:, rows.flatten()].float()) < 1e-2


def test_autograd_chunk_gdn():
    """Training path: chunk_gdn + loss.backward() gives the reference gradients on every leaf."""
    pkg = _kernels_pkg()
    x, ref = _case(2, 8, True, True)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0")}
    o, ht = pkg.chunk_gdn(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["h0"],
        output_final_state=True, cu_seqlens=x["cu"],
    )  # fmt: skip
    loss = (o.float() * x["do"].float()).sum() + (ht * x["dht"]).sum()
    loss.backward()
    got = {"d" + n: t.grad for n, t in leaves.items()}
    _assert_close(got, ref, list(TOL))
    o2, ht2 = pkg.chunk_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu"])
    assert ht2 is None and o2.shape == o.shape


def test_stages_match_emulation():
    """Stage check: each backward kernel against its torch emulation fed the kernel's own inputs."""
    pkg = _kernels_pkg()
    eb = importlib.import_module("qlabench_kernels.dev.emulate_bwd")
    x, _ = _case(1, 3, True, True)
    r = pkg.chunk_gdn_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], dht=x["dht"], initial_state=x["h0"],
        cu_seqlens=x["cu"], return_intermediates=True, split_tokens=0,  # the emulations walk whole sequences
    )  # fmt: skip
    errs = eb.stage_errors(r, x["q"], x["k"], x["v"], x["beta"], x["do"], x["dht"], x["h0"], D**-0.5)
    bad = {n: e for n, e in errs.items() if not e < 3e-2}
    assert not bad, f"stages off their emulation: {bad} (all: {errs})"


@pytest.mark.parametrize("split,variant", [(512, "default"), (1024, "bwd_streams=0"), (256, "bwd_stages=2")])
def test_split_chains_match_reference(split, variant):
    """The split chains (seg_state / fixup start states, bwd_dhu pass 1, reverse fix-up, pass 2),
    with and without the second stream and with bwd_dhu's pipelined loop, give the reference
    gradients and the unsplit h / dh on every defined row."""
    pkg = _kernels_pkg()
    x, ref = _case(2, 4, True, True)
    kw = dict(dht=x["dht"], initial_state=x["h0"], cu_seqlens=x["cu"], return_intermediates=True)
    got = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], split_tokens=split, variant=variant, **kw)
    base = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], split_tokens=0, **kw)
    torch.cuda.synchronize()
    assert got["split_tokens"] == split and got["stab"].shape[0] > len(SEQLENS)
    _assert_close(got, ref, list(TOL))
    ln = (got["ctab"][:, 1] - got["ctab"][:, 0]).long()
    valid = (ln > 0).nonzero().flatten()
    for n in ("h_all", "dh_all"):
        assert rel_l2(got[n][:, valid].float(), base[n][:, valid].float()) < 1e-2, n


@pytest.mark.parametrize("split", [0, 512])
def test_dhu_ws_matches_reference(split):
    """variant bwd_dhu_ws=1 (the default: bwd_pw + the warp-specialised bwd_dhu): the reference
    gradients, and the bwd_dhu path's (bwd_dhu_ws=0) dh and dv_new on every defined row."""
    pkg = _kernels_pkg()
    x, ref = _case(2, 4, True, True)
    kw = dict(dht=x["dht"], initial_state=x["h0"], cu_seqlens=x["cu"], return_intermediates=True, split_tokens=split)
    got = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], variant="bwd_dhu_ws=1", **kw)
    base = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], variant="bwd_dhu_ws=0", **kw)
    torch.cuda.synchronize()
    _assert_close(got, ref, list(TOL))
    ln = (got["ctab"][:, 1] - got["ctab"][:, 0]).long()
    valid = (ln > 0).nonzero().flatten()
    assert rel_l2(got["dh_all"][:, valid].float(), base["dh_all"][:, valid].float()) < 1e-2
    rows = (valid[:, None] * 64 + torch.arange(64, device=valid.device)).flatten()
    rows = rows[(torch.arange(64, device=valid.device)[None, :] < ln[valid][:, None]).flatten()]
    assert rel_l2(got["dvnew"][:, rows].float(), base["dvnew"][:, rows].float()) < 1e-2


def test_bwd_pw_matches_emulation():
    """bwd_pw's Pᵀ and W' on every chunk slot (mixed lengths, unused slots zero) against the torch
    mirror fed the same prep outputs."""
    pkg = _kernels_pkg()
    eb = importlib.import_module("qlabench_kernels.dev.emulate_bwd")
    pw = importlib.import_module("qlabench_kernels.bwd_pw")
    x, _ = _case(2, 4, True, True)
    r = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], cu_seqlens=x["cu"], return_intermediates=True)
    pt, w = pw.run_bwd_pw(x["q"], x["k"], r["gcs"], r["a_beta"], r["ctab"], D**-0.5)
    ept, ew = eb.emu_bwd_pw(x["q"], x["k"], r["gcs"], r["a_beta"], r["ctab"], D**-0.5)
    torch.cuda.synchronize()
    assert rel_l2(pt.float(), ept) < 1e-2 and rel_l2(w.float(), ew) < 1e-2


def test_grp_matches_per_v_head_path():
    """variant bwd_grp=1 (the default: dqkwg / wy per (chunk, qk head) over the GVA group) against the
    reference, and its dq / dk against the per-v-head kernels plus the torch group sum (bwd_grp=0)."""
    pkg = _kernels_pkg()
    x, ref = _case(2, 4, True, True)
    kw = dict(dht=x["dht"], initial_state=x["h0"], cu_seqlens=x["cu"])
    got = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], variant="bwd_grp=1", **kw)
    base = pkg.chunk_gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], variant="bwd_grp=0", **kw)
    torch.cuda.synchronize()
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    _assert_close(dict(zip(names, got)), ref, names)
    for n, a, b in zip(names, got, base):
        assert rel_l2(a.float(), b.float()) < 1e-2, n


@pytest.mark.parametrize("h_qk,h_v", [(2, 4), (1, 3), (2, 2)])
def test_wy_ws_matches_group_wy(h_qk, h_v):
    """variant bwd_wy_ws=1 (the persistent warp-specialised wy, the default; G = 1 runs the group wy)
    against the reference, and every gradient against the group wy it replaces (bwd_wy_ws=0); the
    kernel alone on poisoned dv / dg / dβ (G >= 2; it refuses G = 1)."""
    pkg = _kernels_pkg()
    x, ref = _case(h_qk, h_v, True, True)
    kw = dict(dht=x["dht"], initial_state=x["h0"], cu_seqlens=x["cu"], return_intermediates=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"])
    base = pkg.chunk_gdn_bwd(*args, variant="bwd_wy_ws=0", **kw)
    got = pkg.chunk_gdn_bwd(*args, variant="bwd_wy_ws=1", **kw)
    torch.cuda.synchronize()
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    _assert_close({n: got[n] for n in names}, ref, names)
    for n in names:
        assert rel_l2(got[n].float(), base[n].float()) < 1e-2, n
    # the kernel alone, on poisoned outputs: every valid row written, the same as the group wy
    from qlabench_kernels.bwd_wy_ws import run_bwd_wy_ws

    if h_v == h_qk:
        with pytest.raises(ValueError, match="GVA group of 2 or more"):
            run_bwd_wy_ws(x["k"], x["v"], x["beta"], base["gcs"], base["a_beta"], base["ctab"], base["dw"],
                          base["dvnew"], base["dg_part"], base["dk_part"].clone())  # fmt: skip
        return
    T = x["q"].shape[1]
    dv = torch.full((1, T, h_v, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    dg = torch.full((1, T, h_v), float("nan"), device="cuda")
    db = torch.full((1, T, h_v), float("nan"), device="cuda")
    dk = base["dk_part"].clone()
    run_bwd_wy_ws(x["k"], x["v"], x["beta"], base["gcs"], base["a_beta"], base["ctab"], base["dw"], base["dvnew"],
                  base["dg_part"], dk, dv=dv, dg=dg, dbeta=db)  # fmt: skip
    torch.cuda.synchronize()
    for n, a in (("dv", dv), ("dg", dg), ("dbeta", db), ("dk", dk)):
        assert torch.isfinite(a.float()).all(), f"{n}: rows left unwritten"
    assert rel_l2(dv.float(), base["dv"].float()) < 1e-2
    assert rel_l2(dg, base["dg"]) < 1e-2
    assert rel_l2(db, base["dbeta"]) < 1e-2
    assert rel_l2(dk.float(), base["dk_v"].float()) < 1e-2


@pytest.mark.parametrize("h_qk,h_v", [(2, 4), (1, 3), (2, 2)])
def test_dqkwg_ws_matches_group_dqkwg(h_qk, h_v):
    """variant bwd_dqkwg_ws=1 (persistent warp-specialised dqkwg, with and without bwd_wy_ws) against
    the reference, and its dq / dk partial / dw / dg_part against the group dqkwg it replaces."""
    pkg = _kernels_pkg()
    x, ref = _case(h_qk, h_v, True, True)
    kw = dict(dht=x["dht"], initial_state=x["h0"], cu_seqlens=x["cu"], return_intermediates=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"])
    base = pkg.chunk_gdn_bwd(*args, variant="bwd_dqkwg_ws=0,bwd_wy_ws=0", **kw)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for spec in ("bwd_dqkwg_ws=1,bwd_wy_ws=0", "bwd_dqkwg_ws=1,bwd_wy_ws=1"):
        got = pkg.chunk_gdn_bwd(*args, variant=spec, **kw)
        torch.cuda.synchronize()
        _assert_close({n: got[n] for n in names}, ref, names)
        for n in names:
            assert rel_l2(got[n].float(), base[n].float()) < 1e-2, (spec, n)
    # the kernel alone: the same intermediates as the group dqkwg (dw / dg_part on every row of a slot)
    from qlabench_kernels.bwd_dqkwg_ws import run_bwd_dqkwg_ws

    dq_v, dk_v, dw, dg_part = run_bwd_dqkwg_ws(
        x["q"], x["k"], x["do"], base["gcs"], base["ctab"], base["h_all"], base["dh_all"], base["vnew"],
        base["dvnew"], D**-0.5,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert rel_l2(dq_v.float(), base["dq_v"].float()) < 1e-2
    assert rel_l2(dk_v.float(), base["dk_part"].float()) < 1e-2
    # dw / dg_part on the chunk slots' valid rows (a slot no sequence uses holds whatever dv_new held)
    ctab = base["ctab"].long()
    valid = (torch.arange(64, device="cuda")[None, :] < (ctab[:, 1] - ctab[:, 0])[:, None]).flatten()
    assert rel_l2(dw[:, valid].float(), base["dw"][:, valid].float()) < 1e-2
    assert rel_l2(dg_part[:, valid], base["dg_part"][:, valid]) < 1e-2
