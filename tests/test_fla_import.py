"""The fla backend imports fla-core's kernels without the flash-linear-attention distribution's
``fla.layers`` / ``fla.models`` (transformers), the way fla's ``__init__`` does when they are not
installed, and without running ``fla.ops`` / ``fla.modules``' ``__init__`` (which import every op
and module); a fla that insists on them is imported as it is. A stand-in ``fla`` package (first
on ``sys.path`` of a subprocess) records what was imported."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OPTIONAL = '''
import importlib
def _optional(name):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None
        raise
layers = _optional("fla.layers")
models = _optional("fla.models")
'''
INSISTS = "import fla.layers\nimport fla.models\n"

CHECK = '''
import sys
from qlabench.backends import fla as F
F.import_fla_core()
print("layers", "fla.layers" in sys.modules, "models", "fla.models" in sys.modules,
      "ops", F.OPS in sys.modules, "every_op", "fla.ops.every_op" in sys.modules,
      "every_module", "fla.modules.every_module" in sys.modules)
import fla.layers  # still importable afterwards
print("later", "fla.layers" in sys.modules)
'''


def _fake_fla(root: Path, init: str, chunk: str = "import fla.modules.norm\n") -> None:
    for d in ("fla", "fla/layers", "fla/models", "fla/ops", "fla/ops/gated_delta_rule",
              "fla/modules", "fla/modules/norm"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "__init__.py").write_text("")
    (root / "fla" / "__init__.py").write_text(init)
    # fla's package __init__s that import everything of the library
    (root / "fla/ops/__init__.py").write_text("import fla.ops.every_op\nHELPER = 1\n")
    (root / "fla/ops/every_op.py").write_text("")
    (root / "fla/modules/__init__.py").write_text("import fla.modules.every_module\n")
    (root / "fla/modules/every_module.py").write_text("")
    (root / "fla/ops/gated_delta_rule/chunk.py").write_text(
        chunk + "def chunk_gated_delta_rule_fwd(): pass\n")


def _run(tmp_path: Path, init: str, **kw) -> str:
    _fake_fla(tmp_path, init, **kw)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK)], cwd=tmp_path,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_fla_is_imported_without_its_layers_and_models(tmp_path):
    out = _run(tmp_path, OPTIONAL)
    assert "layers False models False ops True every_op False every_module False" in out
    assert "later True" in out


def test_a_fla_that_needs_them_is_imported_as_it_is(tmp_path):
    out = _run(tmp_path, INSISTS)
    assert "layers True models True ops True" in out


def test_kernels_that_need_the_packages_init_get_fla_as_it_is(tmp_path):
    out = _run(tmp_path, OPTIONAL, chunk="from fla.ops import HELPER\n")
    assert "ops True every_op True every_module False" in out
