"""The planners' cost tables (kernels/calibration.py, kernels/cost_tables/): every committed table
loads and is what the planners price with; a table with a wrong field is refused naming it; the
micro-benchmark's fit (tools/kernels/calibrate.py) recovers the costs that made its timings (timings
made from the planner's own model of each experiment's grid); the planner's picks follow the table."""

import dataclasses
import json

import pytest
from qlabench_kernels import calibration, plan
from qlabench_tools.kernels import calibrate


def test_every_committed_table_loads_and_names_its_source():
    paths = sorted(calibration.TABLES.glob("*.json"))
    assert paths, "no cost table committed"
    for p in paths:
        t = calibration.from_json(json.loads(p.read_text()), where=str(p))
        assert calibration.slug(t.gpu) == p.stem
        src = dict(t.source)
        assert src["fwd"] and src["bwd"], p  # where the numbers come from
    assert calibration.default_table().gpu == calibration.DEFAULT_GPU


def test_the_planners_price_with_the_default_table():
    t = calibration.default_table()
    lens = (32768,)
    assert plan.split_cost(lens, 8, 2048) == plan.split_cost(lens, 8, 2048, costs=t.fwd)
    assert plan.bwd_split_cost(lens, 8, 2048) == plan.bwd_split_cost(lens, 8, 2048, costs=t.bwd)
    assert plan.sm_count(__import__("torch").device("cpu")) == t.sms


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: d["fwd"]["costs"].pop("fused"), "missing ['fused']"),
        (lambda d: d["fwd"]["costs"].update(fuzed=1.0), "unknown ['fuzed']"),
        (lambda d: d["bwd"]["costs"].update(dhu=-1.0), "['dhu'] must be non-negative"),
        (lambda d: d["fwd"]["costs"].update(fused=0.0), "['fused'] must be positive"),
        (lambda d: d["fwd"]["costs"].update(kernel=-1.0), "['kernel'] must be non-negative"),
        (lambda d: d["bwd"]["costs"].update(dhu=0.0, bwd_h=0.0), "dhu + bwd_h must be positive"),
        (lambda d: d["fwd"]["costs"].update(prep=float("nan")), "['prep'] must be positive"),
        (lambda d: d.update(sms=0), "sms must be a positive int"),
        (lambda d: d.pop("bwd"), "no 'bwd'"),
    ],
)
def test_a_wrong_table_is_refused_naming_the_field(edit, needle):
    d = calibration.default_table().to_json()
    edit(d)
    with pytest.raises(ValueError, match=__import__("re").escape(needle)):
        calibration.from_json(d)


def test_round_trip_and_unknown_gpu_falls_back_with_a_warning():
    t = calibration.default_table()
    assert calibration.from_json(json.loads(json.dumps(t.to_json()))) == t
    with pytest.raises(FileNotFoundError, match="no cost table for GPU 'Imaginary GPU'"):
        calibration.load("Imaginary GPU")
    with pytest.warns(UserWarning, match="Imaginary GPU 2"):
        assert calibration._for_name("Imaginary GPU 2") == t
    assert calibration.for_device(__import__("torch").device("cpu")) == t


TRUTH = calibration.FwdCosts(fwd_o=1.9, fwd_o_alone=1.1, fused=3.1, prep=1.2, prep_qk=0.7, seg_state=1.6,
                             fixup=2.9, launch=13.0, fwd_o_few=0.8, fused_few=2.5, seg_state_alone=0.9,
                             seg_state_few=0.7, cta_fwd_o=4.0, cta_fused=6.0,
                             cta_seg_state=2.0, kernel=3.0)  # fmt: skip


#: seg_state's own fixed cost: none of the table's (the split path's ``launch`` holds it)
SEG_STATE_KERNEL = 1.3


def _model_times(c: calibration.FwdCosts, sms: int) -> dict:
    """What each experiment takes if the GPU were the planner's model with costs ``c``."""
    out = {}
    for e in calibrate.experiments(sms):
        (h_qk, h_v), lens, st = e["heads"], e["seqlens"], e["stage"]
        if st.startswith(("fwd_o", "fused")):
            t = plan._final_cost(lens, h_v, 0, sms, e["block_v"], c)
        elif st.startswith("prep"):
            t = plan.prep_cost(lens, h_v, sms, h_qk, c)
        elif st.startswith("seg_state"):  # the non-last segment of each sequence: 4 CTAs per (segment, v-head)
            t = SEG_STATE_KERNEL + plan._paired_makespan([(e["split"] // 64, 4 * h_v * len(lens))], sms, c, "seg_state")
        elif st == "fixup":
            t = c.kernel + (len(range(0, lens[0], e["split"])) - 1) * c.fixup
        else:
            t = plan.split_cost(lens, h_v, e["split"], sms, e["block_v"], h_qk=h_qk, costs=c)
        out[calibrate._key(e)] = t
    return out


@pytest.mark.parametrize("sms", [132, 78, 7])
def test_the_fit_recovers_the_costs_that_made_the_timings(sms):
    got = calibrate.fit_fwd(_model_times(TRUTH, sms), sms)
    # on fewer than 8 SMs seg_state's two grids are one (a segment is 4 CTAs): one step for both
    inseparable = ("seg_state_alone", "seg_state_few", "cta_seg_state") if sms < 8 else ()
    for f in dataclasses.fields(TRUTH):
        if f.name != "unit" and f.name not in inseparable:
            assert getattr(got, f.name) == pytest.approx(getattr(TRUTH, f.name), rel=1e-9), f.name


def test_overheads_below_zero_are_zero_and_a_step_below_zero_is_refused():
    """Noise around no overhead gives 0, not a negative cost; a broken step timing gives an error."""
    times = _model_times(dataclasses.replace(TRUTH, cta_fused=0.0, launch=0.0), 132)
    times[("fused_many", 0)] -= 5.0  # a little faster than one round's overhead allows
    times[("total_split", 0)] -= 2.0
    got = calibrate.fit_fwd(times, 132)
    assert got.cta_fused == 0.0 and got.launch == 0.0 and got.fused == pytest.approx(TRUTH.fused)
    broken = dict(times)
    broken[("total_split", 0)] -= 200.0  # the split path far faster than the unsplit one: a broken timing
    with pytest.raises(RuntimeError, match="negative overhead launch"):
        calibrate.fit_fwd(broken, 132)
    broken = dict(times)
    broken[("fused_many", 0)] *= 0.7
    with pytest.raises(RuntimeError, match="negative overhead cta_fused"):
        calibrate.fit_fwd(broken, 132)
    for stage in ("fused", "fwd_o"):  # no slope
        broken = dict(times)
        broken[(stage, 4096)] = broken[(stage, 1024)]
        with pytest.raises(RuntimeError, match=f"non-positive costs .*'{stage}'"):
            calibrate.fit_fwd(broken, 132)


@pytest.mark.parametrize("sms", [132, 114, 78, 16])
def test_the_experiments_fill_the_sms_as_the_fit_assumes(sms):
    """fwd_o at two CTAs per SM, one, and at most 1/8 of one; the fused kernel one round and 1/8 of
    one; the many-rounds experiments ROUNDS rounds of the fused kernel, ROUNDS / 2 of fwd_o's pairs."""
    unit = calibration.FwdCosts(*[1.0] * 12, cta_fwd_o=0.0, cta_fused=0.0, cta_seg_state=0.0, kernel=0.0)
    ctas = {}
    for e in calibrate.experiments(sms):
        lens, chunks = e["seqlens"], e["seqlens"][0] // 64
        ctas[e["stage"]] = len(lens) * (2 if e["block_v"] == 64 else 1)
        if e["stage"].startswith("seg_state"):  # the non-last segments, 4 CTAs each
            ctas[e["stage"]] = 4 * len(lens) * (e["seqlens"][0] // e["split"] - 1)
        if e["stage"].startswith(("fwd_o", "fused")) and e["x"]:
            assert plan._final_cost(lens, 1, 0, sms, e["block_v"], unit) == chunks
    assert ctas["fwd_o"] == 2 * sms and ctas["fwd_o_alone"] == sms and ctas["fwd_o_few"] <= sms / 8
    assert ctas["fused"] == sms and ctas["fused_few"] <= sms / 8
    assert ctas["fused_many"] == calibrate.ROUNDS * sms and ctas["fwd_o_many"] == calibrate.ROUNDS * sms
    assert ctas["seg_state_many"] == calibrate.ROUNDS * sms
    assert sms - 4 < ctas["seg_state"] / 2 <= sms and sms - 4 < ctas["seg_state_alone"] <= sms
    assert ctas["seg_state_few"] <= max(4, sms / 8)  # one segment at least


def test_more_ctas_than_slots_pair_on_the_sms():
    """fwd_o beyond one CTA per SM: pairs at the shared step, the rest of a slot's load alone; with
    equal steps this is the plain longest-first makespan over two slots per SM."""
    c = dataclasses.replace(TRUTH, cta_fwd_o=0.0, kernel=0.0)
    sms, ch = 10, 16
    # 30 CTAs on 10 SMs: 10 pairs, then 10 alone
    assert plan._paired_makespan([(ch, 30)], sms, c) == pytest.approx(ch * c.fwd_o + ch * c.fwd_o_alone)
    assert plan._paired_makespan([(ch, 20)], sms, c) == pytest.approx(ch * c.fwd_o)
    flat = dataclasses.replace(c, fwd_o_alone=c.fwd_o)
    for n in (11, 20, 25, 37):
        assert plan._paired_makespan([(ch, n), (3, 7)], sms, flat) == plan._lpt_makespan([(ch * c.fwd_o, n), (3 * c.fwd_o, 7)], 2 * sms)


def test_few_ctas_step_faster_up_to_an_eighth_of_the_sms():
    assert plan._few_step(16, 132, 2.0, 1.4) == 1.4
    assert plan._few_step(132, 132, 2.0, 1.4) == 2.0
    assert 1.4 < plan._few_step(74, 132, 2.0, 1.4) < 2.0
    assert calibrate._few_and_full(plan._few_step(90, 132, 2.0, 1.4), 90, plan._few_step(30, 132, 2.0, 1.4), 30, 132) == (
        pytest.approx(1.4), pytest.approx(2.0))


def test_the_planner_follows_the_table():
    """The same batch goes to the fused kernel when its step is cheap and to fwd_o when it is dear."""
    base = calibration.default_table().fwd
    lens = [8192] * 4
    cheap = dataclasses.replace(base, fused=0.5 * base.fwd_o)
    dear = dataclasses.replace(base, fused=10 * base.fwd_o)
    assert plan.plan_fwd(sum(lens), 4, 64, seqlens=lens, h_qk=16, costs=cheap)[0] == 128
    assert plan.plan_fwd(sum(lens), 4, 64, seqlens=lens, h_qk=16, costs=dear)[0] == 64
    # a split path that costs nothing fixed splits a single long sequence of few heads more finely
    free = dataclasses.replace(base, launch=0.0, fixup=1e-6)
    assert plan.plan_split(32768, 1, 8, costs=free) < plan.plan_split(32768, 1, 8)


def test_calibration_without_a_gpu_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert calibrate.main([]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    assert calibrate.main(["--reps", "0"]) == 2 and "--reps 0" in capsys.readouterr().err


def test_a_changed_cost_table_is_a_new_tilelang_version(tmp_path, monkeypatch):
    """Rows resume by backend version: the table that plans this machine's runs enters it (another
    GPU model's table does not)."""
    from qlabench.backends.tilelang import TileLangBackend

    before = TileLangBackend().version()
    for p in calibration.TABLES.glob("*.json"):
        (tmp_path / p.name).write_text(p.read_text())
    monkeypatch.setattr(calibration, "TABLES", tmp_path)
    calibration.load.cache_clear()
    assert TileLangBackend().version() == before
    (tmp_path / "another_gpu.json").write_text(json.dumps({**calibration.default_table().to_json(), "gpu": "Another GPU"}))
    assert TileLangBackend().version() == before
    d = calibration.default_table().to_json()
    d["fwd"]["costs"]["fused"] *= 2
    (tmp_path / f"{calibration.slug(calibration.DEFAULT_GPU)}.json").write_text(json.dumps(d))
    assert TileLangBackend().version() != before
    calibration.load.cache_clear()


BWD_TRUTH = calibration.BwdCosts(dhu=2.2, bwd_h=1.3, seg_state=1.6, fixup=3.2, launch=21.0)


def _model_times_bwd(c: calibration.BwdCosts, sms: int) -> dict:
    """The fit batches at every candidate segment length as the split model prices them, plus a base
    per batch that the split does not change (the stages spread over every SM)."""
    out = {}
    for _, h_v, lens in calibrate.FIT_BWD:
        base = 50.0 + 0.9 * sum(-(-ln // 64) for ln in lens) * h_v / sms
        for seg in plan.bwd_candidates(lens):
            out[(h_v, tuple(lens), seg)] = base + plan.bwd_split_cost(lens, h_v, seg, sms, c)
    return out


@pytest.mark.parametrize("sms", [132, 78])
def test_the_backward_fit_recovers_the_costs_that_made_the_timings(sms):
    got = calibrate.fit_bwd(_model_times_bwd(BWD_TRUTH, sms), sms)
    for f in dataclasses.fields(BWD_TRUTH):
        if f.name != "unit":
            assert getattr(got, f.name) == pytest.approx(getattr(BWD_TRUTH, f.name), rel=1e-6, abs=1e-6), f.name


def test_a_backward_the_split_does_not_change_is_refused():
    """Timings no split changes give no chain cost: an error, not a table that never splits."""
    times = {k: 100.0 for k in _model_times_bwd(BWD_TRUTH, 132)}
    with pytest.raises(RuntimeError, match="chains' step came out 0"):
        calibrate.fit_bwd(times, 132)


def test_the_micro_benchmark_calls_each_kernel_as_its_signature_says(monkeypatch):
    """measure_fwd / measure_bwd on the CPU with every kernel launch replaced by a stub that binds
    its arguments to the real launcher's signature (a wrong call fails here, not on the GPU), the
    timer by one that calls the launch once and returns a time that grows with the batch."""
    import inspect

    import torch
    from qlabench_kernels import backward, fixup, forward, fwd_fused, fwd_o, prep, seg_state

    calls, batch, seg_rows = [], {}, {}
    t = torch.zeros(2, 2)
    stab = torch.zeros(3, 8, dtype=torch.int32)
    stab[1, 5] = 1  # a last segment: seg_state gets the whole table (its grid skips the last segments itself)
    inter = dict(ctab=t, p_all=t, gcs=t, a_beta=t, stab=stab, o=t, final_state=t, e_end=t, m_tr=t,
                 cu_segs=torch.zeros(3, dtype=torch.int32), h_start=t, f_start=t, d_end=t, dh0=t,
                 dh_all=t, dvnew=t, split_tokens=0, block_v=64)  # fmt: skip

    def stub(mod, name, out):
        real = getattr(mod, name)

        def fake(*a, **k):
            inspect.signature(real).bind(*a, **k)
            calls.append(name)
            batch["split"] = int(k.get("split_tokens") or 0)
            if name == "run_seg_state":
                seg_rows[batch["stage"]] = a[4].shape[0]  # the segment table it was launched with
            return out

        monkeypatch.setattr(mod, name, fake)

    stub(forward, "chunk_gdn_fwd_lowlevel", inter)
    stub(backward, "chunk_gdn_bwd", inter)
    for mod, name in ((prep, "run_prep"), (fwd_o, "run_fwd_o"), (fwd_fused, "run_fwd_fused"),
                      (seg_state, "run_seg_state"), (fixup, "run_fixup")):  # fmt: skip
        stub(mod, name, None)
    real_inputs = calibrate._inputs

    def inputs(h_qk, h_v, seqlens, device, seed=0):
        batch.update(lens=list(seqlens), h_v=h_v)
        return real_inputs(h_qk, h_v, seqlens[:1] and [64] * len(seqlens), device, seed)

    def timer(fn, reps):
        n = len(calls)
        fn()
        assert len(calls) == n + 1  # one launch per timed call
        lens, h_v = batch["lens"], batch["h_v"]
        if calls[-1] == "chunk_gdn_bwd":  # the split model's price plus a base
            return 50.0 + plan.bwd_split_cost(lens, h_v, batch["split"], 4, BWD_TRUTH)
        spread = 0.0002 if calls[-1] == "run_fixup" else 0.001
        split = 60.0 if calls[-1].startswith("chunk_gdn") and batch["split"] else 0.0  # its launches
        walk = batch["split"] if calls[-1] == "run_seg_state" else max(lens)  # seg_state walks one segment
        return 5.0 + split + 0.01 * walk + spread * sum(lens) * h_v + 0.5 * len(lens) * h_v  # per CTA

    real_time = calibrate._time_experiment

    def time_experiment(e, device, reps):
        batch["stage"] = e["stage"]
        return real_time(e, device, reps)

    monkeypatch.setattr(calibrate, "_inputs", inputs)
    monkeypatch.setattr(calibrate, "_graph_us", timer)
    monkeypatch.setattr(calibrate, "_time_experiment", time_experiment)
    monkeypatch.setattr(plan, "sm_count", lambda device: 4)
    record = {}
    fwd, checks = calibrate.measure_fwd("cpu", reps=1, echo=lambda *a: None, record=record)
    assert fwd.unit == "us" and len(checks) == len(calibrate.CHECKS)
    assert len(record["fwd"]) == len(calibrate.experiments(4)) + len(calibrate.probes(4))  # every timing taken
    assert len(seg_rows) == 4 and set(seg_rows.values()) == {3}, seg_rows
    for row, (_, _, lens) in zip(checks, calibrate.CHECKS):  # every candidate's time, the pick's among them
        assert set(row["times"]) == {calibrate._cand(c) for c in plan.fwd_candidates(lens, 4)}
        assert row["times"][calibrate._cand(tuple(row["pick"]))] == row["pick_us"]
    bwd, checks_bwd = calibrate.measure_bwd("cpu", reps=1, echo=lambda *a: None, record=record)
    assert bwd.unit == "us" and len(checks_bwd) == len(calibrate.CHECKS_BWD)
    assert len(record["bwd"]) == sum(len(plan.bwd_candidates(lens)) for _, _, lens in calibrate.FIT_BWD)
    assert {"run_prep", "run_fwd_o", "run_fwd_fused", "run_seg_state", "run_fixup", "chunk_gdn_fwd_lowlevel",
            "chunk_gdn_bwd"} <= set(calls)  # fmt: skip
