"""Plan -> engine SQL computing exact, contribution-bounded, clamped, fixed-point aggregates.

The compiled query is a sqlglot expression built once; engines render it in their dialect.
The only engine-specific construct is ``DP_KEYED_HASH(..., secret)``, a keyed hash used to
choose which rows and groups a unit keeps, with a fresh secret per query (never the engine's
RANDOM(): selection must be a function of the unit's own rows only, and unpredictable).

Bounding with a privacy unit (R rows per group, G groups per unit):

1. ``base``     the filtered rows, with key values and per-row fixed-point measure values;
2. ``per_group`` one row per (unit, group) with its row count and partial sums over all rows;
3. ``sampled``  only for (unit, group) pairs over R rows: their R rows of smallest keyed hash,
                re-aggregated — usually a tiny fraction, which is what keeps this cheap
                compared with a row_number() window over every row;
4. ``bounded``  per_group where within R, plus the sampled pairs;
5. ``ranked``   (GROUP BY only) at most G groups per unit, by keyed hash of the key;
6. the final GROUP BY keys summing the bounded partials.

Row-level tables (every row its own unit) need no bounding: one scan and one GROUP BY.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlglot
from sqlglot import exp

from dpsql.policy import ColumnPolicy, TablePolicy
from dpsql.sql.bind import to_literal
from dpsql.sql.domains import SQL_TYPES
from dpsql.sql.plan import Measure, Plan

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

    return expression.transform(keyed).sql(dialect=dialect)


def _q(name: str) -> str:
    return exp.to_identifier(name, quoted=True).sql(dialect="duckdb")


def _col(col: ColumnPolicy) -> str:
    return _q(col.name)


def _clamped_fixed_point(col: ColumnPolicy) -> str:
    """round(clamp(x) / g) as BIGINT: an integer in [lo, hi]."""
    c = _col(col)
    lower, upper = col.lower, col.upper
    if col.type == "int" and col.granularity == 1:
        return f"CAST(LEAST(GREATEST({c}, {int(lower)}), {int(upper)}) AS BIGINT)"  # type: ignore[arg-type]
    return (
        f"CAST(ROUND(LEAST(GREATEST(CAST({c} AS DOUBLE), {lower!r}), {upper!r}) "
        f"/ {col.granularity!r}) AS BIGINT)"
    )


def row_value(m: Measure, table: TablePolicy) -> str | None:
    """SQL of one row's integer contribution to a measure (None: counted per unit/row)."""
    if m.kind in ("rows", "units"):
        return None
    col = table.columns[m.column]  # type: ignore[index]
    c = _col(col)
    if m.kind == "values":
        return f"CASE WHEN {c} IS NULL THEN 0 ELSE 1 END"
    centred = _clamped_fixed_point(col) + (f" - {m.center}" if m.center else "")
    if m.kind == "sum":
        return f"CASE WHEN {c} IS NULL THEN CAST(0 AS BIGINT) ELSE {centred} END"
    squared = f"({centred}) * ({centred})" + (f" - {m.center2}" if m.center2 else "")
    return f"CASE WHEN {c} IS NULL THEN CAST(0 AS BIGINT) ELSE {squared} END"


def _domain_filters(plan: Plan) -> list[str]:
    """Keep rows whose key columns lie in their declared public domain."""
    table = plan.query.table
    filters: list[str] = []
    seen: set[str] = set()
    for kp in plan.keys:
        if kp.domain is None or _is_constant_case(kp.key.expr):
            continue
        for name in kp.key.columns:
            if name in seen:
                continue
            seen.add(name)
            col = table.columns[name]
            c = _col(col)
            if col.values is not None:
                items = ", ".join(
                    exp.cast(to_literal(v), SQL_TYPES[col.type]).sql(dialect="duckdb")
                    for v in col.values
                )
                cond = f"{c} IN ({items})"
            elif col.numeric and col.bounded:
                cond = f"{c} BETWEEN {col.lower!r} AND {col.upper!r}"
            else:
                cond = f"{c} IS NOT NULL"
            if col.nullable:
                cond = f"({cond} OR {c} IS NULL)"
            filters.append(cond)
    return filters


def _is_constant_case(node: exp.Expression) -> bool:
    from dpsql.sql.domains import _constant_case

    return _constant_case(node) is not None


def compile_plan(plan: Plan, secret: int) -> CompiledQuery:
    """Engine SQL for ``plan``; ``secret`` keys row and group selection for this query only."""
    query = plan.query
    table = query.table
    conditions = []
    if query.where is not None:
        # TRY: a row whose expression fails (CAST('x' AS INT), 1 // 0) is filtered out instead
        # of failing the query, so that an error can never reveal whether such a row exists.
        conditions.append(f"TRY({query.where.sql(dialect='duckdb')})")
    conditions.extend(_domain_filters(plan))
    where_sql = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    source = _q(table.name)

    keys = [f"k{i}" for i in range(len(plan.keys))]
    key_select = [f"TRY({kp.key.sql}) AS {k}" for kp, k in zip(plan.keys, keys, strict=True)]
    values = {m.name: row_value(m, table) for m in plan.measures}
    value_measures = [m for m in plan.measures if values[m.name] is not None]
    measure_cols = tuple(m.name for m in plan.measures)

    if table.privacy_unit is None:
        select = list(keys)
        for m in plan.measures:
            expr = values[m.name]
            select.append(f"COUNT(*) AS {m.name}" if expr is None else f"SUM({expr}) AS {m.name}")
        inner = ", ".join(key_select) if key_select else ""
        body = f"SELECT {', '.join(key_select + select[len(keys) :])} FROM {source}{where_sql}" + (
            f" GROUP BY {', '.join(str(i + 1) for i in range(len(keys)))}" if keys else ""
        )
        del inner
        return CompiledQuery(body, tuple(keys), measure_cols)

    unit = _q(table.privacy_unit)
    R, G = plan.max_rows, plan.max_groups
    all_columns = ", ".join(_q(c) for c in table.columns)
    group_cols = ["__u", *keys]
    gc = ", ".join(group_cols)
    vcols = [f"v_{m.name}" for m in value_measures]
    base_select = [f"{unit} AS __u", *key_select]
    base_select += [f"{values[m.name]} AS v_{m.name}" for m in value_measures]
    base_select.append(f"{KEYED_HASH}({all_columns}, {secret}) AS __h")
    sums = ", ".join(f"SUM({v}) AS {v}" for v in vcols)
    sums = f", {sums}" if sums else ""
    partition = ", ".join("b." + c for c in group_cols)
    ctes = [
        f"base AS (SELECT {', '.join(base_select)} FROM {source}{where_sql})",
        f"per_group AS (SELECT {gc}, COUNT(*) AS __n{sums} FROM base GROUP BY {gc})",
        (
            f"sampled AS (SELECT {gc}, COUNT(*) AS __n{sums} FROM ("
            f"SELECT b.*, ROW_NUMBER() OVER (PARTITION BY {partition} "
            f"ORDER BY b.__h) AS __r FROM base AS b WHERE ({gc}) IN "
            f"(SELECT {gc} FROM per_group WHERE __n > {R})) AS o "
            f"WHERE __r <= {R} GROUP BY {gc})"
        ),
        (f"bounded AS (SELECT * FROM per_group WHERE __n <= {R} UNION ALL SELECT * FROM sampled)"),
    ]
    final_source = "bounded"
    if keys:
        key_hash = f"{KEYED_HASH}({', '.join(keys)}, {secret})"
        ctes.append(
            f"ranked AS (SELECT * FROM bounded QUALIFY ROW_NUMBER() OVER "
            f"(PARTITION BY __u ORDER BY {key_hash}, {', '.join(keys)}) <= {G})"
        )
        final_source = "ranked"
    select = list(keys)
    for m in plan.measures:
        if m.kind == "rows":
            select.append(f"SUM(__n) AS {m.name}")
        elif m.kind == "units":
            select.append(f"COUNT(*) AS {m.name}")
        else:
            select.append(f"SUM(v_{m.name}) AS {m.name}")
    body = f"WITH {', '.join(ctes)} SELECT {', '.join(select)} FROM {final_source}" + (
        f" GROUP BY {', '.join(keys)}" if keys else ""
    )
    return CompiledQuery(body, tuple(keys), measure_cols)
