"""Column programs: a bounded aggregate as data, for the DuckDB engine to run on a small
table's columns held in memory (dpsql.engine.columnar) instead of through its SQL.

Why: on the shipped 20k-row fixture DuckDB spends 1.5-4 ms binding, optimising and running
the three-step bounded SQL of a one-line query, against 0.4-0.8 ms for the plain query; the
same steps over columns already in memory cost ~0.1 ms (docs/performance.md, bench_small.py).

A program exists only for the plans whose SQL it mirrors step for step, with the same
integers (tests/test_columnar.py runs both on generated queries and data and compares them):

* row-level plans, and per-unit plans bounded by rescaling (``bounding = "scale"``, or counts
  only), with public keys scaled at G/k or at most G groups in all;
* keys that are bare stored columns of type int, text or bool;
* measures COUNT(*), COUNT(col), SUM and the sums of squares of fixed-point stored columns;
* a WHERE of comparisons, BETWEEN, IN and IS NULL between a stored column and literals of
  its kind (ISO dates for a date column), joined by AND, OR and NOT (dpsql.frontend.simple_where).

Anything else (keyed-hash sampling or ranking, quantiles, DISTINCT, computed columns, joins,
expressions, date keys) compiles to SQL only. Whether a plan has a program depends on the
policy and the query, never on the data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from sqlglot import exp

from dpsql.frontend.simple_where import KEY_TYPES, readable, stored, stored_column
from dpsql.lower.bounding import row_filter
from dpsql.lower.sources import stored_scan
from dpsql.plan.annotated import (
    Plan,
    bounds_groups,
    count_scale,
    value_measures,
)
from dpsql.plan.values import Measure

# the measure kinds a program computes (MeasureKind.programmed; its SQL:
# dpsql.lower.compile.measure_aggregate_expr); the bias measures (dpsql.plan.bias) run only as a
# compiled pass over a store (dpsql.engine.columnar.KERNEL_ONLY): elsewhere such a program's
# SQL runs


@dataclass(frozen=True)
class ColumnProgram:
    """What the engine computes, in the order the SQL does (dpsql.lower.compile._bounded).

    ``unit``: the privacy unit column (None: row-level); ``key_domains``: per key, whether
    pairs are kept only where the key lies in its column's declared domain (bare-column keys
    of unit plans); ``count_scale``: the fine grid of row and unit counts under group scaling.
    """

    table: str
    unit: str | None
    keys: tuple[str, ...]
    key_domains: tuple[bool, ...]
    measures: tuple[Measure, ...]  # the plan's own
    max_rows: int
    max_groups: int
    group_scaling: bool
    count_scale: int
    where: exp.Expression | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def columns(self) -> frozenset[str]:
        """Every column the program reads (the engine asks on every run)."""
        named = {*self.keys, *(m.column for m in self.measures if m.column is not None)}
        if self.unit is not None:
            named.add(self.unit)
        if self.where is not None:
            named.update(c.name for c in self.where.find_all(exp.Column))
        return frozenset(named)


def column_program(plan: Plan) -> ColumnProgram | None:
    """The program of ``plan``, or None when only its SQL computes it (see the module doc)."""
    query = plan.query
    table = query.table
    if not plan.measures or plan.quantiles or plan.clips:
        return None
    if stored_scan(plan.bound.input) is None:  # a join or a per-unit relation: SQL only
        return None
    if not all(m.measure_kind.programmed for m in plan.measures):
        return None
    if table.privacy_unit is not None:
        unit = table.columns.get(table.privacy_unit)
        if unit is None or unit.type not in KEY_TYPES:
            return None
        rescaling = plan.bounding == "scale" or not value_measures(plan)
        if not rescaling or not (plan.group_scaling or not bounds_groups(plan)):
            return None
        if unit.type != "int" and any(m.fine > 1 for m in plan.measures):
            return None  # a rounded count's offset is the engine's hash of such a unit
    for m in plan.measures:
        if m.column is not None and max(abs(m.lo), abs(m.hi)) > 2**53:
            return None
    keys = []
    for kp in plan.keys:
        spec = stored_column(kp.key.expr, table)
        if spec is None or KEY_TYPES.get(spec.type) != kp.key.type:
            return None
        keys.append(spec.name)
    # the rows' WHERE as the Bound node reads it (the Filter under it), as the SQL's
    # guarded WHERE reads it (dpsql.lower.bounding.row_conditions)
    where = row_filter(plan.bound.input)
    if where is not None and not readable(where, table):
        return None
    program = ColumnProgram(
        table=table.name,
        unit=table.privacy_unit,
        keys=tuple(keys),
        key_domains=tuple(
            table.privacy_unit is not None and kp.domain is not None for kp in plan.keys
        ),
        measures=plan.measures,
        max_rows=plan.max_rows,
        max_groups=plan.max_groups,
        group_scaling=plan.group_scaling,
        count_scale=count_scale(plan) if table.privacy_unit is not None else 1,
        where=where,
    )
    if any(stored(table, name) is None for name in program.columns):
        return None
    return program
