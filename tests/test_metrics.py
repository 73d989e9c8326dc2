

def test_run_ceilings_own_then_same_gpu_median_then_none():
    """Derived roofline columns use the row's run ceilings; a run without them (recorded before
    ceilings existed, or marked invalid) takes the median of the other runs on the same GPU model."""
    from qlabench.metrics import run_ceilings

    h200 = {"gpu_name": "NVIDIA H200"}
    metas = {
        "a": {"ceilings": {"matmul_tflops": 790.0, "copy_gbps": 4200.0}, "env": h200},
        "b": {"ceilings": {"matmul_tflops": 800.0, "copy_gbps": 4300.0}, "env": h200},
        "c": {"ceilings": {"matmul_tflops": 780.0, "copy_gbps": 4250.0}, "env": h200},
        "old": {"env": h200},
        "h100": {"ceilings": {"matmul_tflops": 700.0, "copy_gbps": 3000.0}, "env": {"gpu_name": "NVIDIA H100"}},
    }
    assert run_ceilings(metas, "b", "NVIDIA H200")["matmul_tflops"] == 800.0
    c = run_ceilings(metas, "old", "NVIDIA H200")
    assert c == {"matmul_tflops": 790.0, "copy_gbps": 4250.0}  # medians, H100 run ignored
    assert run_ceilings(metas, "old", "NVIDIA A100") is None
    assert run_ceilings({}, "x") is None
    metas["failed"] = {"ceilings": {"device_index": 1, "error": "RuntimeError: OOM"}, "env": h200}
    assert run_ceilings(metas, "failed", "NVIDIA H200") == {"matmul_tflops": 790.0, "copy_gbps": 4250.0}
