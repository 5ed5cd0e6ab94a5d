"""Group by the columns a key reads, then by the key: the same sums, a key evaluated per group.

``GROUP BY smoker, FLOOR(age / 10) * 10`` evaluates its key on every row and hashes a double
per row. When every column the keys read has a small public domain (age 0..100, a boolean, a
declared list of values), the rows can first be grouped by those columns themselves: a few
hundred groups, which DuckDB aggregates with a perfect hash on the stored integers. The keys
are then evaluated on those groups only, and their partial sums and counts summed again.

Exact: a key is a function of the columns it reads, so each inner group falls in exactly one
outer group, and sums and counts of integers are associative (every aggregate this applies
to is a SUM or COUNT; anything else keeps the one-level plan). Whether it applies depends on
the policy and the query only, never on the data: the data's values decide only how many
inner groups there are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlglot import exp

from dpsql.policy import ColumnPolicy, TablePolicy

# DuckDB's default perfect hash threshold (perfect_ht_threshold = 12 bits)
INNER_GROUPS = 4096
# the inner query's alias (Spark's renderer widens the sums inside it: dpsql.lower.compile)
INNER = "__fold"


def domain_size(col: ColumnPolicy) -> int | None:
    """How many values the column's public domain holds, NULL included; None if unknown or
    not small (floats, free text, dates)."""
    if col.expr is not None:
        return None
    size: int | None = None
    if col.values is not None:
        size = len(col.values)
    elif col.type == "bool":
        size = 2
    elif col.type == "int" and col.bounded and col.granularity == 1:
        size = int(col.upper) - int(col.lower) + 1  # type: ignore[arg-type]
    if size is None:
        return None
    return size + 1 if col.nullable else size


def fold_columns(table: TablePolicy, keys: Sequence[exp.Expression]) -> list[str] | None:
    """The columns to group by first, or None: at least one key is an expression (a bare
    column gains nothing), and the columns the keys read have at most :data:`INNER_GROUPS`
    value combinations in their public domains."""
    if not keys or all(isinstance(k, exp.Column) for k in keys):
        return None
    names: list[str] = []
    for key in keys:
        for column in key.find_all(exp.Column):
            if column.name not in names:
                names.append(column.name)
    if not names or any(n not in table.columns for n in names):
        return None
    sizes = [domain_size(table.columns[n]) for n in names]
    if any(s is None for s in sizes) or math.prod(sizes) > INNER_GROUPS:  # type: ignore[arg-type]
        return None
    return names


def foldable(aggregates: Sequence[exp.Expression]) -> bool:
    """Every aggregate call in these measures is SUM or non-DISTINCT COUNT (re-summable)."""
    for node in aggregates:
        for agg in node.find_all(exp.AggFunc):
            if isinstance(agg, exp.Sum) and not isinstance(agg.this, exp.Distinct):
                continue
            if isinstance(agg, exp.Count) and not isinstance(agg.this, exp.Distinct):
                continue
            return False
    return True


def folded(
    columns: list[str],
    keys: Sequence[tuple[exp.Expression, str]],
    measures: Sequence[tuple[exp.Expression, str]],
    source: exp.Expression,
    where: list[exp.Expression],
    lead: Sequence[tuple[str, exp.Expression]] = (),
) -> exp.Select:
    """``SELECT lead, keys, measures FROM source WHERE where GROUP BY lead, keys`` in two
    levels: inner groups by the ``lead`` expressions (name, expression) and ``columns`` (every
    aggregate call a column of its own), outer groups by the lead columns and the keys and sums
    those columns back into each measure's expression."""
    partials: dict[exp.Expression, str] = {}  # an aggregate call met twice is one partial

    def outer(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Sum | exp.Count):
            name = partials.setdefault(node, f"__f{len(partials)}")
            return exp.Sum(this=exp.column(name))
        return node

    outer_measures = [exp.alias_(m.transform(outer), name) for m, name in measures]
    inner_items: list[exp.Expr] = [exp.alias_(node.copy(), name) for name, node in lead]
    inner_items += [exp.column(n, quoted=True) for n in columns]
    width = len(inner_items)
    inner_items += [exp.alias_(node.copy(), name) for node, name in partials.items()]
    inner = exp.Select(expressions=inner_items).from_(source.copy(), copy=False)
    if where:
        inner = inner.where(*[w.copy() for w in where], copy=False)
    inner = inner.group_by(*[exp.Literal.number(i + 1) for i in range(width)], copy=False)
    items: list[exp.Expr] = [exp.column(name) for name, _ in lead]
    items += [exp.alias_(_unqualified(k), name) for k, name in keys]
    return (
        exp.Select(expressions=[*items, *outer_measures])
        .from_(exp.Subquery(this=inner, alias=exp.TableAlias(this=exp.to_identifier(INNER))))
        .group_by(*[exp.Literal.number(i + 1) for i in range(len(items))], copy=False)
    )


def _unqualified(key: exp.Expression) -> exp.Expression:
    """The key over the inner query's columns (any table qualifier dropped)."""

    def strip(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Column) and node.table:
            return exp.Column(this=node.this.copy())
        return node

    return key.transform(strip)
