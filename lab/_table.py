"""Plain aligned text tables, for summaries and the command line."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt(value: object) -> str:
    """A cell: floats to 4 significant digits, None as '-', NaN as 'nan' (it is data)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def render(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart, no trailing blanks."""
    cells = [list(header)] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )
