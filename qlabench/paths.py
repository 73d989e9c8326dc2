"""The directories inside a results directory (:mod:`qlabench.results` describes the layout), the
check of an output path a command is given (:func:`check_out`), and the error of rows that cannot
be read (:class:`RowsError`).

A module of its own, importing only the standard library, so that a run names its worker's log
directory, checks its ``--out`` and catches :class:`RowsError` before it imports the storage code
(pandas, pyarrow)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

PARTS_DIR, RUNS_DIR, LOGS_DIR, FIGURES_DIR, SHARDS_DIR = "parts", "_runs", "_logs", "_figures", "_shards"


class RowsError(Exception):
    """A results path whose rows cannot be read for a command (:func:`qlabench.results.read_rows`);
    the message is one line naming the path or the part file."""


class OutPathError(ValueError):
    """An output path that cannot be written as asked; the message names the option and path."""


def check_out(path: str | Path, kind: str, option: str = "--out") -> Path:
    """Check, before anything is computed, that ``path`` can be written as ``kind``: ``"dir"`` (a
    directory to create or write into) or ``"file"`` (a file whose parent directory exists or can
    be created; not a directory). The nearest existing ancestor of what would be created must be
    a directory in which a directory can be made (tried: one made and removed at once).
    Returns ``path``; :class:`OutPathError` naming ``option``, the path and why otherwise."""
    if kind not in ("dir", "file"):
        raise ValueError(f"check_out: kind {kind!r} is not 'dir' or 'file'")
    p = Path(path)
    if kind == "dir" and p.exists() and not p.is_dir():
        raise OutPathError(f"{option} {p}: is a file, not a directory")
    if kind == "file" and p.is_dir():
        raise OutPathError(f"{option} {p}: is a directory; give a file name (e.g. {p / 'x.json'})")
    target = p if kind == "dir" else p.parent
    anc = target
    while not anc.exists() and not anc.is_symlink() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise OutPathError(f"{option} {p}: {anc} is a file, not a directory")
    if anc == target and kind == "file" and p.exists() and not os.access(p, os.W_OK):
        raise OutPathError(f"{option} {p}: the file is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qlabench-out-check-", dir=anc))
    except OSError as e:
        raise OutPathError(f"{option} {p}: cannot write in {anc} "
                           f"({e.strerror or type(e).__name__})") from None
    return p
