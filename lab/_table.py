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


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 run``, ``2 runs``: a count with its noun, so that no message says "1 runs".

    >>> plural(1, "run"), plural(0, "run"), plural(3, "repeat"), plural(2, "match", "matches")
    ('1 run', '0 runs', '3 repeats', '2 matches')
    """
    return f"{n} {word if n == 1 else (many or word + 's')}"
