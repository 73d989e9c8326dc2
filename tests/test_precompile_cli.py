"""``qlabench precompile`` on the CPU: its help, a bad config path, and what it would compile
(the plan; compiling itself needs nvcc and is exercised by the kernel tests)."""

from pathlib import Path

from typer.testing import CliRunner

from qlabench.cli import app
from qlabench.precompile import BWD_SWEEP_HEADS, FWD_SWEEP_HEADS, TEST_HEADS, plan

ROOT = Path(__file__).resolve().parents[1]


def test_precompile_help():
    r = CliRunner().invoke(app, ["precompile", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "TILELANG_CACHE_DIR" in r.output and "--jobs" in r.output


def test_precompile_bad_config_path_exits_2(tmp_path):
    missing = tmp_path / "no_such_sweep.yaml"
    r = CliRunner().invoke(app, ["precompile", str(missing)])
    assert r.exit_code == 2
    assert "no such config file" in r.output and "no_such_sweep.yaml" in r.output


def test_precompile_needs_a_target():
    assert CliRunner().invoke(app, ["precompile"]).exit_code == 2


def test_plan_named_sets_and_configs():
    from qlabench_kernels.compile import ALL_FLAGS

    tests = {(hq, hv): kw for hq, hv, kw in plan(["tests"])}
    assert set(tests) == set(TEST_HEADS)
    assert all(kw == dict(fwd_flags=tuple(sorted(ALL_FLAGS)), bwd_flags=tuple(sorted(ALL_FLAGS)))
               for kw in tests.values())
    sweep = {(hq, hv): kw for hq, hv, kw in plan(["sweep"])}
    assert set(sweep) == set(FWD_SWEEP_HEADS) | set(BWD_SWEEP_HEADS)
    assert sweep[(2, 8)]["bwd_flags"] == () and sweep[(16, 32)]["bwd_flags"] == ((1, 1),)
    # a sweep YAML: its head configs, backward kernels only when it has a backward direction
    fwd = {(hq, hv): kw for hq, hv, kw in plan([ROOT / "configs" / "h200_fwd.yaml"])}
    assert set(fwd) == set(FWD_SWEEP_HEADS)
    assert all(kw["bwd_flags"] == () and kw["fwd_flags"] == ((1, 1),) for kw in fwd.values())
    bwd = {(hq, hv): kw for hq, hv, kw in plan([ROOT / "configs" / "h200_bwd.yaml"])}
    assert set(bwd) == set(BWD_SWEEP_HEADS)
    assert all(kw["bwd_flags"] == ((1, 1),) for kw in bwd.values())
