"""The bound statements: what the binder (dpsql.frontend.bind) emits and everything below reads.

A DP query is a tree of frozen nodes, ``DPQuery(GroupBy(Compute(Where(Read))))``: each node
carries what is known of it once bound (a Where's conjuncts their totality, a Compute's
columns their types and value ranges, a GroupBy's keys their types), computed once.

The Read holds the policy table as this query reads it (its joined steps included), the Where
the filter, the Compute the computed columns, the GroupBy the keys and the aggregate calls, and
the root the post-processing over the released table; the other statements (a table
function's call, a composite or released-table query, SET/SHOW, EXPLAIN, BEGIN/COMMIT) are
values too. This
module also holds the vocabulary the binder accepts (the scalar nodes, the post-processing
windows and error-bar functions) because the compiler and the scratch engine read it.

It imports no binder, and of the front end only its AND splitter (dpsql.frontend.logic, for the
WHERE's conjuncts), so every layer below the binder can name the statement types without
reaching back up (tests/test_layering.py).
"""

from __future__ import annotations

import datetime as dt
import functools
import threading
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.helper import name_sequence

from dpsql.aggregates import FUNCTIONS, KINDS
from dpsql.errors import Position, ProgrammingError
from dpsql.frontend.logic import conjuncts
from dpsql.frontend.safety import COMPARISON_NODES, cannot_fail
from dpsql.policy import ColumnPolicy, TablePolicy

# One instance: ``.sql(dialect="duckdb")`` looks the name up and builds a Dialect each call
# (a few microseconds, dozens of times in planning one statement).
DIALECT = Dialect.get_or_raise("duckdb")

_GENERATOR = threading.local()


def duckdb_sql(node: exp.Expr, *, copy: bool = True) -> str:
    """``node.sql(dialect=DIALECT)``: the same text, from this thread's one DuckDB generator.
    ``.sql`` builds a Generator (its dialect's settings and dispatch) for every call, which
    cost more than rendering a key or a condition; a generator resets its state as each
    ``generate`` starts, but for the names it gives unnamed table aliases, reset here.
    ``copy=False`` only for a tree nothing else reads (the generator may rewrite it)."""
    generator = getattr(_GENERATOR, "duckdb", None)
    if generator is None:
        generator = _GENERATOR.duckdb = DIALECT.generator()
    generator._next_name = name_sequence("_t")
    return generator.generate(node, copy=copy)


# The table post-processing reads: the released values only (dpsql.engine.scratch).
RELEASED = "__released"

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
        modules below the planner that take the call (dpsql.service.bounds, which asks the
        kind's object its other attributes, and dpsql.service.bias_notes)."""
        return KINDS[self.kind].summed


@dataclass(frozen=True)
class GroupKey:
    """A GROUP BY key: a validated expression over the table's columns."""

    expr: exp.Expression
    columns: tuple[str, ...]
    position: Position | None = field(default=None, compare=False)  # in the analyst's text
    type: str | None = None  # its DuckDB type, set by dpsql.frontend.typecheck before planning
    # The values a top-level ``WHERE key IN (...)`` / ``key = ...`` allows: a public key set
    # from the query text (None: no such restriction). See dpsql.plan.domains.key_domain.
    allowed: tuple[Any, ...] | None = None
    # Top-level WHERE conjuncts over the key's columns only (copies of the WHERE's trees, which
    # dpsql.lower.domain_query lowers under TRY): a value failing one never has rows, so its
    # bin is not released (``WHERE age < 5 GROUP BY age``: 5 bins, not 91).
    conditions: tuple[exp.Expression, ...] = ()

    @functools.cached_property
    def sql(self) -> str:
        """The key's DuckDB text (rendered once: it keys caches, domains and the fingerprint)."""
        return duckdb_sql(self.expr)


@dataclass(frozen=True)
class Read:
    """Leaf: read the policy table as this query reads it (its declared columns; a joined
    source's steps, public joins ON unique keys and per-unit relations, inside
    ``table.joined``). Neighbouring datasets differ by one unit with all of its rows."""

    table: TablePolicy
    # Public tables joined on a unique key (dpsql.frontend.joins), as EXPLAIN shows them:
    # already inlined into the nodes above, 1-stable (dpsql.plan.relational.PublicJoin).
    joins: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Where:
    """Keep the rows ``condition`` accepts: columns named as the table declares them
    (normalised by the binder's scope), literals checked against their columns' types."""

    input: Read
    condition: exp.Expression

    @functools.cached_property
    def conjuncts(self) -> tuple[Conjunct, ...]:
        """The top-level conjuncts, each with its totality, computed once per node: one that
        cannot fail on any row of the read table (dpsql.frontend.safety.cannot_fail) runs bare, the
        others under TRY, so an error can never reveal that a row exists."""
        table = self.input.table
        return tuple(Conjunct(c, cannot_fail(c, table)) for c in conjuncts(self.condition))


@dataclass(frozen=True)
class Conjunct:
    """One top-level AND operand of a WHERE and whether it is total (never raises)."""

    expr: exp.Expression
    total: bool


@dataclass(frozen=True)
class Compute:
    """The computed columns the aggregates read (``SUM(a * b)``, a derived table's column):
    each a column of the table with its SQL (``expr``), its type and its value range
    (``lower``/``upper``, by interval arithmetic in the binder or clipped by the planner)."""

    input: Read | Where
    columns: tuple[ColumnPolicy, ...]


@dataclass(frozen=True)
class GroupBy:
    """The GROUP BY keys and the aggregate calls over the rows below: what is measured.
    Planning annotates it (bounding, measures, mechanisms: dpsql.plan.planner)."""

    input: Read | Where | Compute
    keys: tuple[GroupKey, ...]
    calls: tuple[AggregateCall, ...]


Relation = Read | Where | Compute | GroupBy


def _rows(
    read: Read, where: exp.Expression | None, computed: tuple[ColumnPolicy, ...]
) -> Read | Where | Compute:
    """The rows a GroupBy reads: ``Compute(Where(Read))``, each node only when present."""
    filtered: Read | Where = read if where is None else Where(read, where)
    return Compute(filtered, computed) if computed else filtered


_N = TypeVar("_N", Read, Where, Compute, GroupBy)


@dataclass(frozen=True)
class DPQuery:
    """A validated DP query, as the tree the binder emits: ``GroupBy(Compute(Where(Read)))``
    (the optional nodes present only when the query has them), with the post-processing
    over the released table on top (``post`` reads table __released, columns k0.., a0..).

    The flat views (``table``, ``where``, ``keys``, ``aggregates``, ``joins``) are read off
    the nodes; the ``with_*`` methods rebuild the tree with one part changed. ``table`` is the
    read table with the computed columns added, as the lowerings address columns by name."""

    text: str
    input: GroupBy
    post: exp.Select

    @classmethod
    def build(
        cls,
        text: str,
        table: TablePolicy,
        where: exp.Expression | None,
        keys: tuple[GroupKey, ...],
        aggregates: tuple[AggregateCall, ...],
        post: exp.Select,
        joins: tuple[str, ...] = (),
    ) -> DPQuery:
        """The tree of a query over ``table`` (whose computed columns become a Compute node)."""
        declared = {n: c for n, c in table.columns.items() if c.expr is None}
        computed = tuple(c for c in table.columns.values() if c.expr is not None)
        read = Read(replace(table, columns=declared) if computed else table, joins)
        return cls(
            text, GroupBy(_rows(read, where, computed), tuple(keys), tuple(aggregates)), post
        )

    def nodes(self) -> tuple[Relation, ...]:
        """The relational nodes from the top (GroupBy) down to the Read."""
        return self._nodes

    @functools.cached_property
    def _nodes(self) -> tuple[Relation, ...]:
        """:meth:`nodes`, walked once per query (the views below ask for a node a dozen
        times while one query is planned; the tree is frozen)."""
        out: list[Relation] = []
        node: Relation = self.input
        while True:
            out.append(node)
            if isinstance(node, Read):
                return tuple(out)
            node = node.input

    def node(self, kind: type[_N]) -> _N | None:
        """The node of type ``kind`` in the tree, if the query has one."""
        for n in self._nodes:
            if isinstance(n, kind):
                return n
        return None

    @functools.cached_property
    def read(self) -> Read:
        node = self._nodes[-1]
        assert isinstance(node, Read)  # every chain ends in its Read
        return node

    @functools.cached_property
    def table(self) -> TablePolicy:
        compute = self.node(Compute)
        if compute is None:
            return self.read.table
        extra = {c.name: c for c in compute.columns}
        return replace(self.read.table, columns={**self.read.table.columns, **extra})

    @property
    def where(self) -> exp.Expression | None:
        node = self.node(Where)
        return None if node is None else node.condition

    @property
    def keys(self) -> tuple[GroupKey, ...]:
        return self.input.keys

    @property
    def aggregates(self) -> tuple[AggregateCall, ...]:
        return self.input.calls

    @property
    def joins(self) -> tuple[str, ...]:
        return self.read.joins

    def with_table(self, table: TablePolicy) -> DPQuery:
        """The same query over ``table`` (e.g. with clip ranges the planner chose): its
        computed columns go to the Compute node, the others to the Read."""
        return DPQuery.build(
            self.text, table, self.where, self.keys, self.aggregates, self.post, self.joins
        )

    def with_where(self, where: exp.Expression | None) -> DPQuery:
        """The same query with another WHERE (a text shape's literals, a composite's filter):
        the Read and the Compute's columns are kept as they are (the same objects, so the
        cache keys' memo of the policy table still hits)."""
        compute = self.node(Compute)
        rows = _rows(self.read, where, () if compute is None else compute.columns)
        return replace(self, input=replace(self.input, input=rows))

    def with_keys(self, keys: tuple[GroupKey, ...]) -> DPQuery:
        return replace(self, input=replace(self.input, keys=tuple(keys)))


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
    inner: DPQuery
    outer: DPQuery
    column: str  # a stored column of the outer query's table
    output: str  # the inner query's output column, by name


@dataclass(frozen=True)
class ReleasedQuery:
    """Post-processing over several DP queries' released tables (dpsql.frontend.released):
    ``post`` reads ``__m0..`` (measurement i's released result, its columns as it names
    them) and nothing else; ``names`` say where each measurement was written."""

    text: str
    measurements: tuple[DPQuery, ...]
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
    query: DPQuery | RuleListCall | CompositeQuery | ReleasedQuery
    format: str = "table"  # EXPLAIN (FORMAT TEXT): one readable column (dpsql.service.explain)


@dataclass(frozen=True)
class TransactionStatement:
    """BEGIN / COMMIT / ROLLBACK: accepted as no-ops (dpsql is read-only)."""

    kind: str


Statement = (
    DPQuery
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
