"""A DuckDB connection that holds no private data: domains and post-processing.

It has empty shadow copies of the policy's tables (same names and types, zero rows; typing
itself runs on dpsql.frontend.typecheck's own connection), enumerates public domains, and
evaluates post-processing (HAVING, ORDER BY, arithmetic over released aggregates) on a table
of already-noised values. External access is off and its
configuration locked, like the private engine's.

Post-processing SQL comes from the analyst (a ``SELECT`` without ``FROM``, expressions over the
aggregates), so on top of the binder's whitelist it is checked again here (every function must
be one the binder accepts) and runs under a deadline and result caps: what reaches this shared
connection can neither outgrow the released table nor hold it for long.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

from dpsql.engine.limits import LimitExceeded, ResultCaps, Watchdog, fetch_capped
from dpsql.errors import DataError, OperationalError, ProgrammingError
from dpsql.frontend.identifiers import quote_ident as _q
from dpsql.frontend.statements import (
    AGGREGATE_KINDS,
    DIALECT,
    ERROR_BAR_FUNCTIONS,
    POST_WINDOW_FUNCTIONS,
    RELEASED,
    SCALAR_NODES,
)
from dpsql.lower.builders import alias, select, subquery, unnest_parameter
from dpsql.policy import SQL_TYPES, Policy

POST_TIMEOUT = 10.0  # seconds a post-processing statement may run on the shared connection
# Post-processing returns at most one row per released row (or one, without FROM).
POST_CAPS = ResultCaps(max_rows=1_000_000, max_bytes=256 << 20)
MEMORY_LIMIT = "1GB"  # the scratch connection's DuckDB memory limit
_WATCHDOG = Watchdog()
_POST_CONSTRUCT = "SELECT list / HAVING / ORDER BY"


class Scratch:
    def __init__(self, policy: Policy) -> None:
        self._con = duckdb.connect(":memory:")
        for table in policy.tables.values():
            cols = ", ".join(f"{_q(c.name)} {SQL_TYPES[c.type]}" for c in table.columns.values())
            self._con.execute(f"CREATE TABLE {_q(table.name)} ({cols})")
        # Its queries are tiny (a released table, an empty shadow): one thread costs less than
        # coordinating several, and keeps DuckDB's row order of an unordered DISTINCT stable.
        self._con.execute("SET threads = 1")
        self._con.execute(f"SET memory_limit = '{MEMORY_LIMIT}'")
        self._con.execute("SET enable_external_access = false")
        self._con.execute("SET lock_configuration = true")

    def rows(self, query: exp.Expression) -> list[tuple[Any, ...]]:
        """The rows of a query over generated, public relations (a key's domain enumeration,
        dpsql.lower.domain_query), rendered here in DuckDB's dialect."""
        cur = self._con.cursor()
        try:
            return cur.execute(query.sql(dialect="duckdb")).fetchall()
        finally:
            cur.close()

    def post_process(
        self,
        post: exp.Expression,
        columns: Sequence[str],
        types: Sequence[str],
        rows: Sequence[Sequence[Any]],
    ) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
        """Run the post-processing query ``post`` (its FROM reads ``__released``, or it has
        none) over the released table; returns (description, rows). Its functions are checked
        on the tree (:func:`check_post_tree`), the released table is put in its FROM as a tree
        (:func:`with_released`), and the statement is rendered once, here.

        The table is one ``UNNEST`` of a typed list parameter per column: a dozen parameters
        however many rows (~1.6 ms for 100 rows, against ~13 ms with one parameter per cell).
        Should that fail (a value DuckDB will not put into a typed list, or an error in the
        query itself), the per-cell form runs and gives the result or the error.
        """
        check_post_tree(post)
        if rows:
            try:
                return self._run_post(post, *_unnest_source(columns, types, rows))
            except duckdb.Error:
                pass
        try:
            return self._run_post(post, *_values_source(columns, types, rows))
        except duckdb.Error as exc:
            # Only released (noisy) values and literals are in this connection: the first line
            # of the message is safe to show, and says what went wrong.
            raise DataError(
                f"post-processing failed: {str(exc).splitlines()[0]}",
                construct="SELECT list / HAVING / ORDER BY",
                hint="check casts, divisions and overflows in expressions over the aggregates",
            ) from None

    def _run_post(
        self, post: exp.Expression, released: exp.Select, params: list[Any]
    ) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
        sql = with_released(post, released).sql(dialect=DIALECT)
        cur = self._con.cursor()
        try:
            with _WATCHDOG.deadline(POST_TIMEOUT, cur.interrupt) as deadline:
                try:
                    cur.execute(sql, params)
                    result = fetch_capped(cur, POST_CAPS)
                except duckdb.InterruptException:
                    if deadline.expired:
                        raise _timed_out() from None
                    raise
                except LimitExceeded as exc:
                    raise _too_large(exc) from None
            return [(d[0], str(d[1])) for d in cur.description], result
        finally:
            cur.close()

    def close(self) -> None:
        self._con.close()


# Functions post-processing may call: the binder's own whitelist (scalar constructs, aggregates,
# window functions over released rows).
_POST_FUNCTIONS: tuple[type[exp.Expr], ...] = tuple(
    node
    for node in (*SCALAR_NODES, *AGGREGATE_KINDS, *POST_WINDOW_FUNCTIONS)
    if issubclass(node, exp.Func)
)


def with_released(post: exp.Expression, released: exp.Select) -> exp.Expression:
    """A copy of ``post`` reading ``released`` (as ``__released``) where it reads the
    ``__released`` table."""

    def put(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Table) and node.name == RELEASED and not node.db:
            return subquery(released.copy(), RELEASED)
        return node

    return post.transform(put)


def check_post(post_sql: str, tree: exp.Expr | None = None) -> None:
    """Refuse post-processing SQL that calls a function the binder does not accept.

    A second line behind the binder (``repeat``, ``range``, file readers never reach the shared
    connection, whatever a future path builds). SQL without a parenthesis calls nothing, so
    most post-processing needs no parse; ``tree`` (what ``post_sql`` was rendered from) saves
    the parse (~0.5 ms) for the rest.
    """
    if "(" not in post_sql:
        return
    if tree is None:
        try:
            tree = sqlglot.parse_one(post_sql, read="duckdb")
        except (ParseError, TokenError):
            raise ProgrammingError(
                "post-processing could not be checked",
                sqlstate="42601",
                construct=_POST_CONSTRUCT,
                hint="simplify the expressions over the aggregates",
            ) from None
    check_post_tree(tree)


def check_post_tree(tree: exp.Expr) -> None:
    """:func:`check_post` of a tree: every function it calls is one the binder accepts."""
    for node in tree.walk():
        if not isinstance(node, exp.Func) or isinstance(node, _POST_FUNCTIONS):
            continue
        if isinstance(node, exp.Anonymous) and node.name.lower() in ERROR_BAR_FUNCTIONS:
            continue
        name = node.name.lower() if isinstance(node, exp.Anonymous) else node.sql_name().lower()
        raise ProgrammingError(
            f"function {name}() is not allowed in post-processing",
            sqlstate="42883",
            construct=name,
            hint="see `dpsql help grammar` for the functions accepted over aggregates",
        )


def _timed_out() -> OperationalError:
    return OperationalError(
        "canceling statement due to statement timeout",
        sqlstate="57014",
        construct=_POST_CONSTRUCT,
        hint=f"post-processing may run for {POST_TIMEOUT:g} s; simplify the expressions over "
        "the aggregates",
    )


def _too_large(exc: LimitExceeded) -> DataError:
    amount = f"{exc.limit >> 20} MiB" if exc.kind == "bytes" else f"{exc.limit} rows"
    return DataError(
        f"post-processing result exceeds {amount}",
        sqlstate="54000",
        construct=_POST_CONSTRUCT,
        hint="post-processing returns at most one row per released row; shorten long values",
    )


def _values_source(
    columns: Sequence[str], types: Sequence[str], rows: Sequence[Sequence[Any]]
) -> tuple[exp.Select, list[Any]]:
    """The released table as VALUES with one ``CAST(? AS type)`` per cell (empty: one row of
    NULLs kept by no row, ``WHERE false``)."""
    typed = [_released_type(t) for t in types]
    cell = exp.Placeholder() if rows else exp.Null()
    row = exp.Tuple(expressions=[exp.Cast(this=cell.copy(), to=t.copy()) for t in typed])
    named = exp.TableAlias(
        this=exp.to_identifier("v"), columns=[exp.to_identifier(c, quoted=True) for c in columns]
    )
    values = exp.Values(expressions=[row.copy() for _ in rows] or [row], alias=named)
    params: list[Any] = [v for r in rows for v in r]
    return select([exp.Star()], values, where=[] if rows else [exp.false()]), params


def _unnest_source(
    columns: Sequence[str], types: Sequence[str], rows: Sequence[Sequence[Any]]
) -> tuple[exp.Select, list[Any]]:
    """The released table as parallel UNNESTs of one typed list parameter per column (rows
    keep their order; every list has one element per row)."""
    items = [
        alias(unnest_parameter(_released_type(t)), c, quoted=True)
        for c, t in zip(columns, types, strict=True)
    ]
    return exp.Select(expressions=items), [list(column) for column in zip(*rows, strict=True)]


def _released_type(name: str) -> exp.DataType:
    """The node of a released column's DuckDB type, as DuckDB describes it (``DECIMAL(18,3)``,
    ``TIMESTAMP WITH TIME ZONE``); one sqlglot does not know is kept by its name."""
    return exp.DataType.build(name, dialect="duckdb", udt=True)


@dataclass(frozen=True)
class Projection:
    """A post-processing query that only picks released columns (each at most renamed),
    optionally sorted by released columns and cut by literal LIMIT / OFFSET."""

    items: tuple[tuple[str, int], ...]  # (output name, released column index)
    order: tuple[tuple[int, bool, bool], ...] = ()  # (column index, descending, nulls first)
    limit: int | None = None
    offset: int = 0

    def select_rows(self, rows: Sequence[Sequence[Any]], types: Sequence[str]) -> list[int]:
        """Indices of the rows the query returns, in order.

        A sort is only done here when the ORDER BY values of all rows differ: DuckDB's order
        of tied rows is its own, so ties (including -0.0 against 0.0, or two NaN) raise
        :class:`NotPlain` and DuckDB decides. NULLs go first or last as the query says
        (regardless of direction), NaN sorts above every number, as in DuckDB.
        """
        picked = list(range(len(rows)))
        if self.order:
            keys = [
                tuple(_sort_value(cast_value(row[c], types[c])) for c, _, _ in self.order)
                for row in rows
            ]
            if len(set(keys)) != len(keys):
                raise NotPlain("tied ORDER BY values")
            terms = [(desc, nulls_first) for _, desc, nulls_first in self.order]

            def compare(i: int, j: int) -> int:
                for (desc, nulls_first), a, b in zip(terms, keys[i], keys[j], strict=True):
                    if a == b:
                        continue
                    if a is None or b is None:
                        return -1 if (a is None) == nulls_first else 1
                    return (1 if a > b else -1) * (-1 if desc else 1)
                return 0

            picked.sort(key=functools.cmp_to_key(compare))
        end = None if self.limit is None else self.offset + self.limit
        return picked[self.offset : end]


def _sort_value(value: Any) -> Any:
    """A value's place in DuckDB's order: NaN above every number; None stays None."""
    if value is None:
        return None
    if type(value) is float and value != value:
        return (1, 0.0)
    return (0, value)


def _has_args_besides(node: exp.Expression, *names: str) -> bool:
    """Whether ``node`` sets any argument other than ``names`` (a qualifier, a modifier...)."""
    return any(value for name, value in node.args.items() if name not in names)


def _literal_count(node: exp.Expression | None) -> int | None:
    """The value of a LIMIT / OFFSET that is a plain non-negative integer literal."""
    if not isinstance(node, exp.Limit | exp.Offset) or _has_args_besides(node, "expression"):
        return None
    literal = node.args.get("expression")
    if not isinstance(literal, exp.Literal) or literal.is_string or not literal.is_int:
        return None
    value = int(literal.name)
    return value if value >= 0 else None


def plain_projection(post: exp.Select, columns: Sequence[str]) -> Projection | None:
    """``post`` as a :class:`Projection` when it only picks columns of the released table,
    each at most renamed, optionally with ORDER BY released columns (by name, output alias or
    position) and literal LIMIT / OFFSET: ``SELECT k0 AS "d", a0 FROM __released ORDER BY d``.

    Such a query needs no engine: its rows are the released rows (in order, or sorted), its
    types the released types (see :func:`cast_value`). Anything else (WHERE/HAVING, DISTINCT,
    arithmetic, qualified, unknown or ambiguous names) returns None and goes to DuckDB.
    """
    allowed = ("expressions", "from_", "order", "limit", "offset")
    if not isinstance(post, exp.Select) or _has_args_besides(post, *allowed):
        return None
    source = post.args.get("from_")
    table = source.this if isinstance(source, exp.From) else None
    if (
        not isinstance(table, exp.Table)
        or table.name != RELEASED
        or _has_args_besides(table, "this")
    ):
        return None
    index = {c: i for i, c in enumerate(columns)}
    items = []
    for item in post.expressions:
        inner = item.this if isinstance(item, exp.Alias) else item
        if not _bare_column(inner):
            return None
        column = inner.name
        name = item.alias if isinstance(item, exp.Alias) else column
        if column not in index or not name:
            return None
        items.append((name, index[column]))
    order = []
    if post.args.get("order") is not None:
        node = post.args["order"]
        if _has_args_besides(node, "expressions"):
            return None
        for term in node.expressions:
            nulls_first = term.args.get("nulls_first") if isinstance(term, exp.Ordered) else None
            if not isinstance(nulls_first, bool) or term.args.get("with_fill"):
                return None
            column_index = _order_column(term.this, items, index)
            if column_index is None:
                return None
            order.append((column_index, bool(term.args.get("desc")), nulls_first))
    counts: dict[str, int] = {}
    for name in ("limit", "offset"):
        if post.args.get(name) is not None:
            count = _literal_count(post.args[name])
            if count is None:
                return None
            counts[name] = count
    return Projection(tuple(items), tuple(order), counts.get("limit"), counts.get("offset", 0))


def _bare_column(node: exp.Expression) -> bool:
    return isinstance(node, exp.Column) and not _has_args_besides(node, "this")


def _order_column(
    node: exp.Expression, items: Sequence[tuple[str, int]], index: dict[str, int]
) -> int | None:
    """The released column an ORDER BY term names: a position in the SELECT list, an output
    name (DuckDB matches names case-insensitively) or a released column; None if unsure."""
    if isinstance(node, exp.Literal):
        if node.is_string or not node.is_int or not 1 <= int(node.name) <= len(items):
            return None
        return items[int(node.name) - 1][1]
    if not _bare_column(node):
        return None
    name = node.name
    named = {i for alias, i in items if alias.lower() == name.lower()}
    shadowed = {i for column, i in index.items() if column.lower() == name.lower()}
    if len(named) > 1 or (named and shadowed and named != shadowed):
        return None  # ambiguous: let DuckDB decide (or refuse)
    if named:
        return named.pop()
    return index.get(name) if len(shadowed) == 1 else None


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
