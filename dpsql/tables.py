"""The one table style and number format of every ``dpsql`` command (query, explain, budget,
shell): columns two spaces apart, numbers right-aligned with six significant digits.

Kept free of engine imports, so ``dpsql budget`` starts fast. Machine formats (JSON, CSV) keep
full precision; only what a person reads is rounded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TextIO

MAX_CELL = 80  # a longer cell (engine SQL, a query text) is cut with an ellipsis in tables


def number(value: Any) -> str:
    """Six significant digits, no exponent between 1e-4 and 1e15 (so never ``5.79759e+06``
    next to ``2747``), an exponent outside it (``1e-06``), never 17 digits of float noise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) or not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    magnitude = abs(value)
    if 1e-4 <= magnitude < 1e15:
        digits = max(0, 5 - math.floor(math.log10(magnitude)))
        text = f"{round(value, digits):.{digits}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    return f"{value:.6g}"


def tidy(value: Any) -> Any:
    """A float for JSON and CSV: 15 significant digits, which every double holds exactly, so
    fixed-point sums read 5420280.27 rather than 5420280.2700000005."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.15g}")
    return value


def cell(value: Any) -> str:
    """How a value reads in a table: NULL, a formatted number, or its text on one line."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return number(value)
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def all_numeric(values: Sequence[Any]) -> bool:
    present = [v for v in values if v is not None]
    return bool(present) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in present
    )


def render(
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    out: TextIO,
    *,
    footer: bool = False,
) -> None:
    """Print aligned columns (numbers to the right, text to the left); ``footer`` adds the
    ``(N rows)`` line."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    numeric = [all_numeric([row[i] for row in rows]) for i in range(len(header))]
    for line in ([str(h) for h in header], *cells):
        parts = [
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(line, widths, numeric, strict=True)
        ]
        print("  ".join(parts).rstrip(), file=out)
    if footer:
        print(f"({len(rows)} row{'' if len(rows) == 1 else 's'})", file=out)
