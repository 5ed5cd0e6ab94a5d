"""MODE(col) over a public domain: report-noisy-max on the domain's per-value counts.

The measure (:class:`ModeMeasure`) is a *histogram measure*, as a quantile's is: the engine
counts, per group, the bounded rows holding each value of the column's public domain (the
rows the other aggregates read: R rows per (unit, group), G groups per unit, dpsql.plan.values),
and each group's mode is released from those counts by one draw of the exponential mechanism
with the count as its utility: report-noisy-max with Gumbel noise, sampled exactly
(dpsql.privacy.quantiles.report_noisy_max). Only the chosen value is released, never a
count.

Privacy map (proof). Neighbouring tables differ in one unit with all of its rows. In one group
the unit keeps at most R rows; each row holds one value, so removing the unit lowers the counts
of at most min(R, |D|) values, each by at most R (all R rows may hold one value), and raises
none: the utility u_v = c_v has sensitivity Δ = max_v |c_v − c'_v| <= R. The exponential
mechanism with P(v) ∝ exp(ε_g·u_v / (2Δ)) is ε_g-DP (McSherry & Talwar 2007). Groups are
disjoint in rows; the unit reaches at most G of them, each release ε_g-DP: ε = G·ε_g by basic
composition (pure ε, no δ). In zCDP each release is charged ε_g²/2 (as a quantile's part: a
safe upper bound on the exponential mechanism's ε_g²/8). The measure's cost is charged in the
query's one reservation with every other measurement of the plan (dpsql.plan.planner.build_plan:
the ε share of one histogram slot).

A group without rows releases a uniformly drawn value of the domain (all counts are 0): the
group is public (a public key or no GROUP BY), so this reveals nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from sqlglot import exp

from dpsql.privacy.accounting import Cost
from dpsql.privacy.quantiles import check_noisy_max, exponential_map, report_noisy_max

#: The largest public domain MODE releases over (the engine's CASE has one branch per value).
MAX_MODE_DOMAIN = 10_000


def group_epsilon(share: float, groups: int) -> float:
    """The largest float e with groups · e <= share, exactly."""
    e = share / groups
    while Fraction(e) * groups > Fraction(share):
        e = math.nextafter(e, 0.0)
    return e


@dataclass(frozen=True)
class ModeMeasure:
    """The per-group mode of one column over its public ``domain`` (in the policy's order)."""

    name: str
    column: str
    domain: tuple[Any, ...]
    max_values: int  # R: a unit's rows per group
    groups: int  # G: a unit's groups
    group_epsilon: float  # ε_g of each group's release
    epsilon: float  # the share of the query's ε it was given (>= its cost)

    kind = "mode"

    @property
    def bins(self) -> int:
        return len(self.domain)

    @property
    def cost(self) -> Cost:
        """G releases of ε_g each (basic composition); zCDP ε_g²/2 each."""
        return exponential_map(self.group_epsilon, self.groups)

    def bin_of(self, value: exp.Expression) -> exp.Expression:
        """A row's bin: the index of its value in the domain, NULL for NULL or a value outside
        the domain (not counted). Equality with a literal of the column's own type never
        fails on any row."""
        ifs = [
            exp.If(
                this=exp.EQ(this=value.copy(), expression=_literal(v)), true=exp.Literal.number(i)
            )
            for i, v in enumerate(self.domain)
        ]
        return exp.Case(ifs=ifs)

    def release_all(self, counts: np.ndarray, source: Any, check: Any) -> np.ndarray:
        """Each group's released value (an object array: the domain's own values)."""
        out = np.empty((len(counts), 1), dtype=object)
        for i, row in enumerate(counts):
            check()
            b = report_noisy_max(row, self.group_epsilon, self.max_values, source)
            out[i, 0] = self.domain[b]
        return out

    def check_drawable(self) -> None:
        check_noisy_max(self.group_epsilon)

    def node(self, max_rows: int, max_groups: int) -> ModeMeasurement:
        """The plan tree's node for this measure, with the Bound node's R and G."""
        return ModeMeasurement(
            self.name,
            self.column,
            self.group_epsilon,
            self.max_values,
            max_rows,
            max_groups,
            self.bins,
        )

    def explain(self) -> list[str]:
        return [
            f"    report-noisy-max (exponential mechanism) over the {self.bins} public "
            f"values of {self.column}, eps {self.group_epsilon:.6g} per group, utility = "
            f"the value's count (sensitivity R = {self.max_values}); no interval"
        ]


@dataclass(frozen=True)
class ModeMeasurement:
    """The plan tree's node: per group one ε_g-DP noisy max calibrated for ``calibrated_values``
    rows per unit; the Bound node lets a unit put ``max_values`` rows in each of ``groups``
    groups. The map is groups · ε_g · max(1, max_values / calibrated_values)
    (dpsql.privacy.quantiles.exponential_map, with its proof)."""

    measure: str
    column: str
    group_epsilon: float
    calibrated_values: int
    max_values: int  # from the Bound node
    groups: int  # from the Bound node
    bins: int

    def privacy_map(self) -> Cost:
        return exponential_map(
            self.group_epsilon, self.groups, self.max_values, self.calibrated_values
        )

    def describe(self) -> str:
        return (
            f"Mode {self.measure} of {self.column}: report-noisy-max on {self.bins} public "
            f"values, one release per group of eps {self.group_epsilon:.6g}, utility "
            f"sensitivity <= {self.calibrated_values}"
        )


def _literal(value: Any) -> exp.Expression:
    if isinstance(value, bool):
        return exp.Boolean(this=value)
    if isinstance(value, int | float):
        return exp.Literal.number(repr(value) if isinstance(value, float) else value)
    return exp.Literal.string(str(value))
