"""The per-unit relation's aggregates as objects (issue 26 item 4, kinds as objects).

A per-unit relation V (dpsql.frontend.per_unit) computes, in the engine, one exact aggregate
per unit (and extra key) over that unit's own rows: not a released value, so these are not the
DP aggregate kinds of dpsql.aggregates, though the binder binds each one as such a call first
(``SELECT agg FROM t WHERE ...``: the same checks as a flat query). One object per kind holds
what differs between them and used to be switches on their names in dpsql.frontend.per_unit
(binding, ranges) and dpsql.lower.sources (engine SQL):

- ``name``: the kind as V's spec names it (its identity text and EXPLAIN's description);
- ``function``: the analyst's aggregate function (a sqlglot node) that spells it, if one does;
  ``bound``: the binder's call of the same name (dpsql.aggregates) is computed as this kind;
- ``distinct``: this function with DISTINCT is bound as the function alone and computed as
  that kind (SUM(DISTINCT x): x bound as in SUM(x)); ``distinct_unit``: this function with
  DISTINCT over the privacy unit alone is that kind, never bound (COUNT(DISTINCT unit));
- ``reads_value``: it reads its argument's values (COUNT(DISTINCT unit) is 1 per unit row);
  ``picks_value``: its value is one of the values it reads (MIN, MAX): a column's own policy
  (any type, its declared values or dates) and it commutes with DATE_TRUNC (monotone);
- ``row_bounded``: its range grows with the rows it reads, so it reads the R kept rows of a
  pair only (COUNT, SUM); the others read every row of a kept pair;
- ``ranged(column, R)``: its range, type and granularity over a pair's rows, by interval
  arithmetic over the column's declared bounds (dpsql.frontend.per_unit's docstring);
- ``aggregate(value)``: its engine aggregate over the row values (dpsql.lower.sources).

A new kind is one more object here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.policy import default_granularity

#: the functions a per-unit relation computes, as its refusals list them
LISTED = "COUNT, COUNT(DISTINCT col), SUM, AVG, MIN or MAX"
#: the per-unit relation's shape with them (its refusals' hint)
SHAPE = (
    "a per-unit relation is SELECT unit [, columns], COUNT/SUM/AVG/MIN/MAX(...) AS name FROM t "
    "[WHERE ...] GROUP BY unit [, columns] [HAVING ...]"
)


@dataclass(frozen=True)
class Ranged:
    """A per-unit column's range over a pair's rows: ``out`` (before the analyst's clamp),
    its ``type`` ("int", "float" or, for MIN/MAX, the column's), ``granularity``, each row
    value's clamp (``row_clamp``: the column's declared bounds; None for a count) and whether
    the aggregate may be NULL."""

    out: tuple[float, float]
    type: str
    granularity: float
    row_clamp: tuple[float, float] | None = None
    nullable: bool = False


@dataclass(frozen=True)
class PerUnitKind:
    """One aggregate a per-unit relation computes (the module docstring)."""

    name: str
    ranged: Callable[[Any, int], Ranged]
    aggregate: Callable[[exp.Expression | None], exp.Expression]
    function: type[exp.Expression] | None = None
    spelled: str = ""
    bound: bool = True
    distinct: str | None = None
    distinct_unit: str | None = None
    reads_value: bool = True
    picks_value: bool = False
    row_bounded: bool = False


def _declared(column: Any) -> tuple[float, float]:
    assert column is not None and column.lower is not None and column.upper is not None
    return float(column.lower), float(column.upper)


def _values(column: Any, out: tuple[float, float], kind: str, granularity: float) -> Ranged:
    """A range over the column's values: each row's value clamped to its declared bounds."""
    nullable = column.nullable or column.expr is not None
    return Ranged(out, kind, granularity, _declared(column), nullable)


def _rows_counted(column: Any, rows: int) -> Ranged:
    """COUNT(*) counts 1 to R kept rows (a V row has one), COUNT(x) 0 to R."""
    return Ranged((1 if column is None else 0, rows), "int", 1.0)


def _distinct_counted(column: Any, rows: int) -> Ranged:
    return Ranged((0, rows), "int", 1.0)


def _one_unit(column: Any, rows: int) -> Ranged:
    return Ranged((1, 1), "int", 1.0)


def _summed(column: Any, rows: int) -> Ranged:
    """At most R values of [L, U]: [min(L, R·L), max(U, R·U)]."""
    lo, hi = _declared(column)
    out = (min(lo, rows * lo), max(hi, rows * hi))
    return _values(column, out, "int" if column.type == "int" else "float", column.granularity)


def _averaged(column: Any, rows: int) -> Ranged:
    lo, hi = _declared(column)
    granularity = (
        default_granularity("float", lo, hi) if column.type == "int" else column.granularity
    )
    return _values(column, (lo, hi), "float", granularity)


def _picked(column: Any, rows: int) -> Ranged:
    return _values(column, _declared(column), column.type, column.granularity)


def _value(value: exp.Expression | None) -> exp.Expression:
    assert value is not None
    return value


def _count(value: exp.Expression | None) -> exp.Expression:
    return exp.Count(this=value if value is not None else exp.Star())


KINDS: dict[str, PerUnitKind] = {
    kind.name: kind
    for kind in (
        PerUnitKind(
            "count",
            _rows_counted,
            _count,
            function=exp.Count,
            spelled="COUNT",
            distinct_unit="count_units",
            row_bounded=True,
        ),
        PerUnitKind(
            "count_units",
            _one_unit,
            lambda value: exp.Literal.number("1"),
            reads_value=False,
        ),
        PerUnitKind(
            "count_distinct",
            _distinct_counted,
            lambda value: exp.Count(this=exp.Distinct(expressions=[_value(value)])),
            row_bounded=True,
        ),
        PerUnitKind(
            "sum",
            _summed,
            lambda value: exp.Sum(this=_value(value)),
            function=exp.Sum,
            spelled="SUM",
            distinct="sum_distinct",
            row_bounded=True,
        ),
        PerUnitKind(
            "sum_distinct",
            _summed,
            lambda value: exp.Sum(this=exp.Distinct(expressions=[_value(value)])),
            bound=False,  # SUM(DISTINCT x) is bound as SUM(x): ``distinct`` of "sum"
            row_bounded=True,
        ),
        PerUnitKind(
            "avg",
            _averaged,
            lambda value: exp.Avg(this=_value(value)),
            function=exp.Avg,
            spelled="AVG",
        ),
        PerUnitKind(
            "min",
            _picked,
            lambda value: exp.Min(this=_value(value)),
            function=exp.Min,
            spelled="MIN",
            picks_value=True,
        ),
        PerUnitKind(
            "max",
            _picked,
            lambda value: exp.Max(this=_value(value)),
            function=exp.Max,
            spelled="MAX",
            picks_value=True,
        ),
    )
}
#: the analyst's aggregate functions -> the kind each spells
FUNCTIONS: dict[type[exp.Expression], PerUnitKind] = {
    kind.function: kind for kind in KINDS.values() if kind.function is not None
}
#: the binder's call kinds (dpsql.aggregates) a per-unit relation computes -> its kind
BOUND: dict[str, PerUnitKind] = {name: kind for name, kind in KINDS.items() if kind.bound}
