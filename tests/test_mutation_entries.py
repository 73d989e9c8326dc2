"""scripts/mutation_check.py's entries stay runnable: each names a file, a snippet found there
exactly once, and node ids of test files that exist (the script itself runs the mutations: minutes)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutation_entry_still_finds_its_snippet_once():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    assert mc.MUTATIONS
    for m in mc.MUTATIONS:
        text = (ROOT / m.file).read_text()
        assert text.count(m.original) == 1, (m.name, text.count(m.original))
        for node in m.tests:
            assert (ROOT / node.split("::")[0]).is_file(), (m.name, node)
