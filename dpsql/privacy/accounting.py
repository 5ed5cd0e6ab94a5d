"""Privacy costs, and the budget rule that stays valid under fully adaptive querying.

A query's cost has three parts:

- ``epsilon``: pure ε-DP spent by discrete-Laplace releases;
- ``rho``: zero-concentrated DP spent by discrete-Gaussian releases (ρ = Δ₂²/2σ²);
- ``delta``: additive failure probability of steps that are not Gaussian noise, e.g. the
  τ-thresholding of non-public group keys, or smooth-sensitivity Laplace.

Analysts pick each query, and its ε, after seeing earlier answers, so the budget is enforced
by *privacy filters*, whose guarantees hold for adaptively chosen costs:

1. pure ε and additive δ: the basic-composition filter (Σε ≤ E, Σδ ≤ D) is valid for
   adaptively chosen (εᵢ, δᵢ) (Rogers, Roth, Ullman, Vadhan 2016, "Privacy odometers and
   filters"; Whitehouse et al. 2023);
2. ρ: the zCDP filter Σρ ≤ P is valid for adaptively chosen ρᵢ (Feldman & Zrnic 2021, a
   Rényi filter at every order), and P-zCDP implies (P + 2√(P ln 1/δ_ρ), δ_ρ)-DP (Bun & Steinke
   2016, Prop. 1.3).

Mixing the two kinds inside one adaptively spent total has no such theorem, so the budget is
split *in advance* by the policy (``gaussian_share``): a pure part (ε_p, δ_p) and a zCDP part
whose ρ cap converts to (ε_g, δ_g), with ε_p + ε_g = budget ε and δ_p + δ_g = budget δ. Each
part is its own filter; the two interactive mechanisms compose concurrently to
(ε_p + ε_g, δ_p + δ_g)-DP (Vadhan & Wang 2021; Lyu 2022). Gaussian thresholding's δ draws from
δ_p: conditioned on no thresholding failure every step is ρᵢ-zCDP, and the failure
probabilities add over the transcript however they were chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SLACK = 1e-9  # relative float tolerance when comparing sums with a budget


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


def epsilon_to_rho(epsilon: float, delta: float) -> float:
    """The largest ρ whose (ε, δ) conversion is at most ``epsilon`` (inverse of the above)."""
    if epsilon <= 0 or delta <= 0:
        return 0.0
    log_term = math.log(1.0 / delta)
    root = -math.sqrt(log_term) + math.sqrt(log_term + epsilon)  # √ρ
    return root * root


@dataclass(frozen=True)
class Budget:
    """An analyst's total (ε, δ) allowance on one dataset, split in advance by kind.

    ``gaussian_share`` is the fraction of ε reserved for Gaussian (zCDP) releases; it takes
    half of δ for the ρ → (ε, δ) conversion when it is positive.
    """

    epsilon: float
    delta: float
    gaussian_share: float = 0.0

    @property
    def pure_epsilon(self) -> float:
        return self.epsilon * (1.0 - self.gaussian_share)

    @property
    def pure_delta(self) -> float:
        return self.delta / 2 if self.gaussian_share > 0 else self.delta

    @property
    def rho(self) -> float:
        """The zCDP cap of the Gaussian part."""
        if self.gaussian_share <= 0:
            return 0.0
        return epsilon_to_rho(self.epsilon * self.gaussian_share, self.delta / 2)

    def covers(self, total: Cost) -> bool:
        """Whether ``total`` (everything spent, including the new query) fits every part."""
        return (
            total.epsilon <= self.pure_epsilon * (1 + SLACK) + SLACK * 1e-6
            and total.delta <= self.pure_delta * (1 + SLACK) + 1e-300
            and total.rho <= self.rho * (1 + SLACK) + SLACK * 1e-6
        )

    def epsilon_of(self, total: Cost) -> float:
        """The ε that a running total amounts to (pure part plus the zCDP part's conversion)."""
        delta_rho = self.delta / 2 if self.gaussian_share > 0 else self.delta
        return total.epsilon + rho_to_epsilon(total.rho, delta_rho)

    def remaining(self, total: Cost) -> tuple[float, float]:
        """(ε, δ) still available, for messages and ``dpsql budget``."""
        left_rho = max(0.0, self.rho - total.rho)
        eps = max(0.0, self.pure_epsilon - total.epsilon)
        if self.gaussian_share > 0:
            eps += rho_to_epsilon(left_rho, self.delta / 2)
        return eps, max(0.0, self.pure_delta - total.delta)

    def refusal_reason(self, total: Cost) -> str:
        """Which part of the budget a total exceeds, for the refusal message."""
        if total.rho > self.rho * (1 + SLACK) + SLACK * 1e-6:
            if self.rho == 0:
                return (
                    "this policy reserves no budget for Gaussian noise "
                    "(set gaussian_share in [privacy], or SET mechanism = 'laplace')"
                )
            return f"the Gaussian (zCDP) part is spent: rho cap {self.rho:.6g}"
        if total.epsilon > self.pure_epsilon * (1 + SLACK) + SLACK * 1e-6:
            if self.pure_epsilon == 0:
                return (
                    "this policy reserves all of its budget for Gaussian noise "
                    "(lower gaussian_share in [privacy], or SET mechanism = 'gaussian')"
                )
            return f"the pure-epsilon part is spent: cap {self.pure_epsilon:.6g}"
        return f"the delta part is spent: cap {self.pure_delta:.3g}"
