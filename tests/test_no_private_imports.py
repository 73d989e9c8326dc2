"""No module of qlabench/ uses another module's private name (one starting with ``_``): neither
``from .x import _y`` nor ``x._y`` on an imported qlabench module. Shared helpers are public
functions of the module that owns them (the analysis layer: ``qlabench/analysis.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "qlabench"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """Absolute module name of ``from <node.module> import ...`` inside module ``mod``."""
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(path: Path) -> list[str]:
    """``file:line: what`` for each use of another qlabench module's private name in ``path``."""
    mod = _module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    aliases: dict[str, str] = {}  # local name -> qlabench module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(mod, is_pkg, node)
            if not (src == "qlabench" or src.startswith("qlabench.")):
                continue
            for a in node.names:
                target = f"{src}.{a.name}" if src else a.name
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno}: from {src} import {a.name}")
                elif src == "qlabench" and ((PKG / f"{a.name}.py").exists() or (PKG / a.name).is_dir()):
                    aliases[a.asname or a.name] = target
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "qlabench" or a.name.startswith("qlabench."):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "qlabench"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and aliases[node.value.id] != mod \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_scanner_sees_both_forms(tmp_path):
    pkg = tmp_path / "qlabench"
    pkg.mkdir()
    (pkg / "a.py").write_text("def _h():\n    pass\n")
    (pkg / "b.py").write_text("from .a import _h\nfrom . import a\nfrom . import a as _a\n"
                              "a._h()\n_a._h()\nimport qlabench.a\nqlabench.a\n")
    global PKG
    old, PKG = PKG, pkg
    try:
        got = private_uses(pkg / "b.py")
    finally:
        PKG = old
    assert any("import _h" in g for g in got)
    assert any("a._h" in g and "_a._h" not in g for g in got)
    assert any("_a._h" in g for g in got)


def test_no_module_uses_another_modules_private_name():
    bad = [u for f in sorted(PKG.rglob("*.py")) for u in private_uses(f)]
    assert not bad, "private names used across qlabench modules (make them public where they " \
        "belong, e.g. qlabench/analysis.py):\n" + "\n".join(bad)
