"""CPU tests of the planners (kernels/plan.py): their picks on cases the H200 measured, from host
values only."""

from kernel_helpers import kernels_pkg as _pkg


def test_plan_split_from_shapes_only():
    """The split planner's picks on cases the H200 split sweep measured (the split sweeps of 2026-11-30; tag kernels-variants-2026-11-30)."""
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


def test_lpt_makespan_is_list_scheduling():
    pkg = _pkg()
    from qlabench_kernels.plan import _lpt_makespan as lpt
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
    # measured on the H200 (results/h200_planner/bwd_splits, 2026-12-01, whole backward):
    assert pkg.plan_bwd_split(32768, 1, 4) == 2048  # 2/4 1x32768: 0.770 ms (4096: 0.748, unsplit 1.295)
    assert pkg.plan_bwd_split(8192, 1, 4) == 1024  # 2/4 1x8192: 0.249 ms (2048: 0.246, unsplit 0.345)
    assert pkg.plan_bwd_split(32768, 1, 8) == 4096  # 4/8 1x32768: 1.380 ms (unsplit 1.562)
    assert pkg.plan_bwd_split(8192, 1, 16) == 0  # 8/16 1x8192: 0.561 ms (1024: 0.753)
    assert pkg.plan_bwd_split(32768, 1, 32) == 0  # 16/32 1x32768: 3.987 ms (16384: 4.748)
    eight = [3274, 1029, 2909, 5061, 2011, 3793, 9932, 4759]
    assert pkg.plan_bwd_split(32768, 8, 8, seqlens=eight) == 0  # 4/8: 1.179 ms (1024: 1.415)


def test_plan_fwd_picks_the_faster_final_kernel():
    """plan_fwd against the H200's timings of both final kernels (check_fused, 2026-12-02,
    results/h200_fused/_notes/ab_20261202/call3/timefull_base): the fused kernel (block_v 128)
    where it measured faster, fwd_o elsewhere (not asserted: 2/8 8x1024, where the model keeps fwd_o
    at 0.0791 ms against the fused kernel's 0.0774)."""
    pkg = _pkg()
    assert pkg.plan_fwd(4 * 8192, 4, 64, h_qk=16)[0] == 128  # fused 1.063 ms, fwd_o 1.974
    assert pkg.plan_fwd(8 * 1024, 8, 64, h_qk=16)[0] == 128  # 0.302 vs 0.547
    assert pkg.plan_fwd(4 * 8192, 4, 32, h_qk=32)[0] == 128  # 32/32: 0.556 vs 1.033
    assert pkg.plan_fwd(32768, 1, 64, h_qk=16)[0] != 128  # fwd_o 1.971, fused 2.097 (64 CTAs)
    assert pkg.plan_fwd(4 * 8192, 4, 16, h_qk=4)[0] != 128  # 0.505 vs 0.537
    assert pkg.plan_fwd(32768, 1, 8, h_qk=2) == (64, 4096)  # 0.418 vs the fused split's best 0.433
    # with the grouped prep's price (results/h200_kernels_prev/prep_group_plan): fwd_o 1.531 ms
    # against the fused kernel's 1.581 on 16/64 24576 + 8192
    assert pkg.plan_fwd(32768, 2, 64, seqlens=[24576, 8192], h_qk=16) == (64, 0)
    # the unsplit fused path runs no prep; every other path pays it
    from qlabench_kernels.plan import _final_cost

    lens = [8192] * 4
    assert pkg.split_cost(lens, 64, 0, block_v=128) == _final_cost(lens, 64, 0, 132, 128)
    for seg, bv in ((2048, 128), (0, 64), (2048, 32)):
        assert pkg.split_cost(lens, 64, seg, block_v=bv) == _final_cost(lens, 64, seg, 132, bv) + pkg.prep_cost(lens, 64)
    # sequences too short to split are rated too (one 200-token sequence of 8 heads: 8 fused CTAs
    # of 4 chunks against fwd_o's 32 at V block 32)
    assert pkg.plan_fwd(200, 1, 8) == (32, 0)
    # the 1% margin leaves fwd_o's picks where they were before the fused kernel (6 sweep layouts
    # of h_v 32 moved to V block 64 split 4096 while prep widened it: 1.11x slower on the H200)
    assert pkg.plan_fwd(32768, 2, 32, seqlens=[28672, 4096]) == (32, 0)


def test_prep_slices_share_loads_while_the_sms_stay_busy():
    """prep's CTAs walk G / slices v-heads each: the fewest slices (a divisor of G) that still launch
    0.6 of a round (4 CTAs per SM); the picks on the H200's stage timings (check_fwd --stage prep)."""
    from qlabench_kernels.plan import prep_slices

    assert prep_slices(16, 64, 32768 // 64 + 1) == 1  # 0.419 ms at 1, 0.455 at 2, 0.529 at 4
    assert prep_slices(2, 8, 32768 // 64 + 1) == 1  # 0.0605 at 1, 0.0637 at 2
    assert prep_slices(2, 8, 8192 // 64 + 1) == 2  # 0.0170 at 2, 0.0182 at 1, 0.0191 at 4
    assert prep_slices(2, 8, 128) == 2 and prep_slices(2, 8, 2) == 4  # too few chunks: one v-head each
    assert prep_slices(8, 24, 4096 // 64 + 1) == 1 and prep_slices(1, 3, 10) == 3
    assert prep_slices(16, 16, 2) == 1  # G = 1: nothing to share


def test_prep_cost_counts_the_shared_work_per_qk_head():
    """Per (chunk, v-head) 1.43 + 0.85 / G: grouping lowers prep's price, and h_qk unknown prices G = 1."""
    from qlabench_kernels.plan import prep_cost

    lens = [32768]
    g1, g4 = prep_cost(lens, 64, h_qk=64), prep_cost(lens, 64, h_qk=16)
    assert prep_cost(lens, 64) == g1
    assert abs(g4 / g1 - (1.43 + 0.85 / 4) / (1.43 + 0.85)) < 1e-9
    # the grouped prep's measured stage ratios against the ungrouped one (0.955 / 0.687 at G = 1 / 4)
    assert abs(g4 / g1 - 0.687 / 0.955) < 0.02
