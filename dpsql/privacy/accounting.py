"""Privacy costs and how they compose into one (ε, δ) guarantee per analyst.

A query's cost has three parts, each composed by plain addition, which stays valid when the
analyst chooses each query after seeing earlier answers (fully adaptive composition):

- ``epsilon``: pure ε-DP spent by Laplace-type releases (sequential composition);
- ``rho``: zero-concentrated DP spent by Gaussian releases (zCDP composes additively);
- ``delta``: the additive failure probability of (ε, δ) steps that are not Gaussian,
  e.g. τ-thresholding of non-public group keys, or smooth-sensitivity Laplace.

The total is converted to one (ε, δ) pair: pure ε composes with (ε', δ')-DP as (ε + ε', δ'),
and ρ-zCDP implies (ρ + 2√(ρ ln(1/δ_ρ)), δ_ρ)-DP for every δ_ρ > 0 (Bun & Steinke 2016,
Prop. 1.3), where δ_ρ is whatever part of the δ budget the thresholding steps did not use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """The privacy cost of one release (or of a running total)."""

    epsilon: float = 0.0
    delta: float = 0.0
    rho: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.epsilon + other.epsilon, self.delta + other.delta, self.rho + other.rho)

    @property
    def is_zero(self) -> bool:
        return self.epsilon == 0 and self.delta == 0 and self.rho == 0


def rho_to_epsilon(rho: float, delta: float) -> float:
    """ε such that ρ-zCDP implies (ε, δ)-DP (Bun & Steinke 2016, Prop. 1.3)."""
    if rho <= 0:
        return 0.0
    if delta <= 0:
        return math.inf
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


@dataclass(frozen=True)
class Budget:
    """An analyst's total (ε, δ) allowance on one dataset."""

    epsilon: float
    delta: float

    def epsilon_of(self, total: Cost) -> float:
        """The ε that a running total ``total`` amounts to under this budget's δ."""
        delta_for_rho = self.delta - total.delta
        if total.rho > 0 and delta_for_rho <= 0:
            return math.inf
        return total.epsilon + rho_to_epsilon(total.rho, delta_for_rho)

    def covers(self, total: Cost, *, slack: float = 1e-12) -> bool:
        """Whether ``total`` (everything spent, including the new query) fits this budget."""
        if total.delta > self.delta * (1 + slack) + slack * 1e-9:
            return False
        return self.epsilon_of(total) <= self.epsilon * (1 + slack) + slack

    def remaining(self, total: Cost) -> tuple[float, float]:
        """(ε, δ) still available, for messages and ``dpsql budget``."""
        eps = max(0.0, self.epsilon - self.epsilon_of(total))
        return eps, max(0.0, self.delta - total.delta)
