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

import functools
import math
import numbers
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

# How far a running total may exceed a cap, relative to the cap (each part: ε, δ, ρ).
#
# Totals are exact and so are the pure caps, but the costs that reach the ledger are built
# from floats: a planner splits ε across k measures as fl(ε/k), and k·fl(ε/k) can exceed ε by
# a few ulps (ε = 0.1 over 7 measures does); ρ = Δ₂²/2σ² comes from a numerically solved σ
# and its cap from a square root and a logarithm (`epsilon_to_rho`). Compared with no
# tolerance, a query spending exactly what is left would be refused for rounding alone. The
# tolerance applies to the exact running *total*, never per charge, so however many charges
# are made (tiny or not) a part can overspend by at most cap · 2⁻⁴⁰ (< 1e-12 relative): a fixed
# bound that does not grow with the number of charges. A zero cap allows nothing.
SLACK = Fraction(1, 2**40)

# A float that is a short decimal split k ways (k <= _SPLITS) is read as that rational.
_SPLITS = 64
_SHORT = 12  # significant digits a decimal may have to count as typed

Amount = Fraction | float | int | Decimal | str


def exact(value: Amount) -> Fraction:
    """The rational a privacy parameter stands for.

    A float becomes the decimal of its shortest repr (0.1 is exactly 1/10), because that is
    the number the analyst or the policy wrote: ten charges of 0.1 then sum to exactly 1. A
    float whose repr is long but which is a short decimal divided by a small k (the planner's
    fl(ε/k) share of a query's ε) becomes d/k, so the k shares add up to exactly ε. Either
    way the result rounds back to the float (within half an ulp, 2⁻⁵³ relative), so the
    recorded total is within a factor 1 ± 2⁻⁵³ of the loss of the calibrated mechanisms,
    whatever the number of charges; and denominators stay bounded (powers of ten times
    k <= 64), so exact sums stay cheap. Fractions, ints, Decimals and strings ("1/3",
    "0.25") are taken as they are.
    """
    if isinstance(value, Fraction):
        return value
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    if isinstance(value, numbers.Real):  # float, numpy floats (Decimal is not Real)
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"a privacy parameter must be finite, got {number!r}")
        return _from_float(number)
    if isinstance(value, Decimal | str):
        return Fraction(value)
    raise TypeError(f"a privacy parameter must be a number, got {type(value).__name__}")


@functools.lru_cache(maxsize=4096)
def _from_float(number: float) -> Fraction:
    if (short := _short(number)) is not None:
        return Fraction(short)
    for k in range(2, _SPLITS + 1):
        short = _short(number * k)
        if short is not None and float(candidate := Fraction(short) / k) == number:
            return candidate
    return Fraction(repr(number))


def _short(number: float) -> str | None:
    """A decimal of at most _SHORT significant digits that reads back as ``number``, or None."""
    text = f"{number:.{_SHORT}g}"
    return text if float(text) == number else None


def _part(value: Any) -> Any:
    """A Cost part: exact when it is a finite number; a non-finite float stays as it is (the
    ledger refuses to charge it), and so does a non-number (e.g. ``pytest.approx``)."""
    if type(value) is Fraction:  # sums of costs: the common case, first
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return value
    try:
        return exact(value)
    except TypeError:
        return value


def _show(part: Any) -> str:
    if not isinstance(part, Fraction):
        return repr(part)
    text = repr(float(part))
    return text if Fraction(text) == part else str(part)


@dataclass(frozen=True, init=False)
class Cost:
    """The privacy cost of one release (or of a running total), kept exactly.

    ``Cost(epsilon, delta, rho)`` takes floats, ints, Fractions, Decimals or strings and keeps
    each part as a :class:`~fractions.Fraction` (``exact_epsilon``, ``exact_delta``,
    ``exact_rho``): sums, equality and budget checks are exact, so no charge is ever lost to
    rounding. ``epsilon``, ``delta`` and ``rho`` are float views for messages and display.
    """

    exact_epsilon: Fraction
    exact_delta: Fraction
    exact_rho: Fraction

    def __init__(self, epsilon: Amount = 0, delta: Amount = 0, rho: Amount = 0) -> None:
        object.__setattr__(self, "exact_epsilon", _part(epsilon))
        object.__setattr__(self, "exact_delta", _part(delta))
        object.__setattr__(self, "exact_rho", _part(rho))

    @property
    def epsilon(self) -> float:
        return float(self.exact_epsilon)

    @property
    def delta(self) -> float:
        return float(self.exact_delta)

    @property
    def rho(self) -> float:
        return float(self.exact_rho)

    @property
    def parts(self) -> tuple[Fraction, Fraction, Fraction]:
        """(ε, δ, ρ), exact."""
        return self.exact_epsilon, self.exact_delta, self.exact_rho

    @property
    def is_finite(self) -> bool:
        """Every part is an exact rational (no NaN or infinity slipped in)."""
        return all(isinstance(p, Fraction) for p in self.parts)

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.exact_epsilon + other.exact_epsilon,
            self.exact_delta + other.exact_delta,
            self.exact_rho + other.exact_rho,
        )

    def __neg__(self) -> Cost:
        return Cost(-self.exact_epsilon, -self.exact_delta, -self.exact_rho)

    def __repr__(self) -> str:
        return (
            f"Cost(epsilon={_show(self.exact_epsilon)}, delta={_show(self.exact_delta)}, "
            f"rho={_show(self.exact_rho)})"
        )

    @property
    def is_zero(self) -> bool:
        return self.exact_epsilon == 0 and self.exact_delta == 0 and self.exact_rho == 0


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
    half of δ for the ρ → (ε, δ) conversion when it is positive. The caps of the pure part are
    exact rationals of these numbers; the ρ cap is the computed float. Totals are compared
    with them exactly, up to the fixed relative :data:`SLACK`.
    """

    epsilon: float
    delta: float
    gaussian_share: float = 0.0

    @functools.cached_property
    def exact_pure_epsilon(self) -> Fraction:
        return exact(self.epsilon) * (1 - exact(self.gaussian_share))

    @functools.cached_property
    def exact_pure_delta(self) -> Fraction:
        whole = exact(self.delta)
        return whole / 2 if self.gaussian_share > 0 else whole

    @property
    def pure_epsilon(self) -> float:
        return float(self.exact_pure_epsilon)

    @property
    def pure_delta(self) -> float:
        return float(self.exact_pure_delta)

    @functools.cached_property
    def rho(self) -> float:
        """The zCDP cap of the Gaussian part."""
        if self.gaussian_share <= 0:
            return 0.0
        return epsilon_to_rho(self.epsilon * self.gaussian_share, self.delta / 2)

    @functools.cached_property
    def exact_rho(self) -> Fraction:
        """The ρ cap as the exact value of its float."""
        return Fraction(self.rho)

    @functools.cached_property
    def _limits(self) -> tuple[Fraction, Fraction, Fraction]:
        """What a total may reach in each part (ρ, ε, δ): the cap and its :data:`SLACK`."""
        scale = 1 + SLACK
        return (
            self.exact_rho * scale,
            self.exact_pure_epsilon * scale,
            self.exact_pure_delta * scale,
        )

    def _exceeds(self, total: Cost) -> str | None:
        """Which part ``total`` overspends ("rho", "epsilon", "delta"), or None if it fits.

        Exact comparisons; NaN never fits (a non-finite part compares False with a cap).
        """
        rho, epsilon, delta = self._limits
        if not total.exact_rho <= rho:
            return "rho"
        if not total.exact_epsilon <= epsilon:
            return "epsilon"
        if not total.exact_delta <= delta:
            return "delta"
        return None

    def covers(self, total: Cost) -> bool:
        """Whether ``total`` (everything spent, including the new query) fits every part."""
        return self._exceeds(total) is None

    def epsilon_of(self, total: Cost) -> float:
        """The ε that a running total amounts to (pure part plus the zCDP part's conversion)."""
        delta_rho = self.delta / 2 if self.gaussian_share > 0 else self.delta
        return total.epsilon + rho_to_epsilon(total.rho, delta_rho)

    def remaining(self, total: Cost) -> tuple[float, float]:
        """(ε, δ) still available, for messages and ``dpsql budget`` (computed exactly)."""
        eps = float(max(Fraction(0), self.exact_pure_epsilon - total.exact_epsilon))
        if self.gaussian_share > 0:
            left_rho = max(Fraction(0), self.exact_rho - total.exact_rho)
            eps += rho_to_epsilon(float(left_rho), self.delta / 2)
        return eps, float(max(Fraction(0), self.exact_pure_delta - total.exact_delta))

    def refusal_reason(self, total: Cost) -> str:
        """Which part of the budget a total exceeds, for the refusal message."""
        part = self._exceeds(total)
        if part == "rho":
            if self.rho == 0:
                return (
                    "this policy reserves no budget for Gaussian noise "
                    "(set gaussian_share in [privacy], or SET mechanism = 'laplace')"
                )
            return f"the Gaussian (zCDP) part is spent: rho cap {self.rho:.6g}"
        if part == "epsilon":
            if self.exact_pure_epsilon == 0:
                return (
                    "this policy reserves all of its budget for Gaussian noise "
                    "(lower gaussian_share in [privacy], or SET mechanism = 'gaussian')"
                )
            return f"the pure-epsilon part is spent: cap {self.pure_epsilon:.6g}"
        return f"the delta part is spent: cap {self.pure_delta:.3g}"
