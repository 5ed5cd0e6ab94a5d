"""Where a construct stands in the analyst's SQL text, for error messages."""

from __future__ import annotations

import functools

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

from dpsql.errors import Position


def position_of(node: exp.Expr | None, text: str) -> Position | None:
    """The earliest source position recorded on ``node`` or any of its descendants."""
    if node is None:
        return None
    best: int | None = None
    for sub in node.walk():
        meta = getattr(sub, "_meta", None) or {}
        start = meta.get("start")
        if start is not None and (best is None or start < best):
            best = start
    # Keywords (CREATE, JOIN, LIMIT, OVER, ...) carry no position in sqlglot, so the earliest
    # one above can lie inside the construct: move back to the construct's own first token.
    head = _first_token(node.sql(dialect="duckdb"))
    if head is not None:
        starts = [
            t.start
            for t in _tokens(text)
            if t.text.upper() == head and (best is None or t.start <= best)
        ]
        if starts:
            best = starts[-1]
    if best is None:
        return None
    return offset_position(text, best)


def _tokens(text: str) -> tuple:
    """sqlglot tokens of ``text``, cached: binding asks for the same text's tokens several
    times (the first word, each GROUP BY key's position), and tokenizing dominates planning."""
    return _tokens_cached(text)


def forget_tokens() -> None:
    """Empty the token cache; called as each statement's parse starts.

    The cache serves one statement's several look-ups. Kept across statements it would be
    shared by every analyst of the process: a text another analyst sent recently would parse
    faster (docs/threat_model.md measures ~50-90 us), telling that someone sent it.
    """
    _tokens_cached.cache_clear()


@functools.lru_cache(maxsize=64)
def _tokens_cached(text: str) -> tuple:
    try:
        return tuple(sqlglot.tokenize(text, read="duckdb"))
    except (TokenError, ParseError):
        return ()


def _first_token(sql: str) -> str | None:
    tokens = _tokens(sql)
    return tokens[0].text.upper() if tokens else None


def offset_position(text: str, offset: int) -> Position:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return Position(line=line, column=column, offset=offset)


def snippet(node: exp.Expr, limit: int = 60) -> str:
    """Short SQL rendering of a construct (from the analyst's own query, never data)."""
    sql = node.sql(dialect="duckdb")
    return sql if len(sql) <= limit else sql[: limit - 3] + "..."
