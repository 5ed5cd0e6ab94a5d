"""Measure kinds as objects: what differs between the exact integer aggregates a plan measures.

A plan's :class:`dpsql.plan.values.Measure` names its kind (``rows``, ``values``, ``units``,
``distinct``, ``distinct_sum``, ``sum``, ``sumsq`` and the bias measures ``dropped``, ``cut``,
``clamped``; each one's definition and bound: dpsql.plan.values's comment above MEASURE_KINDS,
dpsql.plan.bias). Everything a consumer used to switch on that name for is asked of the kind's
object here (``Measure.measure_kind``), so a new measure kind is one more object in
:data:`MEASURE_KINDS`, plus its lowerings:

- ``what``: what the engine sums, as EXPLAIN says it; ``shown``: the noise's words in a plot;
- ``counted``: each row (value, pair) adds 0 or 1, so a row's bound is 1 and no column range
  is read; ``per_pair``: one value per kept (unit, group) pair rather than per row, so a
  unit's bound in a group is the row bound, not R times it;
- ``row_scaled`` / ``group_scaled`` / ``divided``: a rescaled bounding multiplies it by R/n
  (summed from row values) and by G/k (every measure read from the bounded rows but distinct
  ones), or its value is divided (``cut``: v·d/n); :meth:`MeasureKind.fine_grid` says whether
  a plan computes it on the fine grid;
  ``rounded``: a count, rounded per unit back to integers when rescaled (the proof:
  dpsql.plan.values above ROUNDING_MULTIPLIER);
- ``distinct``: counted by its own engine query over the bounded rows (sampling is kept);
- ``bias``: a bias estimate (dpsql.plan.bias), never an answer; ``bias_note``: what it
  measures in the bias note's words ({column}, {cap}: C = 2R);
- ``centred`` and ``squared``: fixed-point values centred on the range's midpoint when the
  column's count is measured anyway (the planner's count_of: the count of each centred
  kind's column); a sum of squares;
- ``non_null`` / ``one_row``: the measure it is equal to on every dataset where its column is
  never NULL (values: rows) and where a unit keeps one row per group with the units measured
  anyway (rows: units): dpsql.plan.sharing.canonical makes them one measure;
- ``stored`` / ``programmed``: the lowerings besides engine SQL that know the kind: the
  prepared store's plans (dpsql.lower.prepared_plan) and the numpy column programs
  (dpsql.lower.local_plan); a kind either does not know (a new one, by default) keeps the plain
  engine SQL;
- ``least_noise``: a sum of values (sensitivity many fixed-point units), released under pure ε
  with the noise of least E|X| at the charge (dpsql.privacy.mechanisms.quieter_sum_noise: the
  staircase, where it is quieter than the discrete Laplace); counts and the bias measures keep
  the discrete Laplace (at a sensitivity of a few units the two coincide);
- :meth:`MeasureKind.row_bound`: the largest |value| one row (or pair) adds, from the measure's
  fixed-point range alone (the plan tree re-derives each sensitivity from it: dpsql.plan.tree).

- how the engines' programs compute it (``programmed`` kinds; dpsql.engine.columnar, whose
  compiled store pass is dpsql.engine.clustered): ``tallied``, one of the programs' own
  counts, with no row value (per row the rows kept, ``per_pair`` the pairs kept: the units);
  ``kernel``, the compiled pass's code for it (the name of dpsql.engine.clustered's constant:
  ``VALUES``, ``SUM``, ``SUMSQ``, ``DROPPED``, ``CUT``; None: tallied, or not in the pass);
  ``reads``, what of its column one row's value is computed from: ``""`` nothing (a pair's
  rows), ``"nulls"`` whether it is NULL, ``"fixed"`` its fixed point at [lo, hi] (centred,
  and squared where ``squared``), ``"excess"`` its excess over the clamp (each the store's
  row of that role). The engines ask these, never the kind's name.

- its engine SQL, as sqlglot trees built with the public node constructors the lowering hands
  it (:class:`Builders`: dpsql.lower.builders): ``row_value`` (one row's integer, the numpy
  programs' and the reference queries' value), ``aggregate`` (the measure over a group's or a
  (unit, group) pair's rows, NULLs dropping out) and, for a pair-level bias measure,
  ``pair_value`` (over a pair's rows, from R). dpsql.lower.compile and dpsql.lower.bounding ask
  the object; no lowering switches on the kind's name.

A leaf module (it imports dpsql.plan.bias and sqlglot only; the plan precedes the lowering, so
the builders are passed in, never imported): the planner, the compiler, the engines, the plan
tree, the release and EXPLAIN all read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlglot import exp

from dpsql.plan import bias


class Builders(Protocol):
    """The public node constructors a kind builds its engine SQL with: dpsql.lower.builders,
    handed in by the lowering (tests/test_layering.py: the plan imports nothing of it).
    ``col`` is the measure's column (a dpsql.policy.ColumnPolicy)."""

    def column_value(self, col: Any) -> exp.Expression: ...
    def fixed_point(self, col: Any, lo: int, hi: int) -> exp.Expression: ...
    def clamp(self, x: exp.Expression, lower: int | float, upper: int | float) -> exp.Case: ...
    def cast(self, node: exp.Expression, to: str) -> exp.Cast: ...
    def number(self, value: int | float) -> exp.Expression: ...
    def count_star(self) -> exp.Count: ...
    def count_distinct(self, value: exp.Expression) -> exp.Count: ...
    def sum_distinct(self, value: exp.Expression) -> exp.Sum: ...
    def fraction(
        self,
        v: exp.Expression,
        factor: exp.Expression,
        most: int,
        n: exp.Expression,
        bound: int | None = None,
    ) -> exp.Expression: ...


class MeasureFacts(Protocol):
    """What a kind's SQL reads of its measure (dpsql.plan.values.Measure)."""

    @property
    def lo(self) -> int: ...
    @property
    def hi(self) -> int: ...
    @property
    def center(self) -> int: ...
    @property
    def center2(self) -> int: ...
    @property
    def scale(self) -> int: ...


# one row's (or one pair's) SQL: (measure, its column or None, the builders)
RowSql = Callable[[MeasureFacts, Any, Builders], exp.Expression]


@dataclass(frozen=True)
class MeasureKind:
    name: str
    what: str  # EXPLAIN: what the engine sums ({column}: as the analyst wrote it)
    shown: str | None = None  # a plot's words for its noise (None: never an error bar's part)
    bias_note: str = ""  # a bias measure: what it measures, in the bias note's words
    counted: bool = False
    per_pair: bool = False
    row_scaled: bool = False
    group_scaled: bool = False
    rounded: bool = False
    distinct: bool = False
    bias: bool = False
    centred: bool = False
    squared: bool = False
    divided: bool = False
    stored: bool = False
    programmed: bool = False
    least_noise: bool = False
    # the measure it is equal to on every dataset (dpsql.plan.sharing.canonical): where its
    # column is never NULL (COUNT(col) is COUNT(*): values -> rows), and where a unit keeps one
    # row per group (R = 1) and the units are measured anyway (COUNT(*) is the unit count)
    non_null: str | None = None
    one_row: str | None = None
    # how the engines' programs compute it (dpsql.engine.columnar's numpy programs and its
    # compiled store pass, dpsql.engine.clustered; module doc)
    tallied: bool = False
    kernel: str | None = None
    reads: str = ""
    # its engine SQL (module doc): one row's value (None: counted per row, unit or pair, or by
    # a distinct measure's own query), the aggregate over rows, a pair-level bias measure's value
    row_sql: RowSql | None = field(default=None, repr=False, compare=False)
    aggregate_sql: RowSql | None = field(default=None, repr=False, compare=False)
    pair_sql: Callable[[MeasureFacts, Any, Builders, int], exp.Expression] | None = field(
        default=None, repr=False, compare=False
    )

    def row_value(self, m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression | None:
        """One row's integer contribution to ``m`` over its column ``col``, as SQL built
        with ``sql``; None where the measure is counted per row, unit or pair."""
        return None if self.row_sql is None else self.row_sql(m, col, sql)

    def aggregate(self, m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
        """``m`` aggregated over raw rows (a group's, or a (unit, group) pair's): COUNT(*),
        COUNT(col), SUM(value), ...; the same total as SUM(row value), NULL rows dropping out
        by themselves (an all-NULL SUM is NULL, which the engine reads as 0)."""
        assert self.aggregate_sql is not None, "a pair-level bias measure is a pair_value"
        return self.aggregate_sql(m, col, sql)

    def pair_value(self, m: MeasureFacts, col: Any, sql: Builders, R: int) -> exp.Expression:
        """A pair-level bias measure over a (unit, group)'s rows grouped together, in m's
        fine grid (dpsql.plan.bias), with R rows kept per pair."""
        assert self.pair_sql is not None, "only a pair-level bias measure has a pair value"
        return self.pair_sql(m, col, sql, R)

    def fine_grid(self, bounding: str, group_scaling: bool) -> bool:
        """Whether a plan with this ``bounding`` (and group scaling) computes the measure on
        a fine grid (dpsql.plan.values.rescale_factor): where its values are scaled (R/n, G/k)
        or divided, so that truncation toward zero loses < 2^-20 of a row per pair."""
        return (
            (bounding == "scale" and self.row_scaled)
            or (group_scaling and self.group_scaled)
            or self.divided
        )

    @property
    def row_tally(self) -> bool:
        """The programs' own count of the rows kept (``tallied``, per row): in the bounded
        pairs' SQL, each pair's ``__n``."""
        return self.tallied and not self.per_pair

    def row_bound(self, lo: int, hi: int, center: int, center2: int, R: int) -> int:
        """The largest |value| one row (one pair: ``per_pair``) adds to a measure of this
        kind with the fixed-point range [lo, hi], centre and (sumsq) second centre; a bias
        measure's from R and the range (dpsql.plan.bias.row_bound)."""
        if self.counted:
            return 1
        if self.bias:
            return bias.row_bound(self.name, lo, hi, R)
        c = center if self.centred else 0  # SUM(DISTINCT x) is never centred
        centred = max(abs(lo - c), abs(hi - c))
        if not self.squared:
            return centred
        span = centred * centred  # squared centred values lie in [0, span], less center2
        return max(center2, span - center2)


# -- the kinds' engine SQL (built with the builders handed in: MeasureKind.row_value etc.) ----


def _count_rows(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    """``COUNT(*)``: the group's (the pair's) rows."""
    return sql.count_star()


def _count_values(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    """``COUNT(col)``: its non-NULL values."""
    return exp.Count(this=sql.column_value(col))


def _is_null(col: Any, sql: Builders) -> exp.Expression:
    return exp.Is(this=sql.column_value(col), expression=exp.Null())


def _value_flag(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    """A row's count of values: 0 for NULL, else 1."""
    is_null = _is_null(col, sql)
    return exp.Case(ifs=[exp.If(this=is_null, true=sql.number(0))], default=sql.number(1))


def _centred(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    """The row's fixed-point value minus the measure's centre (none when it is 0)."""
    value = sql.fixed_point(col, m.lo, m.hi)
    return exp.Sub(this=value, expression=sql.number(m.center)) if m.center else value


def _squared(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    """``(centred) * (centred) - center2``: the row's sumsq contribution."""
    square = exp.Mul(
        this=exp.Paren(this=_centred(m, col, sql)), expression=exp.Paren(this=_centred(m, col, sql))
    )
    return exp.Sub(this=square, expression=sql.number(m.center2)) if m.center2 else square


def _clamp_excess(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    """A ``clamped`` bias measure's row value (dpsql.plan.bias): round((x − clamp(x)) / g)
    within [−W, W], W = hi − lo, as BIGINT (NULL for NULL). The quotient is clamped before
    ROUND (a NaN or infinite excess goes to a bound), so the value lies in [−W, W]."""
    x = sql.cast(sql.column_value(col), "DOUBLE")
    excess = exp.Paren(this=exp.Sub(this=x, expression=sql.clamp(x.copy(), col.lower, col.upper)))
    quotient = exp.Div(this=excess, expression=sql.number(col.granularity), typed=False, safe=False)
    width = max(m.hi - m.lo, 1)
    return sql.cast(exp.Round(this=sql.clamp(quotient, -width, width)), "BIGINT")


def _or_zero(value: RowSql) -> RowSql:
    """A row value that is ``value`` where the column is not NULL and a BIGINT 0 where it is."""

    def row(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
        zero = sql.cast(sql.number(0), "BIGINT")
        is_null = _is_null(col, sql)
        return exp.Case(ifs=[exp.If(this=is_null, true=zero)], default=value(m, col, sql))

    return row


def _summed(value: RowSql) -> RowSql:
    """``SUM(value)`` over the rows."""
    return lambda m, col, sql: exp.Sum(this=value(m, col, sql))


def _excess_or_zero(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    return exp.Coalesce(this=_clamp_excess(m, col, sql), expressions=[sql.number(0)])


def _count_distinct(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    """``COUNT(DISTINCT col)``: row-level plans only (bounded ones count it in their own
    query, dpsql.lower.compile's extras)."""
    return sql.count_distinct(sql.column_value(col))


def _sum_distinct(m: MeasureFacts, col: Any, sql: Builders) -> exp.Expression:
    """``SUM(DISTINCT fixed-point value)``, NULLs out (likewise)."""
    return sql.sum_distinct(sql.fixed_point(col, m.lo, m.hi))


def _cut_rows(m: MeasureFacts, col: Any, sql: Builders, R: int) -> exp.Expression:
    """``COUNT(*) - R`` clamped to [0, C], C = 2R: a pair's rows cut by R, in m's fine grid."""
    factor: exp.Expression = sql.clamp(
        exp.Sub(this=sql.count_star(), expression=sql.number(R)), 0, bias.cap(R)
    )
    if m.scale != 1:
        factor = exp.Mul(this=exp.Paren(this=factor), expression=sql.number(m.scale))
    return factor


def _cut_mass(m: MeasureFacts, col: Any, sql: Builders, R: int) -> exp.Expression:
    """The pair's clamped sum times its rows cut by R over its rows (truncated toward zero)."""
    factor = _cut_rows(m, col, sql, R)
    total = exp.Coalesce(
        this=exp.Sum(this=sql.fixed_point(col, m.lo, m.hi)), expressions=[sql.number(0)]
    )
    return sql.fraction(total, factor, bias.cap(R) * m.scale, sql.count_star())


def _kinds(*kinds: MeasureKind) -> dict[str, MeasureKind]:
    return {k.name: k for k in kinds}


#: every measure kind, in the order dpsql.plan.values documents them
MEASURE_KINDS: dict[str, MeasureKind] = _kinds(
    MeasureKind(
        "rows",
        "count of rows",
        "its row count",
        counted=True,
        tallied=True,
        group_scaled=True,
        rounded=True,
        stored=True,
        programmed=True,
        one_row="units",
        aggregate_sql=_count_rows,
    ),
    MeasureKind(
        "values",
        "count of non-NULL {column}",
        "its count of values",
        counted=True,
        row_scaled=True,
        group_scaled=True,
        rounded=True,
        stored=True,
        programmed=True,
        non_null="rows",
        kernel="VALUES",
        reads="nulls",
        row_sql=_value_flag,
        aggregate_sql=_count_values,
    ),
    MeasureKind(
        "units",
        "count of distinct units",
        "its count of units",
        counted=True,
        tallied=True,
        per_pair=True,
        group_scaled=True,
        rounded=True,
        stored=True,
        programmed=True,
        aggregate_sql=_count_rows,
    ),
    MeasureKind(
        "distinct",
        "count of distinct non-NULL {column} over the bounded rows",
        counted=True,
        distinct=True,
        aggregate_sql=_count_distinct,
    ),
    MeasureKind(
        "distinct_sum",
        "sum of distinct non-NULL {column} over the bounded rows",
        "its sum of distinct values",
        distinct=True,
        least_noise=True,
        aggregate_sql=_sum_distinct,
    ),
    MeasureKind(
        "sum",
        "sum of {column}",
        "its sum",
        row_scaled=True,
        group_scaled=True,
        centred=True,
        stored=True,
        programmed=True,
        least_noise=True,
        kernel="SUM",
        reads="fixed",
        row_sql=_or_zero(_centred),
        aggregate_sql=_summed(_centred),
    ),
    MeasureKind(
        "sumsq",
        "sum of squares of {column}",
        "its sum of squares",
        row_scaled=True,
        group_scaled=True,
        centred=True,
        squared=True,
        stored=True,
        programmed=True,
        least_noise=True,
        kernel="SUMSQ",
        reads="fixed",
        row_sql=_or_zero(_squared),
        aggregate_sql=_summed(_squared),
    ),
    MeasureKind(
        "dropped",
        "rows cut by R per unit and group, up to 2R",
        bias_note="rows cut by R (up to {cap} per unit and group)",
        per_pair=True,
        group_scaled=True,
        bias=True,
        programmed=True,
        kernel="DROPPED",
        pair_sql=_cut_rows,
    ),
    MeasureKind(
        "cut",
        "mass of {column} in the rows cut by R",
        bias_note="the {column} mass of those rows",
        per_pair=True,
        group_scaled=True,
        divided=True,
        bias=True,
        programmed=True,
        kernel="CUT",
        reads="fixed",
        pair_sql=_cut_mass,
    ),
    MeasureKind(
        "clamped",
        "mass of {column} cut by its clamp",
        bias_note="the {column} mass clamped (up to the range's width per row)",
        row_scaled=True,
        group_scaled=True,
        bias=True,
        programmed=True,
        kernel="SUM",
        reads="excess",
        row_sql=_excess_or_zero,
        aggregate_sql=_summed(_clamp_excess),
    ),
)
