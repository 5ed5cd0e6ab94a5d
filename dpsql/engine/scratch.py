"""A DuckDB connection that holds no private data: domains, typing and post-processing.

It has empty shadow copies of the policy's tables (same names and types, zero rows) so that
expressions can be typed, and it evaluates post-processing (HAVING, ORDER BY, arithmetic over
released aggregates) on a table of already-noised values. External access is off and its
configuration locked, like the private engine's.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import duckdb
from sqlglot import exp

from dpsql.errors import DataError, ProgrammingError
from dpsql.policy import Policy
from dpsql.sql.domains import SQL_TYPES
from dpsql.sql.identifiers import quote_ident as _q


class Scratch:
    def __init__(self, policy: Policy) -> None:
        self._con = duckdb.connect(":memory:")
        for table in policy.tables.values():
            cols = ", ".join(f"{_q(c.name)} {SQL_TYPES[c.type]}" for c in table.columns.values())
            self._con.execute(f"CREATE TABLE {_q(table.name)} ({cols})")
        self._con.execute("SET enable_external_access = false")
        self._con.execute("SET lock_configuration = true")

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        cur = self._con.cursor()
        try:
            return cur.execute(sql).fetchall()
        finally:
            cur.close()

    def types(self, table: str, expressions: Sequence[str]) -> list[str]:
        """DuckDB types of expressions over an (empty) shadow table."""
        if not expressions:
            return []
        cur = self._con.cursor()
        try:
            cur.execute(f"SELECT {', '.join(expressions)} FROM {_q(table)} LIMIT 0")
            return [str(d[1]) for d in cur.description]
        finally:
            cur.close()

    def check_types(self, table: str, expressions: Sequence[str]) -> None:
        """Bind expressions against the empty shadow table; raise on a type error.

        The shadow holds no rows, so the message depends only on the SQL text and schema.
        """
        if not expressions:
            return
        cur = self._con.cursor()
        try:
            cur.execute(f"SELECT {', '.join(expressions)} FROM {_q(table)} LIMIT 0")
        except duckdb.ConversionException as exc:
            raise DataError(
                f"invalid value for the column's type: {_first_line(exc)}",
                sqlstate="22P02",
                construct="literal",
                hint="compare columns with literals of their declared type",
            ) from None
        except duckdb.Error as exc:
            raise ProgrammingError(
                f"type error: {_first_line(exc)}",
                sqlstate="42804",
                construct="expression",
                hint="check the operand types against the policy's column types",
            ) from None
        finally:
            cur.close()

    def post_process(
        self,
        post_sql: str,
        columns: Sequence[str],
        types: Sequence[str],
        rows: Sequence[Sequence[Any]],
    ) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
        """Run ``post_sql`` over a temporary ``__released`` table; returns (description, rows)."""
        columns_sql = ", ".join(_q(c) for c in columns)
        if rows:
            row_sql = "(" + ", ".join(f"CAST(? AS {t})" for t in types) + ")"
            values = ", ".join(row_sql for _ in rows)
            params: list[Any] = [v for row in rows for v in row]
        else:
            values = "(" + ", ".join(f"CAST(NULL AS {t})" for t in types) + ")"
            params = []
        released = f"(SELECT * FROM (VALUES {values}) AS v({columns_sql})"
        released += ")" if rows else " WHERE false)"
        sql = post_sql.replace('FROM "__released"', f"FROM {released} AS __released", 1)
        sql = sql.replace("FROM __released", f"FROM {released} AS __released", 1)
        cur = self._con.cursor()
        try:
            cur.execute(sql, params)
            result = cur.fetchall()
            description = [(d[0], str(d[1])) for d in cur.description]
            return description, result
        except duckdb.Error as exc:
            # Only released (noisy) values and literals are in this connection: the first line
            # of the message is safe to show, and says what went wrong.
            raise DataError(
                f"post-processing failed: {str(exc).splitlines()[0]}",
                construct="SELECT list / HAVING / ORDER BY",
                hint="check casts, divisions and overflows in expressions over the aggregates",
            ) from None
        finally:
            cur.close()

    def close(self) -> None:
        self._con.close()


RELEASED = "__released"


def plain_projection(
    post: exp.Select, columns: Sequence[str]
) -> tuple[tuple[str, int], ...] | None:
    """(output name, index into ``columns``) per SELECT item, when ``post`` only picks columns
    of the released table, each at most renamed: ``SELECT k0 AS "d", a0 FROM __released``.

    Such a query needs no engine: its rows are the released rows in order, its types the
    released types (see :func:`cast_value`). Anything else (WHERE/HAVING, ORDER BY, LIMIT,
    DISTINCT, arithmetic, qualified or unknown columns) returns None and goes to DuckDB.
    """
    if not isinstance(post, exp.Select) or any(
        value for name, value in post.args.items() if name not in ("expressions", "from_")
    ):
        return None
    source = post.args.get("from_")
    table = source.this if isinstance(source, exp.From) else None
    if (
        not isinstance(table, exp.Table)
        or table.name != RELEASED
        or any(value for name, value in table.args.items() if name != "this")
    ):
        return None
    index = {c: i for i, c in enumerate(columns)}
    out = []
    for item in post.expressions:
        inner = item.this if isinstance(item, exp.Alias) else item
        if not isinstance(inner, exp.Column) or any(
            value for name, value in inner.args.items() if name != "this"
        ):
            return None
        column = inner.name
        name = item.alias if isinstance(item, exp.Alias) else column
        if column not in index or not name:
            return None
        out.append((name, index[column]))
    return tuple(out)


class NotPlain(Exception):
    """A value whose Python type is not the one DuckDB returns for its column: use DuckDB."""


def cast_value(value: Any, sql_type: str) -> Any:
    """``CAST(? AS sql_type)`` as the scratch connection returns it, for the values a released
    table holds; raises :class:`NotPlain` for anything else (then DuckDB does the cast)."""
    if value is None:
        return None
    kind = type(value)
    if sql_type == "DOUBLE":
        if kind is float:
            return value
        if kind is int and -(1 << 53) <= value <= 1 << 53:
            return float(value)
    elif (
        (sql_type == "BIGINT" and kind is int and -(1 << 63) <= value < 1 << 63)
        or (sql_type == "VARCHAR" and kind is str)
        or (sql_type == "BOOLEAN" and kind is bool)
        or (sql_type == "DATE" and kind is dt.date)
        or (sql_type == "TIMESTAMP" and kind is dt.datetime and value.tzinfo is None)
    ):
        return value
    raise NotPlain(sql_type)


def _first_line(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:300]
