"""Plan -> engine SQL computing exact, contribution-bounded, clamped, fixed-point aggregates.

The compiled query is a sqlglot expression built once; engines render it in their dialect.
The only engine-specific construct is ``DP_KEYED_HASH(..., secret)``, a keyed hash used to
choose which rows and groups a unit keeps, with a fresh secret per query (never the engine's
RANDOM(): selection must be a function of the unit's own rows only, and unpredictable).

Bounding with a privacy unit (R rows per group, G groups per unit):

1. ``base``     one row per (unit, group): its row count and partial aggregates over all its
                rows, straight from the table (no per-row CTE: no hash, no copy of the rows);
                bare-column keys are filtered to their public domain here, on the pairs;
2. ``sampled``  only (unit, group) pairs over R rows re-read their rows (a semi join on the
                pair, NULL keys matching NULL) and keep the R of smallest keyed hash of the
                whole row -- the hash and the row_number() window run on those rows only;
3. ``bounded``  base where within R, plus the sampled pairs;
4. ``crowded``/``ranked`` (GROUP BY only, and only when G is below the number of public bins)
                units over G groups keep G, by keyed hash of the key; the other units' pairs
                bypass the window through an anti join;
5. the final GROUP BY keys summing the bounded partials.

A row_number() window over every row costs ~50x the plain query at 10 rows per unit; see
docs/performance.md for the measured figures of this plan.

Row-level tables (every row its own unit) need no bounding: one scan and one GROUP BY.
Plans whose measures are only row and unit counts skip the sampling step: any R of a pair's
n rows count min(n, R), so each pair is capped at min(n, R) directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sqlglot
from sqlglot import exp

from dpsql.policy import ColumnPolicy, TablePolicy
from dpsql.sql.bind import to_literal
from dpsql.sql.domains import SQL_TYPES
from dpsql.sql.identifiers import quote_ident as _q
from dpsql.sql.plan import Measure, Plan
from dpsql.sql.safety import where_conditions
from dpsql.sql.typecheck import lower_key

KEYED_HASH = "DP_KEYED_HASH"


@dataclass(frozen=True)
class CompiledQuery:
    """Engine SQL for one plan. ``key_columns`` and ``measure_columns`` name the result."""

    sql: str  # DuckDB dialect, with DP_KEYED_HASH(...) standing for the keyed hash
    key_columns: tuple[str, ...]
    measure_columns: tuple[str, ...]

    @property
    def expression(self) -> exp.Expression:
        """The query as a sqlglot tree (parsed on demand: DuckDB runs ``sql`` directly)."""
        return sqlglot.parse_one(self.sql, read="duckdb")

    def render(self, dialect: str = "duckdb") -> str:
        if dialect == "duckdb":
            return self.sql.replace(f"{KEYED_HASH}(", "HASH(")
        return render(self.expression, dialect)


def render(expression: exp.Expression, dialect: str) -> str:
    """Render engine SQL, mapping DP_KEYED_HASH to the dialect's own fast hash."""

    def keyed(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Anonymous) and node.name.upper() == KEYED_HASH:
            fn = "HASH" if dialect == "duckdb" else "XXHASH64"
            return exp.Anonymous(this=fn, expressions=node.expressions)
        return node

    expression = expression.transform(keyed)
    if dialect == "spark":
        expression = _spark_safe(expression)
    return expression.sql(dialect=dialect)


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
      values reach within ~10^8 rows.
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
        if select.args.get("qualify") is not None and any(map(_is_star, select.expressions)):
            columns = _output_columns(select, ctes)
            if columns:
                select.set("expressions", [exp.column(c) for c in columns])
    outer = expression if isinstance(expression, exp.Select) else None
    if outer is not None:
        for total in [s for item in outer.expressions for s in item.find_all(exp.Sum)]:
            total.set("this", exp.cast(total.this, exp.DataType.build("DECIMAL(38, 0)")))
    return expression


def _is_star(item: exp.Expression) -> bool:
    return isinstance(item, exp.Star) or (
        isinstance(item, exp.Column) and isinstance(item.this, exp.Star)
    )


def _output_columns(query: exp.Expression, ctes: dict) -> list[str] | None:
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
        from_ = query.args.get("from_") or query.args.get("from")
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


def _col(col: ColumnPolicy) -> str:
    """A column's SQL: its quoted name, or for a computed column its expression under TRY
    (a row on which it fails -- an overflow, a bad cast -- gives NULL instead of an error
    that would reveal that such a row exists)."""
    if col.expr is not None:
        return f"TRY({col.expr})"
    return _q(col.name)


def _clamp(x: str, lower: str, upper: str) -> str:
    """clamp(x) to [lower, upper]; NULL stays NULL, NaN goes to ``upper`` (DuckDB orders NaN
    above every number). A CASE, not LEAST(GREATEST(...)): in DuckDB it is ~2x cheaper."""
    return f"CASE WHEN {x} < {lower} THEN {lower} WHEN {x} > {upper} THEN {upper} ELSE {x} END"


def fixed_point_value(col: ColumnPolicy, lo: int, hi: int) -> str:
    """One row's integer: round(x / g) within the plan's [lo, hi], as BIGINT (NULL for NULL).

    ``x / g`` is clamped to the integers lo and hi *before* ROUND, and any rounding rule is
    monotone and leaves integers alone, so the result lies in [lo, hi] whatever the engine's
    tie rule (DuckDB and Spark round half away from zero; the planner's ties go inward, see
    :func:`dpsql.sql.plan.fixed_point_bounds`): one unit moves each row's value by no more
    than the sensitivity assumes. One clamp costs what clamping x did; a second on the BIGINT
    would cost ~40% more per value. Past 2^53 a bound is not exact as a DOUBLE: there the
    BIGINT is clamped too.
    """
    c = _col(col)
    if col.type == "int" and col.granularity == 1:
        return f"CAST({_clamp(c, str(lo), str(hi))} AS BIGINT)"
    quotient = f"CAST({c} AS DOUBLE) / {col.granularity!r}"
    value = f"CAST(ROUND({_clamp(quotient, str(lo), str(hi))}) AS BIGINT)"
    if max(abs(lo), abs(hi)) > 2**53:
        value = _clamp(value, str(lo), str(hi))
    return value


def row_value(m: Measure, table: TablePolicy) -> str | None:
    """SQL of one row's integer contribution to a measure (None: counted per unit/row)."""
    if m.kind in ("rows", "units"):
        return None
    col = table.columns[m.column]  # type: ignore[index]
    c = _col(col)
    if m.kind == "values":
        return f"CASE WHEN {c} IS NULL THEN 0 ELSE 1 END"
    centred = fixed_point_value(col, m.lo, m.hi) + (f" - {m.center}" if m.center else "")
    if m.kind == "sum":
        return f"CASE WHEN {c} IS NULL THEN CAST(0 AS BIGINT) ELSE {centred} END"
    squared = f"({centred}) * ({centred})" + (f" - {m.center2}" if m.center2 else "")
    return f"CASE WHEN {c} IS NULL THEN CAST(0 AS BIGINT) ELSE {squared} END"


def measure_aggregate(m: Measure, table: TablePolicy) -> str:
    """One measure aggregated over raw rows: COUNT(*), COUNT(col) or SUM(value).

    Same totals as SUM(row_value) but cheaper: NULL rows drop out of COUNT(col) and SUM by
    themselves (an all-NULL SUM is NULL, which the engine reads as 0).
    """
    if m.kind in ("rows", "units"):
        return "COUNT(*)"
    col = table.columns[m.column]  # type: ignore[index]
    if m.kind == "values":
        return f"COUNT({_col(col)})"
    centred = fixed_point_value(col, m.lo, m.hi) + (f" - {m.center}" if m.center else "")
    if m.kind == "sum":
        return f"SUM({centred})"
    return f"SUM(({centred}) * ({centred})" + (f" - {m.center2})" if m.center2 else ")")


_FILTER_CACHE: dict[tuple[ColumnPolicy, str], str] = {}


def _domain_condition(col: ColumnPolicy, target: str) -> str:
    """``target`` lies in ``col``'s declared domain. Depends on the policy only: cached."""
    cache_key = (col, target)
    cond = _FILTER_CACHE.get(cache_key)
    if cond is not None:
        return cond
    if col.values is not None:
        items = ", ".join(
            exp.cast(to_literal(v), SQL_TYPES[col.type]).sql(dialect="duckdb") for v in col.values
        )
        cond = f"{target} IN ({items})"
    elif col.numeric and col.bounded:
        cond = f"{target} BETWEEN {col.lower!r} AND {col.upper!r}"
    else:
        cond = f"{target} IS NOT NULL"
    if col.nullable:
        cond = f"({cond} OR {target} IS NULL)"
    if len(_FILTER_CACHE) < 4096:
        _FILTER_CACHE[cache_key] = cond
    return cond


def _domain_filters(plan: Plan, *, skip_column_keys: bool = False) -> list[str]:
    """Keep rows whose key columns lie in their declared public domain.

    With ``skip_column_keys``, keys that are a bare column are left out: the caller filters
    those on the key itself (after aggregation, on far fewer values) or not at all (a row-level
    GROUP BY, whose groups outside the public domain are never released).
    """
    table = plan.query.table
    filters: list[str] = []
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
            col = table.columns[name]
            filters.append(_domain_condition(col, _col(col)))
    return filters


def _is_constant_case(node: exp.Expression) -> bool:
    from dpsql.sql.domains import _constant_case

    return _constant_case(node) is not None


def _key_select(plan: Plan) -> list[str]:
    """Key expressions as :func:`dpsql.sql.typecheck.lower_key` makes them releasable: under
    TRY (a failing row gets a NULL key; an error would reveal that such a row exists), cast
    to the released type, dates outside years 1..9999 as NULL."""
    return [lower_key(kp.key) for kp in plan.keys]


def compile_plan(plan: Plan, secret: int) -> CompiledQuery:
    """Engine SQL for ``plan``; ``secret`` keys row and group selection for this query only."""
    query = plan.query
    table = query.table
    row_level = table.privacy_unit is None
    conditions = []
    if query.where is not None:
        # TRY: a row whose expression fails (CAST('x' AS INT), 1 // 0) is filtered out instead
        # of failing the query, so that an error can never reveal whether such a row exists.
        # Conjuncts that cannot fail for any row run without it (dpsql.sql.safety).
        conditions.extend(where_conditions(query.where, table, "duckdb"))
    conditions.extend(_domain_filters(plan, skip_column_keys=True))
    if not row_level:
        # A row without a privacy unit belongs to nobody we can bound: it is never used.
        conditions.append(f"{_q(table.privacy_unit)} IS NOT NULL")
    where_sql = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    source = _q(table.name)
    measure_cols = tuple(m.name for m in plan.measures)
    keys = [f"k{i}" for i in range(len(plan.keys))]
    key_exprs = _key_select(plan)

    if row_level:
        select = [f"{e} AS {k}" for e, k in zip(key_exprs, keys, strict=True)]
        select += [f"{measure_aggregate(m, table)} AS {m.name}" for m in plan.measures]
        body = f"SELECT {', '.join(select)} FROM {source}{where_sql}" + (
            f" GROUP BY {', '.join(str(i + 1) for i in range(len(keys)))}" if keys else ""
        )
        return CompiledQuery(body, tuple(keys), measure_cols)
    return CompiledQuery(
        _bounded_sql(plan, secret, where_sql, key_exprs), tuple(keys), measure_cols
    )


def _bounded_sql(plan: Plan, secret: int, where_sql: str, key_exprs: list[str]) -> str:
    """Contribution bounding per privacy unit (see the module docstring for the plan)."""
    table = plan.query.table
    source = _q(table.name)
    unit = _q(table.privacy_unit)  # type: ignore[arg-type]
    R = plan.max_rows
    ks = [f"__k{i}" for i in range(len(plan.keys))]
    gc = ", ".join(["__u", *ks])
    value_measures = [m for m in plan.measures if m.kind not in ("rows", "units")]
    aggs = "".join(f", {measure_aggregate(m, table)} AS v_{m.name}" for m in value_measures)
    keyed = "".join(f", {e} AS {k}" for e, k in zip(key_exprs, ks, strict=True))
    # Bare-column keys are filtered to their public domain on the (unit, key) pairs.
    pair_filters = [
        _domain_condition(table.columns[kp.key.columns[0]], k)
        for kp, k in zip(plan.keys, ks, strict=True)
        if kp.domain is not None and isinstance(kp.key.expr, exp.Column)
    ]
    pairs = (
        f"SELECT {unit} AS __u{keyed}, COUNT(*) AS __n{aggs} FROM {source}{where_sql} GROUP BY {gc}"
    )
    if pair_filters:
        pairs = f"SELECT * FROM ({pairs}) AS p WHERE {' AND '.join(pair_filters)}"
    all_columns = ", ".join(_q(c) for c, spec in table.columns.items() if spec.expr is None)
    match = " AND ".join(["b.__u = o.__u"] + [f"b.{k} IS NOT DISTINCT FROM o.{k}" for k in ks])
    if not value_measures:
        # Only row and unit counts: any R of a pair's n rows count min(n, R), whichever the
        # keyed hash would pick, so the pair's count is capped without re-reading its rows.
        ctes = [f"bounded AS (SELECT {gc}, LEAST(__n, {R}) AS __n FROM ({pairs}) AS p)"]
        return _finish_bounded(plan, ctes, ks, secret)
    ctes = [
        f"base AS ({pairs})",
        # Only (unit, group) pairs over R rows re-read their rows: R of smallest keyed hash.
        (
            f"sampled AS (SELECT {gc}, COUNT(*) AS __n{aggs} FROM (SELECT b.*, ROW_NUMBER() "
            f"OVER (PARTITION BY {', '.join('b.' + c for c in ['__u', *ks])} ORDER BY "
            f"{KEYED_HASH}({all_columns}, {secret})) AS __r FROM (SELECT *, {unit} AS __u"
            f"{keyed} FROM {source}{where_sql}) AS b SEMI JOIN (SELECT {gc} FROM base "
            f"WHERE __n > {R}) AS o ON {match}) AS s WHERE __r <= {R} GROUP BY {gc})"
        ),
        f"bounded AS (SELECT * FROM base WHERE __n <= {R} UNION ALL SELECT * FROM sampled)",
    ]
    return _finish_bounded(plan, ctes, ks, secret)


def _finish_bounded(plan: Plan, ctes: list[str], ks: list[str], secret: int) -> str:
    """At most G groups per unit, then the final GROUP BY over the bounded pairs."""
    G = plan.max_groups
    final_source = "bounded"
    domains = [kp.domain for kp in plan.keys]
    bins = math.prod(len(d) for d in domains) if all(d is not None for d in domains) else None  # type: ignore[arg-type]
    if ks and (bins is None or bins > G):
        # At most G groups per unit, by keyed hash of (unit, key): each unit drops its own
        # groups, not the same groups for everyone. Only units over G are ranked.
        key_hash = f"{KEYED_HASH}(__u, {', '.join(ks)}, {secret})"
        same_unit = "b.__u IS NOT DISTINCT FROM c.__u"
        ctes += [
            f"crowded AS (SELECT __u FROM bounded GROUP BY __u HAVING COUNT(*) > {G})",
            (
                f"ranked AS (SELECT b.* FROM bounded AS b ANTI JOIN crowded AS c ON {same_unit} "
                f"UNION ALL SELECT * FROM (SELECT b.* FROM bounded AS b SEMI JOIN crowded AS c "
                f"ON {same_unit}) AS x QUALIFY ROW_NUMBER() OVER (PARTITION BY __u ORDER BY "
                f"{key_hash}, {', '.join(ks)}) <= {G})"
            ),
        ]
        final_source = "ranked"
    select = [f"{k} AS k{i}" for i, k in enumerate(ks)]
    for m in plan.measures:
        if m.kind == "rows":
            select.append(f"SUM(__n) AS {m.name}")
        elif m.kind == "units":
            select.append(f"COUNT(*) AS {m.name}")
        else:
            select.append(f"SUM(v_{m.name}) AS {m.name}")
    return f"WITH {', '.join(ctes)} SELECT {', '.join(select)} FROM {final_source}" + (
        f" GROUP BY {', '.join(ks)}" if ks else ""
    )
