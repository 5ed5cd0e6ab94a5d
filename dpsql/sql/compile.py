"""Plan -> engine SQL computing exact, contribution-bounded, clamped, fixed-point aggregates.

The compiled query is a sqlglot tree built once per plan from small node builders (no SQL is
written as text here); each engine renders it in its dialect, once per statement. The only
engine-specific construct is ``DP_KEYED_HASH(..., secret)`` (a :func:`keyed_hash` call: HASH
in DuckDB, XXHASH64 in Spark), a keyed hash used to choose which rows and groups a unit keeps,
with a fresh secret per query (never the engine's RANDOM(): selection must be a function of
the unit's own rows only, and unpredictable). The secret is a :func:`secret_slot` call: each run
prints its own where that node stands, without building or rendering the tree again.

Bounding with a privacy unit (R rows per group, G groups per unit):

1. ``base``     one row per (unit, group): its row count and partial aggregates over all its
                rows, straight from the table (no per-row CTE: no hash, no copy of the rows);
                bare-column keys are filtered to their public domain here, on the pairs;
2. ``sampled``  (bounding = "sample") only (unit, group) pairs over R rows re-read their rows
                (a semi join on the pair, NULL keys matching NULL) and keep the R of smallest
                keyed hash of the whole row -- the hash and the row_number() window run on
                those rows only;
3. ``bounded``  base where within R, plus the sampled pairs; with bounding = "scale" every
                pair of ``base`` rescaled to R rows instead (:func:`rescaled`: no row is
                re-read, no window over rows);
4. ``ranked``   (GROUP BY only, and only when G is below the number of public bins) each unit
                keeps its G pairs of smallest keyed hash of the key (one window over the pairs);
5. the final GROUP BY keys summing the bounded partials.

A row_number() window over every row costs ~50x the plain query at 10 rows per unit; see
docs/performance.md for the measured figures of this plan.

Row-level tables (every row its own unit) need no bounding: one scan and one GROUP BY.
Plans whose measures are only row and unit counts skip the sampling step: any R of a pair's
n rows count min(n, R), so each pair is capped at min(n, R) directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import sqlglot
from sqlglot import exp

from dpsql.aggregates.mode import ModeMeasure
from dpsql.policy import ColumnPolicy, TablePolicy, declared_type
from dpsql.privacy.clipping import LogHistogram
from dpsql.sql import fold
from dpsql.sql.clamp_spec import ClampHistogram
from dpsql.sql.hashing import (
    KEYED_HASH,
    SECRET,
    is_keyed_hash,
    is_secret,
    keyed_hash,
    secret_slot,
)
from dpsql.sql.local_plan import ColumnProgram, column_program
from dpsql.sql.plan import (
    ClipEstimate,
    Measure,
    Plan,
    QuantileMeasure,
    bounds_groups,
    count_scale,
    value_measures,
)
from dpsql.sql.row_values import cast as _cast
from dpsql.sql.row_values import clamp as _clamp
from dpsql.sql.row_values import column_value as _col
from dpsql.sql.row_values import domain_condition as _domain_condition
from dpsql.sql.row_values import fixed_point_expr
from dpsql.sql.row_values import fixed_point_value as fixed_point_value
from dpsql.sql.row_values import internal_name as _name
from dpsql.sql.row_values import number as _number
from dpsql.sql.row_values import quoted as _quoted
from dpsql.sql.row_values import sql_type as _type
from dpsql.sql.safety import guarded_conditions
from dpsql.sql.statements import GroupKey
from dpsql.sql.typecheck import DECIMAL_PATTERN, WIDE_INTEGERS

NEUTRAL = "neutral"  # DuckDB's dialect with the keyed hash spelled DP_KEYED_HASH


# What the rendering prints for a secret slot: the text is kept as the pieces between these,
# joined by each run's secret digits. The analyst's functions never reach a plan unvetted
# (dpsql.sql.bind allows listed functions only), so DP_SECRET() and DP_KEYED_HASH(...) in a
# tree are the compiler's own; a marker found more often than the tree has secrets (inside a
# string literal) makes that query print its secret as a literal instead.
_MARKER = f"{SECRET}()"
_HASHES = {"duckdb": "HASH", "spark": "XXHASH64"}  # NEUTRAL keeps DP_KEYED_HASH
_GENERATORS = {
    NEUTRAL: sqlglot.Dialect.get_or_raise("duckdb"),
    "duckdb": sqlglot.Dialect.get_or_raise("duckdb"),
    "spark": sqlglot.Dialect.get_or_raise("spark"),
}


@dataclass(frozen=True)
class CompiledQuery:
    """Engine query for one plan, as one sqlglot tree; ``key_columns`` and ``measure_columns``
    name the result. The tree holds a :func:`secret_slot` call where this run's ``secret`` goes."""

    # the tree, or None where ``builder`` makes it on first use (shared by the copies)
    built: exp.Expression | None
    key_columns: tuple[str, ...]
    measure_columns: tuple[str, ...]
    secret: int = 0
    # more queries over the same bounded rows: per quantile measure (plan.quantiles, in order)
    # keys, bin b, count c; then per distinct-count measure (plan order) keys, count c
    extras: tuple[CompiledQuery, ...] = ()
    # dialect -> rendered text split at the secret; shared by with_secret() copies
    _pieces: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False, repr=False)
    # (sentinel, literal) text pairs: the tree holds sentinel numbers where this query's own
    # literals go (a shape template, dpsql.service.shape_cache); every rendering swaps them
    swaps: tuple[tuple[str, str], ...] = ()
    # the same aggregate as a column program (dpsql.sql.local_plan), for an engine that holds
    # the table's columns in memory; None: only the SQL computes it
    program: ColumnProgram | None = field(default=None, compare=False, repr=False)
    # a query with a program builds its SQL tree only if an engine needs it (one without
    # the table in memory, a literal the program declines, a rendering for logs and shapes)
    builder: Callable[[], exp.Expression] | None = field(default=None, compare=False, repr=False)
    _tree: dict[str, exp.Expression] = field(default_factory=dict, compare=False, repr=False)
    # a default clamp's histogram (clamp_histogram_query) described as data, for an engine
    # that computes the same counts over its store (dpsql.engine.clamp_pass)
    clamp: ClampHistogram | None = field(default=None, compare=False, repr=False)

    @property
    def expression(self) -> exp.Expression:
        """The engine query's tree (built on first use where the compiler deferred it)."""
        if self.built is not None:
            return self.built
        tree = self._tree.get("tree")
        if tree is None:
            assert self.builder is not None  # compile_plan sets one or the other
            tree = self._tree.setdefault("tree", self.builder())
        return tree

    @property
    def sql(self) -> str:
        """DuckDB text with the keyed hash spelled DP_KEYED_HASH (logs, tests)."""
        return self.render(NEUTRAL)

    def with_secret(self, secret: int) -> CompiledQuery:
        """The same tree (and its renderings) with another run's secret."""
        return replace(
            self, secret=secret, extras=tuple(h.with_secret(secret) for h in self.extras)
        )

    def with_literals(self, swaps: tuple[tuple[str, str], ...]) -> CompiledQuery:
        """This template (its tree holding sentinel numbers) with another statement's literals:
        the renderings done so far are reused, each sentinel swapped for its literal's text."""
        pieces = {d: tuple(_swap(p, swaps) for p in ps) for d, ps in self._pieces.items() if ps}
        extras = tuple(h.with_literals(swaps) for h in self.extras)  # same WHERE, same numbers
        return replace(self, _pieces=pieces, swaps=swaps, secret=0, extras=extras)

    def render(self, dialect: str = "duckdb") -> str:
        """Engine text in ``dialect``: the tree is rendered once per dialect, each run's secret
        printed where the secret slots stand."""
        pieces = self._pieces.get(dialect)
        if pieces is None:
            pieces = _rendered_pieces(self.expression, dialect)
            pieces = tuple(_swap(p, self.swaps) for p in pieces)
            self._pieces[dialect] = pieces
        if not pieces:  # the marker also occurs elsewhere: print the secret as a literal
            tree = self.expression.transform(
                lambda node: exp.Literal.number(self.secret) if is_secret(node) else node
            )
            return _swap(_generate(tree, dialect)[0], self.swaps)
        return str(int(self.secret)).join(pieces)


def _swap(text: str, swaps: tuple[tuple[str, str], ...]) -> str:
    """``text`` with each sentinel replaced by its literal (sentinels are unique digit runs)."""
    for sentinel, literal in swaps:
        text = text.replace(sentinel, literal)
    return text


def _generate(tree: exp.Expr, dialect: str) -> tuple[str, int]:
    """The tree's text in ``dialect`` and how many secret slots it holds.

    DuckDB's generator does not rewrite these trees, so it runs on the tree itself (a copy of
    a 500-node tree costs as much as rendering it) and the keyed hash is renamed in the text
    when its spelling occurs exactly once per node (else on a copy of the tree); Spark renders
    a rewritten copy anyway."""
    if dialect == "spark":
        tree = _spark_safe(tree.transform(_hash_named("spark")))
    text = _GENERATORS[dialect].generate(tree, copy=False, comments=False)
    calls: list[str] = []

    def held(name: str) -> int:
        """How many such calls the tree holds (walked only when the text shows one)."""
        if not calls:
            calls.extend(node.name.upper() for node in tree.find_all(exp.Anonymous))
        return calls.count(name)

    secrets = held(SECRET) if _MARKER in text else 0
    call = f"{KEYED_HASH}("
    if dialect == "duckdb" and call in text:
        if text.count(call) == held(KEYED_HASH):
            text = text.replace(call, f"{_HASHES[dialect]}(")
        else:  # the spelling also stands inside a literal
            renamed = tree.transform(_hash_named(dialect))
            text = _GENERATORS[dialect].generate(renamed, copy=False, comments=False)
    return text, secrets


def _hash_named(dialect: str) -> Callable[[exp.Expression], exp.Expression]:
    """A transform giving the keyed-hash calls the dialect's own hash function's name."""
    name = _HASHES[dialect]

    def rename(node: exp.Expression) -> exp.Expression:
        if is_keyed_hash(node):
            return exp.Anonymous(this=name, expressions=[e.copy() for e in node.expressions])
        return node

    return rename


def _rendered_pieces(tree: exp.Expression, dialect: str) -> tuple[str, ...]:
    """The tree's text cut at each secret slot; () if a marker stands anywhere else."""
    text, secrets = _generate(tree, dialect)
    pieces = tuple(text.split(_MARKER))
    return pieces if len(pieces) == secrets + 1 else ()


def render(expression: exp.Expr, dialect: str) -> str:
    """Engine SQL of any tree in ``dialect`` (``duckdb``, ``spark`` or :data:`NEUTRAL`), the
    keyed hash mapped to the dialect's own fast hash. For trees parsed from text (dpsql.sql.rows
    writes DP_KEYED_HASH(...) as a plain call); the tree itself is left unchanged."""
    return _generate(expression, dialect)[0]


def _spark_safe(expression: exp.Expression) -> exp.Expression:
    """Spark-only rewrites that keep the DuckDB meaning of the compiled query.

    - ``(col)`` becomes ``col``: Spark 4.0 cannot parse ``WHERE (flag)`` (a parenthesised
      boolean column).
    - ``TRY(x)`` becomes ``x``: Spark has no TRY, and the Spark engine runs with ANSI mode off,
      where failing casts and divisions by zero already give NULL instead of an error.
    - ``SELECT * ... QUALIFY w`` gets its star expanded (from the CTEs it reads): sqlglot turns
      QUALIFY into ``SELECT * FROM (SELECT *, w AS _w ...) WHERE _w ...``, whose extra column
      would break a UNION ALL beside it.
    - The outermost SELECT's sums accumulate in DECIMAL(38, 0): Spark's SUM(BIGINT) wraps
      around silently past 2^63 (DuckDB widens to HUGEINT), which sums of squared fixed-point
      values reach within ~10^8 rows; so do the inner sums of a folded plan (dpsql.sql.fold).
    """

    def unparen(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Try):  # transform() does not descend into a replacement
            return node.this.transform(unparen)
        if isinstance(node, exp.Paren) and isinstance(node.this, exp.Column):
            return node.this
        return node

    expression = expression.transform(unparen)
    ctes = {cte.alias: cte.this for cte in expression.find_all(exp.CTE)}
    for select in list(expression.find_all(exp.Select)):
        if select.args.get(exp.Qualify.key) is not None and any(map(_is_star, select.expressions)):
            columns = _output_columns(select, ctes)
            if columns:
                select.set("expressions", [exp.column(c) for c in columns])
    for cast in list(expression.find_all(exp.Cast)):
        if cast.to.this == exp.DataType.Type.INT128:  # Spark has no 128-bit integer
            cast.set("to", _decimal(38, 0))
    outer = expression if isinstance(expression, exp.Select) else None
    if outer is not None:
        for total in [s for item in outer.expressions for s in item.find_all(exp.Sum)]:
            if isinstance(total.this, exp.Distinct):  # SUM(DISTINCT CAST(v AS ...))
                (value,) = total.this.expressions
                value.replace(exp.Cast(this=value.copy(), to=_decimal(38, 0)))
                continue
            total.set("this", exp.Cast(this=total.this, to=_decimal(38, 0)))
    for inner in [q for q in expression.find_all(exp.Subquery) if q.alias == fold.INNER]:
        for total in list(inner.this.find_all(exp.Sum)):  # a folded plan's inner sums too
            total.set("this", exp.Cast(this=total.this, to=_decimal(38, 0)))
    return expression


def _decimal(precision: int, scale: int) -> exp.DataType:
    """``DECIMAL(precision, scale)`` as a node (DataType.build would parse the text)."""
    params = [exp.DataTypeParam(this=exp.Literal.number(n)) for n in (precision, scale)]
    return exp.DataType(this=exp.DataType.Type.DECIMAL, expressions=params, nested=False)


def _is_star(item: exp.Expression) -> bool:
    """``*`` or ``t.*`` (QUALIFY over a star needs the star spelled out for Spark)."""
    return isinstance(item, exp.Star) or (
        isinstance(item, exp.Column) and isinstance(item.this, exp.Star)
    )


def _output_columns(query: exp.Expr, ctes: dict) -> list[str] | None:
    """Output column names of a query over CTEs/subqueries (None: depends on a base table)."""
    if isinstance(query, exp.Subquery):
        return _output_columns(query.this, ctes)
    if isinstance(query, exp.Union):
        return _output_columns(query.left, ctes)
    if not isinstance(query, exp.Select):
        return None
    names: list[str] = []
    for item in query.expressions:
        if not _is_star(item):
            if not item.alias_or_name:
                return None
            names.append(item.alias_or_name)
            continue
        qualifier = item.table if isinstance(item, exp.Column) else ""
        from_ = query.args.get("from_")
        sources = [from_.this] if from_ is not None else []
        for join in query.args.get("joins") or []:
            if (join.args.get("kind") or "").upper() not in ("SEMI", "ANTI"):
                sources.append(join.this)  # semi/anti joins add no columns
        if qualifier:
            sources = [src for src in sources if src.alias_or_name == qualifier]
        if len(sources) != 1:
            return None
        source = sources[0]
        if isinstance(source, exp.Table) and source.name in ctes:
            inner = _output_columns(ctes[source.name], ctes)
        elif isinstance(source, exp.Subquery):
            inner = _output_columns(source.this, ctes)
        else:
            inner = None
        if inner is None:
            return None
        names.extend(inner)
    return names


# -- small node builders --------------------------------------------------------------------
# (internal_name, quoted, number, cast, a column's value, clamp and the fixed-point value live in
# dpsql.sql.row_values, imported above under the names the lowerings here and beside use)


def _alias(node: exp.Expression, name: str) -> exp.Alias:
    """``node AS name``, an internal result name (unquoted)."""
    return exp.Alias(this=node, alias=exp.Identifier(this=name, quoted=False))


def _and(conditions: list[exp.Expression]) -> exp.Expression:
    """``a AND b AND c`` as the parser builds it (left-deep)."""
    out = conditions[0]
    for condition in conditions[1:]:
        out = exp.And(this=out, expression=condition)
    return out


def _table(name: str, alias: str | None = None, *, quoted: bool = False) -> exp.Table:
    """A source table (quoted: a policy table) or one of the plan's CTEs, optionally aliased."""
    table = exp.Table(this=exp.Identifier(this=name, quoted=quoted))
    if alias is not None:
        table.set("alias", exp.TableAlias(this=exp.Identifier(this=alias, quoted=False)))
    return table


def _source(table: TablePolicy) -> exp.Expression:
    """The plan's FROM: the policy table, or for a join of private tables on the unit (or a
    unit_path table) that JOIN as a derived table (dpsql.frontend.private_joins); bounding
    runs on its rows, after the join."""
    if table.joined is None:
        return _table(table.name, quoted=True)
    from dpsql.frontend.private_joins import joined_source

    return joined_source(table)


def _subquery(query: exp.Expression, alias: str) -> exp.Subquery:
    """``(query) AS alias``: DuckDB and Spark both need a derived table to be named."""
    return exp.Subquery(
        this=query, alias=exp.TableAlias(this=exp.Identifier(this=alias, quoted=False))
    )


def _select(
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
        where=exp.Where(this=_and(where)) if where else None,
        group=exp.Group(expressions=group) if group else None,
        having=exp.Having(this=having) if having is not None else None,
        qualify=exp.Qualify(this=qualify) if qualify is not None else None,
    )


def _star(table: str | None = None) -> exp.Expression:
    """``*`` or ``t.*``."""
    return exp.Star() if table is None else exp.Column(this=exp.Star(), table=_ident(table))


def _ident(name: str) -> exp.Identifier:
    """An internal name (alias, CTE, qualifier), never quoted."""
    return exp.Identifier(this=name, quoted=False)


def _count_star() -> exp.Count:
    """``COUNT(*)``: rows, or (over pairs) groups."""
    return exp.Count(this=exp.Star())


def _count_distinct(value: exp.Expression) -> exp.Count:
    """``COUNT(DISTINCT value)`` (NULLs are not counted)."""
    return exp.Count(this=exp.Distinct(expressions=[value]))


def _sum_distinct(value: exp.Expression) -> exp.Sum:
    """``SUM(DISTINCT value)`` (NULLs are not summed)."""
    return exp.Sum(this=exp.Distinct(expressions=[value]))


def _row_number(partition: list[exp.Expression], order: list[exp.Expression]) -> exp.Window:
    """``ROW_NUMBER() OVER (PARTITION BY ... ORDER BY ...)``, NULLs last as in DuckDB (so
    Spark, whose NULLs sort first, is told explicitly)."""
    return exp.Window(
        this=exp.RowNumber(),
        partition_by=partition,
        order=exp.Order(expressions=[exp.Ordered(this=o, nulls_first=False) for o in order]),
        over="OVER",
    )


def _join(source: exp.Expression, kind: str, on: exp.Expression) -> exp.Join:
    """A join: SEMI or ANTI filters the left side and adds no column, INNER adds the right's."""
    return exp.Join(this=source, kind=kind, on=on)


def _same(left: str, right: str, column: str, *, nulls_match: bool) -> exp.Expression:
    """``left.column = right.column``, or IS NOT DISTINCT FROM where NULL keys must match."""
    node = exp.NullSafeEQ if nulls_match else exp.EQ
    return node(this=_name(column, left), expression=_name(column, right))


# -- values -----------------------------------------------------------------------------------


def _centred(m: Measure, col: ColumnPolicy) -> exp.Expression:
    """The row's fixed-point value minus the measure's centre (none when it is 0)."""
    value = fixed_point_expr(col, m.lo, m.hi)
    return exp.Sub(this=value, expression=_number(m.center)) if m.center else value


def _squared(m: Measure, col: ColumnPolicy) -> exp.Expression:
    """``(centred) * (centred) - center2``: the row's sumsq contribution."""
    square = exp.Mul(
        this=exp.Paren(this=_centred(m, col)), expression=exp.Paren(this=_centred(m, col))
    )
    return exp.Sub(this=square, expression=_number(m.center2)) if m.center2 else square


def clamp_excess_expr(m: Measure, col: ColumnPolicy) -> exp.Expression:
    """A ``clamped`` bias measure's row value (dpsql.sql.bias): round((x − clamp(x)) / g)
    within [−W, W], W = hi − lo, as BIGINT (NULL for NULL). The quotient is clamped before
    ROUND (a NaN or infinite excess goes to a bound), so the value lies in [−W, W]."""
    x = _cast(_col(col), "DOUBLE")
    excess = exp.Paren(
        this=exp.Sub(this=x, expression=_clamp(x.copy(), col.lower, col.upper))  # type: ignore[arg-type]
    )
    quotient = exp.Div(this=excess, expression=_number(col.granularity), typed=False, safe=False)
    width = max(m.hi - m.lo, 1)
    return _cast(exp.Round(this=_clamp(quotient, -width, width)), "BIGINT")


def _cut_rows(R: int, C: int) -> exp.Expression:
    """``COUNT(*) - R`` clamped to [0, C]: a pair's rows cut by R, at most C."""
    return _clamp(exp.Sub(this=_count_star(), expression=_number(R)), 0, C)


def pair_measure_expr(m: Measure, table: TablePolicy, R: int) -> exp.Expression:
    """A pair-level bias measure (``dropped``, ``cut``: dpsql.sql.bias) over a (unit, group)'s
    rows grouped together, in m's fine grid: the rows cut by R (at most C), or the pair's
    clamped sum times that count over its rows (truncated toward zero)."""
    from dpsql.sql.bias import cap

    C = cap(R)
    factor: exp.Expression = _cut_rows(R, C)
    if m.scale != 1:
        factor = exp.Mul(this=exp.Paren(this=factor), expression=_number(m.scale))
    if m.kind == "dropped":
        return factor
    col = table.columns[m.column]  # type: ignore[index]
    total = exp.Coalesce(
        this=exp.Sum(this=fixed_point_expr(col, m.lo, m.hi)), expressions=[_number(0)]
    )
    return _fraction(total, factor, C * m.scale, _count_star())


def row_value_expr(m: Measure, table: TablePolicy) -> exp.Expression | None:
    """One row's integer contribution to a measure (None: counted per unit/row)."""
    if m.kind in ("rows", "units", "dropped", "cut"):
        return None
    col = table.columns[m.column]  # type: ignore[index]
    if m.kind == "clamped":
        return exp.Coalesce(this=clamp_excess_expr(m, col), expressions=[_number(0)])
    is_null = exp.Is(this=_col(col), expression=exp.Null())
    if m.kind == "values":
        return exp.Case(ifs=[exp.If(this=is_null, true=_number(0))], default=_number(1))
    value = _centred(m, col) if m.kind == "sum" else _squared(m, col)
    return exp.Case(ifs=[exp.If(this=is_null, true=_cast(_number(0), "BIGINT"))], default=value)


def row_value(m: Measure, table: TablePolicy) -> str | None:
    """DuckDB text of :func:`row_value_expr` (benches splice it into reference queries)."""
    node = row_value_expr(m, table)
    return None if node is None else node.sql(dialect="duckdb")


def measure_aggregate_expr(m: Measure, table: TablePolicy) -> exp.Expression:
    """One measure aggregated over raw rows: COUNT(*), COUNT(col) or SUM(value).

    Same totals as SUM(row_value) but cheaper: NULL rows drop out of COUNT(col) and SUM by
    themselves (an all-NULL SUM is NULL, which the engine reads as 0).
    """
    if m.kind in ("rows", "units"):
        return _count_star()
    col = table.columns[m.column]  # type: ignore[index]
    if m.kind == "values":
        return exp.Count(this=_col(col))
    if m.kind == "distinct":  # row-level plans only (bounded ones count it in CompiledQuery.extras)
        return _count_distinct(_col(col))
    if m.kind == "distinct_sum":  # likewise: SUM(DISTINCT fixed-point value), NULLs out
        return _sum_distinct(fixed_point_expr(col, m.lo, m.hi))
    if m.kind == "clamped":
        return exp.Sum(this=clamp_excess_expr(m, col))
    return exp.Sum(this=_centred(m, col) if m.kind == "sum" else _squared(m, col))


def measure_aggregate(m: Measure, table: TablePolicy) -> str:
    """DuckDB text of :func:`measure_aggregate_expr`."""
    return measure_aggregate_expr(m, table).sql(dialect="duckdb")


# -- filters ------------------------------------------------------------------------------------


def _domain_filter_exprs(plan: Plan, *, skip_column_keys: bool = False) -> list[exp.Expression]:
    """Keep rows whose key columns lie in their declared public domain.

    With ``skip_column_keys``, keys that are a bare column are left out: the caller filters
    those on the key itself (after aggregation, on far fewer values) or not at all (a row-level
    GROUP BY, whose groups outside the public domain are never released).
    """
    table = plan.query.table
    filters: list[exp.Expression] = []
    seen: set[str] = set()
    for kp in plan.keys:
        if kp.domain is None or _is_constant_case(kp.key.expr):
            continue
        if skip_column_keys and isinstance(kp.key.expr, exp.Column):
            continue
        for name in kp.key.columns:
            if name in seen:
                continue
            seen.add(name)
            filters.append(_domain_condition(table.columns[name]))
    return filters


def _domain_filters(plan: Plan, *, skip_column_keys: bool = False) -> list[str]:
    """DuckDB text of :func:`_domain_filter_exprs` (bench_core's reference plan splices it)."""
    return [
        f.sql(dialect="duckdb")
        for f in _domain_filter_exprs(plan, skip_column_keys=skip_column_keys)
    ]


def _is_constant_case(node: exp.Expression) -> bool:
    """A CASE of constants only (its values are its domain: no filter needed)."""
    from dpsql.sql.domains import constant_case

    return constant_case(node) is not None


def _q(name: str) -> str:
    """Quoted identifier text (kept for benches that write reference SQL by hand)."""
    from dpsql.sql.identifiers import quote_ident

    return quote_ident(name)


# -- keys ---------------------------------------------------------------------------------------

_DATE_RANGE = {
    "DATE": ("DATE", "0001-01-01", "9999-12-31"),
    "TIMESTAMP": ("TIMESTAMP", "0001-01-01 00:00:00", "9999-12-31 23:59:59.999999"),
}


def lowered_key(key: GroupKey) -> exp.Expression:
    """A key as a tree, such that every value it yields can be released: the tree of
    :func:`dpsql.sql.typecheck.lower_key` (which enumerates public domains with the same
    lowering; tests/test_compile_ast.py checks both agree).

    Non-column keys run under TRY (a failing row gets the NULL key instead of failing the
    query); wide integers and decimals are cast to the released type; dates and timestamps
    outside years 1..9999 become NULL.
    """

    def guarded() -> exp.Expression:
        node = key.expr.copy()
        return node if isinstance(key.expr, exp.Column) else exp.Try(this=node)

    duck_type = key.type
    if duck_type is None:
        return guarded()
    if duck_type in WIDE_INTEGERS:
        return exp.TryCast(this=guarded(), to=_type("BIGINT"))
    if DECIMAL_PATTERN.fullmatch(duck_type) or duck_type == "FLOAT":
        return _cast(guarded(), "DOUBLE")
    if duck_type == '"NULL"':
        return _cast(guarded(), "VARCHAR")
    bounds = _DATE_RANGE.get(duck_type)
    if bounds is not None:
        kind, low, high = bounds
        within = exp.Between(
            this=exp.Paren(this=guarded()),
            low=_cast(exp.Literal.string(low), kind),
            high=_cast(exp.Literal.string(high), kind),
        )
        return exp.Case(ifs=[exp.If(this=within, true=exp.Paren(this=guarded()))])
    return guarded()


# -- the plan -----------------------------------------------------------------------------------


def _conditions(plan: Plan) -> list[exp.Expression]:
    """The scan's WHERE: the analyst's conditions (risky ones under TRY), the public domains
    of non-column keys, and (with a privacy unit) rows that belong to a unit."""
    query = plan.query
    table = query.table
    conditions: list[exp.Expression] = []
    if query.where is not None:
        # TRY: a row whose expression fails (CAST('x' AS INT), 1 // 0) is filtered out instead
        # of failing the query, so that an error can never reveal whether such a row exists.
        # Conjuncts that cannot fail for any row run without it (dpsql.sql.safety).
        conditions.extend(guarded_conditions(query.where, table))
    conditions.extend(_domain_filter_exprs(plan, skip_column_keys=True))
    if table.privacy_unit is not None:
        # A row without a privacy unit belongs to nobody we can bound: it is never used.
        unit = _quoted(table.privacy_unit)
        conditions.append(exp.Not(this=exp.Is(this=unit, expression=exp.Null())))
    return conditions


def compile_plan(plan: Plan, secret: int, *, store: object = None) -> CompiledQuery:
    """The engine query for ``plan``; ``secret`` keys row and group selection for this run
    only (later runs reuse the tree with :meth:`CompiledQuery.with_secret`).

    ``store``: None finds the prepared store of the plan's table and data version
    (dpsql.engine.prepared), False compiles without one; the measures are the same either way.
    """
    keys = tuple(f"k{i}" for i in range(len(plan.keys)))
    measure_cols = tuple(m.name for m in plan.measures)
    tree: exp.Expression | None = None
    program = None
    if store is not False and plan.measures:
        from dpsql.engine import prepared

        info = store if store is not None else _store_of(plan)
        if isinstance(info, prepared.StoreInfo):
            from dpsql.sql.prepared_plan import store_tree

            tree = store_tree(plan, keys, info)
    builder = None
    if tree is None:
        if not plan.measures:
            # quantiles only (no threshold, so the groups are public): nothing else to read
            tree = exp.Select(expressions=[_alias(_number(0), "__none")])
        else:
            program = column_program(plan)
            if plan.query.table.privacy_unit is None:
                builder = lambda: _row_level(plan, keys)  # noqa: E731
            else:
                builder = lambda: _bounded(plan)  # noqa: E731
            if program is None:
                tree, builder = builder(), None
    extras = tuple(
        CompiledQuery(_histogram(plan, qm.column, _grid_bin(qm)), (*keys, "b"), ("c",), secret)
        for qm in plan.quantiles
    )
    extras += tuple(
        CompiledQuery(_distinct_query(plan, m), keys, ("c",), secret)
        for m in plan.measures
        if m.measure_kind.distinct and plan.query.table.privacy_unit is not None
    )
    main_keys = keys if plan.measures else ()
    return CompiledQuery(
        tree, main_keys, measure_cols, secret, extras, program=program, builder=builder
    )


# -- quantiles: bin counts of bounded values ---------------------------------------------------


def _store_of(plan: Plan) -> object:
    """The store a plan compiles against: a service's plan, its own engine's (``plan.store``),
    while that store is still registered (a store closed or rebuilt for another data version
    is never read); a plan built outside a service, any store registered for its table."""
    from dpsql.engine import prepared

    registered = prepared.lookup(plan.query.table, plan.data_version, plan.engine or None)
    if not plan.engine:
        return registered
    held = plan.store
    if registered is None or not isinstance(held, prepared.StoreInfo):
        return None
    return held if held.key == registered.key else None


def compile_clip_histograms(plan: Plan, secret: int) -> tuple[CompiledQuery, ...]:
    """Per auto-clipped column (plan.clips), the counts of |x| per public log bin and group,
    over the rows the main query bounds (run before it: their release sets its bounds)."""
    keys = tuple(f"k{i}" for i in range(len(plan.keys)))
    return tuple(
        CompiledQuery(_histogram(plan, c.column, _log_bin(c)), (*keys, "b"), ("c",), secret)
        for c in plan.clips
    )


def _grid_bin(qm: QuantileMeasure | ModeMeasure) -> Callable[[ColumnPolicy], exp.Expression]:
    """A histogram measure's bin of a row: a quantile's public grid, or the measure's own
    lowering (MODE: the value's index in its public domain, dpsql.aggregates.mode)."""
    if isinstance(qm, QuantileMeasure):
        return lambda col: bin_expr(qm, col)
    return lambda col: qm.bin_of(_col(col))


def _log_bin(clip: ClipEstimate) -> Callable[[ColumnPolicy], exp.Expression]:
    """|clamp(x)| in the clipping histogram's bins: 0 below s, else ⌊ln(|x|/s)/ln r⌋ + 1,
    capped at the last bin (as LogHistogram.bin_of)."""
    return _log_bin_of(clip.histogram)


def _log_bin_of(hist: LogHistogram) -> Callable[[ColumnPolicy], exp.Expression]:
    """:func:`_log_bin` for a bare histogram (the kept clamp histogram, dpsql.service.bounds)."""

    def build(col: ColumnPolicy) -> exp.Expression:
        x = _clamped_double(col)
        a = exp.Least(this=exp.Abs(this=x), expressions=[_number(hist.maximum)], ignore_nulls=True)
        ratio = exp.Div(this=a, expression=_number(hist.smallest), typed=False, safe=False)
        steps = exp.Div(
            this=exp.Ln(this=ratio),
            expression=_number(math.log(hist.ratio)),
            typed=False,
            safe=False,
        )
        raw = exp.Add(this=_cast(exp.Floor(this=steps), "BIGINT"), expression=_number(1))
        top = exp.Least(this=_number(hist.bins - 1), expressions=[raw], ignore_nulls=True)
        below = exp.LT(this=a.copy(), expression=_number(hist.smallest))
        return exp.Case(ifs=[exp.If(this=below, true=_number(0))], default=top)

    return build


def _clamped_double(col: ColumnPolicy) -> exp.Expression:
    """The column's value clamped to its declared range, as DOUBLE: finite on every row."""
    return _cast(_clamp(_col(col), col.lower, col.upper), "DOUBLE")  # type: ignore[arg-type]


def bin_expr(qm: QuantileMeasure, col: ColumnPolicy) -> exp.Expression:
    """A row's bin on the measure's public grid, in [0, B) (NULL for NULL): the value is
    clamped to the declared range first (NaN to the upper bound, as everywhere), so the cast
    to BIGINT can never fail on any row."""
    grid = qm.grid
    x = _clamped_double(col)
    shifted: exp.Expression = exp.Paren(this=exp.Sub(this=x, expression=_number(grid.lower)))
    if grid.scale == "log":
        shifted = exp.Ln(this=exp.Add(this=_number(1), expression=shifted))
        per_unit = grid.bins / math.log1p(grid.upper - grid.lower)
    else:
        per_unit = grid.bins / (grid.upper - grid.lower)
    raw = _cast(exp.Floor(this=exp.Mul(this=shifted, expression=_number(per_unit))), "BIGINT")
    inside = exp.Greatest(this=_number(0), expressions=[raw], ignore_nulls=True)
    return exp.Least(this=_number(grid.bins - 1), expressions=[inside], ignore_nulls=True)


def _distinct_query(plan: Plan, m: Measure) -> exp.Select:
    """A distinct measure's own query over the bounded rows: ``COUNT(DISTINCT col)``, or
    ``SUM(DISTINCT value)`` of the row's fixed-point value in [lo, hi] (``distinct_sum``)."""
    if m.kind == "distinct":
        return _histogram(plan, m.column, None)  # type: ignore[arg-type]
    return _histogram(plan, m.column, None, (m.lo, m.hi))  # type: ignore[arg-type]


def _histogram(
    plan: Plan,
    column: str,
    bins: Callable[[ColumnPolicy], exp.Expression] | None,
    fixed: tuple[int, int] | None = None,
) -> exp.Select:
    """``SELECT keys, bin AS b, COUNT(*) AS c`` over the rows the main query aggregates: the
    same scan conditions and, with a privacy unit, the same bounding (the R rows of smallest
    keyed hash per (unit, group), then the G groups of smallest keyed hash per unit, with the
    run's secret), so the quantiles are of the very values the sums are of. NULLs have no
    bin and are not counted. ``bins`` None: ``SELECT keys, COUNT(DISTINCT column) AS c`` over
    those rows instead (COUNT(DISTINCT col): a unit's <= R rows per group add <= R values);
    with ``fixed`` (lo, hi) too, ``SUM(DISTINCT v) AS c`` of the rows' fixed-point values v in
    [lo, hi] (SUM(DISTINCT col): those <= R values are each at most max(|lo|, |hi|))."""
    table = plan.query.table
    col = table.columns[column]
    keys = [lowered_key(kp.key) for kp in plan.keys]
    not_null = exp.Not(this=exp.Is(this=_col(col), expression=exp.Null()))
    value = _col(col) if fixed is None else fixed_point_expr(col, *fixed)
    if table.privacy_unit is None:
        items: list[exp.Expression] = [_alias(k, f"k{i}") for i, k in enumerate(keys)]
        if bins is None:
            distinct = _count_distinct(_col(col)) if fixed is None else _sum_distinct(value)
            items.append(_alias(distinct, "c"))
        else:
            items += [_alias(bins(col), "b"), _alias(_count_star(), "c")]
        n_group = len(keys) + (bins is not None)
        group: list[exp.Expression] = [exp.Literal.number(i + 1) for i in range(n_group)]
        return _select(
            items,
            _source(table),
            where=[*_conditions(plan), not_null],
            group=group,
        )
    ks = [f"__k{i}" for i in range(len(plan.keys))]
    gc = ["__u", *ks]
    items = [_alias(_quoted(table.privacy_unit), "__u")]  # type: ignore[arg-type]
    items += [_alias(k, name) for k, name in zip(keys, ks, strict=True)]
    value_bin = value if bins is None else exp.Case(ifs=[exp.If(this=not_null, true=bins(col))])
    items.append(_alias(value_bin, "__b"))
    # the main query filters bare-column keys to their domain on its pairs, before bounding
    domain = _column_key_domains(plan, ks)
    ranked_items: list[exp.Expression] = [_name(c) for c in [*gc, "__b"]]
    ranked_items.append(_alias(_row_number([_name(c) for c in gc], [_row_order(table)]), "__r"))
    raw_rows = _select([_star(), *items], _source(table), where=_conditions(plan))
    if domain:
        raw_rows = _select([_star()], _subquery(raw_rows, "p"), where=domain)
    numbered = _select(ranked_items, _subquery(raw_rows, "b"))
    kept = _select(
        [_name(c) for c in [*gc, "__b"]],
        _table("numbered"),
        where=[exp.LTE(this=_name("__r"), expression=_number(plan.max_rows))],
    )
    ctes = [_cte("numbered", numbered), _cte("kept", kept)]
    G = plan.max_groups
    final_where: list[exp.Expression] = [
        exp.Not(this=exp.Is(this=_name("__b"), expression=exp.Null()))
    ]
    joins = None
    if bounds_groups(plan):
        pairs = _select([_name(c) for c in gc], _table("kept"))
        pairs.set("distinct", exp.Distinct())
        ctes += [_cte("bounded", pairs), _cte("ranked", _ranked(ks, G))]
        match = [_same("v", "g", "__u", nulls_match=True)]
        match += [_same("v", "g", k, nulls_match=True) for k in ks]
        joins = [_join(_table("ranked", "g"), "SEMI", _and(match))]
    out: list[exp.Expression] = [_alias(_name(k), f"k{i}") for i, k in enumerate(ks)]
    if bins is None:
        each = _count_distinct if fixed is None else _sum_distinct
        out.append(_alias(each(_name("__b")), "c"))
    else:
        out += [_alias(_name("__b"), "b"), _alias(_count_star(), "c")]
    final = _select(
        out,
        _table("kept", "v"),
        where=final_where,
        joins=joins,
        group=[_name(c) for c in [*ks, *(["__b"] if bins is not None else [])]] or None,
    )
    final.set("with_", exp.With(expressions=ctes))
    return final


def _row_level(plan: Plan, keys: tuple[str, ...]) -> exp.Select:
    """Every row its own unit: one scan and one GROUP BY, no bounding."""
    table = plan.query.table
    aggregates = [(measure_aggregate_expr(m, table), m.name) for m in plan.measures]
    return grouped_select(plan, keys, aggregates, _source(table))


def grouped_select(
    plan: Plan,
    keys: Sequence[str],
    aggregates: list[tuple[exp.Expression, str]],
    source: exp.Expression,
    where: list[exp.Expression] | None = None,
    lead: Sequence[tuple[str, exp.Expression]] = (),
    *,
    fold_keys: bool = True,
) -> exp.Select:
    """``SELECT lead, keys, aggregates FROM source WHERE where GROUP BY lead, keys`` (``where``:
    the plan's conditions by default; ``lead``: (name, expression) grouped before the keys);
    grouped by the keys' columns first where they have small public domains and
    ``fold_keys`` (dpsql.sql.fold)."""
    conditions = _conditions(plan) if where is None else where
    lowered = [(lowered_key(kp.key), k) for kp, k in zip(plan.keys, keys, strict=True)]
    columns = fold.fold_columns(plan.query.table, [kp.key.expr for kp in plan.keys])
    if fold_keys and columns is not None and fold.foldable([a for a, _ in aggregates]):
        return fold.folded(columns, lowered, aggregates, source, conditions, lead)
    items: list[exp.Expression] = [_alias(node, name) for name, node in lead]
    items += [_alias(key, k) for key, k in lowered]
    items += [_alias(node, name) for node, name in aggregates]
    width = len(lead) + len(keys)
    group: list[exp.Expression] = [exp.Literal.number(i + 1) for i in range(width)]
    return _select(items, source, where=conditions, group=group or None)


def _pairs(plan: Plan, ks: list[str]) -> exp.Select:
    """One row per (unit, group): its row count and partial aggregates over all its rows.
    Bare-column keys are filtered to their public domain here, on the pairs."""
    table = plan.query.table
    items: list[exp.Expression] = [_alias(_quoted(table.privacy_unit), "__u")]  # type: ignore[arg-type]
    items += [_alias(lowered_key(kp.key), k) for kp, k in zip(plan.keys, ks, strict=True)]
    items.append(_alias(_count_star(), "__n"))
    items += [_alias(measure_aggregate_expr(m, table), f"v_{m.name}") for m in value_measures(plan)]
    items += [
        _alias(pair_measure_expr(m, table, plan.max_rows), f"v_{m.name}")
        for m in _pair_measures(plan)
    ]
    group: list[exp.Expression] = [_name(c) for c in ["__u", *ks]]
    pairs = _select(items, _source(table), where=_conditions(plan), group=group)
    pair_filters = _column_key_domains(plan, ks)
    if pair_filters:
        pairs = _select([_star()], _subquery(pairs, "p"), where=pair_filters)
    return pairs


def _column_key_domains(plan: Plan, ks: list[str]) -> list[exp.Expression]:
    """Each bare-column key (named ``ks[i]``) in its public domain: bounding then counts a
    unit's groups among the released ones only."""
    table = plan.query.table
    return [
        _domain_condition(table.columns[kp.key.columns[0]], k)
        for kp, k in zip(plan.keys, ks, strict=True)
        if kp.domain is not None and isinstance(kp.key.expr, exp.Column)
    ]


def _row_order(table: TablePolicy) -> exp.Anonymous:
    """The order in which a (unit, group)'s rows are kept: the keyed hash of the table's stored
    columns and the run's secret."""
    stored = [_quoted(c) for c, spec in table.columns.items() if spec.expr is None]
    return keyed_hash([*stored, secret_slot()])


def _pair_measures(plan: Plan) -> list[Measure]:
    """Bias measures computed once per (unit, group) pair from all its rows (dpsql.sql.bias):
    computed in ``base``, carried through the bounding as they are."""
    return [m for m in plan.measures if m.measure_kind.bias and m.measure_kind.per_pair]


def _cte(name: str, query: exp.Expression) -> exp.CTE:
    """``name AS (query)``, one step of the bounded plan."""
    return exp.CTE(this=query, alias=exp.TableAlias(this=_ident(name)))


def _bounded(plan: Plan) -> exp.Select:
    """Contribution bounding per privacy unit (see the module docstring for the plan)."""
    ks = [f"__k{i}" for i in range(len(plan.keys))]
    R = plan.max_rows
    if plan.bounding == "scale" or not value_measures(plan):
        # Only row and unit counts: any R of a pair's n rows count min(n, R), whichever the
        # keyed hash would pick, so the pair's count is capped without re-reading its rows;
        # rescaled, every pair's partials are R/n of it (rescaled() does both)
        ctes = [_cte("base", _pairs(plan, ks)), _cte("bounded", rescaled(plan, ks, "base"))]
        return _finish_bounded(plan, ctes, ks)
    base_within = _select(
        [_star()], _table("base"), where=[exp.LTE(this=_name("__n"), expression=_number(R))]
    )
    bounded = exp.Union(
        this=base_within, expression=_select([_star()], _table("sampled")), distinct=False
    )
    ctes = [
        _cte("base", _pairs(plan, ks)),
        _cte("sampled", _sampled(plan, ks)),
        _cte("bounded", bounded),
    ]
    return _finish_bounded(plan, ctes, ks)


def wide(node: exp.Expression) -> exp.Cast:
    """``CAST(node AS INT128)`` (DuckDB's HUGEINT; DECIMAL(38, 0) on Spark): a partial sum times
    a scale cannot overflow."""
    return _cast(node, "INT128")


def scaled_partial(m: Measure, R: int, n: exp.Expression) -> exp.Expression:
    """A pair's partial ``v_m`` at R/n of its n rows, in m's fine grid (m.scale units per
    integer): ``(v · scale · LEAST(n, R)) // n``, truncated toward zero, so its magnitude is at
    most scale · R · row_bound (n rows of at most row_bound each) — sampling's bound."""
    capped = exp.Least(this=n.copy(), expressions=[_number(R)], ignore_nulls=True)
    factor = exp.Mul(this=_number(m.pair_scale), expression=capped)
    return _fraction(_name(f"v_{m.name}"), factor, m.pair_scale * R, n)


def _fraction(
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
    narrow = exp.Mul(this=_cast(v.copy(), "BIGINT"), expression=exp.Paren(this=factor))
    if bound is not None and bound * max(most, 1) <= 2**63 - 1:
        return exp.IntDiv(this=narrow, expression=n.copy())
    fits = exp.LTE(this=exp.Abs(this=v), expression=_number((2**63 - 1) // max(most, 1)))
    wide_ = exp.Mul(this=wide(v.copy()), expression=exp.Paren(this=factor.copy()))
    return exp.Case(
        ifs=[exp.If(this=fits, true=exp.IntDiv(this=narrow, expression=n.copy()))],
        default=exp.IntDiv(this=wide_, expression=n.copy()),
    )


def group_scaled(
    plan: Plan,
    ks: list[str],
    source: str,
    groups: str | None = None,
    *,
    window: bool = False,
) -> exp.Select:
    """The bounded pairs of ``source`` with every unit over G groups kept whole at G/k
    (plan.group_scaling; k = the unit's pairs, unless ``groups`` names a column holding it
    counted per unit and joined back, or with ``window`` by a window): row and unit counts in
    their fine grid, each partial times min(k, G)/k, truncated toward zero. A unit within G
    keeps its pairs as they are.

    Over every pair of a table the join is much the cheaper (10M rows, R = 5: 10.6x plain
    against 15.2x for the window); over the few pairs a store leaves unproven the window is
    (bench/bench_core.py figures in docs/performance.md)."""
    G = plan.max_groups
    src: exp.Expression = _table(source)
    k = _name(groups or "__g")
    if groups is None and window:
        counted = exp.Window(this=_count_star(), partition_by=[_name("__u")])
        src = _subquery(_select([_star(), _alias(counted, "__g")], src), "w")
    elif groups is None:
        per_unit = _select(
            [_name("__u"), _alias(_count_star(), "__g")], _table(source), group=[_name("__u")]
        )
        same_unit = exp.EQ(this=_name("__u", source), expression=_name("__u", "gc"))
        joined = _select(
            [_star(source), _name("__g", "gc")],
            _table(source),
            joins=[_join(_subquery(per_unit, "gc"), "INNER", same_unit)],
        )
        src = _subquery(joined, "w")
    capped = exp.Least(this=k.copy(), expressions=[_number(G)], ignore_nulls=True)
    items: list[exp.Expression] = [_name(c) for c in ["__u", *ks]]
    scale = count_scale(plan)
    rows_factor = exp.Mul(this=_name("__n"), expression=_number(scale))
    # the pairs are bounded already: a row count by R (times its grid), a partial by
    # per_group_bound, so the 64-bit product cannot overflow and needs no test
    R = plan.max_rows
    items.append(_alias(_fraction(rows_factor, capped.copy(), G, k, bound=R * scale), "__n"))
    units = exp.IntDiv(
        this=exp.Mul(this=_number(scale), expression=exp.Paren(this=capped.copy())),
        expression=k.copy(),
    )
    items.append(_alias(units, "__units"))
    for m in value_measures(plan) + _pair_measures(plan):
        bound = m.per_group_bound * m.fine  # a rounded count's share: on its fine grid
        scaled = _fraction(_name(f"v_{m.name}"), capped.copy(), G, k, bound=bound)
        items.append(_alias(scaled, f"v_{m.name}"))
    return _select(items, src)


def rounded_columns(plan: Plan) -> list[tuple[str, int]]:
    """The pair columns holding a count's fine-grid shares (dpsql.sql.plan.ROUNDED_KINDS), each
    with its grid: what :func:`rounded_counts` rounds per unit."""
    column = {"rows": "__n", "units": "__units"}
    return [(column.get(m.kind, f"v_{m.name}"), m.fine) for m in plan.measures if m.fine > 1]


def unit_offset(plan: Plan, grid: int) -> exp.Expression:
    """U_u in [0, grid): the per-unit offset of the systematic rounding, a public function of
    the unit's id ``__u`` (dpsql.sql.plan.ROUNDING_MULTIPLIER): for an integer unit
    ((u mod grid)·multiplier) mod grid, the same integers in every engine and in the column
    programs (dpsql.engine.columnar); else the engine's hash of u, no secret, mod grid."""
    from dpsql.sql.plan import ROUNDING_MULTIPLIER

    table = plan.query.table
    unit_type = declared_type(table, table.privacy_unit)  # type: ignore[arg-type]
    g = _number(grid)
    if unit_type == "int":
        residue: exp.Expression = exp.Mod(this=_cast(_name("__u"), "BIGINT"), expression=g)
        mixed = exp.Mul(this=_positive_mod(residue, grid), expression=_number(ROUNDING_MULTIPLIER))
        return exp.Mod(this=exp.Paren(this=mixed), expression=g.copy())
    return _positive_mod(exp.Mod(this=keyed_hash([_name("__u")]), expression=g), grid)


def _positive_mod(residue: exp.Expression, grid: int) -> exp.Expression:
    """``(residue + grid) % grid``: SQL's remainder takes the dividend's sign."""
    shifted = exp.Add(this=residue, expression=_number(grid))
    return exp.Mod(this=exp.Paren(this=shifted), expression=_number(grid))


def rounded_counts(plan: Plan, ks: list[str], source: str) -> exp.Expression:
    """The pairs of ``source`` with each count's fine-grid shares w rounded per unit to
    integers by systematic rounding (proof and notation: dpsql.sql.plan, ROUNDED_KINDS): over
    the unit's pairs in key order (NULLs last) A = the running sum of w, then
    c = (A + U_u) // F - (A - w + U_u) // F, every operand >= 0 (floor = truncation). Other
    columns pass as they are.

    A share that is a multiple of F gets w / F whatever A is (⌊x + m⌋ - ⌊x⌋ = m for an integer
    m), and adds a multiple of F to the running sums after it, which changes no later c. So
    the pairs whose shares are all whole rows (every pair of a unit within R and G: nearly all)
    take w // F with no window, and the running sums run over the other pairs alone: the same
    integers as one window over every pair, at a fraction of its sort."""
    rounded = dict(rounded_columns(plan))
    grids = set(rounded.values())
    assert len(grids) == 1  # counts: row bound 1, one fine grid
    (grid,) = grids
    fractional: exp.Expression = exp.NEQ(
        this=exp.Mod(this=_name(next(iter(rounded))), expression=_number(grid)),
        expression=_number(0),
    )
    for name in list(rounded)[1:]:
        share = exp.Mod(this=_name(name), expression=_number(grid))
        fractional = exp.Or(this=fractional, expression=exp.NEQ(this=share, expression=_number(0)))
    columns = _pair_columns(plan, ks)
    whole = _select(
        [
            _alias(exp.IntDiv(this=_name(name), expression=_number(grid)), name)
            if name in rounded
            else _name(name)
            for name in columns
        ],
        _table(source),
        where=[exp.Not(this=exp.Paren(this=fractional.copy()))],
    )
    with_offset = _select(
        [_star(), _alias(unit_offset(plan, grid), "__off")],
        _table(source),
        where=[fractional],
    )
    order = exp.Order(
        expressions=[exp.Ordered(this=_name(k), desc=False, nulls_first=False) for k in ks]
    )
    items: list[exp.Expression] = []
    for column in columns:
        if column not in rounded:
            items.append(_name(column))
            continue
        w = _name(column)
        running: exp.Expression = w.copy()
        if ks:  # one pair per unit without keys: A = w
            # the running sum in 128 bits (Spark: DECIMAL(38, 0)), as every SUM of the plan
            running = exp.Window(
                this=exp.Sum(this=wide(w.copy())),
                partition_by=[_name("__u")],
                order=order.copy(),
                spec=exp.WindowSpec(
                    kind="ROWS", start="UNBOUNDED", start_side="PRECEDING", end="CURRENT ROW"
                ),
                over="OVER",
            )
        upper = exp.Add(this=running, expression=_name("__off"))
        lower = exp.Sub(this=upper.copy(), expression=w.copy())
        c = exp.Sub(
            this=exp.IntDiv(this=exp.Paren(this=upper), expression=_number(grid)),
            expression=exp.IntDiv(this=exp.Paren(this=lower), expression=_number(grid)),
        )
        items.append(_alias(c, column))
    scaled = _select(items, _subquery(with_offset, "o"))
    return exp.Union(this=whole, expression=scaled, distinct=False)


def _pair_columns(plan: Plan, ks: list[str]) -> list[str]:
    """The columns of the bounded pairs the final GROUP BY reads (after group scaling: with
    the unit counts ``__units``)."""
    out = ["__u", *ks, "__n"]
    if plan.group_scaling:
        out.append("__units")
    out += [f"v_{m.name}" for m in value_measures(plan) + _pair_measures(plan)]
    return out


def rescaled(plan: Plan, ks: list[str], pairs: str, keep: tuple[str, ...] = ()) -> exp.Select:
    """The pairs of ``pairs`` bounded by rescaling (dpsql.sql.plan): a row count capped at R,
    every partial at R/n of the pair (a pair within R unchanged, in fine units); the columns
    ``keep`` carried as they are. With counts only (any bounding) it is the cap alone: any R
    of a pair's n rows count min(n, R)."""
    items: list[exp.Expression] = [_name(c) for c in ["__u", *ks, *keep]]
    n = _name("__n")
    capped = exp.Least(this=n, expressions=[_number(plan.max_rows)], ignore_nulls=True)
    items.append(_alias(capped, "__n"))
    items += [
        _alias(scaled_partial(m, plan.max_rows, n), f"v_{m.name}") for m in value_measures(plan)
    ]
    items += [_name(f"v_{m.name}") for m in _pair_measures(plan)]  # per pair already
    return _select(items, _table(pairs))


def _sampled(plan: Plan, ks: list[str]) -> exp.Select:
    """Only (unit, group) pairs over R rows re-read their rows (a semi join on the pair, NULL
    keys matching NULL) and keep the R of smallest keyed hash of the whole row."""
    table = plan.query.table
    R = plan.max_rows
    gc = ["__u", *ks]
    rows_items: list[exp.Expression] = [_star(), _alias(_quoted(table.privacy_unit), "__u")]  # type: ignore[arg-type]
    rows_items += [_alias(lowered_key(kp.key), k) for kp, k in zip(plan.keys, ks, strict=True)]
    rows = _select(rows_items, _source(table), where=_conditions(plan))
    carried = [f"v_{m.name}" for m in _pair_measures(plan)]  # per pair, from base
    over_r = _select(
        [_name(c) for c in [*gc, *carried]],
        _table("base"),
        where=[exp.GT(this=_name("__n"), expression=_number(R))],
    )
    match = [_same("b", "o", "__u", nulls_match=False)]
    match += [_same("b", "o", k, nulls_match=True) for k in ks]
    ranked_items = [
        _star("b"),
        _alias(_row_number([_name(c, "b") for c in gc], [_row_order(table)]), "__r"),
    ]
    ranked_items += [_alias(_name(c, "o"), c) for c in carried]
    ranked = _select(
        ranked_items,
        _subquery(rows, "b"),
        # one row of o per pair: an inner join carries its per-pair columns
        joins=[_join(_subquery(over_r, "o"), "INNER" if carried else "SEMI", _and(match))],
    )
    items: list[exp.Expression] = [_name(c) for c in gc] + [_alias(_count_star(), "__n")]
    items += [_alias(measure_aggregate_expr(m, table), f"v_{m.name}") for m in value_measures(plan)]
    items += [_alias(exp.Max(this=_name(c)), c) for c in carried]
    return _select(
        items,
        _subquery(ranked, "s"),
        where=[exp.LTE(this=_name("__r"), expression=_number(R))],
        group=[_name(c) for c in gc],
    )


def _finish_bounded(
    plan: Plan, ctes: list[exp.CTE], ks: list[str], groups: str | None = None
) -> exp.Select:
    """At most G groups per unit, then the final GROUP BY over the bounded pairs (``groups``:
    a column of the bounded pairs holding each unit's pair count, else a window counts it)."""
    G = plan.max_groups
    final_source = "bounded"
    if plan.group_scaling:
        # public keys: a unit over G groups keeps all k of them at G/k (dpsql.sql.plan)
        ctes.append(_cte("ranked", group_scaled(plan, ks, "bounded", groups)))
        final_source = "ranked"
    elif bounds_groups(plan):
        # At most G groups per unit, by keyed hash of (unit, key): each unit drops its own
        # groups, not the same groups for everyone. Only units over G are ranked.
        ctes.append(_cte("ranked", _ranked(ks, G)))
        final_source = "ranked"
    if rounded_columns(plan):  # counts' fine shares back to integers, per unit
        ctes.append(_cte("rounded", rounded_counts(plan, ks, final_source)))
        final_source = "rounded"
    items: list[exp.Expression] = [_alias(_name(k), f"k{i}") for i, k in enumerate(ks)]
    for m in plan.measures:
        if m.kind == "rows":
            total: exp.Expression = exp.Sum(this=_name("__n"))
        elif m.kind == "units":
            total = exp.Sum(this=_name("__units")) if plan.group_scaling else _count_star()
        elif m.measure_kind.distinct:
            total = _number(0)  # from its own query over the bounded rows (CompiledQuery.extras)
        else:
            total = exp.Sum(this=_name(f"v_{m.name}"))
        items.append(_alias(total, m.name))
    final = _select(items, _table(final_source), group=[_name(k) for k in ks] or None)
    final.set("with_", exp.With(expressions=ctes))
    return final


def _ranked(ks: list[str], G: int) -> exp.Select:
    """Each unit's G pairs of smallest keyed hash of (unit, key), the key breaking ties: one
    window over every bounded pair (a unit with <= G pairs keeps them all). At 10M rows this
    costs half of ranking only the units over G (found by a GROUP BY, then an anti and a semi
    join back to the pairs)."""
    key_hash = keyed_hash([_name("__u"), *[_name(k) for k in ks], secret_slot()])
    window = _row_number([_name("__u")], [key_hash, *[_name(k) for k in ks]])
    return _select(
        [_star()],
        _table("bounded"),
        qualify=exp.LTE(this=window, expression=_number(G)),
    )


def clamp_histogram_query(
    table: TablePolicy, column: str, hist: LogHistogram, secret: int
) -> CompiledQuery:
    """The histogram a default clamp range is chosen from (dpsql.service.bounds, kind "clip"):
    ``SELECT b, COUNT(*) AS c`` of |clamp(x)| in ``hist``'s public log bins over the whole
    table (no WHERE: the range is the table's at its data version), NULLs not counted, each
    privacy unit keeping at most ``table.max_rows_per_unit`` (R) of its non-NULL rows (those
    of smallest keyed hash with the run's ``secret``): a unit moves at most R counts, one per
    value, so Laplace(R/ε) per bin is ε-DP. Generated from the policy only."""
    col = table.columns[column]
    value = _col(col)
    not_null = exp.Not(this=exp.Is(this=value, expression=exp.Null()))
    bin_of = _log_bin_of(hist)(col)
    spec = None
    if table.joined is None:
        spec = ClampHistogram(
            table.name,
            table.privacy_unit,
            tuple((c, cs.type) for c, cs in table.columns.items() if cs.expr is None),
            column,
            col.type,
            col.lower,  # type: ignore[arg-type]
            col.upper,  # type: ignore[arg-type]
            hist.maximum,
            hist.smallest,
            math.log(hist.ratio),
            hist.bins,
            int(table.max_rows_per_unit),
            render(bin_of, "duckdb"),
        )
    if table.privacy_unit is None:
        tree = _select(
            [_alias(bin_of, "b"), _alias(_count_star(), "c")],
            _source(table),
            where=[not_null],
            group=[exp.Literal.number(1)],
        )
        return CompiledQuery(tree, ("b",), ("c",), secret, clamp=spec)
    unit = _quoted(table.privacy_unit)
    rank = _row_number([unit], [_row_order(table)])
    numbered = _select(
        [_alias(bin_of, "__b"), _alias(rank, "__r")], _source(table), where=[not_null]
    )
    tree = _select(
        [_alias(_name("__b"), "b"), _alias(_count_star(), "c")],
        _subquery(numbered, "n"),
        where=[exp.LTE(this=_name("__r"), expression=_number(table.max_rows_per_unit))],
        group=[exp.Literal.number(1)],
    )
    return CompiledQuery(tree, ("b",), ("c",), secret, clamp=spec)


def contribution_query(
    table: TablePolicy, keys: Sequence[GroupKey], kind: str, over: int
) -> CompiledQuery:
    """The contribution histogram ``"auto"`` bounds are chosen from (dpsql.privacy.contribution,
    dpsql.service.bounds): ``SELECT LEAST(n, over) AS b, COUNT(*) AS c`` over the units'
    contributions n, ``kind`` "rows" (rows per unit) or "groups" (distinct tuples of the
    bound query's ``keys``, lowered, per unit, NULL keys included as the main query groups
    them). Over the whole table (no WHERE: the bound is the table's at its data version);
    generated from the policy and the validated keys only (total by construction), at most
    ``over`` rows out."""
    assert table.privacy_unit is not None
    unit = _quoted(table.privacy_unit)
    if kind == "rows":
        per_unit = _select([_alias(_count_star(), "n")], _source(table))
        per_unit.set("group", exp.Group(expressions=[unit]))
    else:
        lowered = [_alias(lowered_key(k), f"__k{i}") for i, k in enumerate(keys)]
        pairs = _select([_alias(unit, "__u"), *lowered], _source(table))
        pairs.set("distinct", exp.Distinct())
        per_unit = _select([_alias(_count_star(), "n")], _subquery(pairs, "d"))
        per_unit.set("group", exp.Group(expressions=[_name("__u")]))
    capped = exp.Least(this=_name("n"), expressions=[_number(over)], ignore_nulls=True)
    tree = _select(
        [_alias(capped, "b"), _alias(_count_star(), "c")],
        _subquery(per_unit, "p"),
        group=[exp.Literal.number(1)],
    )
    return CompiledQuery(tree, ("b",), ("c",), 0)
