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
  column's count is measured anyway; a sum of squares;
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

A leaf module (it imports dpsql.plan.bias only): the planner, the compiler, the engines, the
plan tree, the release and EXPLAIN all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpsql.plan import bias


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

    def fine_grid(self, bounding: str, group_scaling: bool) -> bool:
        """Whether a plan with this ``bounding`` (and group scaling) computes the measure on
        a fine grid (dpsql.plan.values.rescale_factor): where its values are scaled (R/n, G/k)
        or divided, so that truncation toward zero loses < 2^-20 of a row per pair."""
        return (
            (bounding == "scale" and self.row_scaled)
            or (group_scaling and self.group_scaled)
            or self.divided
        )

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


def _kinds(*kinds: MeasureKind) -> dict[str, MeasureKind]:
    return {k.name: k for k in kinds}


#: every measure kind, in the order dpsql.plan.values documents them
MEASURE_KINDS: dict[str, MeasureKind] = _kinds(
    MeasureKind(
        "rows",
        "count of rows",
        "its row count",
        counted=True,
        group_scaled=True,
        rounded=True,
        stored=True,
        programmed=True,
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
    ),
    MeasureKind(
        "units",
        "count of distinct units",
        "its count of units",
        counted=True,
        per_pair=True,
        group_scaled=True,
        rounded=True,
        stored=True,
        programmed=True,
    ),
    MeasureKind(
        "distinct",
        "count of distinct non-NULL {column} over the bounded rows",
        counted=True,
        distinct=True,
    ),
    MeasureKind(
        "distinct_sum",
        "sum of distinct non-NULL {column} over the bounded rows",
        "its sum of distinct values",
        distinct=True,
        least_noise=True,
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
    ),
    MeasureKind(
        "dropped",
        "rows cut by R per unit and group, up to 2R",
        bias_note="rows cut by R (up to {cap} per unit and group)",
        per_pair=True,
        group_scaled=True,
        bias=True,
        programmed=True,
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
    ),
    MeasureKind(
        "clamped",
        "mass of {column} cut by its clamp",
        bias_note="the {column} mass clamped (up to the range's width per row)",
        row_scaled=True,
        group_scaled=True,
        bias=True,
        programmed=True,
    ),
)
