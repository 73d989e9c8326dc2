import pathlib, shutil
src = pathlib.Path("/work/main/kernels/fwd_fused.py").read_text()
def rep(s, a, b):
    assert s.count(a) == 1, a
    return s.replace(a, b)
def C(s):  # substitution: rows of L's diagonal block loaded as vectors; D^T, (D beta)^T rows stored as vectors
    s = rep(s, '''            x16 = T.alloc_local((B,), "float32")''', '''            x16 = T.alloc_local((B,), "float32")
            lrow = T.alloc_local((B,), "float16")
            dst16 = T.alloc_local((B,), "float16")''')
    s = rep(s, '''                        for i in T.unroll(B):
                            acc1 = T.if_then_else(li % B == i, T.float32(1), T.float32(0))
                            for j in T.unroll(i):
                                acc1 = acc1 - T.cast(lo_sh[(li // B) * B + i, (li // B) * B + j], "float32") * x16[j]
                            x16[i] = acc1
                        for i in T.unroll(B):  # @trace a_sstore
                            d_sh[(li // B) * B + i, li] = T.cast(x16[i], "float16")
                            db_sh[(li // B) * B + i, li] = T.cast(x16[i] * gt_sh[js, 1, li], "float16")''',
'''                        for i in T.unroll(B):
                            for j in T.vectorized(B):
                                lrow[j] = lo_sh[(li // B) * B + i, (li // B) * B + j]
                            acc1 = T.if_then_else(li % B == i, T.float32(1), T.float32(0))
                            for j in T.unroll(i):
                                acc1 = acc1 - T.cast(lrow[j], "float32") * x16[j]
                            x16[i] = acc1
                        for i in T.unroll(B):  # @trace a_sstore
                            dst16[i] = T.cast(x16[i], "float16")
                        for i in T.vectorized(B):
                            d_sh[li, (li // B) * B + i] = dst16[i]
                        acc1 = gt_sh[js, 1, li]
                        for i in T.unroll(B):
                            dst16[i] = T.cast(x16[i] * acc1, "float16")
                        for i in T.vectorized(B):
                            db_sh[li, (li // B) * B + i] = dst16[i]''')
    s = rep(s, '''T.gemm(d_sh, lo_sh, a_acc, clear_accum=True)''', '''T.gemm(d_sh, lo_sh, a_acc, transpose_A=True, clear_accum=True)''')
    s = rep(s, '''T.gemm(lo_sh, db_sh, p_acc, clear_accum=True)''', '''T.gemm(lo_sh, db_sh, p_acc, transpose_B=True, clear_accum=True)''')
    return s
for name, fs in {"C": [C]}.items():
    s = src
    for f in fs: s = f(s)
    d = pathlib.Path(f"/work/main/.run/var/pkg_{name}/qlabench_kernels")
    if d.exists(): shutil.rmtree(d)
    shutil.copytree("/work/main/kernels", d, ignore=shutil.ignore_patterns("__pycache__"))
    (d / "fwd_fused.py").write_text(s); print(name, "ok")

def O(s):  # o through q_sh[js] (Q is dead once both state warpgroups' O GEMMs are done): row stores of 16 B
    return rep(s, '''                    T.barrier_arrive(t_free[jt])  # @trace s_store
                    T.barrier_arrive(empty[js])
                    for i, j in T.Parallel(D, C):
                        if j < ln:
                            o[0, t0 + j, hv, i] = T.cast(o_acc[i, j], "bfloat16")''', '''                    T.barrier_arrive(t_free[jt])  # @trace s_store
                    for i, j in T.Parallel(D, C):
                        q_sh[js, j, i] = T.cast(o_acc[i, j], "bfloat16")
                    for j, i in T.Parallel(C, D):
                        if j < ln:
                            o[0, t0 + j, hv, i] = q_sh[js, j, i]
                    T.barrier_arrive(empty[js])''')
for name, fs in {"O": [O], "CO": [C, O]}.items():
    s = src
    for f in fs: s = f(s)
    d = pathlib.Path(f"/work/main/.run/var/pkg_{name}/qlabench_kernels")
    if d.exists(): shutil.rmtree(d)
    shutil.copytree("/work/main/kernels", d, ignore=shutil.ignore_patterns("__pycache__"))
    (d / "fwd_fused.py").write_text(s); print(name, "ok")
