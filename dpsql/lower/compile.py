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

The steps this plan shares with the same plan over a prepared store (dpsql.lower.prepared_plan,
which compile_plan chooses when a store is held) are in dpsql.lower.bounding, its node
constructors in dpsql.lower.builders: both lowerings import them, neither the other's helpers.

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
from sqlglot.transforms import eliminate_distinct_on, eliminate_qualify

from dpsql.aggregates.mode import ModeMeasure
from dpsql.frontend.statements import DIALECT, GroupKey
from dpsql.lower import builders, fold, sources
from dpsql.lower.bounding import column_key_domains as _column_key_domains
from dpsql.lower.bounding import domain_filter_exprs as _domain_filter_exprs
from dpsql.lower.bounding import finish_bounded as _finish_bounded
from dpsql.lower.bounding import (
    grouped_select,
    lowered_key,
    measure_aggregate_expr,
    rescaled,
)
from dpsql.lower.bounding import pair_measures as _pair_measures
from dpsql.lower.bounding import ranked_pairs as _ranked
from dpsql.lower.bounding import row_conditions as _conditions
from dpsql.lower.bounding import row_rank as _row_rank
from dpsql.lower.builders import alias as _alias
from dpsql.lower.builders import and_all as _and
from dpsql.lower.builders import count_distinct as _count_distinct
from dpsql.lower.builders import count_star as _count_star
from dpsql.lower.builders import cte as _cte
from dpsql.lower.builders import decimal_type as _decimal
from dpsql.lower.builders import join as _join
from dpsql.lower.builders import select as _select
from dpsql.lower.builders import star as _star
from dpsql.lower.builders import subquery as _subquery
from dpsql.lower.builders import sum_distinct as _sum_distinct
from dpsql.lower.builders import table_ref as _table
from dpsql.lower.hashing import (
    KEYED_HASH,
    SECRET,
    is_keyed_hash,
    with_secret,
)
from dpsql.lower.local_plan import ColumnProgram, column_program
from dpsql.lower.row_values import cast as _cast
from dpsql.lower.row_values import clamp as _clamp
from dpsql.lower.row_values import column_value as _col
from dpsql.lower.row_values import fixed_point_expr
from dpsql.lower.row_values import fixed_point_value as fixed_point_value
from dpsql.lower.row_values import internal_name as _name
from dpsql.lower.row_values import number as _number
from dpsql.lower.row_values import quoted as _quoted
from dpsql.plan.annotated import (
    Plan,
    bounds_groups,
    value_measures,
)
from dpsql.plan.clamp_spec import ClampHistogram
from dpsql.plan.tree import read_node
from dpsql.plan.values import (
    ClipEstimate,
    Measure,
    QuantileMeasure,
)
from dpsql.policy import ColumnPolicy, TablePolicy
from dpsql.privacy.clipping import LogHistogram

NEUTRAL = "neutral"  # DuckDB's dialect with the keyed hash spelled DP_KEYED_HASH


# What the rendering prints for a secret slot: the text is kept as the pieces between these,
# joined by each run's secret digits. The analyst's functions never reach a plan unvetted
# (dpsql.frontend.bind allows listed functions only), so DP_SECRET() and DP_KEYED_HASH(...) in a
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
    # the same aggregate as a column program (dpsql.lower.local_plan), for an engine that holds
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
            tree = with_secret(self.expression, self.secret)
            return _swap(_generate(tree, dialect)[0], self.swaps)
        return str(int(self.secret)).join(pieces)

    def render_split(self, dialect: str, split: Splitter) -> tuple[list[tuple[str, str]], str]:
        """Engine text of the tree cut into parts by ``split`` (Spark's staged CTEs,
        dpsql.engine.spark_engine.stage_ctes): ``split`` cuts a copy of the tree as the dialect
        renders it (Spark's rewrites done on the whole, before the cut) into named parts and
        the rest, and each is rendered once, with this run's secret and literals, as
        :meth:`render` renders the whole."""
        ready = _dialect_tree(self.expression, dialect, copy=True)
        if dialect == "spark":  # what Spark's generator does to a SELECT, before the cut
            ready = ready.transform(_spark_select_rewrites, copy=False)
        assert isinstance(ready, exp.Expression), "a query is an expression"
        parts, rest = split(ready)
        named = [(name, self._render_part(part, dialect)) for name, part in parts]
        return named, self._render_part(rest, dialect)

    def _render_part(self, part: exp.Expression, dialect: str) -> str:
        pieces = _secret_slots(*_generate_ready(part, dialect))
        if not pieces:  # the marker also occurs elsewhere: print the secret as a literal
            text = _generate_ready(with_secret(part, self.secret), dialect)[0]
            return _swap(text, self.swaps)
        return str(int(self.secret)).join(_swap(p, self.swaps) for p in pieces)


def _spark_select_rewrites(node: exp.Expr) -> exp.Expr:
    """The rewrites sqlglot's Spark generator makes of a SELECT that wrap it in a derived
    table (QUALIFY, DISTINCT ON): made before a cut, as rendering the whole made them, so a
    part given a WITH of its own (a staged CTE's body) keeps the WITH outside the wrapper."""
    if isinstance(node, exp.Select):
        return eliminate_distinct_on(eliminate_qualify(node))
    return node


#: cuts a query's tree into named parts and the rest (see CompiledQuery.render_split)
Splitter = Callable[[exp.Expression], tuple[list[tuple[str, exp.Expression]], exp.Expression]]


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
    return _generate_ready(_dialect_tree(tree, dialect), dialect)


def _dialect_tree(tree: exp.Expr, dialect: str, *, copy: bool = False) -> exp.Expr:
    """The tree as ``dialect`` renders it: Spark's rewritten copy (its keyed hash named
    XXHASH64, :func:`_spark_safe`); the tree itself (or a copy) for DuckDB's."""
    if dialect == "spark":
        return _spark_safe(tree.transform(_hash_named("spark")))
    return tree.copy() if copy else tree


def _generate_ready(tree: exp.Expr, dialect: str) -> tuple[str, int]:
    """:func:`_generate` of a tree already in ``dialect``'s form (:func:`_dialect_tree`)."""
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
    return _secret_slots(*_generate(tree, dialect))


def _secret_slots(text: str, secrets: int) -> tuple[str, ...]:
    """A rendered ``text`` holding ``secrets`` secret slots, cut at them; () if the marker
    stands anywhere else too (the caller then prints the secret as a literal)."""
    pieces = tuple(text.split(_MARKER))
    return pieces if len(pieces) == secrets + 1 else ()


def render(expression: exp.Expr, dialect: str) -> str:
    """Engine SQL of any tree in ``dialect`` (``duckdb``, ``spark`` or :data:`NEUTRAL`), the
    keyed hash mapped to the dialect's own fast hash, for any tree (the engines' fetch_matrix
    renders dpsql.lower.rows' trees, their secret printed, with it); the tree itself is left
    unchanged."""
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
      values reach within ~10^8 rows; so do the inner sums of a folded plan (dpsql.lower.fold).
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


# -- sources and join conditions -------------------------------------------------------------
# (the node constructors live in dpsql.lower.builders, one row's values in dpsql.lower.row_values
# and the bounded plan's shared steps in dpsql.lower.bounding, imported above under the names
# this module's lowerings have always used)


def _source(plan: Plan) -> exp.Expression:
    """The plan's FROM, lowered from the node that reads its table (dpsql.lower.sources): the
    policy table, or for a join of private tables on the unit (or a unit_path table) that
    JOIN as a derived table; bounding runs on its rows, after the join."""
    return sources.source(sources.read_of(plan.bound.input))


def _table_source(table: TablePolicy) -> exp.Expression:
    """The FROM of a query over ``table`` alone (no plan: the default clamp's and the
    contribution histograms), lowered from its read node as a plan's is."""
    return sources.source(read_node(table))


def _same(left: str, right: str, column: str, *, nulls_match: bool) -> exp.Expression:
    """``left.column = right.column``, or IS NOT DISTINCT FROM where NULL keys must match."""
    node = exp.NullSafeEQ if nulls_match else exp.EQ
    return node(this=_name(column, left), expression=_name(column, right))


# -- values -----------------------------------------------------------------------------------


def pair_measure_expr(m: Measure, table: TablePolicy, R: int) -> exp.Expression:
    """A pair-level bias measure (``dropped``, ``cut``: dpsql.plan.bias) over a (unit, group)'s
    rows grouped together, in m's fine grid: its kind's object builds it (MeasureKind.pair_value:
    the rows cut by R, at most C, or the pair's clamped sum times that count over its rows)."""
    col = None if m.column is None else table.columns[m.column]
    return m.measure_kind.pair_value(m, col, builders, R)


def row_value_expr(m: Measure, table: TablePolicy) -> exp.Expression | None:
    """One row's integer contribution to a measure (None: counted per unit/row), as its
    kind's object builds it (MeasureKind.row_value)."""
    col = None if m.column is None else table.columns[m.column]
    return m.measure_kind.row_value(m, col, builders)


def row_value(m: Measure, table: TablePolicy) -> str | None:
    """DuckDB text of :func:`row_value_expr` (benches splice it into reference queries)."""
    node = row_value_expr(m, table)
    return None if node is None else node.sql(dialect=DIALECT)


def measure_aggregate(m: Measure, table: TablePolicy) -> str:
    """DuckDB text of :func:`measure_aggregate_expr`."""
    return measure_aggregate_expr(m, table).sql(dialect=DIALECT)


# -- filters ------------------------------------------------------------------------------------


def _domain_filters(plan: Plan, *, skip_column_keys: bool = False) -> list[str]:
    """DuckDB text of :func:`_domain_filter_exprs` (bench_core's reference plan splices it)."""
    return [
        f.sql(dialect=DIALECT)
        for f in _domain_filter_exprs(plan, skip_column_keys=skip_column_keys)
    ]


def _q(name: str) -> str:
    """Quoted identifier text (kept for benches that write reference SQL by hand)."""
    from dpsql.frontend.identifiers import quote_ident

    return quote_ident(name)


# -- the plan -----------------------------------------------------------------------------------


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
            from dpsql.lower.prepared_plan import store_tree

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
    if m.measure_kind.counted:  # COUNT(DISTINCT col) reads no range
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
            _source(plan),
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
    ranked_items.append(_alias(_row_rank(table, [_name(c) for c in gc]), "__r"))
    raw_rows = _select([_star(), *items], _source(plan), where=_conditions(plan))
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
    return grouped_select(plan, keys, aggregates, _source(plan))


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
    pairs = _select(items, _source(plan), where=_conditions(plan), group=group)
    pair_filters = _column_key_domains(plan, ks)
    if pair_filters:
        pairs = _select([_star()], _subquery(pairs, "p"), where=pair_filters)
    return pairs


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


def _sampled(plan: Plan, ks: list[str]) -> exp.Select:
    """Only (unit, group) pairs over R rows re-read their rows (a semi join on the pair, NULL
    keys matching NULL) and keep the R of smallest keyed hash of the whole row."""
    table = plan.query.table
    R = plan.max_rows
    gc = ["__u", *ks]
    rows_items: list[exp.Expression] = [_star(), _alias(_quoted(table.privacy_unit), "__u")]  # type: ignore[arg-type]
    rows_items += [_alias(lowered_key(kp.key), k) for kp, k in zip(plan.keys, ks, strict=True)]
    rows = _select(rows_items, _source(plan), where=_conditions(plan))
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
        _alias(_row_rank(table, [_name(c, "b") for c in gc]), "__r"),
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
    read = read_node(table)
    spec = None
    if sources.stored_scan(read) is not None:  # a stored table: its store can count it
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
            bin_of.copy(),
        )
    if table.privacy_unit is None:
        tree = _select(
            [_alias(bin_of, "b"), _alias(_count_star(), "c")],
            sources.source(read),
            where=[not_null],
            group=[exp.Literal.number(1)],
        )
        return CompiledQuery(tree, ("b",), ("c",), secret, clamp=spec)
    unit = _quoted(table.privacy_unit)
    rank = _row_rank(table, [unit])
    numbered = _select(
        [_alias(bin_of, "__b"), _alias(rank, "__r")], sources.source(read), where=[not_null]
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
        per_unit = _select([_alias(_count_star(), "n")], _table_source(table))
        per_unit.set("group", exp.Group(expressions=[unit]))
    else:
        lowered = [_alias(lowered_key(k), f"__k{i}") for i, k in enumerate(keys)]
        pairs = _select([_alias(unit, "__u"), *lowered], _table_source(table))
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
