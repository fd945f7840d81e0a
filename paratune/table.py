"""Plain-text tables for the terminal."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from paratune.scalars import plain

__all__ = ["format_table"]


def _cell(value: Any, floatfmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return format(value, floatfmt)
    unwrapped = plain(value)  # a numpy scalar
    if unwrapped is not value:
        return _cell(unwrapped, floatfmt)
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, *,
                 headers: Mapping[str, str] | None = None,
                 floatfmt: str | Mapping[str, str] = ".4g",
                 title: str | None = None) -> str:
    """Align ``rows`` (dicts) into columns; numbers right-aligned.

    Args:
        rows: One mapping per row.
        columns: Keys to show, in order; defaults to the first row's keys.
        headers: Display names for some columns.
        floatfmt: ``format`` spec for floats, or one per column (``".4g"`` for a column
            it does not name).
        title: A line printed above the table.
    """
    if columns is None:
        columns = list(rows[0]) if rows else []
    headers = dict(headers or {})
    names = [headers.get(c, c) for c in columns]
    formats = ({c: floatfmt.get(c, ".4g") for c in columns} if isinstance(floatfmt, Mapping)
               else dict.fromkeys(columns, floatfmt))
    cells = [[_cell(row.get(c), formats[c]) for c in columns] for row in rows]
    numeric = [all(_is_number(row.get(c)) for row in rows) and bool(rows) for c in columns]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]

    def line(parts: Sequence[str]) -> str:
        out = [p.rjust(w) if num else p.ljust(w) for p, w, num in zip(parts, widths, numeric)]
        return "  ".join(out).rstrip()

    lines = [title] if title else []
    lines.append(line(names))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(r) for r in cells)
    return "\n".join(lines)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        hasattr(value, "dtype") and value.dtype.kind in "iuf")
