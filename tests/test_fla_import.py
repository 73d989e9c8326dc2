"""The fla backend imports fla-core's kernels without the flash-linear-attention distribution's
``fla.layers`` / ``fla.models`` (transformers), the way fla's ``__init__`` does when they are not
installed; a fla that insists on them is imported as it is. A stand-in ``fla`` package (first on
``sys.path`` of a subprocess) records what was imported."""

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
      "ops", F.OPS in sys.modules)
import fla.layers  # still importable afterwards
print("later", "fla.layers" in sys.modules)
'''


def _fake_fla(root: Path, init: str) -> None:
    for d in ("fla", "fla/layers", "fla/models", "fla/ops", "fla/ops/gated_delta_rule"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "__init__.py").write_text("")
    (root / "fla" / "__init__.py").write_text(init)
    (root / "fla/ops/gated_delta_rule/chunk.py").write_text("def chunk_gated_delta_rule_fwd(): pass\n")


def _run(tmp_path: Path, init: str) -> str:
    _fake_fla(tmp_path, init)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK)], cwd=tmp_path,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_fla_is_imported_without_its_layers_and_models(tmp_path):
    out = _run(tmp_path, OPTIONAL)
    assert "layers False models False ops True" in out and "later True" in out


def test_a_fla_that_needs_them_is_imported_as_it_is(tmp_path):
    out = _run(tmp_path, INSISTS)
    assert "layers True models True ops True" in out
