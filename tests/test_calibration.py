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
        (lambda d: d["bwd"]["costs"].update(dhu=-1.0), "['dhu'] must be positive"),
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


def _model_times(c: calibration.FwdCosts, sms: int) -> dict:
    """What each experiment takes if the GPU were the planner's model with costs ``c``, plus a fixed
    cost per stage (launches) that the fit must not take for a step cost."""
    fixed = {"fwd_o": 7.0, "fwd_o_alone": 7.0, "fused": 6.0, "prep_g1": 5.0, "prep_g4": 5.5, "seg_state": 4.0,
             "fixup": 3.0, "total_split": 20.0, "total_unsplit": 20.0}  # fmt: skip
    out = {}
    for e in calibrate.experiments(sms):
        (h_qk, h_v), lens, st = e["heads"], e["seqlens"], e["stage"]
        if st in ("fwd_o", "fwd_o_alone", "fused"):
            t = plan._final_cost(lens, h_v, 0, sms, e["block_v"], c)
        elif st.startswith("prep"):
            t = plan.prep_cost(lens, h_v, sms, h_qk, c)
        elif st == "seg_state":  # the non-last segment of each sequence: 4 CTAs per (segment, v-head)
            t = plan._lpt_makespan([(e["split"] // 64, 4 * h_v * len(lens))], 2 * sms) * c.seg_state
        elif st == "fixup":
            t = (len(range(0, lens[0], e["split"])) - 1) * c.fixup
        else:
            t = plan.split_cost(lens, h_v, e["split"], sms, e["block_v"], h_qk=h_qk, costs=c)
        out[calibrate._key(e)] = fixed[st] + t
    return out


@pytest.mark.parametrize("sms", [132, 78, 7])
def test_the_fit_recovers_the_costs_that_made_the_timings(sms):
    truth = calibration.FwdCosts(fwd_o=1.9, fwd_o_alone=1.1, fused=3.1, prep=1.2, prep_qk=0.7, seg_state=1.6,
                                 fixup=2.9, launch=13.0)  # fmt: skip
    got = calibrate.fit_fwd(_model_times(truth, sms), sms)
    for f in dataclasses.fields(truth):
        if f.name != "unit":
            assert getattr(got, f.name) == pytest.approx(getattr(truth, f.name), rel=1e-9), f.name


def test_the_experiments_fill_the_sms_as_the_fit_assumes():
    """fwd_o at two CTAs per SM and alone, the fused kernel and seg_state one round each."""
    sms = 132
    c = calibration.FwdCosts(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    for e in calibrate.experiments(sms):
        lens, chunks = e["seqlens"], e["seqlens"][0] // 64
        if e["stage"] == "fwd_o":
            assert 2 * len(lens) == 2 * sms and plan._fwd_o_grid(2 * len(lens), sms, c)[0] == 2 * sms
        if e["stage"] == "fwd_o_alone":
            assert plan._fwd_o_grid(2 * len(lens), sms, c)[0] == sms
        if e["stage"] in ("fwd_o", "fwd_o_alone", "fused"):
            assert plan._final_cost(lens, 1, 0, sms, e["block_v"], c) == chunks


def test_a_fit_that_gives_a_non_positive_cost_is_refused():
    times = _model_times(calibration.default_table().fwd, 132)
    times[("fused", 4096)] = times[("fused", 1024)]  # no slope: a broken timing
    with pytest.raises(RuntimeError, match="non-positive costs .*fused"):
        calibrate.fit_fwd(times, 132)


def test_the_planner_follows_the_table():
    """The same batch goes to the fused kernel when its step is cheap and to fwd_o when it is dear."""
    base = calibration.default_table().fwd
    lens = [8192] * 4
    cheap = dataclasses.replace(base, fused=0.5 * base.fwd_o)
    dear = dataclasses.replace(base, fused=10 * base.fwd_o)
    assert plan.plan_fwd(sum(lens), 4, 64, seqlens=lens, h_qk=16, costs=cheap)[0] == 128
    assert plan.plan_fwd(sum(lens), 4, 64, seqlens=lens, h_qk=16, costs=dear)[0] == 64
    # a split path that costs nothing fixed splits a single long sequence of few heads more finely
    free = dataclasses.replace(base, launch=1e-6, fixup=1e-6)
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


def _model_times_bwd(c: calibration.BwdCosts, fwd: calibration.FwdCosts, rfixup: float, sms: int) -> dict:
    """The backward's experiments as the planner's model prices them, plus what the chains' model
    leaves out: stages spread over every SM (per chunk of every sequence) and fixed costs."""
    spread = 0.9  # µs per chunk of every (sequence, v-head) over all SMs: bwd_pw, dqkwg, wy
    out = {}
    for e in calibrate.experiments_bwd(sms):
        lens, st = e["seqlens"], e["stage"]
        chunks = sum(-(-ln // 64) for ln in lens)
        if st in ("bwd_full", "bwd_half", "bwd_split", "bwd_unsplit"):
            t = 50.0 + plan.bwd_split_cost(lens, 1, e["split"], sms, c) + spread * chunks / sms
        elif st == "dhu":
            t = 4.0 + plan._lpt_makespan([(lens[0] // 64, len(lens))], sms) * c.dhu
        else:  # rfixup
            t = 3.0 + (len(range(0, lens[0], e["split"])) - 1) * rfixup
        out[calibrate._key(e)] = t
    return out


@pytest.mark.parametrize("sms", [132, 78])
def test_the_backward_fit_recovers_the_costs_that_made_the_timings(sms):
    fwd = calibration.FwdCosts(1.9, 1.1, 3.1, 1.2, 0.7, seg_state=1.6, fixup=2.9, launch=13.0)
    truth = calibration.BwdCosts(dhu=2.2, bwd_h=1.3, seg_state=1.6, fixup=(2.9 + 3.5) / 2, launch=21.0)
    got = calibrate.fit_bwd(_model_times_bwd(truth, fwd, 3.5, sms), sms, fwd)
    for f in dataclasses.fields(truth):
        if f.name != "unit":
            assert getattr(got, f.name) == pytest.approx(getattr(truth, f.name), rel=1e-9), f.name


def test_a_backward_whose_chains_are_cheaper_than_dhu_alone_is_refused():
    """Timings the chains' model cannot describe give an error, not a table with a negative cost."""
    fwd = calibration.default_table().fwd
    truth = calibration.BwdCosts(dhu=2.2, bwd_h=1.3, seg_state=1.6, fixup=2.0, launch=21.0)
    times = _model_times_bwd(truth, fwd, 1.1, 132)
    for L in calibrate.LENGTHS:
        times[("dhu", L)] *= 5
    with pytest.raises(RuntimeError, match="bwd_h"):
        calibrate.fit_bwd(times, 132, fwd)


def test_the_micro_benchmark_calls_each_kernel_as_its_signature_says(monkeypatch):
    """measure_fwd / measure_bwd on the CPU with every kernel launch replaced by a stub that binds
    its arguments to the real launcher's signature (a wrong call fails here, not on the GPU), the
    timer by one that calls the launch once and returns a time that grows with the batch."""
    import inspect

    import torch
    from qlabench_kernels import backward, bwd_dhu, fixup, forward, fwd_fused, fwd_o, prep, seg_state

    calls, batch = [], {}
    t = torch.zeros(2, 2)
    inter = dict(ctab=t, p_all=t, gcs=t, a_beta=t, stab=t, o=t, final_state=t, e_end=t, m_tr=t,
                 cu_segs=torch.zeros(3, dtype=torch.int32), h_start=t, f_start=t, d_end=t, dh0=t, pt_all=t,
                 w_all=t, dh_all=t, dvnew=t, split_tokens=0, block_v=64)  # fmt: skip

    def stub(mod, name, out):
        real = getattr(mod, name)

        def fake(*a, **k):
            inspect.signature(real).bind(*a, **k)
            calls.append(name)
            batch["split"] = bool(k.get("split_tokens"))
            return out

        monkeypatch.setattr(mod, name, fake)

    stub(forward, "chunk_gdn_fwd_lowlevel", inter)
    stub(backward, "chunk_gdn_bwd", inter)
    for mod, name in ((prep, "run_prep"), (fwd_o, "run_fwd_o"), (fwd_fused, "run_fwd_fused"),
                      (seg_state, "run_seg_state"), (fixup, "run_fixup"), (fixup, "run_rfixup"),
                      (bwd_dhu, "run_bwd_dhu")):  # fmt: skip
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
        if calls[-1] == "run_bwd_dhu":  # one chain of the two: less than both together
            return 5.0 + 0.006 * max(lens)
        spread = 0.0002 if calls[-1] in ("run_rfixup", "run_fixup") else 0.001
        split = 60.0 if calls[-1].startswith("chunk_gdn") and batch["split"] else 0.0  # its launches
        return 5.0 + split + 0.01 * max(lens) + spread * sum(lens) * h_v

    monkeypatch.setattr(calibrate, "_inputs", inputs)
    monkeypatch.setattr(calibrate, "_graph_us", timer)
    monkeypatch.setattr(plan, "sm_count", lambda device: 4)
    fwd, checks = calibrate.measure_fwd("cpu", reps=1, echo=lambda *a: None)
    assert fwd.unit == "us" and len(checks) == len(calibrate.CHECKS)
    bwd, checks_bwd = calibrate.measure_bwd(fwd, "cpu", reps=1, echo=lambda *a: None)
    assert bwd.unit == "us" and len(checks_bwd) == len(calibrate.CHECKS_BWD)
    assert {"run_prep", "run_fwd_o", "run_fwd_fused", "run_seg_state", "run_fixup", "run_rfixup", "run_bwd_dhu",
            "chunk_gdn_fwd_lowlevel", "chunk_gdn_bwd"} <= set(calls)  # fmt: skip
