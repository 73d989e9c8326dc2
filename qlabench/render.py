"""Terminal tables of the views (``summary``, ``compare``, ``reproduce``) that fit the terminal
without cutting a cell.

A table is a list of :class:`Column` and rows of cells. Every cell keeps its whole text: columns
never shrink below their widest cell, nothing is ellipsized. When the table is wider than the
width it is fitted to, whole columns are left out in the order of their ``drop`` rank (1 first;
columns of one rank go together; ``drop=None``: always shown) until it fits; then the ranks left
out are tried again, the last left out (the most important) first, and each that fits beside
what is kept comes back. A line under the table names what stays left out. A free-text column
(``wrap=True``) wraps at word boundaries within the room left, never narrower than its
``min_width``. A column marked ``same=True`` whose cells all hold one value is stated once under
the table (``every row: dir fwd``) instead of repeated; one whose cells are all empty is left out
(as is one marked ``omit_empty=True``). With ``parts`` (a separator, e.g. ``", "``) the cells of
a ``same`` column are lists: the parts every row holds are stated once under the table and the
cells keep the rest (``every row: pairing cross-GPU``; a cell ``throttled``).

The width a command fits to (:func:`terminal_width`): ``$COLUMNS`` when it is a positive number,
else the terminal's width when stdout is a terminal; none (every column at its natural width)
with ``--wide`` or when stdout is a pipe or a file. Plain lines printed through :func:`line`
wrap at that width.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

#: how a long layout label is shown in a table cell (:func:`layout_cell`)
LAYOUT_MAX = 16


@dataclass(frozen=True)
class Column:
    """One table column: ``header``, ``justify`` (left | right), ``drop`` (rank in the order
    columns are left out when the table is too wide, 1 first; None: always shown), ``wrap``
    (free text that wraps, at least ``min_width`` wide), ``same`` (a column with one value in
    every row is stated once under the table; all empty: left out), ``omit_empty`` (a column
    whose cells are all empty is left out), ``parts`` (with ``same``: the cells are lists joined
    by this separator; the parts every row holds are stated once)."""

    header: str
    justify: str = "left"
    drop: int | None = None
    wrap: bool = False
    min_width: int = 16
    same: bool = False
    omit_empty: bool = False
    parts: str | None = None


Cell = str | Text


def terminal_width(wide: bool = False) -> int | None:
    """The width tables are fitted to: None with ``wide``; ``$COLUMNS`` when it is a positive
    number; the terminal's width when stdout is a terminal; None otherwise (piped output keeps
    every column). A ``$COLUMNS`` of 0, negative or not a number counts as unset."""
    if wide:
        return None
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def console(width: int | None, stderr: bool = False) -> Console:
    """A console for output fitted to ``width`` (None: lines are never wrapped). Its own width
    never comes from a ``$COLUMNS`` that :func:`terminal_width` counts as unset (rich would read
    ``COLUMNS=0`` as a console 0 wide and print nothing)."""
    if width is None:
        return Console(soft_wrap=True, stderr=stderr,
                       width=shutil.get_terminal_size().columns)
    return Console(width=width, stderr=stderr)


def line(con: Console, text: Cell, width: int | None, style: str | None = None) -> None:
    """Print ``text`` (no markup), wrapped at ``width`` (None: one line however long)."""
    t = text if isinstance(text, Text) else Text(str(text), style=style or "")
    if width is None:
        con.print(t, soft_wrap=True, crop=False, highlight=False)
    else:
        con.print(t, width=width, soft_wrap=False, highlight=False)


def _text(c: Cell) -> Text:
    return c.copy() if isinstance(c, Text) else Text("" if c is None else str(c))


def _table(columns: Sequence[Column], rows: Sequence[Sequence[Text]], keep: Sequence[int],
           measure: bool = False) -> Table:
    """A rich table of the ``keep`` columns; ``measure``: wrapping columns at their min width."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
              header_style="bold")
    for i in keep:
        c = columns[i]
        if c.wrap:
            t.add_column(c.header, justify=c.justify, overflow="fold",
                         min_width=min(c.min_width, _natural(rows, i, c)),
                         max_width=c.min_width if measure else None)
        else:
            t.add_column(c.header, justify=c.justify, no_wrap=True, overflow="ignore")
    for r in rows:
        t.add_row(*(r[i].copy() for i in keep))
    return t


def _natural(rows, i: int, c: Column) -> int:
    return max([Text(c.header).cell_len, *(r[i].cell_len for r in rows)])


def _width(con: Console, t: Table) -> int:
    return Measurement.get(con, con.options.update_width(10**6), t).maximum


@dataclass
class Fitted:
    """What :func:`fit` decided: the kept column indices, the columns left out to fit, the
    columns stated once (header, value), the table's width and its cells as shown."""

    keep: list[int]
    dropped: list[str]
    same: list[tuple[str, str]]
    width: int
    rows: list[list[Text]]


def fit(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int | None,
        con: Console | None = None) -> Fitted:
    """Which columns of the table to show at ``width`` (None: all of them), and the cells as they
    are shown: see the module doc."""
    con = con or Console(width=10**6)
    rows = [[_text(c) for c in r] for r in rows]
    keep, same = [], []
    for i, c in enumerate(columns):
        vals = {r[i].plain for r in rows}
        if (c.same or c.omit_empty) and vals <= {""}:
            continue
        if c.same and len(rows) > 1 and len(vals) == 1:
            same.append((c.header, vals.pop()))
            continue
        if c.same and c.parts and len(rows) > 1:
            lists = [r[i].plain.split(c.parts) if r[i].plain else [] for r in rows]
            common = [p for p in lists[0] if all(p in ps for ps in lists[1:])]
            if common:
                same.append((c.header, c.parts.join(common)))
                for r, ps in zip(rows, lists):
                    r[i] = Text(c.parts.join(p for p in ps if p not in common))
                if all(not r[i].plain for r in rows):
                    continue
        keep.append(i)

    def too_wide(cols: list[int]) -> bool:
        return width is not None and _width(con, _table(columns, rows, cols, True)) > width

    out: list[int] = []  # ranks left out, in the order they went
    ranks = sorted({columns[i].drop for i in keep if columns[i].drop is not None})
    while ranks and too_wide([i for i in keep if columns[i].drop not in out]):
        out.append(ranks.pop(0))
    for r in reversed(list(out)):  # the most important first: each rank that fits comes back
        back = [i for i in keep if columns[i].drop not in out or columns[i].drop == r]
        if not too_wide(back):
            out.remove(r)
    dropped = [columns[i].header for r in out for i in keep if columns[i].drop == r]
    keep = [i for i in keep if columns[i].drop not in out]
    full = _width(con, _table(columns, rows, keep))
    least = _width(con, _table(columns, rows, keep, True))
    w = full if width is None else max(least, min(full, width))
    return Fitted(keep, dropped, same, w, rows)


def table(con: Console, columns: Sequence[Column], rows: Sequence[Sequence[Cell]],
          width: int | None, title: str | None = None, what: str = "row") -> Fitted:
    """Print ``title`` (wrapped at ``width``), the table fitted to ``width``, then one line per
    column stated once (``every <what>: ...``) and one naming the columns left out."""
    if title:
        line(con, title, width)
    f = fit(columns, rows, width, con)
    t = _table(columns, f.rows, f.keep)
    t.width = f.width
    con.print(t, crop=False, soft_wrap=False)
    if f.same:
        line(con, f"every {what}: " + "; ".join(f"{h} {v}" for h, v in f.same), width)
    if f.dropped:
        line(con, f"(left out to fit {width} columns: {', '.join(f.dropped)}; --wide shows them)",
             width)
    return f


def sci(x: float) -> str:
    """``x`` in scientific notation with two significant digits and a bare exponent
    (``4.5e-3``)."""
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def layout_cells(layouts: Sequence[tuple[str, int | None, int | None]]) -> list[str]:
    """Table cells for (label, number of sequences, total tokens) triples: a label of at most
    :data:`LAYOUT_MAX` characters as it is, a longer one as ``<count>x~<mean length>`` (``#2``,
    ``#3``... added where two differ but read the same); :func:`layout_notes` gives the full
    labels for under the table."""
    out, used = [], {}
    for label, n, total in layouts:
        label = str(label)
        try:
            n, total = int(n), int(total)
        except (TypeError, ValueError):
            n = 0
        if len(label) <= LAYOUT_MAX or n <= 0:
            out.append(label)
            continue
        cell = f"{n}x~{round(total / n)}"
        fulls = used.setdefault(cell, [])
        if label not in fulls:
            fulls.append(label)
        k = fulls.index(label)
        out.append(cell if k == 0 else f"{cell}#{k + 1}")
    return out


def layout_notes(cells: Sequence[str], labels: Sequence[str]) -> list[str]:
    """``cell = label`` for each layout cell that is not its label (:func:`layout_cells`)."""
    seen = dict.fromkeys((c, str(f)) for c, f in zip(cells, labels) if c != str(f))
    return [f"{c} = {f}" for c, f in seen]
