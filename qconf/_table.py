"""A tiny plain-text table formatter for the CLI (no dependency).

    >>> print(format_table(["param", "numel"], [["w", 4096], ["b", 64]]))
    param  numel
    -----  -----
    w       4096
    b         64

Numbers (int/float, not bool) are right-aligned, everything else left-aligned; a column is
right-aligned when all its non-empty cells are numbers (override with ``align="lr..."``).
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["format_table"]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _cell(x: Any, float_format: str) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return format(x, float_format)
    return str(x)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, align: str | None = None,
                 float_format: str = ".3f", sep: str = "  ") -> str:
    """Render ``rows`` under ``headers`` with a dashed rule below the header line.

    Args:
        headers: column titles.
        rows: one sequence of cells per row (``None`` is an empty cell); short rows are padded.
        align: optional string of ``'l'``/``'r'`` per column; inferred from the cells when None.
        float_format: format spec for float cells.
        sep: text between columns.
    """
    ncol = len(headers)
    rows = [list(r) + [None] * (ncol - len(r)) for r in rows]
    if any(len(r) > ncol for r in rows):
        raise ValueError(f"a row has more than {ncol} cells")
    if align is None:
        align = "".join(
            "r" if any(r[c] is not None for r in rows) and all(r[c] is None or _is_number(r[c]) for r in rows)
            else "l" for c in range(ncol))
    if len(align) != ncol or set(align) - {"l", "r"}:
        raise ValueError(f"align must be {ncol} characters of 'l'/'r', got {align!r}")
    text = [[_cell(x, float_format) for x in r] for r in rows]
    widths = [max([len(headers[c])] + [len(t[c]) for t in text]) for c in range(ncol)]

    def line(cells: Sequence[str]) -> str:
        parts = [cell.rjust(w) if a == "r" else cell.ljust(w) for cell, w, a in zip(cells, widths, align)]
        return sep.join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(t) for t in text]
    return "\n".join(out)
