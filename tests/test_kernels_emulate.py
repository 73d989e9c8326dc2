"""CPU tests of the speed variants' algorithms (kernels/dev/emulate.py mirrors), no GPU.

- tables=tl: the one-launch table builder's algorithm (block scan + binary search, blocks of
  512 sequences) gives exactly the torch builders' tables, incl. empty sequences, N > 512 and
  the unsplit case.
- prep=blocked: the 16x16-block solve equals (I + L)⁻¹ (fp64 reference) to fp32 rounding.
- variant parsing.
"""

import importlib
import importlib.util
import json
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pkg():
    try:
        return importlib.import_module("qlabench_kernels")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "qlabench_kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["qlabench_kernels"] = mod
        spec.loader.exec_module(mod)
        return mod


def _cu(lens):
    return torch.tensor([0, *torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).tolist()], dtype=torch.int64)


LAYOUTS = [
    [32768],
    [1, 63, 64, 65, 1000, 4097],
    [0, 5, 0, 0, 700, 64, 2000, 0],
    [8] * 1024,
    [0] * 3 + [130] * 600 + [0],  # N > 512 (two blocks), empty sequences at both ends
    [0],
    [64] * 7,
]


@pytest.mark.parametrize("lens", LAYOUTS, ids=lambda x: f"N{len(x)}")
@pytest.mark.parametrize("seg", [None, 64, 1024])
def test_tl_tables_algorithm_equals_torch_tables(lens, seg):
    _pkg()
    common = importlib.import_module("qlabench_kernels._common")
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    cu = _cu(lens)
    T, N = int(cu[-1]), len(lens)
    split = seg is not None
    seg_t = seg if split else max(64, (max(T, 1) + 63) // 64 * 64)
    ctab, cu_chunks = common.chunk_table(cu, T, N)
    stab, cu_segs = common.segment_table(cu, cu_chunks, T, N, seg_t, split=split)
    c2, cc2, s2, cs2 = emu.emu_tables_tl(cu, T, N, seg_t, split)
    assert torch.equal(ctab, c2)
    assert torch.equal(stab, s2)
    assert torch.equal(cu_chunks.int(), cc2)
    assert torch.equal(cu_segs.int(), cs2)


def _gated_l(batch: int, seed: int, no_decay: int):
    """prep's L = StrictLower(diag β · Γ ⊙ K Kᵀ) for ``batch`` random chunks (the last ``no_decay``
    with g = 0), and the fp64 reference (I + L)⁻¹."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(batch, 64, 128, generator=gen), dim=-1)
    beta = torch.sigmoid(torch.randn(batch, 64, generator=gen))
    g = torch.cumsum(torch.nn.functional.logsigmoid(torch.randn(batch, 64, generator=gen) + 3) * 0.5, -1)
    g[-no_decay:] = 0  # no decay
    L = torch.tril(beta[..., None] * torch.exp(g[..., :, None] - g[..., None, :]) * (k @ k.transpose(-1, -2)), -1)
    eye = torch.eye(64, dtype=torch.float64)
    return L, torch.linalg.solve_triangular(eye + L.double(), eye.expand(batch, 64, 64), upper=False)


def test_blocked_solve_equals_inverse():
    _pkg()
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    L, ref = _gated_l(8, 0, 2)
    A = emu.solve_blocked(L.float())
    err = float((A.double() - ref).norm() / ref.norm())
    assert err < 1e-5, err
    assert torch.equal(torch.triu(A, 1), torch.zeros_like(A))


def test_rt_solve_lane_mapping_equals_inverse():
    """prep=rt: the register-tiled merge, emulated lane by lane with the kernel's warp -> block and
    lane -> 2x4 tile mapping, covers every off-diagonal entry once and equals (I + L)⁻¹."""
    _pkg()
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    L, ref = _gated_l(3, 1, 1)
    A = emu.solve_rt(L.float())
    err = float((A.double() - ref).norm() / ref.norm())
    assert err < 1e-5, err
    # block lower triangle fully written (no entry left from the zero init where A is not 0)
    assert float((A.double() - ref).abs().max()) < 1e-4
    assert torch.allclose(A, emu.solve_blocked(L.float()), rtol=1e-5, atol=1e-6)


def test_variant_parsing(monkeypatch):
    pkg = _pkg()
    monkeypatch.delenv("QLABENCH_GDN_VARIANT", raising=False)
    monkeypatch.delenv("QLABENCH_GDN_STAGES", raising=False)
    v = pkg.parse_variant(None)
    assert pkg.variant_name(v) == "default" and v["stages"] == 2  # pipelined seg_state loop
    assert (v["tables"], v["prep"], v["fastmath"], v["fwd_ws"]) == ("tl", "rt", "1", "1")
    assert (v["rowexp"], v["bwd_ws"], v["pprep"], v["uw"], v["autobv"]) == ("1", "1", "1", "1", "1")
    monkeypatch.setenv("QLABENCH_GDN_VARIANT", "tables=torch,prep=subst")
    v = pkg.parse_variant("fwd_bv=32")
    assert (v["tables"], v["prep"], v["fwd_bv"], v["fwd_threads"]) == ("torch", "subst", "32", "128")
    assert pkg.variant_name(v) == "tables=torch,prep=subst,fwd_bv=32"
    with pytest.raises(ValueError):
        pkg.parse_variant("fwd_bv=16")
    with pytest.raises(ValueError):
        pkg.parse_variant("nope=1")
    with pytest.raises(ValueError, match="item 'bwd_grp' must be knob=value"):
        pkg.parse_variant("fwd_bv=32,bwd_grp")
    v = pkg.parse_variant("fwd_bv=64")
    assert (v["bwd_dhu_ws"], v["bwd_grp"]) == ("1", "1")  # the backward's session-6 defaults
    with pytest.raises(ValueError, match="bwd_grp='2' not in"):
        pkg.parse_variant("bwd_grp=2")
    monkeypatch.delenv("QLABENCH_GDN_VARIANT")
    assert pkg.variant_name(pkg.parse_variant("pprep=1,uw=1")) == "default"
    assert pkg.variant_name(pkg.parse_variant("pprep=0,uw=0")) == "pprep=0"
    for bad in ("pprep=1,prep=blocked", "pprep=1,fwd_ws=0"):  # P comes from the rt prep, for fwd_o_ws only
        with pytest.raises(ValueError, match="pprep=1 needs prep=rt, fwd_ws=1 and ws_stages=2"):
            pkg.parse_variant(bad)
    with pytest.raises(ValueError, match="uw=1 needs pprep=1"):
        pkg.parse_variant("uw=1,pprep=0")
    # the pprep / uw defaults yield to an explicitly chosen other prep or fwd_o
    common = importlib.import_module("qlabench_kernels._common")
    for spec in ("prep=blocked", "fwd_ws=0", "ws_stages=3", common.BASELINE_VARIANT):
        v = pkg.parse_variant(spec)
        assert (v["pprep"], v["uw"]) == ("0", "0"), spec
    v = pkg.parse_variant("pprep=0")
    assert (v["pprep"], v["uw"]) == ("0", "0")


def test_fwd_o_ws_barrier_protocol():
    """fwd_ws=1: the mbarrier protocol of fwd_o_ws.py (modelled in dev/ws_protocol.py) never deadlocks,
    never passes a parity wait at the wrong phase and never lets a read see another chunk's data, over
    random skewed interleavings; dropping a needed wait is caught."""
    _pkg()
    wsp = importlib.import_module("qlabench_kernels.dev.ws_protocol")
    assert wsp.check(seeds=100)
    for role, bar in [("wg0", "vp_ready"), ("wg0", "s_free"), ("wg2", "s_ready"), ("prod", "empty"), ("wg2", "vd_ready")]:
        with pytest.raises(AssertionError):
            wsp.check(seeds=100, mutate=wsp.drop_ops(role, lambda op, b=bar: op[0] == "wait" and op[1] == b))


def test_fwd_ws_variant_parses(monkeypatch):
    pkg = _pkg()
    monkeypatch.delenv("QLABENCH_GDN_VARIANT", raising=False)
    v = pkg.parse_variant("fwd_ws=0")
    assert v["fwd_ws"] == "0" and pkg.variant_name(v) == "fwd_ws=0"
    assert pkg.parse_variant(None)["fwd_ws"] == "1"  # the default since the H200 check


def test_tc_solve_equals_inverse():
    """prep=tc: D = blockdiag((I + L_bb)⁻¹), N = D L_off, A = (I − N)(I + N²) D with tf32-rounded
    GEMM operands is the inverse to well below the bf16 rounding of the stored A_β (2⁻⁹ ≈ 2e-3);
    in fp32 it is exact to fp32 rounding (N⁴ = 0: the series stops)."""
    _pkg()
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    L, ref = _gated_l(16, 1, 4)
    exact = emu.solve_tc(L.float(), tf32=False)
    assert float((exact.double() - ref).norm() / ref.norm()) < 1e-6
    a = emu.solve_tc(L.float())
    err = float((a.double() - ref).norm() / ref.norm())
    assert 1e-7 < err < 5e-4, err  # tf32 rounding is visible, and small
    x = torch.tensor([1.0, 1.0 + 2**-12, 1.0 + 2**-10, 3.0 + 2**-9])  # tf32 keeps 10 mantissa bits
    assert torch.equal(emu._tf32(x), torch.tensor([1.0, 1.0, 1.0 + 2**-10, 3.0 + 2**-9]))


def test_pick_variant_needs_every_case_passed_and_a_gain(tmp_path, capsys):
    """kernels/dev/pick_variant.py: the fastest candidate that passed every case and was timed on
    every case the default was; a failing or slower-somewhere candidate is never picked."""
    _pkg()
    pick = importlib.import_module("qlabench_kernels.dev.pick_variant")

    def t(case, var, ms, split=None):
        return dict(case=f"{case}@{var}", split_tokens=split, latency_ms=ms)

    data = dict(
        results=[dict(case=f"c{i}@{v}", ok=not (v == "bad" and i == 1)) for i in range(2) for v in
                 ("default", "fast", "bad", "mixed")],
        timings=[t("a", "default", 1.0), t("b", "default", 2.0), t("a", "default", 0.5, 512),
                 t("a", "fast", 0.8), t("b", "fast", 1.6),
                 t("a", "bad", 0.1), t("b", "bad", 0.1),
                 t("a", "mixed", 0.5), t("b", "mixed", 2.2)],
    )  # fmt: skip
    f = tmp_path / "check_fwd.json"
    f.write_text(json.dumps(data))
    assert pick.main([str(f)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "fast", err  # bad failed a case; mixed is 10% slower on b
    ok, n, rs = pick.ratios(data, "fast")
    assert ok and n == 2 and rs == pytest.approx({"a": 1.25, "b": 1.25})
    assert pick.main([str(f), "mixed"]) == 0 and capsys.readouterr()[0].strip() == "default"
    assert pick.main([str(tmp_path / "missing.json")]) == 0 and capsys.readouterr()[0].strip() == "default"


@pytest.mark.parametrize("split_tokens", [0, 512])
def test_uw_algebra_matches_reference(split_tokens):
    """uw=1 (Vd = A_β V − (A_β diag(e^g) K) S with the W₀ factor in bf16): the emulated forward is as
    close to the fp64 token recurrence as the default algebra, on mixed lengths with g = 0 heads,
    an initial state, and split or unsplit."""
    _pkg()
    emu = importlib.import_module("qlabench_kernels.dev.emulate")
    x = emu.make_inputs([1, 63, 64, 65, 300], 2, 4, seed=3)
    ref_o, ref_h = emu.reference(x["q"], x["k"], x["v"], x["g"], x["beta"], h0=x["h0"], cu=x["cu"])
    errs = {}
    for uw in (False, True):
        r = emu.emu_pipeline(
            x["q"], x["k"], x["v"], x["g"], x["beta"], h0=x["h0"], cu=x["cu"], split_tokens=split_tokens, uw=uw
        )
        errs[uw] = (emu.rel_l2(r["o"], ref_o), emu.rel_l2(r["final_state"], ref_h))
    assert errs[True][0] < 1e-2 and errs[True][1] < 1e-2, errs
    assert errs[True][0] < 2 * errs[False][0] and errs[True][1] < 2 * errs[False][1], errs


def test_plan_split_from_shapes_only():
    """The split planner's picks on cases the H200 split sweep measured (kernels/dev/h200_split_sweep_*.txt)."""
    pkg = _pkg()
    assert pkg.plan_split(32768, 1, 8) == 4096  # 0.447 ms (2048: 0.474, unsplit 1.330)
    assert pkg.plan_split(2048, 1, 8) == 256  # 0.059 ms (512: 0.062, unsplit 0.097)
    assert pkg.plan_split(8192, 1, 16) == 2048  # 4/16: 0.237 ms (1024: 0.253, unsplit 0.380)
    assert pkg.plan_split(32768, 1, 64) == 0  # 128 CTAs already
    assert pkg.plan_split(4 * 8192, 4, 64) == 0
    assert pkg.plan_split(4 * 8192, 4, 8) == 4096  # 2/8 8192x4: 0.436 ms, unsplit the same (2048: 0.448)
    assert pkg.plan_split(8 * 1024, 8, 8) == 0
    assert pkg.plan_split(200, 1, 8) == 0  # too short to cut
    # unequal lengths: only the host lengths show the long sequence (8/24 28672+4096: 1.294 ms at 4096, unsplit 1.493)
    assert pkg.plan_split(32768, 2, 24) == 0
    assert pkg.plan_split(32768, 2, 24, seqlens=[28672, 4096]) == 4096
    assert pkg.split_cost([28672, 4096], 24, 4096) < pkg.split_cost([28672, 4096], 24, 0)


def test_seqlens_hint_is_checked():
    pkg = _pkg()
    T, h = 192, 2
    q = torch.zeros(1, T, h, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, T, h, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, T, h)
    cu = torch.tensor([0, 64, 192])
    with pytest.raises(ValueError, match="seqlens"):
        pkg.chunk_gdn_fwd_lowlevel(q, q, v, g, g, cu_seqlens=cu, seqlens=[100, 100])


def test_lpt_makespan_is_list_scheduling():
    pkg = _pkg()
    lpt = importlib.import_module("qlabench_kernels")._lpt_makespan
    assert lpt([(10, 1), (1, 2)], 2) == 10  # both short jobs go to the idle slot
    assert lpt([(4, 264)], 132) == 8  # two full rounds
    assert lpt([(3, 133)], 132) == 6
    assert lpt([], 132) == 0
    assert pkg.plan_fwd(32768, 1, 32) == (32, 0)  # Hv 32, one sequence: 128 CTAs at V block 32, unsplit


def test_plan_bwd_split_cuts_only_few_long_chains():
    """The backward's split planner cuts a long sequence when its chains (h_v x 4 V blocks) leave
    SMs idle, never short ones, and reads the host lengths for unequal sequences."""
    pkg = _pkg()
    assert pkg.plan_bwd_split(32768, 1, 4) > 0  # 16 chains of 512 chunks
    assert pkg.plan_bwd_split(8192, 1, 4) > 0
    assert pkg.plan_bwd_split(400, 1, 4) == 0  # too short to cut
    assert pkg.plan_bwd_split(32768, 8, 32) == 0  # 1024 chains already
    seg = pkg.plan_bwd_split(32768, 2, 4, seqlens=[32000, 768])
    assert seg > 0 and pkg.bwd_split_cost([32000, 768], 4, seg) < pkg.bwd_split_cost([32000, 768], 4, 0)
    assert pkg.bwd_split_cost([32768], 4, 0) > pkg.bwd_split_cost([32768], 4, 2048)
    # the H200 timings of session 5 (kernels/dev/h200_check_bwd_2026-11-30b.txt, call 2, whole backward):
    assert pkg.plan_bwd_split(32768, 1, 4) == 2048  # 2/4 1x32768: 1.42 ms (1024: 1.51, unsplit 4.40)
    assert pkg.plan_bwd_split(8192, 1, 4) == 512  # 2/4 1x8192: 0.50 ms (1024: 0.55, unsplit 1.19)
    assert pkg.plan_bwd_split(32768, 1, 32) == 0  # 16/32 1x32768: 9.05 ms (1024: 9.25)
    eight = [3274, 1029, 2909, 5061, 2011, 3793, 9932, 4759]
    assert pkg.plan_bwd_split(32768, 8, 8, seqlens=eight) == 2048  # 4/8: 2.47 ms (1024: 2.45, unsplit 2.67)


def test_bwd_dhu_ws_needs_bwd_pw_outputs():
    """run_bwd_dhu_ws called without bwd_pw's Pᵀ / W' says so before compiling anything."""
    _pkg()
    ws = importlib.import_module("qlabench_kernels.bwd_dhu_ws")
    z = torch.zeros(1, 64, 1, 128)
    with pytest.raises(ValueError, match="needs bwd_pw's pt and w"):
        ws.run_bwd_dhu_ws(z, z, torch.zeros(1, 128), None, z, None, None, 1.0, None)
