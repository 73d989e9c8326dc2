"""README.md's example outputs are what the commands print on the kept rows today
(qlabench_tools.readme_examples, tools/readme_examples.py)."""

from __future__ import annotations

import pytest
from qlabench_tools import readme_examples as X


def test_readme_examples_are_current():
    text = X.README.read_text()
    assert text.count("<!-- example: qlabench summary") == 1
    new = X.render(text)
    if new != text:
        import difflib
        diff = "\n".join(difflib.unified_diff(text.splitlines(), new.splitlines(), "README.md",
                                              "made", n=1, lineterm=""))
        pytest.fail("README.md's example outputs are stale; run python -m "
                    f"qlabench_tools.readme_examples\n{diff[:3000]}")


def test_a_stale_block_is_rewritten_and_a_bad_one_is_refused():
    cmd = "qlabench summary results/h200_bwd --model 2/4"
    stale = f"intro\n<!-- example: {cmd} -->\n```text\nold output\n```\n<!-- /example -->\nend\n"
    new = X.render(stale)
    assert "old output" not in new and new.startswith("intro\n") and new.endswith("end\n")
    assert f"```text\n$ {cmd}\n" in new and "fastest correct backend per layout" in new
    assert all(len(ln) <= X.WIDTH for ln in new.splitlines()[3:-3])
    assert X.render(new) == new
    with pytest.raises(X.ExampleError, match="opened"):
        X.render(f"<!-- example: {cmd} -->\n")
    with pytest.raises(X.ExampleError, match="not a `qlabench"):
        X.render("<!-- example: rm -rf / -->\n<!-- /example -->")
    with pytest.raises(X.ExampleError, match="exited 2"):
        X.render("<!-- example: qlabench summary results/nope -->\n<!-- /example -->")
