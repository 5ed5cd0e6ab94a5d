"""Measurements over the aggregate: each states its privacy map; post-processing is free.

A measurement adds noise of a given scale to one measure. Its privacy map takes the measure's
sensitivity (derived by the relational nodes, not by the planner) to a cost:

- discrete Laplace of scale b on an integer query of L1 sensitivity Δ1: ε = Δ1 / b
  (P(k) / P(k + Δ1) <= exp(Δ1 / b));
- discrete Gaussian of σ on an integer query of L2 sensitivity Δ2: ρ = Δ2² / (2σ²)
  (Canonne, Kamath & Steinke 2020, Thm 4).

Thresholding (non-public GROUP BY keys) costs the δ it is calibrated to
(dpsql.plan.values.Threshold). Optimal partition selection (Desfontaines et al. 2022) reads an
exact unit count that is never released (its measurement's map is zero) and costs its own
(ε, δ) (:class:`SelectionMeasurement`). Release (the formula
AVG = SUM / COUNT, clamps) and post-processing (HAVING, ORDER BY, LIMIT on released values)
read released values only: they cost nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

from sqlglot import exp

from dpsql.aggregates import KINDS
from dpsql.aggregates.mode import ModeMeasure, ModeMeasurement
from dpsql.plan.relational import Aggregate, Bound
from dpsql.plan.values import (
    ClipEstimate,
    OutputAggregate,
    QuantileMeasure,
    Selection,
    Threshold,
)
from dpsql.privacy.accounting import Cost
from dpsql.privacy.mechanisms import Mechanism
from dpsql.privacy.partition import OptimalSelection, Unreleased
from dpsql.privacy.quantiles import exponential_map


@dataclass(frozen=True)
class Measurement:
    measure: str
    mechanism: Mechanism | Unreleased
    l1: float  # the sensitivity the relational nodes derive
    l2: float
    groups: int = 1  # how many groups (coordinates) one unit can change: the Bound node's G

    def privacy_map(self) -> Cost:
        """The mechanism's own privacy map at the sensitivity the nodes derive (each
        mechanism states its map beside its sampler: dpsql.privacy.mechanisms), independent
        of the planner's calibration. ``groups`` matters to a noise whose map is not a
        function of the vector's L1 alone (the staircase's: per changed coordinate)."""
        if self.l1 == 0 and self.l2 == 0 and not isinstance(self.mechanism, Unreleased):
            # a constant needs no noise; the planner still charges its share (an over-charge)
            return self.mechanism.cost
        return self.mechanism.privacy_map(self.l1, self.l2, self.groups)

    def describe(self) -> str:
        return (
            f"Measure {self.measure}: {self.mechanism.name} noise, scale "
            f"{self.mechanism.scale:.6g}, sensitivity L1 {self.l1:g} / L2 {self.l2:.6g} "
            "(integer units)"
        )


@dataclass(frozen=True)
class QuantileMeasurement:
    """Per group, ``parts`` exponential mechanisms of ε ``part_epsilon`` each on a column's
    bin counts, calibrated for ``calibrated_values`` values per unit and group. The bound node
    lets a unit put <= ``max_values`` values in each of <= ``groups`` groups; the map is
    parts · groups · part_epsilon · max(1, max_values / calibrated_values)
    (dpsql.privacy.quantiles.exponential_map, with its proof)."""

    measure: str
    column: str
    part_epsilon: float
    parts: int
    calibrated_values: int
    max_values: int  # from the Bound node
    groups: int  # from the Bound node
    bins: int

    def privacy_map(self) -> Cost:
        return exponential_map(
            self.part_epsilon, self.parts * self.groups, self.max_values, self.calibrated_values
        )

    def describe(self) -> str:
        return (
            f"Quantiles {self.measure} of {self.column}: exponential mechanism on {self.bins} "
            f"public bins, {self.parts} release(s) per group of eps {self.part_epsilon:.6g}, "
            f"utility sensitivity <= {self.calibrated_values} x max(q, 1 - q)"
        )


@dataclass(frozen=True)
class ClipMeasurement:
    """Laplace noise of ``scale`` on each bin of a histogram of |x| (automatic clipping). The
    bound node lets a unit have <= max_rows values in each of <= groups groups, each value in
    one bin: L1 = max_rows · groups, so ε = L1 / scale."""

    column: str
    scale: float
    max_rows: int  # from the Bound node
    groups: int  # from the Bound node
    bins: int

    def privacy_map(self) -> Cost:
        return Cost(epsilon=Fraction(self.max_rows * self.groups) / Fraction(self.scale))

    def describe(self) -> str:
        return (
            f"Clipping range of {self.column}: laplace noise of scale {self.scale:.6g} on "
            f"{self.bins} log bins of |{self.column}| (L1 {self.max_rows * self.groups})"
        )


@dataclass(frozen=True)
class SelectionMeasurement:
    """Optimal partition selection on the exact unit count ``measure``: G independent
    (ε/G, δ/G)-DP keep decisions per unit, (ε, δ)-DP by basic composition."""

    measure: str
    mechanism: OptimalSelection
    l1: float  # the unit count's sensitivity the nodes derive: G groups, 1 each

    def privacy_map(self) -> Cost:
        if self.l1 > self.mechanism.max_groups:
            raise ValueError("the selection is calibrated to fewer groups than a unit changes")
        return self.mechanism.cost

    def describe(self) -> str:
        sel = self.mechanism
        return (
            f"Selection: optimal partition selection on exact {self.measure}, eps "
            f"{sel.epsilon:.6g}, delta {sel.delta:g}, G {sel.max_groups} (a key with n units "
            f"is kept with probability pi(n); always from n = {sel.saturation})"
        )


@dataclass(frozen=True)
class Release:
    """Noisy measures -> the released table (keys, values, intervals): post-processing.

    It holds what the planner chose to release (the outputs as formulas over measures, the
    threshold, the histogram and clipping estimators, the partition selection); each
    measurement node below it is *derived* here, its privacy map evaluated at the sensitivity
    the nodes under it allow (:meth:`Bound.unit_change` on the measure's row bound), so the
    cost check (dpsql.plan.check) compares the planner's calibration with the nodes', never
    with itself."""

    input: Aggregate
    outputs: tuple[OutputAggregate, ...]
    threshold: Threshold | None = None
    # histogram measures: quantiles, and MODE's (dpsql.aggregates.mode.ModeMeasure), in the
    # order of the compiled query's extras
    quantiles: tuple[QuantileMeasure | ModeMeasure, ...] = ()
    clips: tuple[ClipEstimate, ...] = ()
    selection: Selection | None = None

    def children(self) -> tuple:
        return (self.input,)

    @property
    def bound(self) -> Bound:
        return self.input.input

    def quantile_of(self, output: OutputAggregate) -> QuantileMeasure | ModeMeasure:
        """The histogram measure an output is read from (its kind's and its column's)."""
        want = KINDS[output.call.kind].histogram
        return next(q for q in self.quantiles if q.column == output.call.column and q.kind == want)

    # The measurement nodes are derived from the fields once per Release (cached_property
    # writes the instance's __dict__, outside the frozen fields: equality, hashing and the
    # canonical key still read the fields only); a changed plan is a new Release.

    @functools.cached_property
    def measurements(self) -> tuple[Measurement, ...]:
        """One noisy measure each, at the sensitivity the Bound node derives for it."""
        out = []
        for spec, m in zip(self.input.specs, self.input.measures, strict=True):
            _, l1, l2 = self.bound.unit_change(spec.row_bound, per_unit=spec.per_unit)
            out.append(Measurement(m.name, m.mechanism, l1, l2, self._groups_changed))
        return tuple(out)

    @property
    def _groups_changed(self) -> int:
        """How many groups one unit's rows can reach: G, or without limit when a unit over G
        public groups keeps all k of them at G/k (bounding = "scale")."""
        return self.bound.max_groups if not self.bound.groups_scaled else 1 << 62

    @functools.cached_property
    def quantile_measurements(self) -> tuple[QuantileMeasurement | ModeMeasurement, ...]:
        R, G = self.bound.max_rows, self.bound.max_groups
        return tuple(
            QuantileMeasurement(
                q.name, q.column, q.part_epsilon, len(q.parts), q.max_values, R, G, q.grid.bins
            )
            if isinstance(q, QuantileMeasure)
            else q.node(R, G)  # its own node (MODE)
            for q in self.quantiles
        )

    @functools.cached_property
    def clip_measurements(self) -> tuple[ClipMeasurement, ...]:
        R, G = self.bound.max_rows, self.bound.max_groups
        return tuple(
            ClipMeasurement(c.column, c.mechanism.mechanism.scale, R, G, c.histogram.bins)
            for c in self.clips
        )

    @functools.cached_property
    def selection_measurement(self) -> SelectionMeasurement | None:
        """The selection at the L1 its exact unit count's measurement node derives."""
        selection = self.selection
        if selection is None or selection.mechanism is None:
            return None
        counted = next(m for m in self.measurements if m.measure == selection.measure)
        return SelectionMeasurement(counted.measure, selection.mechanism, counted.l1)

    def describe(self) -> str:
        return "Release " + ", ".join(
            f"{o.call.label} = f({', '.join(o.measures or (self.quantile_of(o).name,))})"
            for o in self.outputs
        )

    def stability(self) -> str:
        return "post-processing of the measurements: free"

    def privacy_maps(self) -> list[Cost]:
        """Every part's privacy map (threshold, selection, noisy measures, quantiles,
        clipping ranges)."""
        parts = [
            self.threshold,
            self.selection_measurement,
            *self.measurements,
            *self.quantile_measurements,
            *self.clip_measurements,
        ]
        return [part.privacy_map() for part in parts if part is not None]

    def cost(self) -> Cost:
        """The sum of every part's privacy map, exact."""
        total = Cost()
        for mapped in self.privacy_maps():
            total = total + mapped
        return total


@dataclass(frozen=True)
class PostProcess:
    """SELECT list, HAVING, ORDER BY, LIMIT over the released table only."""

    input: Release
    query: exp.Select

    def children(self) -> tuple:
        return (self.input,)

    def describe(self) -> str:
        return f"PostProcess {self.query.sql(dialect='duckdb')}"

    def stability(self) -> str:
        return "reads released values only: free"


@dataclass(frozen=True)
class ReleasedPostProcess:
    """Set operations, joins, windows and subqueries over several DP queries' released tables
    (dpsql.frontend.released): each input is a whole DP query's tree, ``query`` reads their
    released results ``__m0..`` only.

    Stability: none is needed; it reads released values only (post-processing). Privacy map:
    by sequential composition the inputs together cost the sum of their maps, whatever
    ``query`` does, and that sum is what the statement reserves in one charge."""

    inputs: tuple[PostProcess, ...]
    query: exp.Expr

    def children(self) -> tuple:
        return self.inputs

    def describe(self) -> str:
        return f"ReleasedPostProcess {self.query.sql(dialect='duckdb')}"

    def stability(self) -> str:
        return "reads released values only: free; its measurements cost the sum of their maps"

    def cost(self) -> Cost:
        total = Cost()
        for tree in self.inputs:
            total = total + tree.input.cost()
        return total
