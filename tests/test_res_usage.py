"""tools/kernels/res_usage.py: cuobjdump's resource lines per kernel, and its input errors (no GPU)."""

from qlabench_tools.kernels import res_usage as ru

SAMPLE = """
Resource usage:
 Common:
  GLOBAL:0
 Function gdn_fwd_fused_kernel:
  REG:128 STACK:264 SHARED:8192 LOCAL:0 CONSTANT[0]:1016 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function gdn_tables_kernel:
  REG:40 STACK:0 SHARED:4096 LOCAL:8 CONSTANT[0]:400 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_parse_res_usage_reads_each_function():
    rows = ru.parse_res_usage(SAMPLE)
    assert rows == [
        {"function": "gdn_fwd_fused_kernel", "REG": 128, "STACK": 264, "SHARED": 8192, "LOCAL": 0},
        {"function": "gdn_tables_kernel", "REG": 40, "STACK": 0, "SHARED": 4096, "LOCAL": 8},
    ]
    assert ru.parse_res_usage("Resource usage:\n Common:\n  GLOBAL:0\n") == []


def test_bad_input_exits_2_naming_it(capsys, monkeypatch, tmp_path):
    assert ru.main(["--heads", "16/65"]) == 2
    assert "--heads '16/65'" in capsys.readouterr().err
    monkeypatch.setattr(ru, "find_cuobjdump", lambda: None)
    assert ru.main(["--heads", "2/8"]) == 2
    assert "cuobjdump not found" in capsys.readouterr().err
    monkeypatch.setattr(ru, "find_cuobjdump", lambda: "/bin/true")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))  # main points it at its cache; restored after
    assert ru.main(["--heads", "2/8", "--kernel", "no_such_kernel", "--cache", str(tmp_path)]) == 2
    assert "--kernel 'no_such_kernel' matches no kernel" in capsys.readouterr().err
