import pathlib, shutil
src = pathlib.Path("/work/main/kernels/fwd_fused.py").read_text()
def rep(s, a, b):
    assert s.count(a) == 1, a
    return s.replace(a, b)
def A(s):  # Q K^T issued asynchronously after K K^T, waited for after L's gating and store
    s = rep(s, '''                    T.gemm(k_sh[js, :, :], k_sh[js, :, :], a_acc, transpose_B=True, clear_accum=True)  # @trace a_kk
''', '''                    T.gemm(k_sh[js, :, :], k_sh[js, :, :], a_acc, transpose_B=True, clear_accum=True)  # @trace a_kk
                    T.wgmma_gemm(q_sh[js, :, :], k_sh[js, :, :], p_acc, transpose_B=True, clear_accum=True)
''')
    s = rep(s, '''                    T.barrier_wait(t_free[jt], 1 - pt)  # @trace a_wait_free
                    T.gemm(q_sh[js, :, :], k_sh[js, :, :], p_acc, transpose_B=True, clear_accum=True)  # @trace a_qk
''', '''                    T.wait_wgmma(0)  # @trace a_qk
                    T.barrier_wait(t_free[jt], 1 - pt)  # @trace a_wait_free
''')
    return s
for name, fs in {"A": [A]}.items():
    s = src
    for f in fs: s = f(s)
    d = pathlib.Path(f"/work/main/.run/var/pkg_{name}/qlabench_kernels")
    if d.exists(): shutil.rmtree(d)
    shutil.copytree("/work/main/kernels", d, ignore=shutil.ignore_patterns("__pycache__"))
    (d / "fwd_fused.py").write_text(s); print(name, "ok")
