"""What the default clamp's histogram query computes, as data an engine can read.

dpsql.lower.compile.clamp_histogram_query generates the histogram's SQL and attaches this
description of it; an engine that holds the table's store computes the same counts as one pass
over it (dpsql.engine.clamp_pass) and runs the SQL otherwise. A leaf module: the compiler and
the engines both import it, and it imports nothing of dpsql (the bin is a sqlglot tree).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp


@dataclass(frozen=True)
class ClampHistogram:
    """The histogram's SQL, as facts of the policy: the table, the privacy unit, the stored
    columns (name, type) in the policy's order (the keyed hash's arguments, before the
    secret), the counted column, its type and declared bounds, the log bins (M, s, ln r, as
    the SQL's literals, and their number), R, and the compiler's tree of one row's bin (the
    engine's probe runs it on literals: the very tree the histogram query holds, never its
    text read back). A copy: whoever puts it in a larger tree copies it again."""

    table: str
    unit: str | None
    stored: tuple[tuple[str, str], ...]
    column: str
    kind: str
    lower: int | float
    upper: int | float
    maximum: float
    smallest: float
    log_ratio: float
    bins: int
    rows: int
    bin_of: exp.Expression
