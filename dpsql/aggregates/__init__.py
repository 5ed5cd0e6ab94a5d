"""Aggregate kinds as objects: what each measures, how it is released, how it is explained.

One object per kind (COUNT, COUNT(DISTINCT unit), SUM, AVG, VAR/STDDEV) holds everything that
differs between kinds and used to be spread over if/elif chains in the planner, the release,
the interval code and the released-table schema:

- ``measures(column)``: the exact integer aggregates (dpsql.plan.values.Measure kinds) it reads;
  their sensitivities follow from the measure kinds and the plan's R and G;
- ``evaluate``: the released value as post-processing of the noisy measures;
- ``single_measure``: whether the value *is* one noisy measure (its interval is then the
  exact one of the discrete noise) and ``floor_zero`` (counts are released clamped at 0);
- ``error_terms``: the linearised noise of a formula (for intervals at other levels);
- ``released_type`` and ``output_bounds``: the released column's SQL type and clamp range.

- ``explain``: the one-line formula EXPLAIN shows; ``summed`` (automatic clipping reads it),
  ``histogram`` (the kind of histogram measure a rank- or value-released kind reads:
  "quantile", "mode"; dpsql.plan.values builds it through ``histogram_measure``);
- ``column_problem``: why the kind cannot aggregate a column (the binder's refusal, free);
- ``bias_reads`` and ``bias_estimate``: the bias measures (dpsql.plan.bias) that estimate its
  bias and the estimate from their noisy values (dpsql.plan.bias and dpsql.privacy.bias ask);
- ``reads_values``: it reads its column's values, not only which are NULL (COUNT(col) does
  not: a column only counted besides keeps the clamp chosen for its sums, dpsql.service.bounds);
  ``ratio``: its value is its first measure (a sum) over its second (a count), so in a group of
  n rows its noise is about the sum's over n (EXPLAIN's line, dpsql.plots); ``group_clamp``:
  its column's default clamp may be chosen per group, from the count it releases, where every
  call of the column is such a kind (dpsql.service.group_clamps: AVG); ``recentred``: its value
  adds the centre times a count back where its sum measure is centred (SUM: g (S + c N); the
  error plots simulate both noises);
- ``counts``, ``distinct``, ``distinct_unit`` and ``leveled``: how the binder
  (dpsql.frontend.bind.calls) binds a call of its function: COUNT counts (COUNT(*) and
  COUNT(constant) its rows, COUNT(col) of any column, the privacy unit's too, with no range);
  its DISTINCT form (COUNT: count_distinct, SUM: sum_distinct; none: refused) and, of the
  privacy unit, COUNT's (count_units); PERCENTILE_CONT/DISC state their level in the call;
- ``FUNCTIONS``: the analyst's aggregate functions (sqlglot nodes) bound to each kind.

New kinds are one more object here (MODE: :class:`ModeKind` and dpsql.aggregates.mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from sqlglot import exp

from dpsql.aggregates.mode import MAX_MODE_DOMAIN, ModeMeasure, group_epsilon
from dpsql.aggregates.views import CallView, MeasureView, OutputView, PlanView

if TYPE_CHECKING:
    from dpsql.policy import ColumnPolicy
    from dpsql.privacy.mechanisms import Mechanism

Spec = tuple[str, str | None]  # a measure's (kind, column), as dpsql.plan.sharing names it
# a bias measure's noisy value per group in answer units and its noise's half-width; None:
# not measured (dpsql.privacy.bias)
BiasPart = tuple[np.ndarray, float] | None


def _mass(parts: dict[str, BiasPart], n: int) -> tuple[np.ndarray, float] | None:
    """The mass the bounds cut from a sum (``cut`` + ``clamped``), None where neither is
    measured; an absent one adds 0."""
    cut, clamped = parts.get("cut"), parts.get("clamped")
    if cut is None and clamped is None:
        return None
    c, hc = cut if cut is not None else (np.zeros(n), 0.0)
    k, hk = clamped if clamped is not None else (np.zeros(n), 0.0)
    return c + k, hc + hk


def values_measure(plan: PlanView, sum_measure: MeasureView) -> MeasureView:
    """The count a centred sum adds centre × back: COUNT(col), or the shared COUNT(*) /
    unit count of a non-null column (dpsql.plan.sharing)."""
    if sum_measure.count is not None:
        return plan.measure(sum_measure.count)
    return next(m for m in plan.measures if m.kind == "values" and m.column == sum_measure.column)


@dataclass(frozen=True)
class AggregateKind:
    name: ClassVar[str]
    floor_zero: ClassVar[bool] = False
    explain: ClassVar[str] = ""
    summed: ClassVar[bool] = False  # sums a column's values (automatic clipping applies)
    histogram: ClassVar[str | None] = None  # "quantile" | "mode": read from a histogram measure
    takes_expressions: ClassVar[bool] = True  # SUM(a * b): a computed column's range
    # the bias measures (dpsql.plan.bias: "dropped", "cut", "clamped") whose noisy values
    # estimate its bias (setting bias_estimate); none: it gets no bias estimate
    bias_reads: ClassVar[tuple[str, ...]] = ()
    # asked by the service and the plots (module doc): reads its column's values, not only
    # which are NULL; its value is a sum over a count; its column's clamp may be chosen per
    # group; its value adds the centre times a count back
    reads_values: ClassVar[bool] = True
    ratio: ClassVar[bool] = False
    group_clamp: ClassVar[bool] = False
    recentred: ClassVar[bool] = False
    # asked by the binder (module doc): it counts values or rows, never ranged; the kind its
    # DISTINCT form binds to (None: DISTINCT is refused) and that of DISTINCT privacy unit
    counts: ClassVar[bool] = False
    distinct: ClassVar[str | None] = None
    distinct_unit: ClassVar[str | None] = None

    @property
    def leveled(self) -> bool:
        """Its call states the level it releases (PERCENTILE_CONT/DISC: the binder reads it)."""
        return False

    def column_problem(
        self, upper: str, column: ColumnPolicy, table: str
    ) -> tuple[str, str] | None:
        """Why this kind (``upper``: its name as the message shows it) cannot aggregate
        ``column`` (what is wrong, what to do), or None: the binder refuses with it before
        any data is read. Default: a bounded number."""
        if not column.numeric:
            return (
                f"{upper}({column.name}): column is {column.type}, not a number",
                "aggregate an int or float column",
            )
        if not column.bounded:
            return (
                f"{upper}({column.name}) needs declared bounds",
                f"declare lower and upper for {column.name} in the policy "
                f"([tables.{table}.columns.{column.name}])",
            )
        return None

    def measures(self, column: str | None) -> list[tuple[str, str | None]]:
        raise NotImplementedError

    def evaluate(
        self, output: OutputView, plan: PlanView, values: dict[str, np.ndarray]
    ) -> np.ndarray:
        raise NotImplementedError

    def single_measure(self, first: MeasureView) -> bool:
        return False

    def interval_measures(self, output: OutputView, plan: PlanView) -> set[str]:
        """The measures whose noise the value's interval simulates."""
        return set(output.measures)

    def error_terms(
        self, output: OutputView, plan: PlanView, value: np.ndarray
    ) -> tuple[tuple[Mechanism, ...], np.ndarray]:
        raise NotImplementedError

    def label(self, call: CallView) -> str:
        """The call as EXPLAIN, messages and the answer's column show it."""
        shown = call.shown or call.column
        if call.level is not None:
            return f"{call.kind.upper()}({call.level:g}) WITHIN GROUP (ORDER BY {shown})"
        return f"{call.kind.upper()}({shown or '*'})"

    def noise_weights(
        self, parts: Sequence[Spec], sum_scale: Callable[[Spec], tuple[float, float, float]]
    ) -> dict[Spec, float]:
        """Per measure it reads, the weight of its noise in this output's relative error
        (times N), for the split of ε (dpsql.plan.sharing.output_coefficients: the formula
        and ``sum_scale``). Default: equal weights."""
        return dict.fromkeys(parts, 1.0)

    def histogram_measure(
        self, name: str, column: ColumnPolicy, max_values: int, groups: int, epsilon: float
    ) -> Any:
        """The histogram measure of a ``histogram`` kind other than "quantile" (whose targets
        of one column are released jointly: dpsql.plan.values builds those)."""
        raise NotImplementedError

    def bias_estimate(
        self,
        output: OutputView,
        parts: dict[str, BiasPart],
        noisy: dict[str, np.ndarray],
        value: np.ndarray,
    ) -> np.ndarray | None:
        """An (n_groups, 2) array of (bias estimate, its half-width) from the noisy bias
        measures it reads (``parts``, by kind: each one's value in answer units and its
        noise's half-width, None where the plan does not measure it; dpsql.privacy.bias), or
        None: no estimate."""
        return None

    def released_type(self, column: ColumnPolicy | None) -> str:
        return "DOUBLE"

    def output_bounds(self, column: ColumnPolicy | None) -> tuple[float | None, float | None]:
        return None, None


@dataclass(frozen=True)
class Count(AggregateKind):
    """COUNT(*) / COUNT(col): rows (or non-NULL values), one per row, clamped at 0."""

    name: ClassVar[str] = "count"
    floor_zero: ClassVar[bool] = True
    explain: ClassVar[str] = "the noisy count, clamped at 0"
    bias_reads: ClassVar[tuple[str, ...]] = ("dropped",)
    reads_values: ClassVar[bool] = False  # COUNT(col): which values are NULL only
    counts: ClassVar[bool] = True
    distinct: ClassVar[str | None] = "count_distinct"
    distinct_unit: ClassVar[str | None] = "count_units"

    def bias_estimate(self, output, parts, noisy, value):
        dropped = parts["dropped"]  # the rows R cut
        if dropped is None:
            return None
        d, h = dropped
        return np.stack([d, np.full(len(value), h)], axis=1)

    def measures(self, column: str | None) -> list[tuple[str, str | None]]:
        return [("rows", None) if column is None else ("values", column)]

    def evaluate(self, output, plan, values):
        return np.maximum(values[output.measures[0]], 0.0)

    def single_measure(self, first):
        return True

    def released_type(self, column):
        return "BIGINT"

    def noise_weights(self, parts, sum_scale):
        return {parts[0]: 1.0}  # error X_N / N


@dataclass(frozen=True)
class CountUnits(Count):
    """COUNT(DISTINCT unit): one per (unit, group) after bounding."""

    name: ClassVar[str] = "count_units"
    bias_reads: ClassVar[tuple[str, ...]] = ()
    reads_values: ClassVar[bool] = True  # its units (the unit column's values)
    distinct: ClassVar[str | None] = None  # a DISTINCT form's own kind (not bound from COUNT)
    distinct_unit: ClassVar[str | None] = None
    explain: ClassVar[str] = "the noisy count of units, clamped at 0"

    def measures(self, column):
        return [("units", None)]

    def label(self, call):
        return f"COUNT(DISTINCT {call.shown or call.column})"


@dataclass(frozen=True)
class CountDistinct(Count):
    """COUNT(DISTINCT col) of a column other than the unit: its distinct non-NULL values over
    the bounded rows; a unit's <= R rows per group add <= R of them (sensitivity as COUNT)."""

    name: ClassVar[str] = "count_distinct"
    bias_reads: ClassVar[tuple[str, ...]] = ()
    reads_values: ClassVar[bool] = True
    distinct: ClassVar[str | None] = None  # (likewise)
    distinct_unit: ClassVar[str | None] = None
    explain: ClassVar[str] = "the noisy count of distinct values, clamped at 0"

    def measures(self, column):
        return [("distinct", column)]

    def label(self, call):
        return f"COUNT(DISTINCT {call.shown or call.column})"


@dataclass(frozen=True)
class Sum(AggregateKind):
    """SUM(x): the fixed-point sum, centred on the range's midpoint when a count of x is
    measured anyway (SUM(x - c) + c * COUNT(x): half the per-row range)."""

    name: ClassVar[str] = "sum"
    explain: ClassVar[str] = "the noisy sum"
    summed: ClassVar[bool] = True
    recentred: ClassVar[bool] = True
    bias_reads: ClassVar[tuple[str, ...]] = ("cut", "clamped")
    distinct: ClassVar[str | None] = "sum_distinct"

    def bias_estimate(self, output, parts, noisy, value):
        mass = _mass(parts, len(value))  # the sum's cut mass
        if mass is None:
            return None
        return np.stack([mass[0], np.full(len(value), mass[1])], axis=1)

    def measures(self, column):
        return [("sum", column)]

    def noise_weights(self, parts, sum_scale):
        h, c, m = sum_scale(parts[0])  # error (X_S + c X_N) / (N M)
        out = {parts[0]: h / m}
        if c and len(parts) > 1:
            out[parts[1]] = abs(c) / m
        return out

    def evaluate(self, output, plan, values):
        first = plan.measure(output.measures[0])
        total = values[first.name].astype(float)
        if first.center:
            total = total + first.center * values[values_measure(plan, first).name]
        return total * first.granularity

    def single_measure(self, first):
        return not first.center

    def interval_measures(self, output, plan):
        first = plan.measure(output.measures[0])
        names = set(output.measures)
        if first.center:
            names.add(values_measure(plan, first).name)
        return names

    def error_terms(self, output, plan, value):
        first = plan.measure(output.measures[0])
        count = values_measure(plan, first)
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
    explain: ClassVar[str] = "the noisy sum of distinct values"

    def measures(self, column):
        return [("distinct_sum", column)]

    def label(self, call):
        return f"SUM(DISTINCT {call.shown or call.column})"

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
    explain: ClassVar[str] = "noisy sum / noisy count, clamped to the column's range"
    summed: ClassVar[bool] = True
    ratio: ClassVar[bool] = True
    group_clamp: ClassVar[bool] = True
    bias_reads: ClassVar[tuple[str, ...]] = ("dropped", "cut", "clamped")

    def bias_estimate(self, output, parts, noisy, value):
        cut = _mass(parts, len(value))
        if cut is None:
            return None
        mass, mass_half = cut
        # AVG = S / N: the uncut mean (S + mass) / (N + dropped), from the released values
        d, hd = parts["dropped"] or (np.zeros(len(value)), 0.0)
        count = np.maximum(np.asarray(noisy[output.measures[1]], dtype=float), 1.0)
        total = value * count
        uncut = np.maximum(count + d, 1.0)
        b = (total + mass) / uncut - value
        h = (mass_half + np.abs(value) * hd) / uncut
        return np.stack([b, h], axis=1)

    def measures(self, column):
        return [("sum", column), ("values", column)]

    def noise_weights(self, parts, sum_scale):
        h, _, m = sum_scale(parts[0])  # error (X_S − μ_c X_N) / (N M), |μ_c| <= h at worst
        return {parts[0]: h / m, parts[1]: h / m}

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
    summed: ClassVar[bool] = True
    sample: bool = True
    root: bool = False
    explain: str = "from noisy sum, count and sum of squares (sample variance)"  # type: ignore[misc]

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


def quantile_target(call: CallView) -> tuple[str, float | None]:
    """The rank target of a quantile call: ("min", None), ("max", None) or ("quantile", q)
    (PERCENTILE at level 0 or 1 is MIN or MAX): its kind's (:meth:`Quantile.target`)."""
    kind = KINDS[call.kind]
    assert isinstance(kind, Quantile), call.kind
    return kind.target(call)


@dataclass(frozen=True)
class Quantile(AggregateKind):
    """MEDIAN / PERCENTILE_CONT / PERCENTILE_DISC / MIN / MAX: one rank target of the column's
    quantile measure (dpsql.plan.values.QuantileMeasure), released per group by the exponential
    mechanism on the column's public grid. Not a formula over noisy sums: ``measures`` is empty
    and the value is read from the quantile release. Its interval is in ranks (EXPLAIN states
    it), not in values: a value interval would need the data's quantile function, so the
    released table's interval columns are NULL for it."""

    name: ClassVar[str] = "quantile"
    histogram: ClassVar[str | None] = "quantile"
    explain: str = "exponential mechanism on a public grid"  # type: ignore[misc]
    # the level it releases (MIN 0, MAX 1, MEDIAN 0.5); None: its call's (PERCENTILE_CONT/DISC)
    level: float | None = None

    @property
    def leveled(self) -> bool:
        return self.level is None

    def target(self, call: CallView) -> tuple[str, float | None]:
        """``call``'s rank target (:func:`quantile_target`): the level 0 is MIN's, 1 MAX's."""
        q = self.level if self.level is not None else float(call.level)  # type: ignore[arg-type]
        if q <= 0:
            return "min", None
        if q >= 1:
            return "max", None
        return "quantile", q

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


_MODE_TYPES = {"int": "BIGINT", "float": "DOUBLE", "text": "VARCHAR", "bool": "BOOLEAN"}


def mode_domain(column: ColumnPolicy) -> tuple[Any, ...] | None:
    """The public values MODE(column) chooses among, from the policy alone: declared
    ``values``, a bool's two, or a bounded int's range; None when there is none (or it has
    more than MAX_MODE_DOMAIN values, or the type has no released form here)."""
    if column.type not in _MODE_TYPES:
        return None
    if column.values is not None:
        domain: tuple[Any, ...] = tuple(column.values)
    elif column.type == "bool":
        domain = (False, True)
    elif column.type == "int" and column.bounded:
        lo, hi = int(column.lower), int(column.upper)  # type: ignore[arg-type]
        if hi - lo + 1 > MAX_MODE_DOMAIN:
            return None
        domain = tuple(range(lo, hi + 1))
    else:
        return None
    return domain if 0 < len(domain) <= MAX_MODE_DOMAIN else None


@dataclass(frozen=True)
class ModeKind(AggregateKind):
    """MODE(col): the most frequent value of a column with a public domain, per group, by
    report-noisy-max over the domain's counts (dpsql.aggregates.mode: mechanism, privacy map
    and proof). Released as one of the domain's values, with no interval."""

    name: ClassVar[str] = "mode"
    histogram: ClassVar[str | None] = "mode"
    takes_expressions: ClassVar[bool] = False
    explain: ClassVar[str] = "report-noisy-max over the column's public values"

    def column_problem(self, upper, column, table):
        if mode_domain(column) is None:
            return (
                f"MODE({column.name}) needs a public domain of at most {MAX_MODE_DOMAIN:,} "
                "values: its value is chosen among them",
                f"declare values = [...] for {column.name} in the policy "
                f"([tables.{table}.columns.{column.name}]), or a bool or bounded int column",
            )
        return None

    def measures(self, column):
        return []

    def histogram_measure(
        self, name: str, column: ColumnPolicy, max_values: int, groups: int, epsilon: float
    ) -> ModeMeasure:
        return ModeMeasure(
            name=name,
            column=column.name,
            domain=mode_domain(column),  # type: ignore[arg-type]
            max_values=max_values,
            groups=groups,
            group_epsilon=group_epsilon(epsilon, groups),
            epsilon=epsilon,
        )

    def evaluate(self, output, plan, values):
        return values[plan.quantile_of(output).name][:, 0]

    def released_type(self, column):
        return _MODE_TYPES[column.type] if column is not None else "VARCHAR"


KINDS: dict[str, AggregateKind] = {}
#: the analyst's aggregate functions (sqlglot nodes, after dpsql.frontend.rewrite) -> kind;
#: COUNT(DISTINCT ...) and SUM(DISTINCT ...) are chosen by the binder from COUNT and SUM
FUNCTIONS: dict[type[exp.Expr], str] = {}


def _register(name: str, kind: AggregateKind, *functions: type[exp.Expr]) -> None:
    KINDS[name] = kind
    for function in functions:
        FUNCTIONS[function] = name


_register("count", Count(), exp.Count)
_register("count_units", CountUnits())
_register("count_distinct", CountDistinct())
_register("sum", Sum(), exp.Sum)
_register("sum_distinct", SumDistinct())
_register("avg", Mean(), exp.Avg)
_register("var_samp", Variance(sample=True), exp.Variance)
_register(
    "var_pop",
    Variance(
        sample=False, explain="from noisy sum, count and sum of squares (population variance)"
    ),
    exp.VariancePop,
)
_register(
    "stddev_samp",
    Variance(sample=True, root=True, explain="square root of the sample variance from noisy sums"),
    exp.Stddev,
    exp.StddevSamp,
)
_register(
    "stddev_pop",
    Variance(
        sample=False, root=True, explain="square root of the population variance from noisy sums"
    ),
    exp.StddevPop,
)
_register(
    "median",
    Quantile(explain="exponential mechanism on a public grid (the 0.5 quantile)", level=0.5),
    exp.Median,
)
_register("percentile_cont", Quantile(), exp.PercentileCont)
_register("percentile_disc", Quantile(), exp.PercentileDisc)
_register(
    "min",
    Quantile(
        explain="exponential mechanism on a public grid (the smallest value's bin)", level=0.0
    ),
    exp.Min,
)
_register(
    "max",
    Quantile(explain="exponential mechanism on a public grid (the largest value's bin)", level=1.0),
    exp.Max,
)
_register("mode", ModeKind(), exp.Mode)

#: aggregates that sum a column's values (automatic clipping applies to them)
SUMMED_KINDS = tuple(name for name, kind in KINDS.items() if kind.summed)
#: released by the exponential mechanism on a public grid (dpsql.privacy.quantiles)
QUANTILE_KINDS = tuple(name for name, kind in KINDS.items() if kind.histogram == "quantile")


def kind_of(output: OutputView) -> AggregateKind:
    return KINDS[output.call.kind]
