"""The small sqlglot node constructors every lowering of a plan builds its engine SQL from.

One public module for them (issue 26 item 2), below both the per-query compiler
(dpsql.lower.compile) and the prepared-store lowering (dpsql.lower.prepared_plan), so neither
reaches into the other's private helpers. One row's values (a column, a clamp, the
fixed-point value, internal names and numbers) are in dpsql.lower.row_values; the ones a
measure kind builds its SQL with (dpsql.plan.measure_kinds.Builders: a column's value, a clamp,
the fixed point, a cast, a number) are named here too, so the lowering hands this module to
the kind's object.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlglot import exp

from dpsql.lower.row_values import cast, fixed_point_expr, number, sql_type
from dpsql.lower.row_values import clamp as clamp
from dpsql.lower.row_values import column_value as column_value
from dpsql.policy import ColumnPolicy


def alias(node: exp.Expression, name: str, *, quoted: bool = False) -> exp.Alias:
    """``node AS name``: an internal result name (unquoted), or a policy column's (quoted)."""
    return exp.Alias(this=node, alias=exp.Identifier(this=name, quoted=quoted))


def and_all(conditions: Sequence[exp.Expression]) -> exp.Expression:
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


def subquery(query: exp.Expression, alias: str | None) -> exp.Subquery:
    """``(query) AS alias``: Spark needs a derived table to be named; DuckDB alone (its
    administrative queries: the column store's build) reads ``(query)`` unnamed too."""
    if alias is None:
        return exp.Subquery(this=query)
    return exp.Subquery(
        this=query, alias=exp.TableAlias(this=exp.Identifier(this=alias, quoted=False))
    )


def select(
    items: Sequence[exp.Expression],
    source: exp.Expression,
    *,
    where: Sequence[exp.Expression] | None = None,
    group: list[exp.Expression] | None = None,
    joins: list[exp.Join] | None = None,
    having: exp.Expression | None = None,
    qualify: exp.Expression | None = None,
    distinct: bool = False,
) -> exp.Select:
    """``SELECT [DISTINCT] items FROM source [joins] [WHERE a AND b] [GROUP BY group]
    [HAVING h] [QUALIFY q]``: the one shape every step of the plan takes."""
    return exp.Select(
        expressions=list(items),
        distinct=exp.Distinct() if distinct else None,
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


def fixed_point(col: ColumnPolicy, lo: int, hi: int) -> exp.Expression:
    """One row's fixed-point integer in [lo, hi] (dpsql.lower.row_values.fixed_point_expr)."""
    return fixed_point_expr(col, lo, hi)


def wide(node: exp.Expression) -> exp.Cast:
    """``CAST(node AS INT128)`` (DuckDB's HUGEINT; DECIMAL(38, 0) on Spark): a partial sum times
    a scale cannot overflow."""
    return cast(node, "INT128")


def fraction(
    v: exp.Expression,
    factor: exp.Expression,
    most: int,
    n: exp.Expression,
    bound: int | None = None,
) -> exp.Expression:
    """``(v * factor) // n`` exactly, truncated toward zero, for 0 <= factor <= most: in 64
    bits where |v| * most cannot overflow (every real pair: 128-bit division is ~5x slower),
    else in 128. ``bound``: the largest |v| can be (a partial already bounded); when
    bound * most fits in 64 bits the test is known to pass and left out."""
    narrow = exp.Mul(this=cast(v.copy(), "BIGINT"), expression=exp.Paren(this=factor))
    if bound is not None and bound * max(most, 1) <= 2**63 - 1:
        return exp.IntDiv(this=narrow, expression=n.copy())
    fits = exp.LTE(this=exp.Abs(this=v), expression=number((2**63 - 1) // max(most, 1)))
    wide_ = exp.Mul(this=wide(v.copy()), expression=exp.Paren(this=factor.copy()))
    return exp.Case(
        ifs=[exp.If(this=fits, true=exp.IntDiv(this=narrow, expression=n.copy()))],
        default=exp.IntDiv(this=wide_, expression=n.copy()),
    )


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


# -- statements and shapes of the prepared store's build (dpsql.engine.prepared, spark_store) --


def policy_column(name: str, table: str | None = None) -> exp.Column:
    """A policy column by its quoted name, optionally qualified by an internal alias.

    >>> policy_column("Dept A", "r").sql("duckdb")
    'r."Dept A"'
    """
    column = exp.Column(this=exp.Identifier(this=name, quoted=True))
    if table is not None:
        column.set("table", ident(table))
    return column


def named_table(name: str, catalog: str | None = None) -> exp.Table:
    """A table by its quoted name, in an attached ``catalog`` or the connection's own: the
    name is a policy table's or derives from one, so it is quoted, never spliced in.

    >>> named_table("store", "__dp_p_t").sql("duckdb")
    '"__dp_p_t"."store"'
    """
    table = exp.Table(this=exp.Identifier(this=name, quoted=True))
    if catalog is not None:
        table.set("db", exp.Identifier(this=catalog, quoted=True))
    return table


def create_table_as(target: exp.Table, query: exp.Expression) -> exp.Create:
    """``CREATE TABLE target AS query``.

    >>> create_table_as(named_table("s"), select([star()], named_table("t"))).sql("duckdb")
    'CREATE TABLE "s" AS SELECT * FROM "t"'
    """
    return exp.Create(this=target, kind="TABLE", expression=query)


def with_ctes(query: exp.Select, ctes: list[exp.CTE]) -> exp.Select:
    """``WITH ctes query`` (``query`` itself, its WITH set)."""
    if ctes:
        query.set("with_", exp.With(expressions=ctes))
    return query


def order_by(query: exp.Select, keys: list[exp.Expression]) -> exp.Select:
    """``query ORDER BY keys``, ascending with NULLs last as in DuckDB (Spark, whose NULLs
    sort first, is told explicitly by its renderer)."""
    query.set(
        "order", exp.Order(expressions=[exp.Ordered(this=k, nulls_first=False) for k in keys])
    )
    return query


def left_join(source: exp.Expression, on: exp.Expression) -> exp.Join:
    """``LEFT JOIN source ON on``: every row of the left side, NULLs where nothing matches."""
    return exp.Join(this=source, side="LEFT", on=on)


def same(left: exp.Expression, right: exp.Expression) -> exp.NullSafeEQ:
    """``left IS NOT DISTINCT FROM right``: equal, or both NULL (Spark: ``<=>``)."""
    return exp.NullSafeEQ(this=left, expression=right)


def coalesce(value: exp.Expression, default: exp.Expression) -> exp.Coalesce:
    """``COALESCE(value, default)``."""
    return exp.Coalesce(this=value, expressions=[default])


def count_where_over(condition: exp.Expression, partition: list[exp.Expression]) -> exp.Window:
    """``COUNT(*) FILTER (WHERE condition) OVER (PARTITION BY partition)``.

    >>> count_where_over(exp.column("ok"), [exp.column("u")]).sql("duckdb")
    'COUNT(*) FILTER(WHERE ok) OVER (PARTITION BY u)'
    """
    counted = exp.Filter(this=count_star(), expression=exp.Where(this=condition))
    return exp.Window(this=counted, partition_by=partition, over="OVER")


def attach(path: str, catalog: str, *, read_only: bool) -> exp.Attach:
    """``ATTACH 'path' AS catalog [(READ_ONLY)]`` (DuckDB): the path a string literal, the
    catalog a quoted name.

    >>> attach("/tmp/it's.duckdb", "c", read_only=True).sql("duckdb")
    'ATTACH \\'/tmp/it\\'\\'s.duckdb\\' AS "c" (READ_ONLY)'
    """
    target = exp.Alias(
        this=exp.Literal.string(path), alias=exp.Identifier(this=catalog, quoted=True)
    )
    options = [exp.AttachOption(this=exp.Var(this="READ_ONLY"))] if read_only else None
    return exp.Attach(this=target, exists=False, expressions=options)


def detach(catalog: str) -> exp.Detach:
    """``DETACH catalog`` (DuckDB).

    >>> detach("c").sql("duckdb")
    'DETACH "c"'
    """
    return exp.Detach(this=exp.Identifier(this=catalog, quoted=True), exists=False)


# -- the row inputs' features (dp_rule_list, the regressions: dpsql.lower.rows) -------------


def flag(condition: exp.Expression) -> exp.Case:
    """``CASE WHEN condition THEN 1 ELSE 0 END``: 1 where it holds, 0 where it is false or
    NULL (a feature's or a label's 0/1 column).

    >>> flag(exp.EQ(this=policy_column("x"), expression=literal("a"))).sql("duckdb")
    'CASE WHEN "x" = \\'a\\' THEN 1 ELSE 0 END'
    """
    return exp.Case(
        ifs=[exp.If(this=condition, true=exp.Literal.number(1))], default=exp.Literal.number(0)
    )


def literal(value: object) -> exp.Expression:
    """A declared value as a SQL literal: TRUE or FALSE, a number as Python prints it
    (``repr``: every digit of a float), anything else its text as a string.

    >>> [literal(v).sql("duckdb") for v in (True, 3, 0.1, "it's")]
    ['TRUE', '3', '0.1', "'it''s'"]
    """
    if isinstance(value, bool):
        return exp.Boolean(this=value)
    if isinstance(value, int | float):
        return exp.Literal.number(repr(value))
    return exp.Literal.string(str(value))


# -- the column store's build (dpsql.engine.columnar) and the engines' probes ---------------


def unnest_parameter(type_name: str | exp.DataType, number: int | None = None) -> exp.Explode:
    """``UNNEST(CAST(? AS type[]))`` (``$number`` when given): one column of rows from a list
    parameter, so values reach DuckDB as parameters, never as text. ``type_name``: a plain
    type's name, or a type node (a released column's ``DECIMAL(18,3)``)."""
    element = type_name.copy() if isinstance(type_name, exp.DataType) else sql_type(type_name)
    array = exp.DataType(this=exp.DataType.Type.ARRAY, expressions=[element])
    slot = exp.Placeholder() if number is None else exp.Placeholder(this=str(number))
    return exp.Explode(this=exp.Cast(this=slot, to=array))


def is_null(value: exp.Expression) -> exp.Is:
    """``value IS NULL``."""
    return exp.Is(this=value, expression=exp.Null())


def not_null(value: exp.Expression) -> exp.Not:
    """``value IS NOT NULL`` (sqlglot's tree of it: ``NOT value IS NULL``, the same test)."""
    return exp.Not(this=is_null(value))


def date_literal(day: str) -> exp.Cast:
    """A date constant, ``DATE 'yyyy-mm-dd'`` (sqlglot's tree of it: a cast of the text).

    >>> date_literal("1970-01-01").sql("duckdb")
    "CAST('1970-01-01' AS DATE)"
    """
    return cast(exp.Literal.string(day), "DATE")


def day_number(value: exp.Expression, infinity: int) -> exp.Cast:
    """A DuckDB date as its day number since 1970-01-01 (BIGINT), its 'infinity' and
    '-infinity' as +-``infinity`` (dpsql.engine.columnar: what the column store holds)."""
    epoch = date_literal("1970-01-01")
    sign = exp.Case(
        ifs=[exp.If(this=exp.GT(this=value.copy(), expression=epoch), true=number(infinity))],
        default=number(-infinity),
    )
    days = exp.Case(
        ifs=[exp.If(this=exp.IsInf(this=value.copy()), true=exp.Paren(this=sign))],
        default=exp.Sub(this=value.copy(), expression=epoch.copy()),
    )
    return cast(days, "BIGINT")


def distinct_values(value: exp.Expression, source: exp.Expression, name: str) -> exp.Select:
    """``SELECT DISTINCT value AS name FROM source WHERE value IS NOT NULL``."""
    return select([alias(value, name)], source, where=[not_null(value.copy())], distinct=True)


def numbered(values: exp.Select, name: str, code: str) -> exp.Select:
    """``SELECT name, CAST(ROW_NUMBER() OVER (ORDER BY name) - 1 AS BIGINT) AS code FROM
    (values)``: each distinct value numbered from 0 in its sorted order."""
    value = exp.column(name)
    rank = exp.Window(
        this=exp.RowNumber(),
        order=exp.Order(expressions=[exp.Ordered(this=value.copy(), nulls_first=False)]),
        over="OVER",
    )
    first = cast(exp.Sub(this=rank, expression=number(1)), "BIGINT")
    return select([value, alias(first, code)], subquery(values, None))


def create_temp_table_as(target: exp.Table, query: exp.Expression) -> exp.Create:
    """``CREATE OR REPLACE TEMPORARY TABLE target AS query`` (the connection's own, gone
    with it).

    >>> create_temp_table_as(table_ref("t"), select([star()], table_ref("s"))).sql("duckdb")
    'CREATE OR REPLACE TEMPORARY TABLE t AS SELECT * FROM s'
    """
    properties = exp.Properties(expressions=[exp.TemporaryProperty()])
    return exp.Create(
        this=target, kind="TABLE", replace=True, expression=query, properties=properties
    )


def drop_table(target: exp.Table) -> exp.Drop:
    """``DROP TABLE IF EXISTS target``."""
    return exp.Drop(tables=[target], kind="TABLE", exists=True)
