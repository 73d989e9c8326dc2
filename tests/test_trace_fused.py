"""tools/kernels/trace_fused.py: the traced copy of the fused kernel's program (no GPU)."""

import pathlib

import pytest


def test_traced_source_stamps_every_marked_line_per_role():
    import qlabench_kernels as pkg
    from qlabench_tools.kernels import trace_fused as tf

    src = pathlib.Path(pkg.fwd_fused.__file__).read_text()
    text, names = tf.traced_source(src)
    assert len(names) == len(set(names)) == src.count("  # @trace ") > 20
    assert {n.split("_", 1)[0] for n in names} == {"s", "a", "p"}
    for i, n in enumerate(names):  # the stamp right before its marked line, by its role's thread
        lines = text.split("\n")
        at = next(j for j, ln in enumerate(lines) if ln.endswith(f"# @trace {n}"))
        assert lines[at - 1].strip() == f'tr[sh, ci, {i}] = T.call_extern("int64", "clock64")'
        assert f"tx == {tf.ROLE_TX[n[0]]}," in lines[at - 2]
    assert 'tr: T.Tensor((NT, TC, 32), "int64"),' in text
    with pytest.raises(ValueError, match="s_, a_ or p_"):
        tf.traced_source(src.replace("# @trace s_xo", "# @trace x_xo"))
    with pytest.raises(ValueError, match="no longer has the lines"):
        tf.traced_source(src.replace('N = T.dynamic("N")', 'N = T.dynamic("N")  # n'))


def test_traced_program_builds_and_the_package_program_has_no_stamps():
    pytest.importorskip("tilelang")
    import qlabench_kernels as pkg
    from qlabench_tools.kernels import trace_fused as tf

    mod, names = tf.traced_module(pkg)
    traced = mod.fwd_fused_program(2, 8, True, True).script()
    plain = pkg.fwd_fused.fwd_fused_program(2, 8, True, True).script()
    assert traced.count("clock64") == len(names) and "clock64" not in plain
    assert (
        len(mod.fwd_fused_program(2, 8, True, True).params)
        == len(pkg.fwd_fused.fwd_fused_program(2, 8, True, True).params) + 1
    )


def test_summary_medians_per_phase_and_unwritten_stamps():
    torch = pytest.importorskip("torch")
    from qlabench_tools.kernels import trace_fused as tf

    names = ["s_a", "s_b", "a_x", "a_y", "p_q"]
    tr = torch.zeros(2, 7, tf.NSLOT, dtype=torch.int64)
    for c in range(7):  # state: phases 10 + 30, aux 5 + 15, producer 7 cycles per chunk
        tr[:, c, 0], tr[:, c, 1], tr[:, c, 2], tr[:, c, 3], tr[:, c, 4] = (
            40 * c + 1,
            40 * c + 11,
            20 * c + 1,
            20 * c + 6,
            7 * c + 1,
        )
    nch = torch.tensor([6, 6])
    summ = tf.summarize(tr, names, nch)
    assert summ["s"] == {"phases": {"s_a": 10.0, "s_b": 30.0}, "period": 40.0}
    assert summ["a"] == {"phases": {"a_x": 5.0, "a_y": 15.0}, "period": 20.0}
    assert summ["p"]["period"] == 7.0
    assert tf.unwritten_stamps(tr, names, nch) == []
    tr[1, 3, 2] = 0  # aux's first stamp missing on one chunk of one walk
    assert tf.unwritten_stamps(tr, names, nch) == ["a_x"]


def test_walks_fill_and_span_per_walk_length():
    torch = pytest.importorskip("torch")
    from qlabench_tools.kernels import trace_fused as tf

    names = ["p_wait_empty", "s_xo", "s_store"]
    tr = torch.zeros(4, 4, tf.NSLOT, dtype=torch.int64)
    for cta, (t0, n) in enumerate([(100, 4), (500, 2), (900, 4)]):
        for c in range(n):  # the producer at t0 + 10c, the state's GEMMs from t0 + 50 + 100c, each 80 long
            tr[cta, c, 0], tr[cta, c, 1], tr[cta, c, 2] = t0 + 10 * c, t0 + 50 + 100 * c, t0 + 130 + 100 * c
    w = tf.walks(tr, names, torch.tensor([4, 2, 4, 0]))
    assert w == {2: dict(ctas=1, fill=50.0, span=230.0, per_chunk=115.0),
                 4: dict(ctas=2, fill=50.0, span=430.0, per_chunk=107.5)}  # fmt: skip
    assert len(tf.SHAPES["16/64 serving"][0]) == 64 and sum(tf.SHAPES["16/64 serving"][0]) == 15486
