"""The README's example outputs, made from the kept rows.

    python -m qlabench_tools.readme_examples           # rewrite the example blocks of README.md
    python -m qlabench_tools.readme_examples --check   # exit 1 when README.md is not current

An example block is a fenced ``text`` block between two HTML comments; the first names the
command (a ``qlabench`` view that only reads stored rows)::

    <!-- example: qlabench summary results/h200_fwd --model 2/8 -->
    ```text
    $ qlabench summary results/h200_fwd --model 2/8
    ...
    ```
    <!-- /example -->

The block holds ``$ <command>`` and the command's output in a terminal of :data:`WIDTH` columns
(the CLI run in this process with ``COLUMNS`` set, from the repository root; trailing spaces
stripped). A command that exits other than 0 or 1 (1: ``compare`` found a regression) is an
error. ``tests/test_readme_examples.py`` renders README.md and fails when it differs, so a stale
example fails CI.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: the terminal width of the examples
WIDTH = 100
#: the commands an example may run: views that only read stored rows
VIEWS = ("summary", "compare")
BLOCK = re.compile(r"(?P<open><!-- example: (?P<cmd>[^\n]*?) -->\n)(?P<body>.*?)(?P<close><!-- /example -->)",
                   re.S)


class ExampleError(Exception):
    """An example block or its command is wrong; the message names it."""


def run(command: str, width: int = WIDTH) -> str:
    """The output of ``command`` (``qlabench <view> ...``) at ``width`` columns, run from the
    repository root, trailing spaces stripped."""
    from typer.testing import CliRunner

    from qlabench.cli import app

    argv = shlex.split(command)
    if len(argv) < 2 or argv[0] != "qlabench" or argv[1] not in VIEWS:
        raise ExampleError(f"example {command!r}: not a `qlabench {'|'.join(VIEWS)} ...` command")
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)
        r = CliRunner().invoke(app, argv[1:], env={"COLUMNS": str(width), "FORCE_COLOR": None,
                                                    "TTY_COMPATIBLE": None})
    finally:
        os.chdir(cwd)
    if r.exit_code not in (0, 1):
        raise ExampleError(f"example {command!r} exited {r.exit_code}: "
                           f"{(r.output.strip().splitlines() or [''])[-1]}")
    return "\n".join(ln.rstrip() for ln in r.stdout.rstrip("\n").splitlines())


def render(text: str, width: int = WIDTH) -> str:
    """``text`` (a README) with every example block's output made afresh."""
    def block(m: re.Match) -> str:
        cmd = m["cmd"].strip()
        return f"{m['open']}```text\n$ {cmd}\n{run(cmd, width)}\n```\n{m['close']}"

    opened, closed = text.count("<!-- example:"), text.count("<!-- /example -->")
    if opened != closed or len(BLOCK.findall(text)) != opened:
        raise ExampleError(f"README: {opened} example block(s) opened, {closed} closed")
    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when README.md is not current")
    p.add_argument("--readme", type=Path, default=README)
    a = p.parse_args(argv)
    try:
        text = a.readme.read_text()
        new = render(text)
    except (OSError, ExampleError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.check:
        if new != text:
            print(f"{a.readme}: example outputs are stale; run python -m "
                  "qlabench_tools.readme_examples", file=sys.stderr)
            return 1
        return 0
    if new != text:
        a.readme.write_text(new)
        print(f"wrote {a.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
