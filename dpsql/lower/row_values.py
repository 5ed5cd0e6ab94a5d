"""One row's values in engine SQL, as the policy declares them: a column's value (a computed
column under TRY), clamped, as the fixed-point integer the sensitivity assumes, and whether it
lies in the column's declared domain; with the small node builders they need.

Below both the compiler (dpsql.lower.compile, which re-exports these under its old names) and
the prepared store's build (dpsql.engine.prepared), so neither imports the other for them.
Depends on the policy only: no plan, no data.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from dpsql.frontend.statements import to_literal
from dpsql.policy import SQL_TYPES, ColumnPolicy


def internal_name(name: str, table: str | None = None) -> exp.Column:
    """An internal column (``__u``, ``k0``, ``b.__u``): dpsql's own names, never quoted."""
    column = exp.Column(this=exp.Identifier(this=name, quoted=False))
    if table is not None:
        column.set("table", exp.Identifier(this=table, quoted=False))
    return column


def quoted(name: str) -> exp.Column:
    """A policy column by its quoted name (any name the policy declares is safe to run)."""
    return exp.Column(this=exp.Identifier(this=name, quoted=True))


def number(value: int | float) -> exp.Expression:
    """A numeric literal spelled as Python prints it (``repr`` keeps every digit of a float)."""
    return exp.Literal.number(repr(value) if isinstance(value, float) else value)


def sql_type(name: str) -> exp.DataType:
    """A plain type node (DataType.build would parse the name)."""
    return exp.DataType(this=exp.DataType.Type[name], nested=False)


def cast(node: exp.Expression, to: str) -> exp.Cast:
    """``CAST(node AS to)``: a failing cast errors (callers guard with TRY where it can)."""
    return exp.Cast(this=node, to=sql_type(to))


def column_value(col: ColumnPolicy) -> exp.Expression:
    """A column's value: its quoted name, or for a computed column its expression under TRY
    (a row on which it fails -- an overflow, a bad cast -- gives NULL instead of an error
    that would reveal that such a row exists).

    A computed column carries its expression as a tree (``ColumnPolicy.tree``, the binder's
    node copied when it made the column: dpsql.frontend.bind.calls); each use places a copy
    of it, never its rendering parsed back.
    """
    if col.expr is not None:
        assert isinstance(col.tree, exp.Expression), "a computed column carries its tree"
        return exp.Try(this=col.tree.copy())
    return quoted(col.name)


def clamp(x: exp.Expression, lower: int | float, upper: int | float) -> exp.Case:
    """clamp(x) to [lower, upper]; NULL stays NULL, NaN goes to ``upper`` (DuckDB orders NaN
    above every number). A CASE, not LEAST(GREATEST(...)): in DuckDB it is ~2x cheaper."""
    return exp.Case(
        ifs=[
            exp.If(this=exp.LT(this=x, expression=number(lower)), true=number(lower)),
            exp.If(this=exp.GT(this=x.copy(), expression=number(upper)), true=number(upper)),
        ],
        default=x.copy(),
    )


def fixed_point_expr(col: ColumnPolicy, lo: int, hi: int) -> exp.Expression:
    """One row's integer: round(x / g) within the plan's [lo, hi], as BIGINT (NULL for NULL).

    ``x / g`` is clamped to the integers lo and hi *before* ROUND, and any rounding rule is
    monotone and leaves integers alone, so the result lies in [lo, hi] whatever the engine's
    tie rule (DuckDB and Spark round half away from zero; the planner's ties go inward, see
    :func:`dpsql.plan.fixed_point.fixed_point_bounds`): one unit moves each row's value by no more
    than the sensitivity assumes. One clamp costs what clamping x did; a second on the BIGINT
    would cost ~40% more per value. Past 2^53 a bound is not exact as a DOUBLE: there the
    BIGINT is clamped too.
    """
    c = column_value(col)
    if col.type == "int" and col.granularity == 1:
        return cast(clamp(c, lo, hi), "BIGINT")
    quotient = exp.Div(
        this=cast(c, "DOUBLE"), expression=number(col.granularity), typed=False, safe=False
    )
    value: exp.Expression = cast(exp.Round(this=clamp(quotient, lo, hi)), "BIGINT")
    if max(abs(lo), abs(hi)) > 2**53:
        value = clamp(value, lo, hi)
    return value


def fixed_point_value(col: ColumnPolicy, lo: int, hi: int) -> str:
    """DuckDB text of :func:`fixed_point_expr`, for tests that evaluate it on their own rows."""
    return fixed_point_expr(col, lo, hi).sql(dialect="duckdb")


_DOMAIN_CACHE: dict[tuple[ColumnPolicy, str | None], exp.Expression] = {}


def domain_condition(col: ColumnPolicy, target: str | None = None) -> exp.Expression:
    """``target`` (an internal column, or by default the column itself) lies in ``col``'s
    declared domain. Depends on the policy only: built once, copied per use."""
    cache_key = (col, target)
    cond = _DOMAIN_CACHE.get(cache_key)
    if cond is None:
        cond = _build_domain_condition(
            col, lambda: column_value(col) if target is None else internal_name(target)
        )
        if len(_DOMAIN_CACHE) < 4096:
            _DOMAIN_CACHE[cache_key] = cond
    return cond.copy()


def _build_domain_condition(
    col: ColumnPolicy, target: Callable[[], exp.Expression]
) -> exp.Expression:
    """IN (declared values), BETWEEN (declared bounds or days) or IS NOT NULL, OR IS NULL if
    nullable."""
    cond: exp.Expression
    if col.values is not None:
        items = [exp.cast(to_literal(v), SQL_TYPES[col.type]) for v in col.values]
        cond = exp.In(this=target(), expressions=items)
    elif col.numeric and col.bounded:
        assert col.lower is not None and col.upper is not None  # what bounded means
        cond = exp.Between(this=target(), low=number(col.lower), high=number(col.upper))
    elif col.date_range is not None:  # a date column's declared days, as an int's bounds
        first, last = (exp.cast(exp.Literal.string(d.isoformat()), "DATE") for d in col.date_range)
        cond = exp.Between(this=target(), low=first, high=last)
    else:
        cond = exp.Not(this=exp.Is(this=target(), expression=exp.Null()))
    if col.nullable:
        cond = exp.Paren(
            this=exp.Or(this=cond, expression=exp.Is(this=target(), expression=exp.Null()))
        )
    return cond
