"""The query that enumerates a GROUP BY key's public domain, as a sqlglot tree.

dpsql.plan.domains decides whether a key has a public domain (from the policy alone) and
orders its bins; the bins themselves are the values the key's lowering yields over the public
relations of its columns, which this module builds through dpsql.lower.builders and the
service runs on its scratch engine (dpsql.engine.scratch, no private data). Each column's
relation holds every value the policy allows (declared values, a bool's two, an int's or a
date's declared range, a float's grid), NULL too for a nullable column: a function of the
policy alone, so whatever function of the column a key applies, its domain is public.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlglot import exp

from dpsql.frontend.statements import GroupKey, to_literal
from dpsql.lower.bounding import lowered_key
from dpsql.lower.builders import alias, date_literal, select, subquery
from dpsql.lower.row_values import cast, internal_name, number
from dpsql.plan.domains import column_size, float_grid_steps
from dpsql.policy import SQL_TYPES, ColumnPolicy, TablePolicy


def column_relation(col: ColumnPolicy) -> exp.Expression | None:
    """A one-column relation of every value the policy allows ``col``, named as the column
    (None: the column has no public domain, see :func:`dpsql.plan.domains.column_size`)."""
    if column_size(col) is None:
        return None
    sql_type = SQL_TYPES[col.type]
    body: exp.Expression
    if col.values is not None:
        rows = [_row(exp.cast(to_literal(v), sql_type), col) for v in col.values]
        # an empty domain (an empty public table): a relation of no rows
        body = _union(rows) if rows else _row(_null(sql_type), col, where=exp.false())
    elif col.type == "bool":
        pairs = [exp.Tuple(expressions=[exp.Boolean(this=b)]) for b in (False, True)]
        named = exp.TableAlias(this=internal_name("t").this, columns=[internal_name("b").this])
        values = exp.Values(expressions=pairs, alias=named)
        body = select([_name(cast(internal_name("b"), "BOOLEAN"), col)], values)
    elif col.type == "int":
        lo, hi = int(col.lower), int(col.upper)  # type: ignore[arg-type]
        body = select([_name(cast(_range(), "BIGINT"), col)], _series(lo, hi + 1))
    elif col.type == "date":
        first, last = col.date_range  # type: ignore[misc]
        day = exp.Add(this=date_literal(first.isoformat()), expression=cast(_range(), "INT"))
        body = select([_name(cast(day, "DATE"), col)], _series(0, (last - first).days + 1))
    else:  # a bounded float: its grid (plan.domains.float_grid_steps)
        low, high = float(col.lower), float(col.upper)  # type: ignore[arg-type]
        steps = float_grid_steps(col)
        span = exp.Mul(this=exp.Paren(this=number(high - low)), expression=_range())
        point = exp.Add(this=number(low), expression=exp.Div(this=span, expression=number(steps)))
        body = select([_name(cast(point, "DOUBLE"), col)], _series(0, steps + 1))
    if col.nullable:
        body = _union([body, _row(_null(sql_type), col)])
    return body


def enumeration(key: GroupKey, table: TablePolicy, limit: int) -> exp.Select | None:
    """``SELECT DISTINCT <key lowered> FROM (r0) AS t0 CROSS JOIN (r1) AS t1 ... [WHERE
    TRY(c) AND ...] LIMIT limit`` over the relations of the key's columns (None: one has no
    public domain).

    The key is lowered as the engine lowers it (:func:`dpsql.lower.bounding.lowered_key`:
    under TRY, cast to the released type), so a value on which it fails becomes the NULL bin
    and the bins are the values the engine yields. The WHERE conjuncts over the key's columns
    run as the engine runs them (under TRY: a value on which one fails is filtered out), on
    the public values: their bins have no rows.
    """
    sources = []
    for i, c in enumerate(key.columns):
        relation = column_relation(table.columns[c])
        if relation is None:
            return None
        sources.append(subquery(relation, f"t{i}"))
    joins = [exp.Join(this=s, kind="CROSS") for s in sources[1:]]
    where = [exp.Try(this=c.copy()) for c in key.conditions]
    query = select([lowered_key(key)], sources[0], joins=joins, where=where, distinct=True)
    return query.limit(limit, copy=False)


def _name(value: exp.Expression, col: ColumnPolicy) -> exp.Alias:
    """``value AS col``, the column's name quoted only where DuckDB needs it (as the key's
    lowering names it: case-insensitive either way)."""
    name = exp.to_identifier(col.name)
    return alias(value, name.this, quoted=name.quoted)


def _row(value: exp.Expression, col: ColumnPolicy, where: Any = None) -> exp.Select:
    """``SELECT value AS col [WHERE where]``: one row, no FROM."""
    row = exp.Select(expressions=[_name(value, col)])
    return row if where is None else row.where(where, copy=False)


def _union(queries: Sequence[exp.Expression]) -> exp.Expression:
    """``q0 UNION ALL q1 UNION ALL ...`` as the parser builds it (left-deep)."""
    out: exp.Expression = queries[0]
    for query in queries[1:]:
        out = exp.Union(this=out, expression=query, distinct=False)
    return out


def _null(sql_type: str) -> exp.Cast:
    return exp.cast(exp.Null(), sql_type)


def _range() -> exp.Column:
    """``range``: the column of DuckDB's ``range(start, stop)``."""
    return internal_name("range")


def _series(start: int, stop: int) -> exp.Table:
    """``range(start, stop)``: the integers start .. stop - 1 (DuckDB's table function)."""
    series = exp.GenerateSeries(start=number(start), end=number(stop), is_end_exclusive=True)
    return exp.Table(this=series)
