"""Developer tools of the in-repo kernels: GPU checks (check_fwd, check_bwd, check_fused,
split_sweep, trace_fused), CPU emulations (emulate, emulate_bwd), barrier-protocol models
(ws_protocol, dqkwy_protocol, fused_protocol), generated CUDA and resource dumps (dump_cuda,
res_usage). Run each as ``python -m qlabench_tools.kernels.<name>``."""
