"""CPU test of the installed kernel package's boundaries: ``kernels/`` imports nothing from
``qlabench`` (the library stands alone), holds only the library (developer tools live in
tools/kernels/, installed apart as ``qlabench_tools.kernels``), and stays small."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
#: the whole installed qlabench_kernels package, in lines (docstrings and comments included)
MAX_LINES = 4100


def _imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_kernels_import_nothing_from_qlabench():
    bad = [
        f"{p.relative_to(ROOT)}: {name}"
        for p in sorted(KERNELS.rglob("*.py"))
        for name in _imports(p)
        if name == "qlabench" or name.startswith("qlabench.")
    ]
    assert not bad, f"kernels/ must not import qlabench: {bad}"


def test_package_is_flat_and_small():
    """Python modules in one folder, plus the planners' cost tables (data, kernels/cost_tables/*.json)."""
    every = sorted(p for p in KERNELS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    tables = [p for p in every if p.parent == KERNELS / "cost_tables" and p.suffix == ".json"]
    files = [p for p in every if p not in tables]
    assert tables, "no cost table"
    assert all(p.parent == KERNELS for p in files), [str(p.relative_to(ROOT)) for p in files if p.parent != KERNELS]
    assert all(p.suffix == ".py" for p in files), [p.name for p in files if p.suffix != ".py"]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert lines <= MAX_LINES, f"qlabench_kernels is {lines} lines (at most {MAX_LINES})"


def test_pyproject_installs_only_the_library():
    text = (ROOT / "pyproject.toml").read_text()
    pkgs = re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S).group(1))
    assert [p for p in pkgs if p.startswith("qlabench_kernels")] == ["qlabench_kernels"]
    assert re.search(r'^qlabench_kernels = "kernels"$', text, re.M)
    # the developer tools: a package of their own, from tools/
    assert {"qlabench_tools", "qlabench_tools.kernels", "qlabench_tools.correctness"} <= set(pkgs)
    assert re.search(r'^qlabench_tools = "tools"$', text, re.M)


def test_no_private_imports_back_from_the_package_init():
    """No import circle hidden by import order: no module of kernels/ imports from ``.`` (the package
    __init__), which only re-exports."""
    for p in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and not node.module:
                raise AssertionError(f"{p.name} imports from the package __init__: {[a.name for a in node.names]}")


def test_every_developer_tool_imports_from_the_installed_package():
    """tools/ is the installed package ``qlabench_tools``: each module imports by its package name
    (no sys.path edits, no loading by file path), so ``python -m qlabench_tools.kernels.X`` runs."""
    import importlib
    import pkgutil

    import qlabench_tools

    assert pathlib.Path(qlabench_tools.__file__).resolve().parent == ROOT / "tools"
    names = [m.name for m in pkgutil.walk_packages(qlabench_tools.__path__, "qlabench_tools.")]
    assert {"qlabench_tools.kernels.check_fwd", "qlabench_tools.correctness.dump_errors",
            "qlabench_tools.fixed_cost_report"} <= set(names)
    for name in names:
        importlib.import_module(name)
    for p in sorted((ROOT / "tools").rglob("*.py")):
        text = p.read_text()
        assert "sys.path.insert" not in text and "sys.path.append" not in text, p.relative_to(ROOT)
