"""The bound statements: what the binder (dpsql.sql.bind) emits and everything below reads.

A bound query is a frozen value: the policy table as this query reads it (its joined steps and
computed columns included), the WHERE, the GROUP BY keys, the aggregate calls and the
post-processing over the released table; the other statements (a table function's call, a
composite or released-table query, SET/SHOW, EXPLAIN, BEGIN/COMMIT) are values too. This
module also holds the vocabulary the binder accepts (the scalar nodes, the post-processing
windows and error-bar functions) because the compiler and the scratch engine read it.

It imports no binder and no frontend module, so every layer below the binder can name the
statement types without reaching back up (tests/test_layering.py).
"""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass, field
from typing import Any

from sqlglot import exp

from dpsql.aggregates import FUNCTIONS, KINDS
from dpsql.errors import Position, ProgrammingError
from dpsql.policy import TablePolicy

DIALECT = "duckdb"

# The table post-processing reads: the released values only (dpsql.engine.scratch).
RELEASED = "__released"

COMPARISON_NODES: tuple[type[exp.Expression], ...] = (
    exp.EQ,
    exp.NEQ,
    exp.GT,
    exp.GTE,
    exp.LT,
    exp.LTE,
    exp.NullSafeEQ,
    exp.NullSafeNEQ,
)

# Deterministic scalar constructs allowed in WHERE, GROUP BY and post-processing.
SCALAR_NODES: tuple[type[exp.Expression], ...] = (
    exp.Column,
    exp.Identifier,
    exp.Literal,
    exp.Boolean,
    exp.Null,
    exp.Paren,
    exp.Neg,
    exp.Not,
    exp.And,
    exp.Or,
    *COMPARISON_NODES,
    exp.Is,
    exp.In,
    exp.Between,
    exp.Like,
    exp.ILike,
    exp.Add,
    exp.Sub,
    exp.Mul,
    exp.Div,
    exp.IntDiv,
    exp.Mod,
    exp.Case,
    exp.If,
    exp.Cast,
    exp.TryCast,
    exp.DataType,
    exp.Coalesce,
    exp.Abs,
    exp.Floor,
    exp.Ceil,
    exp.Round,
    exp.Lower,
    exp.Upper,
    exp.Length,
    exp.Substring,
    exp.Trim,
    exp.Concat,
    exp.DPipe,
    exp.Year,
    exp.Month,
    exp.Day,
    exp.Extract,
    exp.Var,
    exp.Greatest,
    exp.Least,
    exp.TimestampTrunc,
    exp.DateTrunc,
    exp.Sqrt,
    exp.Ln,
    exp.Log,
    exp.Exp,
    exp.Pow,
    exp.Sign,
    exp.Tuple,
    exp.Nullif,
    exp.DataTypeParam,
    exp.Quarter,
    exp.DayOfWeek,
    exp.Left,  # LEFT / RIGHT / INITCAP: PostgreSQL's names, DuckDB's functions (run under TRY)
    exp.Right,
    exp.Initcap,
    exp.Interval,  # INTERVAL 1 DAY: Metabase's shifted weeks (d + INTERVAL 1 DAY)
    exp.TimeToStr,  # strftime(d, '%Y-%m'): its format is a constant (DuckDB binds it)
)

# The analyst's aggregate functions and the kinds they bind to: each kind's object declares
# its own (dpsql.aggregates.FUNCTIONS), as it declares everything else about it.
AGGREGATE_KINDS: dict[type[exp.Expr], str] = FUNCTIONS


# Post-processing functions that read a released value's 95% noise interval.
ERROR_BAR_FUNCTIONS = ("dp_interval_low", "dp_interval_high", "dp_suppression_probability")

# Window functions post-processing may call ``OVER (...)`` the released rows of a DP query
# (running totals, percent of total, ranks): their arguments, PARTITION BY and ORDER BY are
# expressions over released aggregates and GROUP BY keys, never over private rows.
POST_WINDOW_FUNCTIONS: tuple[type[exp.Func], ...] = (
    exp.Sum,
    exp.Avg,
    exp.Min,
    exp.Max,
    exp.Count,
    exp.Rank,
    exp.DenseRank,
    exp.RowNumber,
    exp.PercentRank,
    exp.CumeDist,
    exp.Ntile,
    exp.Lag,
    exp.Lead,
    exp.FirstValue,
    exp.LastValue,
)


@dataclass(frozen=True)
class AggregateCall:
    """One aggregate the analyst asked for, e.g. SUM(cost). ``column`` is None for COUNT(*);
    for an expression (SUM(a * b)) it names a computed column of the bound table, and
    ``shown`` is the expression as the analyst wrote it."""

    # count | count_units | count_distinct (COUNT(DISTINCT col), col not the unit) | sum | avg
    # | sum_distinct (SUM(DISTINCT col))
    # | var_samp | var_pop | stddev_samp | stddev_pop
    # | median | percentile_cont | percentile_disc | min | max | mode (MODE(col), public domain)
    # (each kind's object: dpsql.aggregates.KINDS)
    kind: str
    column: str | None
    shown: str | None = field(default=None, compare=False)
    level: float | None = None  # PERCENTILE_CONT/DISC: the quantile level in [0, 1]

    @property
    def label(self) -> str:
        return KINDS[self.kind].label(self)  # each kind shows itself (dpsql.aggregates)

    @property
    def summed(self) -> bool:
        """Whether its kind sums the column's values (SUM, AVG, VAR, STDDEV: automatic
        clipping and the default clamp apply), as the kind's object declares it; read by
        modules below the planner (dpsql.service.bounds, dpsql.service.bias_notes), which
        take the call and import no kind."""
        return KINDS[self.kind].summed


@dataclass(frozen=True)
class GroupKey:
    """A GROUP BY key: a validated expression over the table's columns."""

    expr: exp.Expression
    columns: tuple[str, ...]
    position: Position | None = field(default=None, compare=False)  # in the analyst's text
    type: str | None = None  # its DuckDB type, set by dpsql.sql.typecheck before planning
    # The values a top-level ``WHERE key IN (...)`` / ``key = ...`` allows: a public key set
    # from the query text (None: no such restriction). See dpsql.sql.domains.key_domain.
    allowed: tuple[Any, ...] | None = None
    # Top-level WHERE conjuncts over the key's columns only (SQL): a value failing one never
    # has rows, so its bin is not released (``WHERE age < 5 GROUP BY age``: 5 bins, not 91).
    conditions: tuple[str, ...] = ()

    @functools.cached_property
    def sql(self) -> str:
        """The key's DuckDB text (rendered once: it keys caches, domains and the fingerprint)."""
        return self.expr.sql(dialect=DIALECT)


@dataclass(frozen=True)
class BoundQuery:
    """A validated DP query: one table, a filter, keys, aggregates, and post-processing."""

    text: str
    table: TablePolicy
    where: exp.Expression | None
    keys: tuple[GroupKey, ...]
    aggregates: tuple[AggregateCall, ...]
    post: exp.Select  # over table __released with columns k0.., a0..
    # Public tables joined on a unique key (dpsql.frontend.joins), as EXPLAIN shows them:
    # already inlined into where/keys/aggregates, 1-stable (dpsql.ir.relational.PublicJoin).
    joins: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class PublicSelect:
    """A SELECT that reads no table (e.g. ``SELECT 1``): evaluated without private data."""

    text: str
    post: exp.Select


@dataclass(frozen=True)
class RuleListCall:
    """``SELECT … FROM dp_rule_list('table', label => …, …)`` or another DP table function
    (:mod:`dpsql.table_functions` names them and their result columns)."""

    text: str
    table: TablePolicy
    arguments: dict[str, Any]
    post: exp.Select  # over table __released with the function's result columns
    function: str = "dp_rule_list"


@dataclass(frozen=True)
class CompositeQuery:
    """A DP query whose rows are filtered by another DP query's released values
    (dpsql.frontend.compose): ``outer`` keeps rows with ``column IN released(inner, output)``."""

    text: str
    inner: BoundQuery
    outer: BoundQuery
    column: str  # a stored column of the outer query's table
    output: str  # the inner query's output column, by name


@dataclass(frozen=True)
class ReleasedQuery:
    """Post-processing over several DP queries' released tables (dpsql.frontend.released):
    ``post`` reads ``__m0..`` (measurement i's released result, its columns as it names
    them) and nothing else; ``names`` say where each measurement was written."""

    text: str
    measurements: tuple[BoundQuery, ...]
    names: tuple[str, ...]
    post: exp.Query
    operations: tuple[str, ...] = ()


@dataclass(frozen=True)
class SettingStatement:
    action: str  # set | reset | show
    name: str
    value: Any = None


@dataclass(frozen=True)
class ExplainStatement:
    query: BoundQuery | RuleListCall | CompositeQuery | ReleasedQuery
    format: str = "table"  # EXPLAIN (FORMAT TEXT): one readable column (dpsql.service.explain)


@dataclass(frozen=True)
class TransactionStatement:
    """BEGIN / COMMIT / ROLLBACK: accepted as no-ops (dpsql is read-only)."""

    kind: str


Statement = (
    BoundQuery
    | CompositeQuery
    | ReleasedQuery
    | PublicSelect
    | RuleListCall
    | SettingStatement
    | ExplainStatement
    | TransactionStatement
)


def to_literal(value: Any) -> exp.Expression:
    if value is None:
        return exp.Null()
    if isinstance(value, bool):
        return exp.Boolean(this=value)
    if isinstance(value, int | float):
        return exp.Literal.number(value)
    if isinstance(value, dt.datetime):
        return exp.Cast(
            this=exp.Literal.string(value.isoformat()), to=exp.DataType.build("TIMESTAMP")
        )
    if isinstance(value, dt.date):
        return exp.Cast(this=exp.Literal.string(value.isoformat()), to=exp.DataType.build("DATE"))
    if isinstance(value, str):
        return exp.Literal.string(value)
    raise ProgrammingError(
        f"unsupported parameter type {type(value).__name__}",
        construct="parameter",
        hint="pass int, float, str, bool, date or None",
    )
