"""Aggregate kinds as objects: what each measures, how it is released, how it is explained.

One object per kind (COUNT, COUNT(DISTINCT unit), SUM, AVG, VAR/STDDEV) holds everything that
differs between kinds and used to be spread over if/elif chains in the planner, the release,
the interval code and the released-table schema:

- ``measures(column)``: the exact integer aggregates (dpsql.sql.plan.Measure kinds) it reads;
  their sensitivities follow from the measure kinds and the plan's R and G;
- ``evaluate``: the released value as post-processing of the noisy measures;
- ``single_measure``: whether the value *is* one noisy measure (its interval is then the
  exact one of the discrete noise) and ``floor_zero`` (counts are released clamped at 0);
- ``error_terms``: the linearised noise of a formula (for intervals at other levels);
- ``released_type`` and ``output_bounds``: the released column's SQL type and clamp range.

New kinds (quantiles, MIN/MAX) are one more object here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from dpsql.policy import ColumnPolicy
    from dpsql.privacy.mechanisms import Mechanism
    from dpsql.sql.bind import AggregateCall
    from dpsql.sql.plan import Measure, OutputAggregate, Plan


def _values_measure(plan: Plan, sum_measure: Measure) -> Measure:
    """The count a centred sum adds centre × back: COUNT(col), or the shared COUNT(*) /
    unit count of a non-null column (dpsql.sql.sharing)."""
    if sum_measure.count is not None:
        return plan.measure(sum_measure.count)
    return next(m for m in plan.measures if m.kind == "values" and m.column == sum_measure.column)


@dataclass(frozen=True)
class AggregateKind:
    name: ClassVar[str]
    floor_zero: ClassVar[bool] = False

    def measures(self, column: str | None) -> list[tuple[str, str | None]]:
        raise NotImplementedError

    def evaluate(
        self, output: OutputAggregate, plan: Plan, values: dict[str, np.ndarray]
    ) -> np.ndarray:
        raise NotImplementedError

    def single_measure(self, first: Measure) -> bool:
        return False

    def interval_measures(self, output: OutputAggregate, plan: Plan) -> set[str]:
        """The measures whose noise the value's interval simulates."""
        return set(output.measures)

    def error_terms(
        self, output: OutputAggregate, plan: Plan, value: np.ndarray
    ) -> tuple[tuple[Mechanism, ...], np.ndarray]:
        raise NotImplementedError

    def released_type(self, column: ColumnPolicy | None) -> str:
        return "DOUBLE"

    def output_bounds(self, column: ColumnPolicy | None) -> tuple[float | None, float | None]:
        return None, None


@dataclass(frozen=True)
class Count(AggregateKind):
    """COUNT(*) / COUNT(col): rows (or non-NULL values), one per row, clamped at 0."""

    name: ClassVar[str] = "count"
    floor_zero: ClassVar[bool] = True

    def measures(self, column: str | None) -> list[tuple[str, str | None]]:
        return [("rows", None) if column is None else ("values", column)]

    def evaluate(self, output, plan, values):
        return np.maximum(values[output.measures[0]], 0.0)

    def single_measure(self, first):
        return True

    def released_type(self, column):
        return "BIGINT"


@dataclass(frozen=True)
class CountUnits(Count):
    """COUNT(DISTINCT unit): one per (unit, group) after bounding."""

    name: ClassVar[str] = "count_units"

    def measures(self, column):
        return [("units", None)]


@dataclass(frozen=True)
class CountDistinct(Count):
    """COUNT(DISTINCT col) of a column other than the unit: its distinct non-NULL values over
    the bounded rows; a unit's <= R rows per group add <= R of them (sensitivity as COUNT)."""

    name: ClassVar[str] = "count_distinct"

    def measures(self, column):
        return [("distinct", column)]


@dataclass(frozen=True)
class Sum(AggregateKind):
    """SUM(x): the fixed-point sum, centred on the range's midpoint when a count of x is
    measured anyway (SUM(x - c) + c * COUNT(x): half the per-row range)."""

    name: ClassVar[str] = "sum"

    def measures(self, column):
        return [("sum", column)]

    def evaluate(self, output, plan, values):
        first = plan.measure(output.measures[0])
        total = values[first.name].astype(float)
        if first.center:
            total = total + first.center * values[_values_measure(plan, first).name]
        return total * first.granularity

    def single_measure(self, first):
        return not first.center

    def interval_measures(self, output, plan):
        first = plan.measure(output.measures[0])
        names = set(output.measures)
        if first.center:
            names.add(_values_measure(plan, first).name)
        return names

    def error_terms(self, output, plan, value):
        first = plan.measure(output.measures[0])
        count = _values_measure(plan, first)
        ones = np.ones(len(value))
        # each weight per unit of its mechanism's noise (a rescaled measure's fine grid)
        weights = [ones / first.scale, first.center * ones / count.scale]
        return (first.mechanism, count.mechanism), np.stack(weights, axis=1)

    def released_type(self, column):
        return "BIGINT" if column is not None and column.type == "int" else "DOUBLE"


@dataclass(frozen=True)
class SumDistinct(AggregateKind):
    """SUM(DISTINCT x): the sum of the distinct fixed-point values of x (clamped, rounded to
    the granularity, NULLs out) among the bounded rows of each group, one ``distinct_sum``
    measure, never centred (a centre would not cancel: the count of distinct values is not
    measured). Released as SUM is: the noisy integer times the granularity."""

    name: ClassVar[str] = "sum_distinct"

    def measures(self, column):
        return [("distinct_sum", column)]

    def evaluate(self, output, plan, values):
        first = plan.measure(output.measures[0])
        return values[first.name].astype(float) * first.granularity

    def single_measure(self, first):
        return True

    def error_terms(self, output, plan, value):
        first = plan.measure(output.measures[0])
        return (first.mechanism,), np.ones(len(value))[:, None] / first.scale

    def released_type(self, column):
        return "BIGINT" if column is not None and column.type == "int" else "DOUBLE"


@dataclass(frozen=True)
class Mean(AggregateKind):
    """AVG(x) = noisy SUM / noisy COUNT, clamped to x's range (never "the mean's
    sensitivity")."""

    name: ClassVar[str] = "avg"

    def measures(self, column):
        return [("sum", column), ("values", column)]

    def evaluate(self, output, plan, values):
        first = plan.measure(output.measures[0])
        s, n = values[output.measures[0]], values[output.measures[1]]
        mean_y = s / np.maximum(n, 1.0)
        return np.clip((first.center + mean_y) * first.granularity, output.lower, output.upper)

    def error_terms(self, output, plan, value):
        first = plan.measure(output.measures[0])
        count = plan.measure(output.measures[1])
        mean = value / first.granularity - first.center
        ones = np.ones(len(value))
        weights = [ones / first.scale, -mean / count.scale]
        return (first.mechanism, count.mechanism), np.stack(weights, axis=1)

    def output_bounds(self, column):
        if column is None:
            return None, None
        return column.lower, column.upper


@dataclass(frozen=True)
class Variance(AggregateKind):
    """VAR_SAMP / VAR_POP / STDDEV_SAMP / STDDEV_POP from noisy SUM, COUNT and sum of
    squares, clamped to [0, (range / 2)²]."""

    name: ClassVar[str] = "var_samp"
    sample: bool = True
    root: bool = False

    def measures(self, column):
        return [("sum", column), ("values", column), ("sumsq", column)]

    def evaluate(self, output, plan, values):
        first = plan.measure(output.measures[0])
        s, n = values[output.measures[0]], values[output.measures[1]]
        denominator = np.maximum(n, 1.0)
        mean_y = s / denominator
        squares = plan.measure(output.measures[2])
        ey2 = values[squares.name] / denominator + squares.center2
        half_range = (first.hi - first.lo) / 2.0
        var = np.clip(ey2 - mean_y**2, 0.0, half_range**2)
        if self.sample:
            var = np.where(denominator > 1, var * denominator / np.maximum(denominator - 1, 1), var)
        var = var * first.granularity**2
        return np.sqrt(var) if self.root else var

    def error_terms(self, output, plan, value):
        squares = plan.measure(output.measures[2])
        return (squares.mechanism,), np.ones(len(value))[:, None] / squares.scale


def quantile_target(call: AggregateCall) -> tuple[str, float | None]:
    """The rank target of a quantile call: ("min", None), ("max", None) or ("quantile", q)
    (PERCENTILE at level 0 or 1 is MIN or MAX)."""
    if call.kind in ("min", "max"):
        return call.kind, None
    q = 0.5 if call.kind == "median" else float(call.level)  # type: ignore[arg-type]
    if q <= 0:
        return "min", None
    if q >= 1:
        return "max", None
    return "quantile", q


@dataclass(frozen=True)
class Quantile(AggregateKind):
    """MEDIAN / PERCENTILE_CONT / PERCENTILE_DISC / MIN / MAX: one rank target of the column's
    quantile measure (dpsql.sql.plan.QuantileMeasure), released per group by the exponential
    mechanism on the column's public grid. Not a formula over noisy sums: ``measures`` is empty
    and the value is read from the quantile release. Its interval is in ranks (EXPLAIN states
    it), not in values: a value interval would need the data's quantile function, so the
    released table's interval columns are NULL for it."""

    name: ClassVar[str] = "quantile"

    def measures(self, column):
        return []

    def evaluate(self, output, plan, values):
        quantiles = plan.quantile_of(output)
        index = quantiles.targets.index(quantile_target(output.call))
        return values[quantiles.name][:, index]

    def released_type(self, column):
        return "DOUBLE"

    def output_bounds(self, column):
        if column is None:
            return None, None
        return column.lower, column.upper


KINDS: dict[str, AggregateKind] = {
    "count": Count(),
    "count_units": CountUnits(),
    "count_distinct": CountDistinct(),
    "sum": Sum(),
    "sum_distinct": SumDistinct(),
    "avg": Mean(),
    "var_samp": Variance(sample=True),
    "var_pop": Variance(sample=False),
    "stddev_samp": Variance(sample=True, root=True),
    "stddev_pop": Variance(sample=False, root=True),
    "median": Quantile(),
    "percentile_cont": Quantile(),
    "percentile_disc": Quantile(),
    "min": Quantile(),
    "max": Quantile(),
}


def kind_of(output: OutputAggregate) -> AggregateKind:
    return KINDS[output.call.kind]
