"""kvlab's one markdown-table writer: every report's tables come out of `table`.

Reports used to join `| a | b |` rows and `|---|---:|` separators by hand, each file its own
way; one writer keeps them alike and makes a column's alignment a single letter.
"""

from __future__ import annotations

from typing import Iterable, Sequence

RULE = {"l": "---", "r": "---:", "c": ":---:"}


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """The table's lines: header, rule, one line per row (cells as `str(cell)`; None is a blank cell, `| |`).

    `align`: a letter per column, l (left, the default), r (right) or c (centre); shorter than
    the header, the remaining columns are left-aligned.
    """
    width = len(header)
    if len(align) > width or set(align) - set(RULE):
        raise ValueError(f"align {align!r} for {width} columns: use l, r or c per column")
    rule = [RULE[a] for a in align.ljust(width, "l")]
    lines = [row_line(header), "|" + "|".join(rule) + "|"]
    for row in rows:
        if len(row) != width:
            raise ValueError(f"a row of {len(row)} cells in a table of {width} columns: {row!r}")
        lines.append(row_line(row))
    return lines


def row_line(cells: Sequence[object]) -> str:
    return "|" + "".join(" |" if cell is None else f" {cell} |" for cell in cells)
