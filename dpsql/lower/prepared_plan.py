"""Plans over a prepared store (dpsql.engine.prepared): same exact measures, less work.

Row-level: one scan of the store, the fixed-point columns read as they are (no per-row clamp,
division or rounding), centred after aggregating (``SUM(fp) - c * COUNT(fp)``: exact in integer
arithmetic, so the same total).

Privacy unit, two phases:

1. ``direct``  rows whose statistics prove their (unit, group) pair holds at most R rows and their
               unit at most G groups go straight to a GROUP BY on the keys. A filter only removes
               rows, so the proof holds under any WHERE and domain filter, and the plan without a
               store would have kept every such row and pair as it is: same sums.
2. the others run the plan of dpsql.lower.compile (pairs, keyed-hash sampling of pairs over R,
               G groups per crowded unit) on the store's rows, the row hash read from the stored
               mix (``XOR(mix, HASH(secret))`` equals ``HASH(columns..., secret)`` bit for bit,
               checked when the store is built).

Bounding is per unit (samples within a pair, groups within a unit), so splitting the units
between the phases changes nothing: each unit keeps exactly the rows and groups it kept before.
The tree's shape depends on the policy and the store's layout only, never on the statistics.

With ``bounding = "scale"`` (dpsql.plan.values) phase 2 is one aggregate per pair, rescaled to R
rows (no window, no hash); a direct pair is within R, so its partial times the scale is exactly
what the rescaling gives it: the same measures as the plan without a store.
"""

from __future__ import annotations

from sqlglot import exp

from dpsql.lower import bounding, builders, hashing, row_values, sources
from dpsql.lower.store_layout import StoreInfo
from dpsql.plan.annotated import (
    Plan,
    bounds_groups,
    value_measures,
)
from dpsql.plan.values import Measure
from dpsql.policy import TablePolicy


def store_tree(plan: Plan, keys: tuple[str, ...], store: StoreInfo) -> exp.Expression | None:
    """The plan's engine query over ``store``; None when the store cannot serve it (COUNT of
    distinct units per group, which needs the pairs of every unit; measure kinds it does not
    know) or its plan would not be faster than the plan without one (:func:`two_phase_pays`):
    a store never makes a query slower."""
    # only the measure kinds this module knows (MeasureKind.stored: a kind added later keeps
    # the plain plan); a join (or a unit_path table) reads its joined source, not one
    # table's store
    if not plan.measures or not all(m.measure_kind.stored for m in plan.measures):
        return None
    if sources.stored_scan(plan.bound.input) is None:
        return None
    if plan.query.table.privacy_unit is None:
        return _row_level(plan, keys, store)
    # a measure per (unit, group) pair (the unit count) needs every unit's pairs
    if any(m.measure_kind.per_pair for m in plan.measures) or store.unit_rows is None:
        return None
    partials = _partials(plan, store)
    if partials is not None:
        return _from_partials(plan, store, partials)
    if not two_phase_pays(plan):
        return None
    return _two_phase(plan, store)


def two_phase_pays(plan: Plan) -> bool:
    """Whether the two-phase plan is never slower than the plan without a store, from the
    plan's shape alone (never the statistics: the data decide neither the plan nor its time).
    Counts only or rescaled (``_split``: one scan grouped by a CASE that folds the proven rows)
    with groups ranked (a unit may be in more than G groups): when every unit is over G no row
    is proven, and the store plan is the plain plan's (unit, key) aggregation grouped by that
    CASE over a wider relation, 1.1-1.2x the plan without a store (bench/bench_prepared_sql.py,
    docs/performance.md), so it runs without the store. Sampled (three scans), or groups not
    ranked (every row within R proven direct), the store plan is faster: 0.15-0.85x."""
    split = not value_measures(plan) or plan.bounding == "scale"
    return not (split and bounds_groups(plan))


def _partials(plan: Plan, store: StoreInfo) -> str | None:
    """The partials relation that holds this plan's (unit, group) pairs exactly, if any: no
    filter but the unit's (the analyst's WHERE would change them), no key or one bare column
    key with partials, and every summed measure over a stored fixed point of the plan's range.
    Sampling needs the rows themselves, so only rescaled plans and counts-only plans use it."""
    if bounding.row_filter(plan.bound.input) is not None or len(bounding.row_conditions(plan)) != 1:
        return None
    if plan.bounding != "scale" and value_measures(plan):
        return None
    if len(plan.keys) > 1:
        return None
    column = ""
    if plan.keys:
        key = plan.keys[0].key
        if not isinstance(key.expr, exp.Column) or bounding.lowered_key(key) != key.expr:
            return None
        column = key.columns[0]
    table = plan.query.table
    for m in value_measures(plan):
        if m.column not in store.partial_columns or _fixed(m, table, store) is None:
            return None
    return store.partials.get(column)


def _partial_value(m: Measure, store: StoreInfo) -> exp.Expression:
    """A pair's partial of m from the stored sums: the same integer as aggregating its rows."""
    s, q, n = (row_values.internal_name(name) for name in store.partial_columns[m.column])  # type: ignore[index]
    return _centred(m, s, q, n)


def _centred(m: Measure, s: exp.Expression, q: exp.Expression, n: exp.Expression) -> exp.Expression:
    """m's exact total from the sum s, sum of squares q and count n of its fixed-point values:
    COUNT(col) = n; SUM(fp - k) = s - k n; SUM((fp - k)^2 - k2) = q - 2k s + (k^2 - k2) n."""
    if m.measure_kind.counted:  # COUNT(col)
        return n
    if not m.measure_kind.squared:
        return exp.Sub(this=s, expression=_times(n, m.center)) if m.center else s
    total: exp.Expression = q
    if m.center:
        total = exp.Sub(this=total, expression=_times(s, 2 * m.center))
    constant = m.center * m.center - m.center2
    if constant:
        total = exp.Add(this=total, expression=_times(n, constant))
    return total


def _from_partials(plan: Plan, store: StoreInfo, relation: str) -> exp.Select:
    """The bounded plan over the stored (unit, group) partials: no row is read. The pairs are
    those of dpsql.lower.compile's ``base`` (same unit, key, row count and partial sums), so the
    bounding after them is the plan without a store, step for step."""
    ks = [f"__k{i}" for i in range(len(plan.keys))]
    items: list[exp.Expression] = [row_values.internal_name("__u")]
    items += [builders.alias(row_values.internal_name("__k"), k) for k in ks]
    items.append(row_values.internal_name("__n"))
    items += [builders.alias(_partial_value(m, store), f"v_{m.name}") for m in value_measures(plan)]
    if plan.group_scaling:  # the unit's pairs in the domain, counted when the store was built
        items.append(row_values.internal_name("__g"))
    pairs = builders.select(items, builders.named_table(relation, store.catalog))
    filters = bounding.column_key_domains(plan, ks)
    if filters:
        pairs = builders.select([builders.star()], builders.subquery(pairs, "p"), where=filters)
    keep = ("__g",) if plan.group_scaling else ()
    ctes = [
        builders.cte("base", pairs),
        builders.cte("bounded", bounding.rescaled(plan, ks, "base", keep)),
    ]
    return bounding.finish_bounded(plan, ctes, ks, groups=keep[0] if keep else None)


def _source(store: StoreInfo, alias: str | None = None) -> exp.Table:
    """The store's rows, by quoted names (a table's name may need quoting), optionally aliased."""
    table = builders.named_table(store.relation, store.catalog)
    if alias is not None:
        table.set("alias", exp.TableAlias(this=builders.ident(alias)))
    return table


def _fixed(m: Measure, table: TablePolicy, store: StoreInfo) -> exp.Expression | None:
    """The stored fixed-point column of m's column, if it has the plan's very range."""
    spec = store.fixed.get(m.column or "")
    if spec is None or table.columns[m.column].expr is not None:  # type: ignore[index]
        return None
    if not m.measure_kind.counted and spec[:2] != (m.lo, m.hi):  # a count reads no range
        return None
    return row_values.internal_name(spec[2])


def _times(node: exp.Expression, factor: int) -> exp.Expression:
    """``CAST(node AS INT128) * factor`` (HUGEINT): a count times a centre cannot overflow."""
    return exp.Mul(this=row_values.cast(node, "INT128"), expression=row_values.number(factor))


def aggregate(m: Measure, table: TablePolicy, store: StoreInfo) -> exp.Expression:
    """m aggregated over store rows: the stored fixed point, centred after summing."""
    fp = _fixed(m, table, store) if m.column is not None else None
    if fp is None:
        return bounding.measure_aggregate_expr(m, table)
    # the fixed point is NULL exactly where the column is: COUNT(fp) is COUNT(col)
    squares = exp.Sum(this=exp.Mul(this=fp.copy(), expression=fp.copy()))
    return _centred(m, exp.Sum(this=fp.copy()), squares, exp.Count(this=fp))


def _row_level(plan: Plan, keys: tuple[str, ...], store: StoreInfo) -> exp.Select:
    table = plan.query.table
    aggregates = [(aggregate(m, table, store), m.name) for m in plan.measures]
    return bounding.grouped_select(plan, keys, aggregates, _source(store))


# -- privacy unit ---------------------------------------------------------------------------


def _within(plan: Plan, store: StoreInfo) -> tuple[exp.Expression, exp.Expression | None]:
    """Whatever the query's filter, from the store's statistics on the row itself: is the row's
    (unit, group) pair within R rows, and (None: groups are not ranked) its unit within G?"""
    unit_rows = row_values.internal_name(store.unit_rows)  # type: ignore[arg-type]
    pair = [
        row_values.internal_name(store.pair_rows[kp.key.columns[0]])
        for kp in plan.keys
        if isinstance(kp.key.expr, exp.Column) and kp.key.columns[0] in store.pair_rows
    ]
    bound: exp.Expression = unit_rows
    if pair:
        bound = pair[0] if len(pair) == 1 else exp.Least(this=pair[0], expressions=pair[1:])
    rows_ok: exp.Expression = exp.LTE(this=bound, expression=row_values.number(plan.max_rows))
    if not bounds_groups(plan):
        return rows_ok, None
    G = row_values.number(plan.max_groups)
    groups_ok: exp.Expression = exp.LTE(this=unit_rows.copy(), expression=G)
    columns = sorted({name for kp in plan.keys for name in kp.key.columns})
    if columns and all(name in store.unit_keys for name in columns):
        product: exp.Expression = row_values.internal_name(store.unit_keys[columns[0]])
        for name in columns[1:]:
            product = exp.Mul(
                this=product, expression=row_values.internal_name(store.unit_keys[name])
            )
        groups_ok = exp.Paren(
            this=exp.Or(this=groups_ok, expression=exp.LTE(this=product, expression=G.copy()))
        )
    return rows_ok, groups_ok


def _not(condition: exp.Expression) -> exp.Expression:
    """NOT condition; ``a > b`` for ``a <= b`` (statistics are never NULL), which DuckDB can
    check against a row group's min/max and skip the group."""
    if isinstance(condition, exp.LTE):
        return exp.GT(this=condition.this.copy(), expression=condition.expression.copy())
    return exp.Not(this=exp.Paren(this=condition.copy()))


def _grouped(
    plan: Plan, store: StoreInfo, ks: list[str], condition: exp.Expression, *, by_unit: bool
) -> exp.Select:
    """Rows meeting ``condition`` grouped by (unit,) keys: row count and partial measures."""
    lead: list[tuple[str, exp.Expression]] = []
    if by_unit:
        lead.append(("__u", row_values.quoted(plan.query.table.privacy_unit)))  # type: ignore[arg-type]
    return _partials_by(plan, store, ks, lead, [condition], fold_keys=not by_unit)


def _partials_by(
    plan: Plan,
    store: StoreInfo,
    ks: list[str],
    lead: list[tuple[str, exp.Expression]],
    where: list[exp.Expression],
    *,
    fold_keys: bool = True,
) -> exp.Select:
    """The store's rows (the plan's conditions and ``where``) grouped by the ``lead`` columns
    (name, expression) and the keys: row count and partial measures, bare-column keys then
    filtered to their public domain."""
    table = plan.query.table
    aggregates: list[tuple[exp.Expression, str]] = [(builders.count_star(), "__n")]
    aggregates += [(aggregate(m, table, store), f"v_{m.name}") for m in value_measures(plan)]
    conditions = [*bounding.row_conditions(plan), *where]
    query = bounding.grouped_select(
        plan, ks, aggregates, _source(store), conditions, lead, fold_keys=fold_keys
    )
    filters = bounding.column_key_domains(plan, ks)
    if filters:
        query = builders.select([builders.star()], builders.subquery(query, "p"), where=filters)
    return query


def _split(plan: Plan, store: StoreInfo, ks: list[str], safe: exp.Expression) -> list[exp.CTE]:
    """One scan for both phases: rows grouped by (unit unless safe, keys), so the rows proven
    within R and G collapse into one partial per key (``direct``, unit NULL) and the others
    into one per (unit, key) (``pairs``); the same partials as two scans filtered by ``safe``
    and by its negation (statistics are never NULL, so every row is on exactly one side). A
    row without a unit is never read (dpsql.lower.bounding.row_conditions), so a NULL unit marks
    the proven side: no column of its own to compute and group by (~12% of the scan)."""
    unit = row_values.quoted(plan.query.table.privacy_unit)  # type: ignore[arg-type]
    unless_safe = exp.Case(ifs=[exp.If(this=safe.copy(), true=exp.Null())], default=unit)
    grouped = _partials_by(plan, store, ks, [("__u", unless_safe)], [])
    values = [f"v_{m.name}" for m in value_measures(plan)]
    proven = exp.Is(this=row_values.internal_name("__u"), expression=exp.Null())
    pairs = builders.select(
        [row_values.internal_name(n) for n in ["__u", *ks, "__n", *values]],
        builders.table_ref("grouped"),
        where=[exp.Not(this=proven)],
    )
    direct = builders.select(
        [row_values.internal_name(n) for n in [*ks, "__n", *values]],
        builders.table_ref("grouped"),
        where=[proven.copy()],
    )
    return [
        builders.cte("grouped", grouped),
        builders.cte("pairs", pairs),
        builders.cte("direct", direct),
    ]


def _sampled(plan: Plan, store: StoreInfo, ks: list[str], heavy: exp.Expression) -> exp.Select:
    """Rows whose pair may hold more than R rows: each pair keeps the R of smallest keyed hash
    (as dpsql.lower.compile._sampled), the hash from the stored mix. A pair the filter left
    within R keeps all its rows, as it would without a store; no pair count is needed first."""
    table = plan.query.table
    R = plan.max_rows
    gc = ["__u", *ks]
    partials = [aggregate(m, table, store) for m in value_measures(plan)]
    order: exp.Expression
    if store.hash_mix is not None:
        order = exp.BitwiseXor(
            this=row_values.internal_name(store.hash_mix),
            expression=hashing.keyed_hash([hashing.secret_slot()]),
        )
    else:
        order = bounding.row_order(table)
    # only the columns the partials and the order read go through the window (not the row)
    needed = {col.name: col for p in [*partials, order] for col in p.find_all(exp.Column)}
    rows_items: list[exp.Expression] = [col.copy() for col in needed.values()]
    rows_items.append(builders.alias(row_values.quoted(table.privacy_unit), "__u"))  # type: ignore[arg-type]
    rows_items += [
        builders.alias(bounding.lowered_key(kp.key), k) for kp, k in zip(plan.keys, ks, strict=True)
    ]
    rows = builders.select(
        rows_items, _source(store), where=[*bounding.row_conditions(plan), heavy]
    )
    ranked = builders.select(
        [
            builders.star("b"),
            builders.alias(
                builders.row_number([row_values.internal_name(n, "b") for n in gc], [order]), "__r"
            ),
        ],
        builders.subquery(rows, "b"),
    )
    items: list[exp.Expression] = [row_values.internal_name(n) for n in gc] + [
        builders.alias(builders.count_star(), "__n")
    ]
    items += [
        builders.alias(aggregate(m, table, store), f"v_{m.name}") for m in value_measures(plan)
    ]
    sampled = builders.select(
        items,
        builders.subquery(ranked, "s"),
        where=[exp.LTE(this=row_values.internal_name("__r"), expression=row_values.number(R))],
        group=[row_values.internal_name(n) for n in gc],
    )
    filters = bounding.column_key_domains(plan, ks)
    if filters:
        sampled = builders.select([builders.star()], builders.subquery(sampled, "p"), where=filters)
    return sampled


def _two_phase(plan: Plan, store: StoreInfo) -> exp.Select:
    """direct (pair within R, unit within G) + light (pair within R, unit maybe over G: its
    pairs as they are) + sampled (pair maybe over R), the last two ranked as before."""
    ks = [f"__k{i}" for i in range(len(plan.keys))]
    rows_ok, groups_ok = _within(plan, store)
    safe = rows_ok.copy()
    if groups_ok is not None:
        safe = exp.And(this=safe, expression=groups_ok.copy())
    # counts only (any R of a pair's n rows count min(n, R): no row is sampled) or rescaled:
    # every pair not proven within R and G aggregated as it is, then capped / rescaled to R
    split = not value_measures(plan) or plan.bounding == "scale"
    if split:
        ctes = [
            *_split(plan, store, ks, safe),
            builders.cte("bounded", bounding.rescaled(plan, ks, "pairs")),
        ]
    else:
        bounded: exp.Expression = builders.select([builders.star()], builders.table_ref("sampled"))
        ctes = [builders.cte("sampled", _sampled(plan, store, ks, _not(rows_ok)))]
        if groups_ok is not None:
            light = exp.And(this=rows_ok.copy(), expression=_not(groups_ok))
            ctes.append(builders.cte("light", _grouped(plan, store, ks, light, by_unit=True)))
            bounded = exp.Union(
                this=builders.select([builders.star()], builders.table_ref("light")),
                expression=bounded,
                distinct=False,
            )
        ctes.append(builders.cte("bounded", bounded))
    source = "bounded"
    if plan.group_scaling:  # a unit over G keeps its k pairs at G/k; all its rows are here
        ctes.append(builders.cte("ranked", bounding.group_scaled(plan, ks, "bounded", window=True)))
        source = "ranked"
    elif groups_ok is not None:
        G = plan.max_groups
        ctes.append(builders.cte("ranked", bounding.ranked_pairs(ks, G)))
        source = "ranked"
    if bounding.rounded_columns(plan):  # counts' fine shares back to integers, per unit
        ctes.append(builders.cte("rounded", bounding.rounded_counts(plan, ks, source)))
        source = "rounded"
    if not split:
        ctes.append(builders.cte("direct", _grouped(plan, store, ks, safe, by_unit=False)))
    parts = [*ks, "__n", *[f"v_{m.name}" for m in value_measures(plan)]]
    direct: list[exp.Expression] = [row_values.internal_name(n) for n in ks]
    rows: exp.Expression = row_values.internal_name("__n")
    rows_scale = next((m.scale for m in plan.measures if m.measure_kind.row_tally), 1)
    if rows_scale != 1:  # a direct pair's unit is within G: its row count in the rows' grid
        rows = builders.alias(exp.Mul(this=rows, expression=row_values.number(rows_scale)), "__n")
    direct.append(rows)
    for m in value_measures(plan):  # a direct pair is within R: its partial times the scale
        v: exp.Expression = row_values.internal_name(f"v_{m.name}")
        if plan.bounding == "scale":
            v = builders.alias(
                exp.Mul(this=bounding.wide(v), expression=row_values.number(m.scale)), f"v_{m.name}"
            )
        direct.append(v)
    both = exp.Union(
        this=builders.select(
            [row_values.internal_name(n) for n in parts], builders.table_ref(source)
        ),
        expression=builders.select(direct, builders.table_ref("direct")),
        distinct=False,
    )
    items: list[exp.Expression] = [
        builders.alias(row_values.internal_name(k), f"k{i}") for i, k in enumerate(ks)
    ]
    for m in plan.measures:
        name = "__n" if m.measure_kind.row_tally else f"v_{m.name}"
        items.append(builders.alias(exp.Sum(this=row_values.internal_name(name)), m.name))
    final = builders.select(
        items, builders.subquery(both, "f"), group=[row_values.internal_name(k) for k in ks] or None
    )
    final.set("with_", exp.With(expressions=ctes))
    return final
