"""Where a construct stands in the analyst's SQL text, for error messages."""

from __future__ import annotations

import contextvars
import functools

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError
from sqlglot.tokens import TokenType

from dpsql.errors import Position

SOURCE = "dp_source"  # the meta key of a parsed node's :class:`Source`


class Source:
    """The statement a tree was parsed from: its text and the dialect it was read in
    (dpsql.frontend.dialect). :func:`mark` records it on the meta of every node that carries a
    position, as the parse ends, so a refusal finds where its construct stands from the node
    alone (:func:`position_of`), however far from the parse it is raised; copies of a node
    (CTE and derived-table inlining, rewrites) keep it, with the positions, in their meta.
    A tree a cache serves again (plan, shape and text-shape caches) keeps the source of the
    text it was parsed from: every such cache is keyed by the analyst, so a position or an
    echoed construct is only ever read from the analyst's own text."""

    __slots__ = ("dialect", "text")

    def __init__(self, text: str, dialect: str) -> None:
        self.text = text
        self.dialect = dialect

    def tokens(self) -> tuple:
        """The text's tokens, cached for the statement (see :func:`forget_tokens`): binding
        asks for them more than once (the first word, each refusal's position), and
        tokenizing dominates planning."""
        return _tokens_cached(self.text, self.dialect)

    def __deepcopy__(self, memo: dict) -> Source:  # one statement: copies share it
        return self


# The statement whose parse started last on this thread/task (:func:`reading`): the source of
# a node that records none (a node dpsql built, a statement's first look before its parse).
_NOTHING = Source("", "duckdb")
_READING: contextvars.ContextVar[Source] = contextvars.ContextVar("dpsql_reading", default=_NOTHING)


def reading(text: str, dialect: str) -> Source:
    """Record the text and dialect of the statement whose parse starts (per thread/task)."""
    source = Source(text, dialect)
    _READING.set(source)
    return source


def mark(node: exp.Expr, source: Source) -> None:
    """Record ``source`` on ``node``'s meta, which holds its position (see :class:`Source`)."""
    node.meta[SOURCE] = source


def source_of(node: exp.Expr | None) -> Source:
    """The statement ``node`` was parsed from: the source recorded on it or a descendant, else
    the statement being read."""
    if node is not None:
        for sub in node.walk():
            meta = sub._meta
            if meta and (source := meta.get(SOURCE)) is not None:
                return source
    return _READING.get()


def position_of(node: exp.Expr | None) -> Position | None:
    """The earliest source position recorded on ``node`` or any of its descendants, in the
    statement it was parsed from."""
    if node is None:
        return None
    source = source_of(node)
    offset = _start_offset(node, source)
    return None if offset is None else offset_position(source.text, offset)


def _start_offset(node: exp.Expr | None, source: Source) -> int | None:
    if node is None:
        return None
    best: int | None = None
    for sub in node.walk():
        meta = getattr(sub, "_meta", None) or {}
        start = meta.get("start")
        if start is not None and (best is None or start < best):
            best = start
    # Keywords (CREATE, JOIN, LIMIT, OVER, ...) carry no position in sqlglot, so the earliest
    # one above can lie inside the construct: move back to the construct's own first token,
    # as the statement's dialect spells it (INITCAP, not DuckDB's ARRAY_TO_STRING rendering).
    for dialect in dict.fromkeys((source.dialect, "duckdb")):
        try:
            head = _first_token(node.sql(dialect=dialect), dialect)
        except Exception:  # a node the dialect cannot render: keep the recorded position
            continue
        if head is None:
            continue
        starts = [
            t.start
            for t in source.tokens()
            if t.text.upper() == head and (best is None or t.start <= best)
        ]
        if starts:
            return starts[-1]
    return best


def forget_tokens() -> None:
    """Empty the token cache; called as each statement's parse starts.

    The cache serves one statement's several look-ups. Kept across statements it would be
    shared by every analyst of the process: a text another analyst sent recently would parse
    faster (docs/threat_model.md measures ~50-90 us), telling that someone sent it.
    """
    _tokens_cached.cache_clear()


@functools.lru_cache(maxsize=64)
def _tokens_cached(text: str, dialect: str = "duckdb") -> tuple:
    try:
        return tuple(sqlglot.tokenize(text, read=dialect))
    except (TokenError, ParseError):
        return ()


def _first_token(sql: str, dialect: str = "duckdb") -> str | None:
    tokens = _tokens_cached(sql, dialect)
    return tokens[0].text.upper() if tokens else None


def offset_position(text: str, offset: int) -> Position:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return Position(line=line, column=column, offset=offset)


def snippet(node: exp.Expr, limit: int = 60) -> str:
    """Short SQL of a construct, as the analyst wrote it: the span of the statement's text
    the node was parsed from (so a PostgreSQL ``TO_CHAR(d, 'YYYY-MM')`` is named so, not by
    the DuckDB rendering it was mapped to); the node's DuckDB rendering when it has no span
    (a node dpsql built). Never data: only the query's own text."""
    sql = written(node)
    if sql is None:
        sql = node.sql(dialect="duckdb")
    return sql if len(sql) <= limit else sql[: limit - 3] + "..."


def written_name(node: exp.Expr) -> str:
    """A function's name as the analyst wrote it (``to_char``), else as DuckDB renders it."""
    sql = written(node)
    if sql is not None and "(" in sql:
        return sql.split("(")[0].strip()
    return node.sql(dialect="duckdb").split("(")[0]


_CLAUSE_WORDS = frozenset(
    {"FROM", "WHERE", "GROUP", "HAVING", "ORDER", "LIMIT", "OFFSET", "AS", "UNION", "WINDOW"}
)


def written(node: exp.Expr) -> str | None:
    """The text of the statement that ``node`` was parsed from, or None."""
    if node is None:
        return None
    source = source_of(node)
    text, dialect = source.text, source.dialect
    if not text:
        return None
    metas: list[tuple[exp.Expr, dict]] = [
        (sub, sub._meta or {}) for sub in node.walk() if getattr(sub, "_meta", None)
    ]
    # Positions recorded on a node parsed from another text (a stored model's SQL) do not
    # point into this one: every recorded identifier must read as itself there.
    for sub, meta in metas:
        start, end = meta.get("start"), meta.get("end")
        if (
            isinstance(sub, exp.Identifier)
            and start is not None
            and end is not None
            and text[start : end + 1].strip('"`').lower() != sub.name.lower()
        ):
            return None
    start = _start_offset(node, source)
    if start is None:
        return None
    tokens = source.tokens()
    first = next((i for i, t in enumerate(tokens) if t.start == start), None)
    if first is None:
        return None
    last_recorded = max((m["end"] for _, m in metas if m.get("end") is not None), default=start)
    if first + 1 < len(tokens) and tokens[first + 1].token_type == TokenType.L_PAREN:
        last = _closing(tokens, first + 1)  # a call: its name through its closing paren
    else:
        try:
            wanted = len(_tokens_cached(node.sql(dialect=dialect), dialect))
        except Exception:
            wanted = 1
        last, depth = first, 0
        for i in range(first, len(tokens)):
            t = tokens[i]
            depth += t.token_type == TokenType.L_PAREN
            depth -= t.token_type == TokenType.R_PAREN
            if depth < 0:
                break
            beyond = t.start > last_recorded and i - first >= wanted
            if beyond and depth == 0:
                break
            if t.start > last_recorded and depth == 0 and i > first:
                if t.token_type in (TokenType.COMMA, TokenType.SEMICOLON):
                    break
                if t.text.upper() in _CLAUSE_WORDS and t.token_type != TokenType.STRING:
                    break
            last = i
        if depth > 0:
            return None
    if last is None:
        return None
    return text[tokens[first].start : tokens[last].end + 1]


def _closing(tokens: tuple, open_index: int) -> int | None:
    depth = 0
    for i in range(open_index, len(tokens)):
        kind = tokens[i].token_type
        if kind == TokenType.L_PAREN:
            depth += 1
        elif kind == TokenType.R_PAREN:
            depth -= 1
            if depth == 0:
                return i
    return None
