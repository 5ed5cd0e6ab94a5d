"""Post-processing over several DP queries' released tables, on a database of its own.

A :class:`dpsql.frontend.bind.ReleasedQuery` (dpsql.frontend.released) is measurements M1..Mk and
one post-processing step P over their released results (a set operation, a join, windows, CTE
chains, scalar subqueries). Privacy:

1. Each Mi is an ordinary DP query with cost ci, planned before anything runs; by sequential
   composition the k releases together cost c1 + ... + ck, whatever P is.
2. c1 + ... + ck is reserved in ONE charge before the engine reads a row (reserve all ->
   execute all -> release -> remember): when it does not fit the budget nothing runs and
   nothing is released. A failure after the charge is the uniform charged failure.
3. P reads the released (noisy) rows only: post-processing, free. It runs on a DuckDB
   database of its own that stays empty (no policy table, not even an empty shadow copy;
   nothing is created in it; external access off, configuration locked), a cursor per
   statement, with the released rows as CTEs over typed list parameters. Its SQL is
   rendered from the validated post tree (tables ``__m0..`` and its own CTEs only,
   functions on the post-processing whitelist), never the analyst's text.
   Whatever fails there fails on released values and the text only; it is still checked
   before the charge on empty tables and on one public dummy row per measurement, so a
   mistyped column or a cast that cannot work is a free refusal.

Intervals: a UNION ALL whose branches are whole DP queries keeps every row's intervals (each
row is one measurement's released row); otherwise post-processing columns have none (NULL):
a join, a ratio, a rank or a filter of released values is no longer one released value.
Windows inside one DP query combine them (dpsql.service.plan_cache).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import duckdb
from sqlglot import exp

from dpsql.engine.limits import LimitExceeded, ResultCaps, Watchdog, fetch_capped
from dpsql.errors import DataError, OperationalError, ProgrammingError
from dpsql.frontend.released import MEASURED
from dpsql.lower.builders import alias, cte, policy_column, select, table_ref, unnest_parameter
from dpsql.lower.row_values import cast

DIALECT = "duckdb"
MEMORY_LIMIT = "1GB"  # as the scratch connection's
# The released columns' DB-API type codes as SQL types (dpsql.service.results).
SQL_TYPES = {t: t for t in ("BIGINT", "DOUBLE", "VARCHAR", "BOOLEAN", "DATE", "TIMESTAMP")}

POST_TIMEOUT = 10.0  # seconds the post-processing statement may run
POST_CAPS = ResultCaps(max_rows=1_000_000, max_bytes=256 << 20)
_WATCHDOG = Watchdog()  # one thread, started at the first deadline
_CONSTRUCT = "post-processing of released results"
NULL_TYPE = "NULL"  # a released column that is a NULL literal in its measurement's SELECT list
_BRANCH = "__branch"
_ROW = "__row"


# -- the post-processing connection --------------------------------------------------------------


_DATABASE: duckdb.DuckDBPyConnection | None = None
_DATABASE_LOCK = threading.Lock()


def _connection() -> duckdb.DuckDBPyConnection:
    """A cursor on the post-processing database: in memory, empty (no table, not even an empty
    shadow of a policy table), no file or extension reachable, configuration locked. It stays
    empty: the only SQL it runs is a SELECT rendered from a validated post tree, whose released
    tables are CTEs over parameters (nothing is created). Opened once per process (opening one
    per statement cost ~60 ms under load); each statement gets a cursor of its own."""
    global _DATABASE
    with _DATABASE_LOCK:
        if _DATABASE is None:
            con = duckdb.connect(":memory:")
            con.execute("SET threads = 1")
            con.execute(f"SET memory_limit = '{MEMORY_LIMIT}'")
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
            _DATABASE = con
        return _DATABASE.cursor()


Table = tuple[list[tuple[str, str]], list[tuple[Any, ...]]]  # (description, rows)


def _released_ctes(tables: Sequence[Table]) -> tuple[list[exp.CTE], list[Any]]:
    """``__m<i>`` (the released columns) and ``__m<i>__rows`` (the same plus its row number)
    as CTEs over typed list parameters, one per column; the parameters in order."""
    ctes: list[exp.CTE] = []
    params: list[Any] = []
    for i, (description, rows) in enumerate(tables):
        types = [SQL_TYPES.get(code, "VARCHAR") for _, code in description]
        names = [name for name, _ in description]
        if rows:
            # a column the measurement's SELECT list holds as a NULL literal (``SELECT NULL,
            # COUNT(*)``, a TOTAL row's key) stays untyped, as in SQL: a UNION gives it the
            # other branch's type
            items = [
                alias(exp.Null() if code == NULL_TYPE else unnest_parameter(t), n, quoted=True)
                for n, t, (_, code) in zip(names, types, description, strict=True)
            ]
            items.append(alias(unnest_parameter("BIGINT"), _ROW))
            body = exp.Select(expressions=items)
            params += [
                list(column)
                for column, (_, code) in zip(zip(*rows, strict=True), description, strict=True)
                if code != NULL_TYPE
            ]
            params.append(list(range(len(rows))))
        else:
            items = [
                alias(exp.Null() if code == NULL_TYPE else cast(exp.Null(), t), n, quoted=True)
                for n, t, (_, code) in zip(names, types, description, strict=True)
            ]
            items.append(alias(cast(exp.Null(), "BIGINT"), _ROW))
            body = exp.Select(expressions=items).where(exp.false(), copy=False)
        rows_name = f"{MEASURED}{i}__rows"
        visible: list[exp.Expression] = [policy_column(n) for n in names]
        visible = visible or [alias(exp.Null(), "__none")]
        ctes.append(cte(rows_name, body))
        ctes.append(cte(f"{MEASURED}{i}", select(visible, table_ref(rows_name))))
    return ctes, params


def _is_leaf(node: exp.Expression) -> int | None:
    """The measurement index of a branch that is exactly ``SELECT * FROM __m<i>``."""
    if not isinstance(node, exp.Select) or len(node.expressions) != 1:
        return None
    if not isinstance(node.expressions[0], exp.Star):
        return None
    if any(v for k, v in node.args.items() if k not in ("expressions", "from_")):
        return None
    source = node.args["from_"].this
    match = (
        re.fullmatch(rf"{MEASURED}(\d+)", source.name) if isinstance(source, exp.Table) else None
    )
    return int(match.group(1)) if match and not source.alias else None


def _is_constant(node: exp.Expression) -> bool:
    """A branch that reads no table (``SELECT 'TOTAL', 0``): its rows have no interval."""
    return (
        isinstance(node, exp.Select)
        and node.args.get("from_") is None
        and node.find(exp.Table, exp.Star) is None
        and not any(v for k, v in node.args.items() if k != "expressions")
    )


def tagged(post: exp.Query, tables: Sequence[Table]) -> exp.Query | None:
    """``post`` with each row tagged by its measurement and row (two trailing columns, NULL
    for a constant branch's rows), when it is a UNION ALL of whole DP queries and constant
    rows; None otherwise."""

    def leaves(node: exp.Expression, root: bool = True) -> list[exp.Expression] | None:
        if isinstance(node, exp.Union) and not node.args.get("distinct"):
            if not root and any(node.args.get(k) for k in ("with_", "order", "limit", "offset")):
                return None
            left, right = leaves(node.this, False), leaves(node.expression, False)
            return None if left is None or right is None else left + right
        return [node] if _is_leaf(node) is not None or _is_constant(node) else None

    if not isinstance(post, exp.Union) or post.args.get("with_"):
        return None
    found = leaves(post)
    if found is None or all(_is_leaf(leaf) is None for leaf in found):
        return None
    out = post.copy()
    copies = leaves(out)
    assert copies is not None and len(copies) == len(found)
    for leaf in copies:
        index = _is_leaf(leaf)
        if index is None:  # a constant branch
            assert isinstance(leaf, exp.Select)
            leaf.select(exp.alias_(exp.null(), _BRANCH), exp.alias_(exp.null(), _ROW), copy=False)
            continue
        names = [exp.column(n, quoted=True) for n, _ in tables[index][0]]
        tagged = exp.select(
            *names,
            exp.alias_(exp.Literal.number(index), _BRANCH),
            exp.column(_ROW),
        ).from_(exp.to_table(f"{MEASURED}{index}__rows"))
        leaf.replace(tagged)
    return out


def _sources(select: exp.Select) -> list[exp.Expression]:
    from_ = select.args.get("from_")
    return ([from_.this] if from_ is not None else []) + [
        j.this for j in select.args.get("joins") or []
    ]


Pick = tuple[int, int, int]  # (hidden row column, measurement, released column)


def picked(post: exp.Query, tables: Sequence[Table]) -> tuple[exp.Query, list[Pick | None]] | None:
    """``post`` with, per source that is a whole DP query read as a CTE or derived table, its
    row number as a hidden trailing column, and for each output column that picks one of its
    released values (``a.n``) where that value comes from; None when the query has no such
    pick, or merges or reshapes rows in a way a row number could not follow (an aggregate, a
    star, a set operation, DISTINCT, GROUP BY, a NATURAL join)."""
    if not isinstance(post, exp.Select) or post.find(exp.SetOperation):
        return None
    for star in post.find_all(exp.Star):  # a star would show the hidden row numbers
        leaf = isinstance(star.parent, exp.Select) and _is_leaf(star.parent) is not None
        if not leaf and not isinstance(star.parent, exp.Count):
            return None
    if post.args.get("group") or post.args.get("distinct"):
        return None
    if any(
        not isinstance(a.parent, exp.Window) and a.find_ancestor(exp.Select) is post
        for e in post.expressions
        for a in e.find_all(exp.AggFunc)
    ):
        return None
    if any(
        (j.args.get("kind") or "").upper() == "NATURAL" or j.args.get("method")
        for j in post.args.get("joins") or []
    ):
        return None
    ctes = {
        c.alias_or_name.lower(): c
        for c in (post.args["with_"].expressions if post.args.get("with_") else [])
    }
    measured: dict[str, int] = {}  # source alias -> measurement
    for source in _sources(post):
        body = None
        if isinstance(source, exp.Subquery):
            body = source.this
        elif isinstance(source, exp.Table) and source.name.lower() in ctes:
            body = ctes[source.name.lower()].this
        index = _is_leaf(body) if body is not None else None
        if index is not None:
            measured[source.alias_or_name.lower()] = index
    if not measured:
        return None
    complete = len(measured) == len(_sources(post))
    picks: list[Pick | None] = []
    hidden: dict[str, int] = {}
    for item in post.expressions:
        column = item.unalias()
        pick = None
        if isinstance(column, exp.Column):
            owners = (
                [column.table.lower()]
                if column.table
                else [
                    alias
                    for alias, k in measured.items()
                    if any(n.lower() == column.name.lower() for n, _ in tables[k][0])
                ]
            )
            if len(owners) == 1 and owners[0] in measured and (column.table or complete):
                k = measured[owners[0]]
                names = [n.lower() for n, _ in tables[k][0]]
                if column.name.lower() in names:
                    slot = hidden.setdefault(owners[0], len(hidden))
                    pick = (slot, k, names.index(column.name.lower()))
        picks.append(pick)
    if not hidden:
        return None
    out = post.copy()
    out_ctes = {
        c.alias_or_name.lower(): c
        for c in (out.args["with_"].expressions if out.args.get("with_") else [])
    }
    for source in _sources(out):
        alias = source.alias_or_name.lower()
        if alias not in hidden:
            continue
        rows = exp.select("*").from_(exp.to_table(f"{MEASURED}{measured[alias]}__rows"))
        if isinstance(source, exp.Subquery):
            source.set("this", rows)
        else:
            out_ctes[source.name.lower()].set("this", rows)
    for alias, slot in sorted(hidden.items(), key=lambda a: a[1]):
        out.select(exp.alias_(exp.column(_ROW, table=alias), f"__src{slot}"), copy=False)
    return out, picks


def run_post(
    post: exp.Query, tables: Sequence[Table], names: Sequence[str]
) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
    """``post`` over the released ``tables`` on the empty, locked post-processing database:
    (description as DuckDB types, rows). DuckDB's error text names released values and the
    query's own names only; ``__m<i>`` is shown as the measurement's name."""
    ctes, params = _released_ctes(tables)
    tree = post.copy()
    own = tree.args.get("with_")
    tree.set("with_", exp.With(expressions=ctes + (list(own.expressions) if own else [])))
    sql = tree.sql(dialect=DIALECT)
    cur = _connection()
    try:
        with _WATCHDOG.deadline(POST_TIMEOUT, cur.interrupt) as deadline:
            try:
                cur.execute(sql, params)
                rows = fetch_capped(cur, POST_CAPS)
            except duckdb.InterruptException:
                if deadline.expired:
                    raise OperationalError(
                        "canceling statement due to statement timeout",
                        sqlstate="57014",
                        construct=_CONSTRUCT,
                        hint=f"post-processing may run for {POST_TIMEOUT:g} s",
                    ) from None
                raise
            except LimitExceeded as exc:
                raise DataError(
                    f"post-processing result exceeds {exc.limit} {exc.kind}",
                    sqlstate="54000",
                    construct=_CONSTRUCT,
                    hint="return fewer or shorter rows",
                ) from None
            except duckdb.Error as exc:
                # DuckDB's first line, without its error class ("Binder Error: ")
                message = re.sub(r"^[A-Za-z ]*Error: ", "", str(exc).splitlines()[0])
                message = re.sub(
                    rf"\b{MEASURED}(\d+)(__rows)?\b",
                    lambda m: repr(names[int(m.group(1))]),
                    message,
                )
                raise ProgrammingError(
                    f"post-processing failed: {message}",
                    sqlstate="42000",
                    construct=_CONSTRUCT,
                    hint="check the column names, types and casts of the query over the "
                    "released results",
                ) from None
        return [(d[0], str(d[1])) for d in cur.description], rows
    finally:
        cur.close()


def check_tables(post: exp.Query) -> None:
    """Post tree: tables are released results (``__m<i>``) or its own CTEs; no table function
    (its functions are checked against the post-processing whitelist by the caller)."""
    own = {cte.alias_or_name.lower() for cte in post.find_all(exp.CTE)}
    for table in post.find_all(exp.Table):
        name = table.name.lower()
        ok = isinstance(table.this, exp.Identifier) and not table.args.get("db")
        if not ok or not (re.fullmatch(rf"{MEASURED}\d+", name) or name in own):
            raise ProgrammingError(
                f"post-processing of released results cannot read {table.sql(dialect=DIALECT)}",
                sqlstate="42501",
                construct=table.sql(dialect=DIALECT),
                hint="read only the DP queries' results",
            )
