"""CPU test: every in-repo TileLang kernel compiles for sm_90a (nvcc, no GPU) with the structure
its protocol needs: wgmma, TMA loads behind mbarriers, setmaxnreg per role, one CTA-wide barrier.

Needs nvcc and tilelang (skipped otherwise). One head config (2/8), one build per program.
"""

import importlib
import re

import pytest
from kernel_helpers import why_cannot_compile as _why_cannot_compile

pytestmark = pytest.mark.skipif(_why_cannot_compile() is not None, reason=str(_why_cannot_compile()))

TARGET_K = '{"arch": "sm_90a", "kind": "cuda"}'


def _mod(name):
    return importlib.import_module(f"qlabench_kernels.{name}")


@pytest.fixture(scope="module")
def sources():
    """{name: generated CUDA} of one build of every program (2/8, both state flags on)."""
    builds = {
        "tables": ("tables", "get_tables_kernel", (512,), {}),
        "prep": ("prep", "get_prep_kernel", (2, 8), {}),
        "fwd_o": ("fwd_o", "get_fwd_o_kernel", (2, 8, True, True), {}),
        "fwd_fused": ("fwd_fused", "get_fwd_fused_kernel", (2, 8, True, True), {}),
        "seg_state": ("seg_state", "get_seg_state_kernel", (2, 8), {}),
        "fixup": ("fixup", "get_fixup_kernel", (8, True, 32), {}),
        "rfixup": ("fixup", "get_fixup_kernel", (8, True, 32), {"reverse": True}),
        "bwd_h": ("bwd_h", "get_bwd_h_kernel", (2, 8, True), {}),
        "bwd_dhu": ("bwd_dhu", "get_bwd_dhu_kernel", (2, 8, True, True), {}),
        "bwd_dhu_seg": ("bwd_dhu", "get_bwd_dhu_kernel", (2, 8, True, True), {"split": "seg"}),
        "bwd_dhu_carry": ("bwd_dhu", "get_bwd_dhu_kernel", (2, 8, True, True), {"split": "carry"}),
        "bwd_dqkwy": ("bwd_dqkwy", "get_bwd_dqkwy_kernel", (2, 8), {}),
    }
    return {
        name: getattr(_mod(mod), getter)(*args, target_k=TARGET_K, **kw).get_kernel_source()
        for name, (mod, getter, args, kw) in builds.items()
    }


#: the most shared memory one block may use on sm_90 (H100, H200), static and dynamic together
SMEM_MAX = 232448


def _launch_smem(host_src: str, threads: int) -> int:
    """The dynamic shared memory of the launch in TileLang's host stub: the integer argument right
    after its block dimensions (threads, 1, 1)."""
    vals = [int(v) for v in re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);", host_src)]
    found = [vals[i + 3] for i in range(len(vals) - 3) if vals[i : i + 3] == [threads, 1, 1]]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize(
    "mod,getter,args,threads",
    [("fwd_fused", "get_fwd_fused_kernel", (2, 8, True, True), 512), ("fwd_o", "get_fwd_o_kernel", (2, 8, True, True), 256),
     ("bwd_dhu", "get_bwd_dhu_kernel", (2, 8, True, True), 384), ("bwd_dqkwy", "get_bwd_dqkwy_kernel", (2, 8), 384),
     ("seg_state", "get_seg_state_kernel", (2, 8), 256), ("bwd_h", "get_bwd_h_kernel", (2, 8, True), 256)],
)  # fmt: skip
def test_shared_memory_fits_the_block_limit(sources, mod, getter, args, threads):
    """TileLang compiles a program whose shared memory exceeds the block limit without complaint and
    the launch fails on the GPU: each launch's dynamic shared memory (its reduction workspaces
    included) stays under 227 KB with 1 KB left for the static mbarriers."""
    host = getattr(_mod(mod), getter)(*args, target_k=TARGET_K).get_host_source()
    smem = _launch_smem(host, threads)
    assert 0 < smem <= SMEM_MAX - 1024, (mod, smem)


def test_every_kernel_compiles_and_all_but_tables_use_wgmma(sources):
    for name, src in sources.items():
        assert "__global__" in src, name
        if name != "tables":
            assert "wgmma" in src, f"{name}: generated source has no wgmma"


def test_gva_head_index_is_compiled_in(sources):
    # v-head j reads q/k head j // 4 for 2/8: fwd_o divides its v-head index by 4 (a shift); prep's
    # CTA is one q/k head (blockIdx.x) and one slice of its group (blockIdx.y, nv v-heads each,
    # passed: no division on the device), walked in two rolled loops (P, then A_β).
    assert ">> 2" in sources["fwd_o"] or "/ 4" in sources["fwd_o"]
    src = sources["prep"]
    assert src.count("(((((int)blockIdx.x) * 4) + (((int)blockIdx.y) * nv)) + v") == 2  # the two TMA stores
    assert "for (int v = 0; v < nv; ++v)" in src and "for (int v_1 = 0; v_1 < nv; ++v_1)" in src
    assert " / nslice" not in src and " % nslice" not in src


@pytest.mark.parametrize(
    "name,mod,threads",
    [("fwd_o", "fwd_o", 256), ("fwd_fused", "fwd_fused", 512), ("bwd_h", "bwd_h", 256), ("bwd_dhu", "bwd_dhu", 384),
     ("bwd_dhu_seg", "bwd_dhu", 384), ("bwd_dhu_carry", "bwd_dhu", 384), ("bwd_dqkwy", "bwd_dqkwy", 384),
     ("seg_state", "seg_state", 256)],
)  # fmt: skip
def test_warp_specialised_kernels(sources, name, mod, threads):
    """TMA loads into rings behind mbarriers; setmaxnreg per role (.inc above the launch count, .dec
    below it: a .dec to a larger count is illegal on the GPU); the only CTA-wide barrier is the one
    after the mbarrier init (the roles sync with mbarriers and named barriers)."""
    src, m = sources[name], _mod(mod)
    assert f"__launch_bounds__({threads}" in src
    assert "tma_load" in src and "expect_transaction" in src and ".arrive()" in src
    launch = getattr(m, "NREG_LAUNCH", 65536 // threads // 8 * 8)
    for nreg in m.NREG:
        assert f"warpgroup_reg_{'alloc' if nreg > launch else 'dealloc'}<{nreg}>" in src, (name, nreg)
    assert src.count("__syncthreads()") == 1


def test_fused_aux_gates_by_factors_with_a_per_element_fallback(sources):
    """fwd_fused's aux warpgroup gates L and P by the producer's row / column factor tables behind a
    per-chunk flag (the column factors loaded as float2 vectors, no exp), with the per-element path
    (one exp per element) as the fallback; warp 13 votes on the gates' sign for the flag."""
    src = sources["fwd_fused"]
    nreg = _mod("fwd_fused").NREG
    aux = src[src.index(f"warpgroup_reg_dealloc<{nreg[1]}>") : src.index(f"warpgroup_reg_dealloc<{nreg[2]}>")]
    producer = src[src.index(f"warpgroup_reg_dealloc<{nreg[2]}>") :]
    assert aux.count("if (fac != ") == 2 and aux.count("expf(") == 2
    assert aux.count("*(float2*)(cj + ") == 2
    # L and N by stmatrix, and P and A_β into each of their two ring buffers
    assert aux.count("ptx_stmatrix") == 6
    # the inverse: −N = −D L from shared memory, then three rounds with Rₖ from registers
    assert aux.count("wgmma_ss<tl::DataType::kFloat16") == 1 and aux.count("wgmma_rs<tl::DataType::kFloat16") == 3
    # the substitution's thread index comes from a shuffle each chunk, so that its selects and row
    # addresses are not hoisted out of the chunk loop (where ptxas spills them on GVA-3 heads)
    assert aux.count("__shfl_sync(") == 1
    assert "__all_sync" in producer


def test_prep_solves_on_tensor_cores_as_the_fused_aux(sources):
    """prep runs the fused kernel's aux algorithm: Q Kᵀ and K Kᵀ on bf16 wgmma, gated by the factor
    tables behind the flag with the per-element fallback, the inverse as four fp16 wgmmas (N = D L from
    shared memory, the three rounds after it with A from registers); P, L, N and A_β by stmatrix; P and
    A_β out by TMA stores; warp 0 votes for the flag."""
    src = sources["prep"]
    assert src.count("wgmma_ss<tl::DataType::kBFloat16") == 2
    assert src.count("wgmma_ss<tl::DataType::kFloat16") == 1 and src.count("wgmma_rs<tl::DataType::kFloat16") == 3
    assert src.count("if (fac != ") == 2 and src.count("*(float2*)(cj + ") == 2
    assert src.count("ptx_stmatrix") == 4
    assert src.count("tma_store(") == 2
    assert "__all_sync" in src
    assert f"__launch_bounds__(128, {_mod('prep').MIN_BLOCKS})" in src


def test_fused_state_reads_v_by_ldmatrix(sources):
    """The state warpgroups read V once a chunk, into registers by ldmatrix .trans (``qlb_load_vt``),
    no element loads of V, and take every GEMM's A operand from registers (Vdᵀ = (Vᵀ − e^g ⊙ Xᵀ) A_βᵀ
    is one GEMM per ring slot's branch); they issue every wgmma inside one of their four turns a
    chunk (a named-barrier sync before, an arrive after; one more arrive before the loop), and
    TileLang inserts no sync of its own on their path; o is staged in q_sh with no sync before it
    (the turns order the other warpgroup's read of Q), then one sync of the 256 threads for a
    partial chunk's rows stored from there, then a proxy fence and the arrives on o_staged and empty;
    warp 14 stores full chunks by TMA."""
    src = sources["fwd_fused"]
    nreg = _mod("fwd_fused").NREG
    state = src[src.index(f"warpgroup_reg_alloc<{nreg[0]}>") : src.index(f"warpgroup_reg_dealloc<{nreg[1]}>")]
    assert state.count("v_sh)[") == state.count("qlb_load_vt(") == 1 and "wgmma_ss<" not in state
    assert src.count("ldmatrix.sync.aligned.x4.trans") == 1
    assert state.count("qlb_turn_begin(") == 4 and state.count("qlb_turn_end(") == 5
    turn = None
    for m in re.finditer(r"qlb_turn_(begin|end)\(|tl::wgmma_", state):  # every wgmma after a turn's sync, before its arrive
        turn = m.group(1) or turn
        assert m.group(1) or turn == "begin", m.start()
    bar = f"__sync_thread_partial({_mod('fwd_o').O_SYNC_BAR}, 256);"
    assert state.count("__sync_thread_partial") == state.count(bar) == 1
    order = [state.index("qlb_stage_o_trans("), state.index(bar), state.index("*(uint4*)(o + "),
             state.rindex("fence_proxy_async"), state.rindex("o_staged["), state.rindex("empty[")]  # fmt: skip
    assert order == sorted(order)  # o into q_sh, sync, partial rows, fence, arrives
    assert state.count("qlb_stage_o_trans(") == 1 and "tma_store(o_desc" in src
    assert not re.search(r"__sync_thread_partial\((13|14),", src)  # the turns' barriers are theirs alone
    _one_count_per_barrier(src)


def _one_count_per_barrier(src):
    """Each named barrier id is synced with one thread count (the explicit ones of o's staging and
    those TileLang inserts must not share an id)."""
    ids = {}
    for bid, n in re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", src):
        ids.setdefault(bid, set()).add(n)
    assert all(len(v) == 1 for v in ids.values()), ids


def test_fwd_o_keeps_its_state_in_registers(sources):
    """fwd_o's state warpgroup takes the A operand of each of its five GEMMs (Q, K, A_β with V folded
    in, P, the state update) from registers (five wgmma_rs, no wgmma_ss), V read into registers by
    ldmatrix .trans (``qlb_load_vt``; no operand by stmatrix); o is
    staged in the stage's P buffer by stmatrix .trans between two syncs, a partial chunk's rows
    stored from there, then a proxy fence and the arrives on o_staged and empty; warp 6 stores full
    chunks by TMA; two CTAs per SM at 128 registers."""
    src, m = sources["fwd_o"], _mod("fwd_o")
    assert f"__launch_bounds__(256, {m.MIN_BLOCKS})" in src and m.NREG_LAUNCH * 256 * m.MIN_BLOCKS == 65536
    assert src.count("wgmma_rs<") == 5 and src.count("wgmma_ss<") == 0
    assert "tl::ptx_stmatrix" not in src and src.count("stmatrix.sync.aligned.x4.trans") == 1
    assert src.count("ldmatrix.sync.aligned.x4.trans") == 1 and src.count("qlb_load_vt(") == 2  # defined, called
    state = src[src.index(f"warpgroup_reg_alloc<{m.NREG[0]}>") : src.index(f"warpgroup_reg_dealloc<{m.NREG[1]}>")]
    bar = f"__sync_thread_partial({_mod('fwd_o').O_SYNC_BAR}, 128);"
    syncs = [i for i in range(len(state)) if state.startswith(bar, i)]
    order = [syncs[0], state.index("qlb_stage_o_trans("), syncs[1], state.index("*(uint4*)(o + "),
             state.rindex("fence_proxy_async"), state.rindex("o_staged["), state.rindex("empty[")]  # fmt: skip
    assert len(syncs) == 2 and order == sorted(order) and "tma_store(o_desc" in src
    _one_count_per_barrier(src)


def _chain_reads_v_by_ldmatrix(src):
    """seg_state's chain (``chain_step_macro``): three GEMMs, each A operand from registers (Sᵀ Kᵀ,
    (Vᵀ − e^g ⊙ Xᵀ) A_βᵀ, the state update), V read once a chunk by ldmatrix .trans after the first
    GEMM's issue and before its wait; no operand by descriptor on both sides, no stmatrix."""
    assert src.count("wgmma_rs<") == 3 and src.count("wgmma_ss<") == 0 and "stmatrix" not in src
    assert src.count("ldmatrix.sync.aligned.x4.trans") == 1 and src.count("qlb_load_vt(") == 2  # defined, called
    call = src.index("qlb_load_vt((")
    assert src.rindex("warpgroup_commit_batch", 0, call) > src.index("wgmma_rs<") and src.index("wait_wgmma", call) > call


def test_seg_state_keeps_its_state_in_registers(sources):
    """seg_state's state warpgroup runs the chain above (V in the V half only) from the warm-up start
    every thread finds; two CTAs per SM at 128 registers, the producer's .dec paying for the state's .inc."""
    src, m = sources["seg_state"], _mod("seg_state")
    assert f"__launch_bounds__(256, {m.MIN_BLOCKS})" in src and m.NREG_LAUNCH * 256 * m.MIN_BLOCKS == 65536
    _chain_reads_v_by_ldmatrix(src)
    # the warm-up start: found once by all 256 threads, before the roles part (its shuffles take full warps)
    assert src.count("qlb_warmup_len(") == 2 and src.index("= qlb_warmup_len(") < src.index("warpgroup_reg_alloc")


def test_bwd_h_keeps_its_state_in_registers(sources):
    """bwd_h's state warpgroup runs seg_state's chain; h and v_new leave through a staging tile in
    shared memory by TMA stores (warp 6): the state stores nothing to HBM itself; two CTAs per SM at
    128 registers, the producer's .dec paying for the state's .inc."""
    src, m = sources["bwd_h"], _mod("bwd_h")
    assert f"__launch_bounds__(256, {m.MIN_BLOCKS})" in src and m.NREG_LAUNCH * 256 * m.MIN_BLOCKS == 65536
    _chain_reads_v_by_ldmatrix(src)
    for buf in ("h_all", "vnew"):
        assert f"tma_store({buf}_desc" in src and f"{buf}[" not in src and f"({buf} + " not in src, buf


def test_register_budgets_fit_the_file():
    m = _mod("bwd_dqkwy")  # .inc is served by what .dec released
    assert 2 * m.NREG[0] + m.NREG[1] <= 3 * m.NREG_LAUNCH


def test_bwd_dhu_keeps_its_gradient_in_registers(sources):
    """bwd_dhu's two state warpgroups take the A operand of every GEMM but K Qᵀ and (Pᵀ dO)ᵀ from
    registers (W'ᵀ, Y₀, W' dH, K dH, the dO and Y terms of the update; pass 1 has no K dH); Pᵀ and W'
    stay in shared memory (no global pt / w); dh and dv_new leave
    through a staging tile in shared memory by TMA stores (warp 10; the state stores nothing to HBM
    in its walk), except in pass 1 (F only: no dh, dv_new writes); the persistent kernels' outputs
    leave through TMA stores."""
    for name, rs in (("bwd_dhu", 6), ("bwd_dhu_carry", 6), ("bwd_dhu_seg", 5)):
        src = sources[name]
        assert src.count("wgmma_rs<") == rs and src.count("wgmma_ss<") == 2, name
        assert "pt_sh" in src and "w_sh" in src and " pt[" not in src and "(pt + " not in src, name
        assert "stmatrix" not in src, name
    for name in ("bwd_dhu", "bwd_dhu_carry"):
        for buf in ("dh_all", "dvnew"):
            src = sources[name]
            assert f"tma_store({buf}_desc" in src and f"{buf}[" not in src and f"({buf} + " not in src, (name, buf)
    seg = sources["bwd_dhu_seg"]
    assert "tma_store" not in seg
    for buf in ("dh_all", "dvnew"):
        assert f"{buf}[" not in seg and f"({buf} + " not in seg, buf
    assert "tma_store(dv_desc" in sources["bwd_dqkwy"]


def test_bwd_dhu_issues_its_p_and_w_gemms_asynchronously(sources):
    """Each step issues K Qᵀ and W'ᵀ together, waits on K Qᵀ first (to gate Pᵀ) and W'ᵀ last, and
    fences each accumulator with one thread's registers (64×64 and 128×64 fp32 over 256 threads)."""
    for name in ("bwd_dhu", "bwd_dhu_seg", "bwd_dhu_carry"):
        src = sources[name]
        assert src.count("tl::wait_wgmma<1>();") == 1 and src.count("tl::wait_wgmma<0>();") == 1, name
        w1, w0 = src.index("tl::wait_wgmma<1>();"), src.index("tl::wait_wgmma<0>();")
        assert w1 < w0
        assert src[w1:w0].count("warpgroup_fence_operand(reinterpret_cast<float*>(kq_acc + 0), 16)") == 1, name
        assert "warpgroup_fence_operand(reinterpret_cast<float*>(y_acc + 0), 32)" in src[w0 : w0 + 200], name


def test_dqkwy_issues_phase_b_gemms_asynchronously(sources):
    """bwd_dqkwy issues phase B's GEMMs in asynchronous groups (waits on the oldest, not after each),
    fences each accumulator after its wait with the registers one thread holds (a fence over the
    whole fragment's element count would touch registers past the thread's array), and syncs both
    consumer warpgroups before dv overwrites v's buffer; dq and dk accumulate over the item's
    v-heads in registers cleared once per item (no select on the v-head index: a conditional clear
    made ptxas spill the accumulators)."""
    src = sources["bwd_dqkwy"]
    waits = re.findall(r"tl::wait_wgmma<(\d)>\(\);", src)
    assert sorted(waits) == ["0", "0", "1", "1", "2", "2"], waits
    counts = [int(n) for n in re.findall(r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(\w+ \+ 0\), (\d+)\)", src)]
    assert counts and max(counts) <= 64, sorted(set(counts))
    # the explicit consumer sync (barrier 3, 256 threads) must be the id TileLang gives the consumers'
    # own syncs: one named barrier id, one thread count
    ids = {}
    for bid, n in re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", src):
        ids.setdefault(bid, set()).add(n)
    assert ids.get("3") == {"256"} and all(len(v) == 1 for v in ids.values()), ids
    assert re.search(r"for \(int vi = 0; vi < 4; \+\+vi\)", src), "the item's v-heads: an inner loop"


def test_lpt_ranks_by_warp_match_groups(sources):
    """The tables kernel's longest-first order (behind its ``lpt`` flag): a slot's rank is its key's
    start, its warp's earlier count and its place among its warp's lanes of the same key
    (``__match_any_sync``), stored row by row."""
    src = sources["tables"]
    assert "if (lpt != 0)" in src
    assert "__match_any_sync" in src and src.count("__popc") == 2 and "atomicAdd" in src.replace("AtomicAdd", "atomicAdd")


def test_compile_list_covers_every_program():
    comp = _mod("compile")
    names = {getter.__name__ for _, getter, _, _ in comp.default_kernels(2, 2)}
    assert names == {
        "get_tables_kernel", "get_prep_kernel", "get_fwd_o_kernel", "get_fwd_fused_kernel", "get_seg_state_kernel",
        "get_fixup_kernel", "get_bwd_h_kernel", "get_bwd_dhu_kernel", "get_bwd_dqkwy_kernel",
    }  # fmt: skip
    fwd = comp.default_kernels(2, 8, fwd_flags=((1, 1),), bwd_flags=())
    assert [a for _, g, a, _ in fwd if g.__name__ == "get_fwd_o_kernel"] == [(2, 8, True, True)]
    assert not any(g.__name__.startswith("get_bwd") for _, g, _, _ in fwd)
