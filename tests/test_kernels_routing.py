"""CPU test of the forward driver's routing (kernels/forward.py): which kernels run, and which
intermediates come back, for each block_v / split_tokens / save_prep combination. The kernel
launchers are replaced by recorders (tables by the torch tables), so no GPU is needed."""

import importlib

import pytest
import torch
from qlabench_kernels import calibration

D = 128


def _cu(lens):
    return torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()])


@pytest.fixture
def fwd(monkeypatch):
    mod = importlib.import_module("qlabench_kernels.forward")
    common = importlib.import_module("qlabench_kernels._common")
    calls, plans, lpts, final_stab = [], [], [], []

    def tables(cu, T, N, seg, split, lpt=False, target=None):
        calls.append("tables")
        ctab, cu_chunks = common.chunk_table(cu, T, N)
        stab, cu_segs = common.segment_table(cu, cu_chunks, T, N, seg, split)
        if lpt:
            lpts.append(True)
        return ctab, cu_chunks.int(), stab, cu_segs.int(), common.lpt_order(stab) if lpt else stab

    def prep(q, k, g, beta, ctab, scale, target=None):
        calls.append("prep")
        hv, ncs = g.shape[2], ctab.shape[0]
        return torch.zeros(hv, ncs * 64), torch.zeros(hv, ncs * 64, 64), torch.zeros(hv, ncs * 64, 64)

    def record(name):
        def run(*args, **kw):
            calls.append(name)
            if name == "fwd_fused":  # (q, k, v, g, beta, stab, h_init, ...)
                calls.append(("h_init", None if args[6] is None else tuple(args[6].shape)))
            if name in ("fwd_fused", "fwd_o"):
                final_stab.append(args[5] if name == "fwd_fused" else args[6])

        return run

    def plan(T, N, h_v, sms, seqlens=None, blocks=(128, 64), h_qk=None, costs=None):
        assert (h_v, h_qk) == (2, 1)  # the driver prices prep with the q/k head count
        assert costs == calibration.default_table().fwd  # and with the device's cost table
        plans.append(blocks)
        return (blocks[0], 0)

    monkeypatch.setattr(mod, "run_tables", tables)
    monkeypatch.setattr(mod, "run_prep", prep)
    for name in ("seg_state", "fixup", "fwd_fused", "fwd_o"):
        monkeypatch.setattr(mod, f"run_{name}", record(name))
    monkeypatch.setattr(mod, "plan_fwd", plan)
    monkeypatch.setattr(mod, "sm_count", lambda dev: 132)

    def call(T=1000, **kw):
        for x in (calls, plans, lpts, final_stab):
            x.clear()
        hqk, hv = 1, 2
        q = torch.zeros(1, T, hqk, D, dtype=torch.bfloat16)
        g, beta = torch.zeros(1, T, hv), torch.zeros(1, T, hv)
        v = torch.zeros(1, T, hv, D, dtype=torch.bfloat16)
        r = mod.chunk_gdn_fwd_lowlevel(q, q, v, g, beta, **kw)
        r.update(lpt_calls=list(lpts), final_stab=list(final_stab))
        return r, list(calls), list(plans)

    return call


def test_planned_fused_runs_no_prep(fwd):
    r, calls, plans = fwd()
    assert plans == [(128, 64)]
    assert calls == ["tables", "fwd_fused", ("h_init", None)]
    assert r["block_v"] == 128 and r["gcs"] is None and r["a_beta"] is None and r["p_all"] is None


def test_save_prep_plans_fwd_o_and_returns_prep(fwd):
    r, calls, plans = fwd(save_prep=True)
    assert plans == [(64,)]
    assert calls == ["tables", "prep", "fwd_o"] and r["block_v"] == 64
    assert r["gcs"] is not None and r["a_beta"] is not None


def test_save_prep_with_the_fused_kernel_still_runs_prep(fwd):
    r, calls, _ = fwd(block_v=128, split_tokens=0, save_prep=True)
    assert calls == ["tables", "prep", "fwd_fused", ("h_init", None)]
    assert r["gcs"] is not None


def test_a_split_given_alone_runs_fwd_o(fwd):
    r, calls, plans = fwd(split_tokens=256)
    assert plans == []
    assert calls == ["tables", "prep", "seg_state", "fixup", "fwd_o"]
    assert r["split_tokens"] == 256 and r["block_v"] == 64


def test_fused_split_starts_from_the_segment_states(fwd):
    r, calls, _ = fwd(block_v=128, split_tokens=256)
    ns = 1000 // 256 + 1
    assert calls == ["tables", "prep", "seg_state", "fixup", "fwd_fused", ("h_init", (ns, 2, D, D))]
    assert r["h_start"].shape == (ns, 2, D, D)


def test_fwd_o_unsplit(fwd):
    r, calls, _ = fwd(block_v=64, split_tokens=0)
    assert calls == ["tables", "prep", "fwd_o"] and r["block_v"] == 64


def test_block_v_is_checked(fwd):
    for bad in (96, 32):  # fwd_o has one V block (64)
        with pytest.raises(ValueError, match=f"block_v={bad}"):
            fwd(block_v=bad)


def test_final_kernel_takes_the_longest_first_table_past_one_round(fwd):
    common = importlib.import_module("qlabench_kernels._common")
    r, _, _ = fwd()  # 1 sequence x 2 v-heads: one round of CTAs, slot order
    assert r["lpt_calls"] == [] and r["final_stab"][0] is r["stab"]
    r, _, _ = fwd(T=sum(lens := [300] * 100), cu_seqlens=_cu(lens), seqlens=lens)  # equal walks: slot order
    assert r["lpt_calls"] == []
    lens = [(i * 37) % 300 + 1 for i in range(100)]  # 200 CTAs of 1-5 chunks on 132 SMs: the order pays
    cu = _cu(lens)
    for bv in (128, 64):
        r, _, _ = fwd(T=sum(lens), cu_seqlens=cu, seqlens=lens, block_v=bv, split_tokens=0)
        assert r["lpt_calls"] == [True] and torch.equal(r["final_stab"][0], common.lpt_order(r["stab"]))
        chunks = (r["final_stab"][0][:, 1] - r["final_stab"][0][:, 0] + 63) // 64
        assert bool((chunks[:-1] >= chunks[1:]).all()) and chunks[0] == 5


def test_lpt_order_is_stable_by_capped_chunk_count():
    common = importlib.import_module("qlabench_kernels._common")
    lens = [64, 5000, 0, 130, 64 * 40, 1, 129]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()])
    ctab, cu_chunks = common.chunk_table(cu, sum(lens), len(lens))
    stab, _ = common.segment_table(cu, cu_chunks, sum(lens), len(lens), 8192, False)
    seqs = common.lpt_order(stab)[:, 2].tolist()
    # 5000 and 2560 tokens both cap at 31 chunks (slot order), then 3, 3, 1, 1 chunk(s), the empty one, unused slots
    assert seqs == [1, 4, 3, 6, 0, 5, 2] + [-1] * (len(seqs) - 7)
