import pytest

from qlabench import config as C
from qlabench.profiling_cli import parse_ncu_csv, select_point
from qlabench.sweep import points

PTS = points(C.load("configs/h200_fwd.yaml"))


def test_select_point_by_index_and_label():
    assert select_point(PTS, "0", None).index == 0
    p = select_point(PTS, "1x32768", "2/8")
    assert p.seqlens == (32768,) and p.h_v == 8
    assert select_point(PTS, "4x8192", "397B/122B TP1").h_v == 64


@pytest.mark.parametrize("point,model,needle", [("999", None, "points 0..170"),
                                                ("1x32768", None, "add --model"),
                                                ("3x3", None, "no such point")])
def test_select_point_errors(point, model, needle):
    with pytest.raises(ValueError, match=needle):
        select_point(PTS, point, model)


def test_parse_ncu_long_and_wide():
    long = ('==PROF== done\n"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","k1","gpu__time_duration.sum","usecond","1,234.5"\n'
            '"0","k1","launch__grid_size","","128"\n"1","k2","launch__grid_size","","4"\n')
    r = parse_ncu_csv(long)
    assert r[0]["kernel"] == "k1" and r[0]["gpu__time_duration.sum"] == 1234.5
    assert r[0]["launch__grid_size"] == 128 and r[1]["kernel"] == "k2"
    wide = ('"ID","Kernel Name","gpu__time_duration.sum","launch__grid_size"\n'
            '"","","usecond",""\n"0","k1","10.5","132"\n"1","k2","2","8"\n')
    r = parse_ncu_csv(wide)
    assert [x["kernel"] for x in r] == ["k1", "k2"] and r[0]["launch__grid_size"] == 132
    assert parse_ncu_csv("no csv here") == []


def test_ncu_command_profiles_only_the_marked_call():
    """--ncu: clocks left alone, only kernels inside the NVTX range of the one profiled call,
    headline metrics by default, a section set and a kernel filter when asked."""
    from pathlib import Path

    from qlabench.profiling_cli import NCU_METRICS, NCU_RANGE, ncu_command

    child = ["python", "-m", "qlabench.cli", "profile", "c.yaml"]
    cmd = ncu_command("ncu", Path("out/tag"), child)
    assert cmd[:3] == ["ncu", "--clock-control", "none"]
    assert cmd[cmd.index("--nvtx-include") + 1] == f"{NCU_RANGE}/"
    assert cmd[cmd.index("--metrics") + 1] == ",".join(NCU_METRICS) and "--set" not in cmd
    assert cmd[-len(child):] == child and cmd[cmd.index("-o") + 1] == "out/tag"
    full = ncu_command("ncu", Path("r"), child, ncu_set="full", ncu_kernel="gdn_fwd_o")
    assert full[full.index("--set") + 1] == "full" and "--metrics" not in full
    assert full[full.index("-k") + 1] == "regex:gdn_fwd_o"


def test_ncu_stalls_summary_from_source_page(tmp_path, capsys):
    """qlabench_tools.kernels.ncu_stalls reads ncu's SASS source page (CSV, optionally .xz): totals per stall
    reason, per USETMAXREG region, and the most-stalled instructions."""
    import lzma

    from qlabench_tools.kernels import ncu_stalls as mod
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
           "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
    rows = [["0x100", "MOV R1, R2", "5", "10", "1", "4", "0"],
            ["0x110", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa0", "0", "4", "0", "0", "0"],
            ["0x120", "@!P0 BRA 0x300", "90", "8", "88", "2", "0"]]
    text = '"Kernel Name","k",\n' + "\n".join(",".join(f'"{c}"' for c in r) for r in [hdr, *rows]) + "\n"
    f = tmp_path / "source.csv.xz"
    with lzma.open(f, "wt") as fh:
        fh.write(text)
    assert mod.main([str(f), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 instructions, 95 stall samples" in out
    assert "long_sb" in out.splitlines()[1] and "93.7%" in out  # 89 of 95 samples
    assert "+00010 USETMAXREG" in out and "+00020" in out and "long_sb 88" in out


def test_kernel_names_become_a_stored_list_and_a_path_per_backend():
    """Every kernel of one call is stored (JSON, by time) and each backend names its route from
    the names: FlashInfer's CUTLASS flat kernel, FlashQLA with / without its CP kernels, ours
    split or direct (FLA's route comes from its dispatch: tests/test_fla_backend.py)."""
    import json

    from qlabench import backends as B
    from qlabench.profile import generic_path, parse_trace, short_name, stored_kernels

    trace = {"traceEvents": [
        {"cat": "kernel", "ph": "X", "name": "tilelang_prepare_h_kernel_kernel", "dur": 10.0,
         "args": {"grid": [4, 2, 1], "block": [128, 1, 1]}},
        {"cat": "kernel", "ph": "X", "name": "tilelang_fused_chunk_gdr_fwd_kernel_kernel",
         "dur": 30.0, "args": {"grid": [8, 1, 1]}},
        {"cat": "cpu_op", "ph": "X", "name": "aten::empty", "dur": 99.0}]}
    kb = parse_trace(trace)
    stored = json.loads(stored_kernels(kb))
    assert [k["name"] for k in stored] == ["tilelang_fused_chunk_gdr_fwd_kernel_kernel",
                                           "tilelang_prepare_h_kernel_kernel"]
    assert stored[0]["share_pct"] == 75.0 and stored[1]["grid"] == [4, 2, 1]
    names = [k["name"] for k in kb]
    assert B.get("flashqla").path(names) == "cp"
    assert B.get("flashqla").path(names[:1]) == "fused"
    assert B.get("tilelang").path(["gdn_fwd_o_kernel", "gdn_seg_state_kernel"]) == "split"
    assert B.get("tilelang").path(["gdn_fwd_o_kernel", "gdn_prep_p_kernel"]) == "direct"
    assert B.get("tilelang").path(["gdn_tables_kernel", "gdn_fwd_fused_kernel"]) == "fused-direct"
    assert B.get("tilelang").path(["gdn_prep_p_kernel", "gdn_seg_state_kernel", "gdn_fwd_fused_kernel"]) == "fused-split"
    flat = ("void cutlass::device_kernel<flat::kernel::FlatKernelTmaWarpSpecializedDeltaRule"
            "<flat::collective::X<int>, 3>>(Params)")
    assert short_name(flat) == "FlatKernelTmaWarpSpecializedDeltaRule"
    assert B.get("flashinfer").path([flat]) == "flat"
    cute = "kernel_cutlass_kernel_delta_rule_dsl{}Sm90_object_at_0"
    assert B.get("flashinfer").path([cute.format("CPDeltaRulePrefill"),
                                     cute.format("CPDeltaRuleTPrecompute")]) == "cp"
    assert B.get("flashinfer").path([cute.format("_FullyFusedDeltaRule")]) == "fused"
    assert generic_path(["a(int)", "void ns::b<1>(x)", "c", "d", "e"]) == "a+b+c+2"
