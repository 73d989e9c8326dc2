"""Every repository path and git tag the docs name exists.

Scans README.md, docs/*.md and results/README.md (not CHANGELOG.md, which names paths as they were):
every token of an inline code span or fenced code block that is a repository path (it starts with
one of the top-level folders below, or is a top-level file) must exist, as must every relative link
target; every ``tag `name` `` must be a tag of the checkout. Skipped: placeholders (``<...>``,
``*``, ``{...}``, ``$VAR``, ``...``), user output under ``runs/``, URLs and anchors.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md"]
FOLDERS = ("qlabench/", "kernels/", "configs/", "scripts/", "tools/", "tests/", "docs/", "results/",
           "notebooks/", "examples/", ".ci/", ".github/")
TOP_FILES = ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", ".gitignore")
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.|…")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
TAG = re.compile(r"\btags?\s+`([^`]+)`")


def _clean(token: str) -> str:
    token = token.split("::", 1)[0]               # tests/x.py::test_name
    token = token.split("=", 1)[-1]               # VAR=path
    token = token.strip("\"'`()[],;:")
    return token.rstrip(".")


def repo_paths(text: str) -> set[str]:
    """The repository paths named in code spans and fenced blocks of ``text``."""
    chunks = CODE_SPAN.findall(FENCE.sub("", text)) + FENCE.findall(text)
    found = set()
    for chunk in chunks:
        for raw in chunk.split():
            tok = _clean(raw)
            if not tok or PLACEHOLDER.search(tok):
                continue
            if tok.startswith(FOLDERS) or tok in TOP_FILES:
                found.add(tok)
    return found


def link_paths(doc: Path, text: str) -> set[str]:
    """Relative link targets of ``doc`` as paths from the repository root (inside it only)."""
    found = set()
    for target in LINK.findall(text):
        target = target.split("#", 1)[0]
        if not target or "://" in target or target.startswith("mailto:") or PLACEHOLDER.search(target):
            continue
        path = (doc.parent / target).resolve()
        try:
            found.add(str(path.relative_to(ROOT)))
        except ValueError:
            continue                              # outside the repository
    return found


def tags_named(text: str) -> set[str]:
    return set(TAG.findall(text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc):
    text = doc.read_text()
    named = repo_paths(text) | link_paths(doc, text)
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_tags_exist(doc):
    named = tags_named(doc.read_text())
    if not named:
        return
    tags = set(subprocess.run(["git", "tag"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split())
    assert named <= tags, f"{doc.relative_to(ROOT)} names tags that do not exist: {sorted(named - tags)}"


def test_scanner_finds_paths_and_skips_placeholders():
    text = ("Run `python scripts/plan_refit.py fwd runs/x` and `tests/test_docs.py::test_x`;\n"
            "`results/h200_{fwd,bwd}` `runs/<run_id>.json` `$QLABENCH_CACHE_DIR` at tag `v1`.\n"
            "```bash\nqlabench run configs/smoke.yaml --out runs/smoke\n```\n")
    assert repo_paths(text) == {"scripts/plan_refit.py", "tests/test_docs.py", "configs/smoke.yaml"}
    assert tags_named(text) == {"v1"}
    assert link_paths(ROOT / "results" / "README.md", "[a](h200_fwd/x.md) [b](https://x/y) [c](#z)") == {
        "results/h200_fwd/x.md"}
