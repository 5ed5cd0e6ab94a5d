"""Measurements over the aggregate: each states its privacy map; post-processing is free.

A measurement adds noise of a given scale to one measure. Its privacy map takes the measure's
sensitivity (derived by the relational nodes, not by the planner) to a cost:

- discrete Laplace of scale b on an integer query of L1 sensitivity Δ1: ε = Δ1 / b
  (P(k) / P(k + Δ1) <= exp(Δ1 / b));
- discrete Gaussian of σ on an integer query of L2 sensitivity Δ2: ρ = Δ2² / (2σ²)
  (Canonne, Kamath & Steinke 2020, Thm 4).

Thresholding (non-public GROUP BY keys) costs the δ it is calibrated to. Optimal partition
selection (Desfontaines et al. 2022) reads an exact unit count that is never released (its
measurement's map is zero) and costs its own (ε, δ) (:class:`Selection`). Release (the formula
AVG = SUM / COUNT, clamps) and post-processing (HAVING, ORDER BY, LIMIT on released values)
read released values only: they cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from sqlglot import exp

from dpsql.aggregates.mode import ModeMeasurement
from dpsql.plan.relational import Aggregate
from dpsql.privacy.accounting import Cost
from dpsql.privacy.mechanisms import Gaussian, Laplace, Mechanism
from dpsql.privacy.partition import OptimalSelection, Unreleased
from dpsql.privacy.quantiles import exponential_map


@dataclass(frozen=True)
class Measurement:
    measure: str
    mechanism: Mechanism | Unreleased
    l1: float  # the sensitivity the relational nodes derive
    l2: float

    def privacy_map(self) -> Cost:
        """The cost of this noise scale at this sensitivity (independent of the planner's
        calibration: computed from the scale the sampler will use)."""
        if isinstance(self.mechanism, Unreleased):
            # exact, read by the selection only (dpsql.plan.check: no output reads it); the
            # Selection node charges what deciding on it costs
            return Cost()
        if self.l1 == 0 and self.l2 == 0:
            # a constant needs no noise; the planner still charges its share (an over-charge)
            return self.mechanism.cost
        if isinstance(self.mechanism, Laplace):
            # ε = Δ1 / b, exactly as the mechanism computes b = Δ1 / ε in floating point
            return Cost(epsilon=Fraction(self.l1) / Fraction(self.mechanism.scale))
        if isinstance(self.mechanism, Gaussian):
            return Cost(rho=self.l2**2 / (2 * self.mechanism.scale**2))
        raise TypeError("unknown mechanism")

    def describe(self) -> str:
        return (
            f"Measure {self.measure}: {self.mechanism.name} noise, scale "
            f"{self.mechanism.scale:.6g}, sensitivity L1 {self.l1:g} / L2 {self.l2:.6g} "
            "(integer units)"
        )


@dataclass(frozen=True)
class Threshold:
    measure: str
    tau: float
    delta: float

    def privacy_map(self) -> Cost:
        return Cost(delta=self.delta)

    def describe(self) -> str:
        return (
            f"Threshold: release a group when noisy {self.measure} >= {self.tau:g} "
            f"(delta {self.delta:g})"
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
class Selection:
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
    """Noisy measures -> the released table (keys, values, intervals): post-processing."""

    input: Aggregate
    measurements: tuple[Measurement, ...]
    threshold: Threshold | None
    outputs: tuple[str, ...]  # AVG(x) = m0 / m1 ...
    # histogram measurements: quantiles, and MODE's (dpsql.aggregates.mode.ModeMeasurement)
    quantiles: tuple[QuantileMeasurement | ModeMeasurement, ...] = ()
    clips: tuple[ClipMeasurement, ...] = ()
    selection: Selection | None = None

    def children(self) -> tuple:
        return (self.input,)

    def describe(self) -> str:
        return "Release " + ", ".join(self.outputs)

    def stability(self) -> str:
        return "post-processing of the measurements: free"

    def cost(self) -> Cost:
        """The sum of every part's privacy map (threshold, selection, noisy measures,
        quantiles, clipping ranges)."""
        parts = [self.threshold, self.selection, *self.measurements, *self.quantiles, *self.clips]
        total = Cost()
        for part in parts:
            if part is not None:
                total = total + part.privacy_map()
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
