"""Where a construct stands in the analyst's SQL text, for error messages."""

from __future__ import annotations

from sqlglot import exp

from dpsql.errors import Position


def position_of(node: exp.Expression | None, text: str) -> Position | None:
    """The earliest source position recorded on ``node`` or any of its descendants."""
    if node is None:
        return None
    best: int | None = None
    for sub in node.walk():
        meta = getattr(sub, "_meta", None) or {}
        start = meta.get("start")
        if start is not None and (best is None or start < best):
            best = start
    if best is None:
        return None
    return offset_position(text, best)


def offset_position(text: str, offset: int) -> Position:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return Position(line=line, column=column, offset=offset)


def snippet(node: exp.Expression, limit: int = 60) -> str:
    """Short SQL rendering of a construct (from the analyst's own query, never data)."""
    sql = node.sql(dialect="duckdb")
    return sql if len(sql) <= limit else sql[: limit - 3] + "..."
