"""Aggregate calls: COUNT, SUM, AVG, ... of a column or an expression, bound to their kinds.

:class:`AggregateBinder` binds each aggregate of one SELECT to an :class:`AggregateCall`
(its kind from dpsql.aggregates, which also says what it can aggregate), and gives each
aggregated expression a computed column whose range comes from interval arithmetic over the
declared bounds (dpsql.frontend.intervals), one per distinct expression.
"""

from __future__ import annotations

import math

from sqlglot import exp

from dpsql.aggregates import KINDS
from dpsql.frontend.bind.scope import Scope
from dpsql.frontend.intervals import NotNumeric, Range, value_range
from dpsql.frontend.positions import snippet, written_name
from dpsql.frontend.statements import (
    AGGREGATE_KINDS,
    AggregateCall,
    duckdb_sql,
)
from dpsql.policy import ColumnPolicy, default_granularity


class AggregateBinder:
    """The aggregate calls of one SELECT in ``scope``, and their computed columns."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        # computed columns of aggregated expressions, by their SQL (see _computed_column)
        self.computed: dict[str, ColumnPolicy] = {}

    def aggregate(self, node: exp.AggFunc, aggregates: list[AggregateCall]) -> AggregateCall:
        assert self.scope.table is not None
        kind = AGGREGATE_KINDS.get(type(node))
        if kind is None:
            name = written_name(node)  # as written: string_agg, not sqlglot's LISTAGG
            raise self.scope.refuse(
                f"aggregate {name} is not supported",
                node,
                "use COUNT, SUM, AVG, VARIANCE, STDDEV, MEDIAN, PERCENTILE_CONT/DISC, "
                "QUANTILE_CONT/DISC, MIN, MAX or MODE",
            )
        the = KINDS[kind]  # what differs between kinds (dpsql.aggregates: the binder's part)
        level = None
        if the.leveled:  # PERCENTILE_CONT/DISC: the level the call states
            level = self._quantile_level(node)
        arg = node.this
        distinct = isinstance(arg, exp.Distinct)
        if distinct:
            inner = arg.expressions
            if len(inner) != 1 or not isinstance(inner[0], exp.Column):
                raise self.scope.refuse(
                    "DISTINCT takes one column", node, "COUNT(DISTINCT <privacy unit>)"
                )
            arg = inner[0]
        # COUNT(1), COUNT('x'), COUNT(true): a non-NULL constant counts rows, like COUNT(*)
        constant = isinstance(arg, exp.Literal | exp.Boolean)
        if the.counts and (arg is None or isinstance(arg, exp.Star) or constant):
            if distinct:
                raise self.scope.refuse("COUNT(DISTINCT *) is not supported", node, "COUNT(*)")
            return AggregateCall(kind, None)
        # a second argument: COUNT(a, b), DuckDB's MIN(x, n) / MAX(x, n) (sqlglot's ``count``)
        if len(node.expressions) > 0 or node.args.get("count"):
            raise self.scope.refuse(
                f"{kind.upper()} takes one argument",
                node,
                f"{kind.upper()}(column) or {kind.upper()}(expression)",
            )
        if not isinstance(arg, exp.Column):
            if distinct:
                raise self.scope.refuse(
                    "DISTINCT takes one column", node, "COUNT(DISTINCT <privacy unit>)"
                )
            if not the.takes_expressions:
                raise self.scope.refuse(
                    f"{kind.upper()} takes a column, not an expression",
                    node,
                    f"{kind.upper()}(column) of a column with a public domain",
                )
            return self._expression_aggregate(kind, node, arg, level)
        column = self.scope.column_name(arg)
        spec = self.scope.table.columns[column]
        if distinct and the.distinct is None:
            raise self.scope.refuse(
                f"{snippet(node)}: DISTINCT is only supported in COUNT(DISTINCT column)"
                " and SUM(DISTINCT column)",
                node,
                f"{kind.upper()}({column}), or COUNT(DISTINCT {column})",
            )
        if the.counts:  # of any column, the privacy unit's too: no range, no column problem
            if not distinct:
                return AggregateCall(kind, column)
            if column == self.scope.table.privacy_unit and the.distinct_unit is not None:
                return AggregateCall(the.distinct_unit, column)
            return AggregateCall(the.distinct, column)  # type: ignore[arg-type]
        if column == self.scope.table.privacy_unit:
            raise self.scope.refuse(
                f"{kind.upper()} of the privacy unit is meaningless",
                node,
                f"COUNT(DISTINCT {column}) counts units",
            )
        problem = the.column_problem(kind.upper(), spec, self.scope.table.name)
        if problem is not None:  # each kind says what it can aggregate (dpsql.aggregates)
            raise self.scope.refuse(problem[0], node, problem[1])
        if distinct:  # SUM(DISTINCT x): the distinct fixed-point values of x (bounded rows)
            return AggregateCall(the.distinct, column)  # type: ignore[arg-type]
        return AggregateCall(kind, column, level=level)

    def _quantile_level(self, node: exp.AggFunc) -> float:
        """The level of PERCENTILE_CONT/DISC or QUANTILE_CONT/DISC: a literal number in [0, 1]
        (public, from the query text); an array of levels is refused (one call per level)."""
        name = "PERCENTILE_CONT" if isinstance(node, exp.PercentileCont) else "PERCENTILE_DISC"
        level = node.args.get("expression")
        if level is None:
            raise self.scope.refuse(
                f"{name}(q) needs the column it orders",
                node,
                f"{name}(0.5) WITHIN GROUP (ORDER BY column), or QUANTILE_CONT(column, 0.5)",
            )
        if isinstance(level, exp.Array):
            raise self.scope.refuse(
                f"{name} with an array of levels is not supported",
                node,
                f"write one {name} per level: the levels of a column are released jointly",
            )
        text = level.this if isinstance(level, exp.Literal) and not level.is_string else None
        try:
            value = float(text) if text is not None else math.nan
        except ValueError:
            value = math.nan
        if not 0 <= value <= 1:
            raise self.scope.refuse(
                f"{name}: the level must be a number from 0 to 1",
                level,
                f"e.g. {name}(0.9) WITHIN GROUP (ORDER BY column)",
            )
        return value

    def _expression_aggregate(
        self, kind: str, node: exp.AggFunc, arg: exp.Expression, level: float | None = None
    ) -> AggregateCall:
        """SUM(a * b), AVG(LEAST(GREATEST(x, 50), 100)), COUNT(CASE WHEN ... END): an
        aggregate of a computed column whose range comes from interval arithmetic over the
        declared bounds (dpsql.frontend.intervals). COUNT needs no range."""
        assert self.scope.table is not None
        self.scope.check_scalar(arg, f"{kind.upper()}(...)")
        self.scope.check_literal_types(arg)
        expr = self.scope.normalise_columns(arg)
        shown = snippet(arg)
        if KINDS[kind].counts:  # COUNT needs no range
            return AggregateCall(kind, self._computed_column(expr, None).name, shown)
        if any(c.name == self.scope.table.privacy_unit for c in expr.find_all(exp.Column)):
            raise self.scope.refuse(
                f"{kind.upper()} of an expression of the privacy unit is not allowed",
                node,
                f"COUNT(DISTINCT {self.scope.table.privacy_unit}) counts units",
            )
        try:
            found = value_range(expr, self.scope.table)
        except NotNumeric as exc:
            raise self.scope.refuse(
                f"{kind.upper()}({shown}): {snippet(exc.node)} — {exc.why}",
                node,
                f"{kind.upper()} a number: a bounded column or an arithmetic expression of them",
            ) from None
        if not found.finite:
            lacking = ", ".join(found.unbounded) or "a bound"
            raise self.scope.refuse(
                f"{kind.upper()}({shown}) is unbounded: it needs a bound on {lacking}",
                node,
                "declare lower and upper for the columns it uses in the policy, or clamp "
                "per query: LEAST(GREATEST(expr, low), high)",
            )
        return AggregateCall(kind, self._computed_column(expr, found).name, shown, level)

    def _computed_column(self, expr: exp.Expression, found: Range | None) -> ColumnPolicy:
        """The computed column for ``expr`` (one per distinct expression in the query): its
        rendering (``expr``, for the cache keys and EXPLAIN) and a copy of its tree, which the
        lowerings read (never the rendering parsed back)."""
        assert self.scope.table is not None
        sql = duckdb_sql(expr)
        known = self.computed.get(sql)
        if known is not None and (found is None or known.bounded):
            return known
        name = known.name if known is not None else f"__e{len(self.computed)}"
        if found is None:
            column = ColumnPolicy(
                name=name, type="float", nullable=True, expr=sql, tree=expr.copy()
            )
        else:
            lower, upper = (found.lower, found.upper) if found.lower <= found.upper else (0, 0)
            floats = [
                self.scope.table.columns[c.name].granularity
                for c in expr.find_all(exp.Column)
                if self.scope.table.columns[c.name].type == "float"
            ]
            integral = found.integral
            granularity = 1.0 if integral else (min(floats) if floats else None)
            if granularity is None:
                granularity = default_granularity("float", lower, upper)
            column = ColumnPolicy(
                name=name,
                type="int" if integral else "float",
                lower=float(lower),
                upper=float(upper),
                nullable=True,
                granularity=granularity,
                expr=sql,
                tree=expr.copy(),
            )
        self.computed[sql] = column
        return column
