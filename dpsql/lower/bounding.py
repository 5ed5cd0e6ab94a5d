"""The steps of the bounded plan that the per-query compiler and the prepared-store lowering share.

The guarded WHERE and key domains of a plan (row_conditions), the measures' per-pair
aggregates (measure_aggregate_expr: each kind's object builds its own), the grouped SELECT,
the rescaling of pairs to R rows (rescaled, scaled_partial), G-group scaling (group_scaled),
the rounding of counts' fine shares back to integers per unit (rounded_counts) and the final
steps of the bounded plan (finish_bounded). dpsql.lower.compile documents the plan these steps
build; they live here, public, so that dpsql.lower.prepared_plan (the same plan over a prepared
store) reads them without importing the compiler, which chooses between the two lowerings.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlglot import exp

from dpsql.frontend.logic import conjuncts
from dpsql.frontend.safety import cannot_fail, guarded
from dpsql.frontend.statements import GroupKey
from dpsql.frontend.typecheck import DECIMAL_PATTERN, WIDE_INTEGERS
from dpsql.lower import builders, fold
from dpsql.lower.builders import (
    alias as _alias,
)
from dpsql.lower.builders import (
    count_star as _count_star,
)
from dpsql.lower.builders import (
    cte as _cte,
)
from dpsql.lower.builders import fraction as fraction_expr
from dpsql.lower.builders import (
    join as _join,
)
from dpsql.lower.builders import (
    row_number as _row_number,
)
from dpsql.lower.builders import (
    select as _select,
)
from dpsql.lower.builders import (
    star as _star,
)
from dpsql.lower.builders import (
    subquery as _subquery,
)
from dpsql.lower.builders import (
    table_ref as _table,
)
from dpsql.lower.builders import wide as wide
from dpsql.lower.hashing import (
    keyed_hash,
    secret_slot,
)
from dpsql.lower.row_values import cast as _cast
from dpsql.lower.row_values import domain_condition as _domain_condition
from dpsql.lower.row_values import fixed_point_value as fixed_point_value
from dpsql.lower.row_values import internal_name as _name
from dpsql.lower.row_values import number as _number
from dpsql.lower.row_values import quoted as _quoted
from dpsql.lower.row_values import sql_type as _type
from dpsql.plan.annotated import (
    Plan,
    bounds_groups,
    count_scale,
    value_measures,
)
from dpsql.plan.relational import Filter, Project
from dpsql.plan.values import Measure
from dpsql.policy import TablePolicy, declared_type


def measure_aggregate_expr(m: Measure, table: TablePolicy) -> exp.Expression:
    """One measure aggregated over raw rows (COUNT(*), COUNT(col), SUM(value), ...): its kind's
    object builds it (dpsql.plan.measure_kinds, MeasureKind.aggregate) with the builders."""
    col = None if m.column is None else table.columns[m.column]
    return m.measure_kind.aggregate(m, col, builders)


def domain_filter_exprs(plan: Plan, *, skip_column_keys: bool = False) -> list[exp.Expression]:
    """Keep rows whose key columns lie in their declared public domain.

    With ``skip_column_keys``, keys that are a bare column are left out: the caller filters
    those on the key itself (after aggregation, on far fewer values) or not at all (a row-level
    GROUP BY, whose groups outside the public domain are never released).
    """
    table = plan.query.table
    filters: list[exp.Expression] = []
    seen: set[str] = set()
    for kp in plan.keys:
        if kp.domain is None or is_constant_case(kp.key.expr):
            continue
        if skip_column_keys and isinstance(kp.key.expr, exp.Column):
            continue
        for name in kp.key.columns:
            if name in seen:
                continue
            seen.add(name)
            filters.append(_domain_condition(table.columns[name]))
    return filters


def is_constant_case(node: exp.Expression) -> bool:
    """A CASE of constants only (its values are its domain: no filter needed)."""
    from dpsql.plan.domains import constant_case

    return constant_case(node) is not None


DATE_RANGE = {
    "DATE": ("DATE", "0001-01-01", "9999-12-31"),
    "TIMESTAMP": ("TIMESTAMP", "0001-01-01 00:00:00", "9999-12-31 23:59:59.999999"),
}


def lowered_key(key: GroupKey) -> exp.Expression:
    """A key as a tree, such that every value it yields can be released: the tree of
    :func:`dpsql.frontend.typecheck.lower_key` (which enumerates public domains with the same
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
    bounds = DATE_RANGE.get(duck_type)
    if bounds is not None:
        kind, low, high = bounds
        within = exp.Between(
            this=exp.Paren(this=guarded()),
            low=_cast(exp.Literal.string(low), kind),
            high=_cast(exp.Literal.string(high), kind),
        )
        return exp.Case(ifs=[exp.If(this=within, true=exp.Paren(this=guarded()))])
    return guarded()


def row_filter(rows: object) -> exp.Expression | None:
    """The condition of the rows' Filter node, read by visiting the relational nodes the
    plan's Bound node reads (dpsql.plan.tree.relational_nodes: [Project] over [Filter] over
    Scan, PerUnit or PublicJoin); None: the rows are not filtered."""
    node = rows
    while isinstance(node, Project):
        node = node.input
    return node.condition if isinstance(node, Filter) else None


def row_conditions(plan: Plan) -> list[exp.Expression]:
    """The scan's WHERE: the analyst's conditions (risky ones under TRY), the public domains
    of non-column keys, and (with a privacy unit) rows that belong to a unit."""
    query = plan.query
    table = query.table
    conditions: list[exp.Expression] = []
    if (condition := row_filter(plan.bound.input)) is not None:
        # TRY: a row whose expression fails (CAST('x' AS INT), 1 // 0) is filtered out instead
        # of failing the query, so that an error can never reveal whether such a row exists.
        # Conjuncts that cannot fail for any row run without it: each conjunct's totality is
        # a fact of its node over the read table, computed once (dpsql.frontend.safety).
        read = query.read.table
        conditions.extend(guarded([(c, cannot_fail(c, read)) for c in conjuncts(condition)]))
    conditions.extend(domain_filter_exprs(plan, skip_column_keys=True))
    if table.privacy_unit is not None:
        # A row without a privacy unit belongs to nobody we can bound: it is never used.
        unit = _quoted(table.privacy_unit)
        conditions.append(exp.Not(this=exp.Is(this=unit, expression=exp.Null())))
    return conditions


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
    ``fold_keys`` (dpsql.lower.fold)."""
    conditions = row_conditions(plan) if where is None else where
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


def column_key_domains(plan: Plan, ks: list[str]) -> list[exp.Expression]:
    """Each bare-column key (named ``ks[i]``) in its public domain: bounding then counts a
    unit's groups among the released ones only."""
    table = plan.query.table
    return [
        _domain_condition(table.columns[kp.key.columns[0]], k)
        for kp, k in zip(plan.keys, ks, strict=True)
        if kp.domain is not None and isinstance(kp.key.expr, exp.Column)
    ]


def pair_measures(plan: Plan) -> list[Measure]:
    """Bias measures computed once per (unit, group) pair from all its rows (dpsql.plan.bias):
    computed in ``base``, carried through the bounding as they are."""
    return [m for m in plan.measures if m.measure_kind.bias and m.measure_kind.per_pair]


def scaled_partial(m: Measure, R: int, n: exp.Expression) -> exp.Expression:
    """A pair's partial ``v_m`` at R/n of its n rows, in m's fine grid (m.scale units per
    integer): ``(v · scale · LEAST(n, R)) // n``, truncated toward zero, so its magnitude is at
    most scale · R · row_bound (n rows of at most row_bound each) — sampling's bound."""
    capped = exp.Least(this=n.copy(), expressions=[_number(R)], ignore_nulls=True)
    factor = exp.Mul(this=_number(m.pair_scale), expression=capped)
    return fraction_expr(_name(f"v_{m.name}"), factor, m.pair_scale * R, n)


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
    items.append(_alias(fraction_expr(rows_factor, capped.copy(), G, k, bound=R * scale), "__n"))
    units = exp.IntDiv(
        this=exp.Mul(this=_number(scale), expression=exp.Paren(this=capped.copy())),
        expression=k.copy(),
    )
    items.append(_alias(units, "__units"))
    for m in value_measures(plan) + pair_measures(plan):
        bound = m.per_group_bound * m.fine  # a rounded count's share: on its fine grid
        scaled = fraction_expr(_name(f"v_{m.name}"), capped.copy(), G, k, bound=bound)
        items.append(_alias(scaled, f"v_{m.name}"))
    return _select(items, src)


def rounded_columns(plan: Plan) -> list[tuple[str, int]]:
    """The pair columns holding a count's fine-grid shares (dpsql.plan.values.ROUNDED_KINDS), each
    with its grid: what :func:`rounded_counts` rounds per unit."""
    column = {"rows": "__n", "units": "__units"}
    return [(column.get(m.kind, f"v_{m.name}"), m.fine) for m in plan.measures if m.fine > 1]


def unit_offset(plan: Plan, grid: int) -> exp.Expression:
    """U_u in [0, grid): the per-unit offset of the systematic rounding, a public function of
    the unit's id ``__u`` (dpsql.plan.values.ROUNDING_MULTIPLIER): for an integer unit
    ((u mod grid)·multiplier) mod grid, the same integers in every engine and in the column
    programs (dpsql.engine.columnar); else the engine's hash of u, no secret, mod grid."""
    from dpsql.plan.values import ROUNDING_MULTIPLIER

    table = plan.query.table
    unit_type = declared_type(table, table.privacy_unit)  # type: ignore[arg-type]
    g = _number(grid)
    if unit_type == "int":
        residue: exp.Expression = exp.Mod(this=_cast(_name("__u"), "BIGINT"), expression=g)
        mixed = exp.Mul(this=positive_mod(residue, grid), expression=_number(ROUNDING_MULTIPLIER))
        return exp.Mod(this=exp.Paren(this=mixed), expression=g.copy())
    return positive_mod(exp.Mod(this=keyed_hash([_name("__u")]), expression=g), grid)


def positive_mod(residue: exp.Expression, grid: int) -> exp.Expression:
    """``(residue + grid) % grid``: SQL's remainder takes the dividend's sign."""
    shifted = exp.Add(this=residue, expression=_number(grid))
    return exp.Mod(this=exp.Paren(this=shifted), expression=_number(grid))


def rounded_counts(plan: Plan, ks: list[str], source: str) -> exp.Expression:
    """The pairs of ``source`` with each count's fine-grid shares w rounded per unit to
    integers by systematic rounding (proof and notation: dpsql.plan.values, ROUNDED_KINDS): over
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
    columns = pair_columns(plan, ks)
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


def pair_columns(plan: Plan, ks: list[str]) -> list[str]:
    """The columns of the bounded pairs the final GROUP BY reads (after group scaling: with
    the unit counts ``__units``)."""
    out = ["__u", *ks, "__n"]
    if plan.group_scaling:
        out.append("__units")
    out += [f"v_{m.name}" for m in value_measures(plan) + pair_measures(plan)]
    return out


def rescaled(plan: Plan, ks: list[str], pairs: str, keep: tuple[str, ...] = ()) -> exp.Select:
    """The pairs of ``pairs`` bounded by rescaling (dpsql.plan.values): a row count capped at R,
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
    items += [_name(f"v_{m.name}") for m in pair_measures(plan)]  # per pair already
    return _select(items, _table(pairs))


def finish_bounded(
    plan: Plan, ctes: list[exp.CTE], ks: list[str], groups: str | None = None
) -> exp.Select:
    """At most G groups per unit, then the final GROUP BY over the bounded pairs (``groups``:
    a column of the bounded pairs holding each unit's pair count, else a window counts it)."""
    G = plan.max_groups
    final_source = "bounded"
    if plan.group_scaling:
        # public keys: a unit over G groups keeps all k of them at G/k (dpsql.plan.values)
        ctes.append(_cte("ranked", group_scaled(plan, ks, "bounded", groups)))
        final_source = "ranked"
    elif bounds_groups(plan):
        # At most G groups per unit, by keyed hash of (unit, key): each unit drops its own
        # groups, not the same groups for everyone. Only units over G are ranked.
        ctes.append(_cte("ranked", ranked_pairs(ks, G)))
        final_source = "ranked"
    if rounded_columns(plan):  # counts' fine shares back to integers, per unit
        ctes.append(_cte("rounded", rounded_counts(plan, ks, final_source)))
        final_source = "rounded"
    items: list[exp.Expression] = [_alias(_name(k), f"k{i}") for i, k in enumerate(ks)]
    for m in plan.measures:
        # a tally (MeasureKind.tallied): per row, the pairs' rows kept; per pair, the pairs
        if m.measure_kind.row_tally:
            total: exp.Expression = exp.Sum(this=_name("__n"))
        elif m.measure_kind.tallied:
            total = exp.Sum(this=_name("__units")) if plan.group_scaling else _count_star()
        elif m.measure_kind.distinct:
            total = _number(0)  # from its own query over the bounded rows (CompiledQuery.extras)
        else:
            total = exp.Sum(this=_name(f"v_{m.name}"))
        items.append(_alias(total, m.name))
    final = _select(items, _table(final_source), group=[_name(k) for k in ks] or None)
    final.set("with_", exp.With(expressions=ctes))
    return final


def ranked_pairs(ks: list[str], G: int) -> exp.Select:
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


# -- the rows each unit keeps (one function for every lowering that bounds rows per unit) ----


def row_order(table: TablePolicy) -> exp.Anonymous:
    """The order in which a unit's rows are kept: the keyed hash of the table's stored columns
    and the run's secret slot (dpsql.lower.hashing). A function of the row and the secret only,
    so which rows a unit keeps depends on that unit's own rows, never on anyone else's."""
    stored = [_quoted(c) for c, spec in table.columns.items() if spec.expr is None]
    return keyed_hash([*stored, secret_slot()])


def row_rank(table: TablePolicy, partition: Sequence[exp.Expression]) -> exp.Window:
    """``ROW_NUMBER() OVER (PARTITION BY partition ORDER BY row_order(table))``: a row's place
    among its unit's rows (``partition`` the unit) or its (unit, group)'s (the unit and the
    keys); the R first are the ones kept. The query plan's sampled pairs and histograms
    (dpsql.lower.compile) and :func:`unit_rows` all rank rows by this one window."""
    return _row_number(list(partition), [row_order(table)])


def unit_rows(
    table: TablePolicy,
    source: exp.Expression,
    where: Sequence[exp.Expression] = (),
    max_rows: int | None = None,
) -> exp.Select:
    """The rows of ``source`` (the table, or its joined source) that each privacy unit keeps:
    ``SELECT * FROM source WHERE where AND unit IS NOT NULL QUALIFY row_rank(table, [unit])
    <= R`` (R = ``max_rows``, the table's max_rows_per_unit by default), the R rows of
    smallest keyed hash of each unit; a row without a unit belongs to nobody we can bound and
    is never used. Without a privacy unit every row is its own unit: the WHERE alone.

    The row inputs of DP algorithms (dp_rule_list's pattern counts, the regressions' matrix:
    dpsql.lower.rows) are these rows; the tree holds the secret slot, filled per run."""
    conditions = list(where)
    if table.privacy_unit is None:
        return _select([_star()], source, where=conditions or None)
    unit = _quoted(table.privacy_unit)
    conditions.append(exp.Not(this=exp.Is(this=unit.copy(), expression=exp.Null())))
    R = table.max_rows_per_unit if max_rows is None else max_rows
    kept = exp.LTE(this=row_rank(table, [unit]), expression=_number(int(R)))
    return _select([_star()], source, where=conditions, qualify=kept)
