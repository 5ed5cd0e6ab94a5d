"""The small sqlglot node constructors every lowering of a plan builds its engine SQL from.

One public module for them (issue 26 item 2), below both the per-query compiler
(dpsql.lower.compile) and the prepared-store lowering (dpsql.lower.prepared_plan), so neither
reaches into the other's private helpers. One row's values (a column, a clamp, the
fixed-point value, internal names and numbers) are in dpsql.lower.row_values.
"""

from __future__ import annotations

from sqlglot import exp


def alias(node: exp.Expression, name: str) -> exp.Alias:
    """``node AS name``, an internal result name (unquoted)."""
    return exp.Alias(this=node, alias=exp.Identifier(this=name, quoted=False))


def and_all(conditions: list[exp.Expression]) -> exp.Expression:
    """``a AND b AND c`` as the parser builds it (left-deep)."""
    out = conditions[0]
    for condition in conditions[1:]:
        out = exp.And(this=out, expression=condition)
    return out


def table_ref(name: str, alias: str | None = None, *, quoted: bool = False) -> exp.Table:
    """A source table (quoted: a policy table) or one of the plan's CTEs, optionally aliased."""
    table = exp.Table(this=exp.Identifier(this=name, quoted=quoted))
    if alias is not None:
        table.set("alias", exp.TableAlias(this=exp.Identifier(this=alias, quoted=False)))
    return table


def subquery(query: exp.Expression, alias: str) -> exp.Subquery:
    """``(query) AS alias``: DuckDB and Spark both need a derived table to be named."""
    return exp.Subquery(
        this=query, alias=exp.TableAlias(this=exp.Identifier(this=alias, quoted=False))
    )


def select(
    items: list[exp.Expression],
    source: exp.Expression,
    *,
    where: list[exp.Expression] | None = None,
    group: list[exp.Expression] | None = None,
    joins: list[exp.Join] | None = None,
    having: exp.Expression | None = None,
    qualify: exp.Expression | None = None,
) -> exp.Select:
    """``SELECT items FROM source [joins] [WHERE a AND b] [GROUP BY group] [HAVING h]
    [QUALIFY q]``: the one shape every step of the plan takes."""
    return exp.Select(
        expressions=items,
        from_=exp.From(this=source),
        joins=joins or None,
        where=exp.Where(this=and_all(where)) if where else None,
        group=exp.Group(expressions=group) if group else None,
        having=exp.Having(this=having) if having is not None else None,
        qualify=exp.Qualify(this=qualify) if qualify is not None else None,
    )


def star(table: str | None = None) -> exp.Expression:
    """``*`` or ``t.*``."""
    return exp.Star() if table is None else exp.Column(this=exp.Star(), table=ident(table))


def ident(name: str) -> exp.Identifier:
    """An internal name (alias, CTE, qualifier), never quoted."""
    return exp.Identifier(this=name, quoted=False)


def count_star() -> exp.Count:
    """``COUNT(*)``: rows, or (over pairs) groups."""
    return exp.Count(this=exp.Star())


def count_distinct(value: exp.Expression) -> exp.Count:
    """``COUNT(DISTINCT value)`` (NULLs are not counted)."""
    return exp.Count(this=exp.Distinct(expressions=[value]))


def sum_distinct(value: exp.Expression) -> exp.Sum:
    """``SUM(DISTINCT value)`` (NULLs are not summed)."""
    return exp.Sum(this=exp.Distinct(expressions=[value]))


def row_number(partition: list[exp.Expression], order: list[exp.Expression]) -> exp.Window:
    """``ROW_NUMBER() OVER (PARTITION BY ... ORDER BY ...)``, NULLs last as in DuckDB (so
    Spark, whose NULLs sort first, is told explicitly)."""
    return exp.Window(
        this=exp.RowNumber(),
        partition_by=partition,
        order=exp.Order(expressions=[exp.Ordered(this=o, nulls_first=False) for o in order]),
        over="OVER",
    )


def join(source: exp.Expression, kind: str, on: exp.Expression) -> exp.Join:
    """A join: SEMI or ANTI filters the left side and adds no column, INNER adds the right's."""
    return exp.Join(this=source, kind=kind, on=on)


def cte(name: str, query: exp.Expression) -> exp.CTE:
    """``name AS (query)``, one step of the bounded plan."""
    return exp.CTE(this=query, alias=exp.TableAlias(this=ident(name)))


def decimal_type(precision: int, scale: int) -> exp.DataType:
    """``DECIMAL(precision, scale)`` as a node (DataType.build would parse the text): Spark's
    renderings widen sums to it (dpsql.lower.compile and the Spark store)."""
    params = [exp.DataTypeParam(this=exp.Literal.number(n)) for n in (precision, scale)]
    return exp.DataType(this=exp.DataType.Type.DECIMAL, expressions=params, nested=False)
