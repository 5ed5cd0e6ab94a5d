"""Privacy costs, and the budget rule that stays valid under fully adaptive querying.

A query's cost has three parts, and one derived part used by the zCDP filter:

- ``epsilon``: pure ε-DP spent by discrete-Laplace releases;
- ``rho``: zero-concentrated DP spent by discrete-Gaussian releases (ρ = Δ₂²/2σ²);
- ``delta``: additive failure probability of steps that are not Gaussian noise, e.g. the
  τ-thresholding or partition selection of non-public group keys;
- ``zrho``: the zCDP the release amounts to, ρ + Σ εᵢ²/2 over its pure steps (an ε-DP step is
  ε²/2-zCDP, Bun & Steinke 2016, Prop. 1.4; an (ε, δ)-DP step is δ-approximately ε²/2-zCDP,
  ibid. §8). It defaults to ρ + ε²/2 for one release; sums of costs add it, so a query whose
  cost is the sum of its k per-measure costs (ε/k each) gets the tighter k·(ε/k)²/2.

Analysts pick each query, and its ε, after seeing earlier answers, so the budget is enforced
by a *privacy filter*, valid for adaptively chosen costs. For a budget (E, D):

- D = 0: the basic-composition filter Σε ≤ E (Rogers, Roth, Ullman, Vadhan 2016); no ρ.
- D > 0: D is split in advance into D_T = (1 − s)·D, for the δ of thresholding-type steps,
  and D_ρ = s·D, for converting zCDP to (ε, δ) (s = ``conversion_delta_share``). A charge is
  allowed when, after it, Σδ ≤ D_T and at least one of

  (a) zCDP: Σ zrho ≤ ρ*, the largest ρ whose tight conversion (Canonne, Kamath & Steinke
      2020, Prop. 12 / Cor. 13) gives (E, D_ρ)-DP;
  (b) pure: no Gaussian ρ was spent and Σε ≤ E

  holds. The transcript is (E, D)-DP: (a) alone is the approximate-zCDP filter of
  Whitehouse, Ramdas, Rogers & Wu (2023) with the conversion; (b) is added without loss
  because the conversion's bound runs through the supermartingale exp((α−1)L − α(α−1)Σzrho)
  restricted to the event Σ zrho ≤ ρ*, and off that event the loss is at most Σε ≤ E surely.
  docs/ledger.md states the theorem and the proof.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any

# How far a running total may exceed a cap, relative to the cap (each part: ε, δ, ρ).
#
# Totals are exact and so are the pure caps, but the costs that reach the ledger are built
# from floats: a planner splits ε across k measures as fl(ε/k), and k·fl(ε/k) can exceed ε by
# a few ulps (ε = 0.1 over 7 measures does); ρ = Δ₂²/2σ² comes from a numerically solved σ
# and its cap from a numerical search over Rényi orders (`zcdp_cap`). Compared with no
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
    if isinstance(value, float) and value.__class__ is float:  # first: no abstract classes
        if not math.isfinite(value):
            raise ValueError(f"a privacy parameter must be finite, got {value!r}")
        return _from_float(value)
    if isinstance(value, int) and value.__class__ is int:
        return Fraction(value)
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


_FIELDS = ("exact_epsilon", "exact_delta", "exact_rho", "exact_zrho")


@dataclass(frozen=True, init=False)
class Cost:
    """The privacy cost of one release (or of a running total), kept exactly.

    ``Cost(epsilon, delta, rho)`` takes floats, ints, Fractions, Decimals or strings and keeps
    each part as a :class:`~fractions.Fraction` (``exact_epsilon``, ``exact_delta``,
    ``exact_rho``): sums, equality and budget checks are exact, so no charge is ever lost to
    rounding. ``epsilon``, ``delta`` and ``rho`` are float views for messages and display.

    ``exact_zrho`` (optional ``zrho``) is the zCDP the cost amounts to, ρ + ε²/2 by default;
    it is bookkeeping derived from the parts, so it takes no part in ``==`` (two totals of the
    same (ε, δ, ρ) made of different charges compare equal; compare ``exact_zrho`` for it).
    """

    exact_epsilon: Fraction
    exact_delta: Fraction
    exact_rho: Fraction
    exact_zrho: Any = field(compare=False)

    def __init__(
        self, epsilon: Amount = 0, delta: Amount = 0, rho: Amount = 0, zrho: Amount | None = None
    ) -> None:
        eps, rho_part = _part(epsilon), _part(rho)
        object.__setattr__(self, "exact_epsilon", eps)
        object.__setattr__(self, "exact_delta", _part(delta))
        object.__setattr__(self, "exact_rho", rho_part)
        if zrho is None:
            if isinstance(eps, Fraction) and isinstance(rho_part, Fraction):
                # rho + eps^2 / 2 in one normalisation (Fraction arithmetic is most of a
                # plan's accounting time)
                n, d = eps.numerator, eps.denominator
                zrho = Fraction(n * n, 2 * d * d)
                if rho_part:
                    zrho += rho_part
            else:
                zrho = math.nan
        object.__setattr__(self, "exact_zrho", _part(zrho))

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
    def zrho(self) -> float:
        return float(self.exact_zrho)

    @property
    def parts(self) -> tuple[Fraction, Fraction, Fraction]:
        """(ε, δ, ρ), exact."""
        return self.exact_epsilon, self.exact_delta, self.exact_rho

    @property
    def is_finite(self) -> bool:
        """Every part is an exact rational (no NaN or infinity slipped in)."""
        return all(isinstance(p, Fraction) for p in (*self.parts, self.exact_zrho))

    def __add__(self, other: Cost) -> Cost:
        parts = (
            (self.exact_epsilon, other.exact_epsilon),
            (self.exact_delta, other.exact_delta),
            (self.exact_rho, other.exact_rho),
            (self.exact_zrho, other.exact_zrho),
        )
        if all(type(a) is Fraction and type(b) is Fraction for a, b in parts):
            # exact parts (the common case): their sums are exact already, and a zero part
            # (δ and ρ of every Laplace charge) adds nothing; a plan adds a few dozen costs
            total = object.__new__(Cost)
            for name, (a, b) in zip(_FIELDS, parts, strict=True):
                object.__setattr__(total, name, b if not a else a if not b else a + b)
            return total
        return Cost(*(a + b for a, b in parts))

    def __neg__(self) -> Cost:
        return Cost(-self.exact_epsilon, -self.exact_delta, -self.exact_rho, -self.exact_zrho)

    def __repr__(self) -> str:
        return (
            f"Cost(epsilon={_show(self.exact_epsilon)}, delta={_show(self.exact_delta)}, "
            f"rho={_show(self.exact_rho)})"
        )

    @property
    def is_zero(self) -> bool:
        return self.exact_epsilon == 0 and self.exact_delta == 0 and self.exact_rho == 0


# --- zCDP -> (ε, δ) -------------------------------------------------------------------------


def rho_to_epsilon(rho: float, delta: float) -> float:
    """ε such that ρ-zCDP implies (ε, δ)-DP: ρ + 2√(ρ ln 1/δ) (Bun & Steinke 2016, Prop. 1.3)."""
    if rho <= 0:
        return 0.0
    if delta <= 0:
        return math.inf
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def epsilon_to_rho(epsilon: float, delta: float) -> float:
    """The largest ρ whose :func:`rho_to_epsilon` is at most ``epsilon`` (its inverse)."""
    if epsilon <= 0 or delta <= 0:
        return 0.0
    log_term = math.log(1.0 / delta)
    root = -math.sqrt(log_term) + math.sqrt(log_term + epsilon)  # √ρ
    return root * root


def _cks_offset(alpha: float, delta: float) -> float:
    """g(α) with ε(α) = αρ + g(α): ρ-zCDP is (αρ + g(α), δ)-DP for every α > 1, where
    g(α) = (ln(1/δ) + α ln(1 − 1/α) − ln(α − 1)) / (α − 1) (Canonne, Kamath & Steinke 2020,
    Prop. 12 / Cor. 13: δ = e^((α−1)(αρ−ε)) (1 − 1/α)^α / (α − 1))."""
    return (math.log(1.0 / delta) + alpha * math.log1p(-1.0 / alpha) - math.log(alpha - 1.0)) / (
        alpha - 1.0
    )


def _golden_max(f: Callable[[float], float], lo: float, hi: float) -> float:
    """The largest value of a unimodal ``f`` on [lo, hi] that a golden-section search finds:
    every evaluated point is a valid choice, so the search's accuracy only affects tightness."""
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    best = max(fc, fd)
    for _ in range(200):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
        best = max(best, fc, fd)
        if b - a < 1e-12:
            break
    return best


# Orders searched: α = 1 + e^t for t in this range (α from 1 + 2e-9 to 1 + 5e8).
_LOG_ORDER = (-20.0, 20.0)
_SAFETY = 1.0 - 2.0**-40  # margin for the floating-point evaluation of a valid bound


@functools.lru_cache(maxsize=1024)
def zcdp_epsilon(rho: float, delta: float) -> float:
    """The smallest ε found with ρ-zCDP ⇒ (ε, δ)-DP: the tight conversion of Canonne, Kamath
    & Steinke (2020), minimised over the Rényi order, and never above :func:`rho_to_epsilon`."""
    if rho <= 0:
        return 0.0
    if delta <= 0 or not math.isfinite(rho):
        return math.inf
    best = -_golden_max(
        lambda t: -((1.0 + math.exp(t)) * rho + _cks_offset(1.0 + math.exp(t), delta)),
        *_LOG_ORDER,
    )
    return min(best, rho_to_epsilon(rho, delta)) / _SAFETY


@functools.lru_cache(maxsize=1024)
def zcdp_cap(epsilon: float, delta: float) -> float:
    """The largest ρ found whose conversion is (ε, δ)-DP: max over α of (ε − g(α))/α.

    Any single α gives a valid cap (ρ ≤ (ε − g(α))/α makes ρ-zCDP (ε, δ)-DP), so the search
    can only be loose, never unsafe; the float result is shrunk by 2⁻⁴⁰ for rounding.
    """
    if epsilon <= 0 or delta <= 0:
        return 0.0
    best = _golden_max(
        lambda t: (epsilon - _cks_offset(1.0 + math.exp(t), delta)) / (1.0 + math.exp(t)),
        *_LOG_ORDER,
    )
    return max(0.0, max(best, epsilon_to_rho(epsilon, delta)) * _SAFETY)


# --- the budget -----------------------------------------------------------------------------

CONVERSION_DELTA_SHARE = 0.1  # of the budget's δ, reserved for the zCDP -> (ε, δ) conversion


def _left(cap: Any, spent: Any) -> float:
    """``float(max(Fraction(0), cap - spent))``, the same float: for two exact rationals from
    their integers, unreduced (``int / int`` is correctly rounded, so n/d and its reduced
    form give one float), without building the Fractions (read after every charge)."""
    if type(cap) is Fraction and type(spent) is Fraction:
        n = cap.numerator * spent.denominator - spent.numerator * cap.denominator
        return n / (cap.denominator * spent.denominator) if n > 0 else 0.0
    return float(max(Fraction(0), cap - spent))


@dataclass(frozen=True)
class Budget:
    """An analyst's total (ε, δ) allowance on one dataset, and the filter that enforces it.

    δ = 0: a pure filter (Σε ≤ ε). δ > 0: one zCDP filter for pure and Gaussian releases
    (Σ zrho ≤ ρ*), or the pure filter while no Gaussian ρ is spent, whichever allows the
    charge; thresholding δ draws from its share (1 − ``conversion_delta_share``)·δ, fixed in
    advance. ``gaussian_share`` is kept for policies that set it: the zCDP filter no longer
    splits ε by mechanism, so it is ignored. Caps are exact rationals (the ρ cap is the exact
    value of its float); totals are compared with them exactly, up to :data:`SLACK`.
    """

    epsilon: float
    delta: float
    gaussian_share: float = 0.0
    conversion_delta_share: float = CONVERSION_DELTA_SHARE

    @property
    def zcdp(self) -> bool:
        """Whether the zCDP filter applies (the budget has δ > 0)."""
        return self.delta > 0

    @functools.cached_property
    def exact_pure_epsilon(self) -> Fraction:
        """The ε cap of the pure filter: the whole budget ε."""
        return exact(self.epsilon)

    @functools.cached_property
    def exact_pure_delta(self) -> Fraction:
        """D_T: the cap on Σδ of thresholding-type steps."""
        whole = exact(self.delta)
        return whole * (1 - exact(self.conversion_delta_share)) if self.zcdp else whole

    @property
    def pure_epsilon(self) -> float:
        return float(self.exact_pure_epsilon)

    @property
    def pure_delta(self) -> float:
        return float(self.exact_pure_delta)

    @property
    def conversion_delta(self) -> float:
        """D_ρ: the δ of the zCDP -> (ε, δ) conversion."""
        return float(exact(self.delta) - self.exact_pure_delta) if self.zcdp else 0.0

    @functools.cached_property
    def rho(self) -> float:
        """ρ*: the zCDP filter's cap, (budget ε, D_ρ)-DP by the tight conversion."""
        return zcdp_cap(self.epsilon, self.conversion_delta) if self.zcdp else 0.0

    @functools.cached_property
    def exact_rho(self) -> Fraction:
        """The ρ cap as the exact value of its float."""
        return Fraction(self.rho)

    @functools.cached_property
    def _limits(self) -> tuple[Fraction, Fraction, Fraction]:
        """What a total may reach (zrho, ε, δ): each cap and its :data:`SLACK`."""
        scale = 1 + SLACK
        caps = self.exact_rho, self.exact_pure_epsilon, self.exact_pure_delta
        return caps[0] * scale, caps[1] * scale, caps[2] * scale

    def _pure_fits(self, total: Cost) -> bool:
        return total.exact_rho == 0 and total.exact_epsilon <= self._limits[1]

    def _zcdp_fits(self, total: Cost) -> bool:
        return self.zcdp and total.exact_zrho <= self._limits[0]

    def _exceeds(self, total: Cost) -> str | None:
        """Which part ``total`` overspends ("delta", "rho", "epsilon"), or None if it fits.

        Exact comparisons; NaN never fits (a non-finite part compares False with a cap).
        """
        if not total.is_finite:
            return "epsilon"
        if not total.exact_delta <= self._limits[2]:
            return "delta"
        if self._pure_fits(total) or self._zcdp_fits(total):
            return None
        return "rho" if total.exact_rho > 0 else "epsilon"

    def covers(self, total: Cost) -> bool:
        """Whether ``total`` (everything spent, including the new query) fits the filter."""
        return self._exceeds(total) is None

    def epsilon_of(self, total: Cost) -> float:
        """The ε of the (ε, δ) guarantee a running total amounts to (see :meth:`guarantee`)."""
        return self.guarantee(total)[0]

    def guarantee(self, total: Cost) -> tuple[float, float]:
        """(ε, δ) such that the transcript charged ``total`` is (ε, δ)-DP.

        The better of the pure sum (Σε, Σδ), when no Gaussian ρ was spent, and the zCDP
        conversion (ε(Σ zrho, D_ρ), Σδ + D_ρ); nothing spent is (0, 0).
        """
        if total.is_zero:
            return 0.0, 0.0
        options = []
        if total.exact_rho == 0:
            options.append((total.epsilon, total.delta))
        if self.zcdp and total.is_finite:
            eps = zcdp_epsilon(total.zrho, self.conversion_delta)
            options.append((eps, total.delta + self.conversion_delta))
        return min(options, default=(math.inf, total.delta))

    def remaining(self, total: Cost) -> tuple[float, float]:
        """(largest ε of one more pure-ε release that fits, δ left for thresholding).

        A release of ε costs ε in the pure filter and ε²/2 in the zCDP filter; the larger of
        the two allowances is what is left. Computed from exact totals.
        """
        eps = 0.0
        if total.exact_rho == 0:
            eps = _left(self.exact_pure_epsilon, total.exact_epsilon)
        if self.zcdp and total.is_finite:
            eps = max(eps, math.sqrt(2 * _left(self.exact_rho, total.exact_zrho)))
        return eps, _left(self.exact_pure_delta, total.exact_delta)

    def unspent(self, total: Cost) -> tuple[float, float]:
        """(budget ε − guaranteed ε, budget δ − guaranteed δ): the guarantee not yet used."""
        eps, delta = self.guarantee(total)
        return max(0.0, self.epsilon - eps), max(0.0, self.delta - delta)

    def queries_left(self, total: Cost, per_query: Cost) -> int:
        """How many more releases of cost ``per_query`` fit after ``total`` (capped at 10⁹).

        Each filter's allowance grows with every charge, so k more fit iff the k-th does;
        exact, by the largest k of each filter, then a check.
        """
        if per_query.is_zero:
            return 10**9
        limit = 10**9
        best = 0
        for k in self._candidates(total, per_query, limit):
            if k > best and self.covers(total + _times(per_query, k)):
                best = k
        return best

    def _candidates(self, total: Cost, per_query: Cost, limit: int) -> list[int]:
        """The largest k each filter's own caps allow (exact floors)."""
        rho_cap, eps_cap, delta_cap = self._limits
        out = []
        caps = [(delta_cap, total.exact_delta, per_query.exact_delta)]
        pure = (eps_cap, total.exact_epsilon, per_query.exact_epsilon)
        if total.exact_rho == 0 and per_query.exact_rho == 0:
            out.append(_floor_min([*caps, pure], limit))
        if self.zcdp:
            zcdp = (rho_cap, total.exact_zrho, per_query.exact_zrho)
            out.append(_floor_min([*caps, zcdp], limit))
        return out

    def refusal_reason(self, total: Cost) -> str:
        """Which part of the budget a total exceeds, for the refusal message."""
        part = self._exceeds(total)
        if part == "delta":
            return f"the delta part for non-public group keys is spent: cap {self.pure_delta:.3g}"
        if part == "rho" and not self.zcdp:
            return (
                "a budget with delta = 0 admits no Gaussian noise "
                "(set budget_delta > 0 in [privacy], or SET mechanism = 'laplace')"
            )
        if self.zcdp:
            return (
                f"the zCDP budget is spent: rho cap {self.rho:.6g}, i.e. epsilon "
                f"{self.epsilon:.6g} at delta {self.conversion_delta:.3g}"
            )
        return f"the epsilon budget is spent: cap {self.pure_epsilon:.6g}"

    def too_large(self, cost: Cost) -> bool:
        """Whether ``cost`` alone would not fit this budget, even with nothing spent."""
        return not self.covers(cost)

    def refusal(self, spent: Cost, cost: Cost) -> str:
        """Which limit a charge of ``cost`` after ``spent`` would break, and by how much.

        In the ε view of the filter: a query that does not fit even an unspent budget is
        "this query's ε 20 is more than the whole budget ε 10"; otherwise "spent ε 9.8 of 10;
        this query needs ε 0.5, 0.3 more than the 0.2 left", where ε spent is the guarantee
        (:meth:`guarantee`) and the query's ε and what is left are counted as one pure-ε
        release, by the filter (pure or zCDP) that comes closest to admitting it. Under the
        zCDP filter the ρ figures follow, so the message says exactly what the filter compared.
        Words only: what fits is decided by :meth:`covers`.
        """
        total = spent + cost
        part = self._exceeds(total)
        if part is None or not total.is_finite or (part == "rho" and not self.zcdp):
            return self.refusal_reason(total)
        if part == "delta":
            return self._delta_refusal(spent, cost)
        whole = f"budget \u03b5 {_g(self.epsilon)}" + (
            f" (\u03b4 {_g(self.delta, 3)})" if self.zcdp else ""
        )
        if self.too_large(cost):
            text = f"this query's \u03b5 {_g(self.epsilon_of(cost))} is more than the whole {whole}"
            return text + self._zcdp_words(Cost(), cost)
        need, left = self._closest(spent, cost)
        text = (
            f"spent \u03b5 {_g(self.epsilon_of(spent))} of {_g(self.epsilon)}"
            + (f" (\u03b4 {_g(self.delta, 3)})" if self.zcdp else "")
            + f"; this query needs \u03b5 {_g(need)}, {_g(need - left)} more than the "
            f"{_g(left)} left"
        )
        return text + self._zcdp_words(spent, cost)

    def _closest(self, spent: Cost, cost: Cost) -> tuple[Fraction | float, Fraction | float]:
        """(the query's ε, the ε left) as one pure-ε release, in the filter that falls short
        by the least: the pure filter (Σε ≤ E, while no Gaussian ρ is spent) counts ε; the
        zCDP filter counts √(2·zrho) against √(2(ρ* − Σ zrho))."""
        options: list[tuple[Fraction | float, Fraction | float]] = []
        if spent.exact_rho == 0 and cost.exact_rho == 0:
            left = max(Fraction(0), self.exact_pure_epsilon - spent.exact_epsilon)
            options.append((cost.exact_epsilon, left))
        if self.zcdp:
            room = max(Fraction(0), self.exact_rho - spent.exact_zrho)
            options.append((math.sqrt(2 * cost.zrho), math.sqrt(2 * float(room))))
        return min(options, key=lambda o: float(o[0]) - float(o[1]))

    def _zcdp_words(self, spent: Cost, cost: Cost) -> str:
        if not self.zcdp:
            return ""
        before = f"spent \u03c1 {_g(spent.zrho)} of " if not spent.is_zero else ""
        return (
            f"; as zCDP: {before}the cap \u03c1 {_g(self.rho)}, this query \u03c1 {_g(cost.zrho)}"
        )

    def _delta_refusal(self, spent: Cost, cost: Cost) -> str:
        share = f"the \u03b4 for non-public group keys, {_g(self.pure_delta, 3)}"
        if self.zcdp:
            share += f" of the budget \u03b4 {_g(self.delta, 3)}"
        if not cost.exact_delta <= self._limits[2]:
            return f"this query's \u03b4 {_g(cost.delta, 3)} is more than all of {share}"
        left = max(Fraction(0), self.exact_pure_delta - spent.exact_delta)
        return (
            f"spent \u03b4 {_g(spent.delta, 3)} of {share}; this query needs \u03b4 "
            f"{_g(cost.delta, 3)}, {_g(cost.exact_delta - left, 3)} more than the "
            f"{_g(left, 3)} left"
        )


def _g(value: Fraction | float, digits: int = 6) -> str:
    """A figure for a message: ``digits`` significant digits, no trailing zeros."""
    return f"{float(value):.{digits}g}"


def _times(cost: Cost, k: int) -> Cost:
    return Cost(
        cost.exact_epsilon * k, cost.exact_delta * k, cost.exact_rho * k, cost.exact_zrho * k
    )


def _floor_min(caps: list[tuple[Fraction, Fraction, Fraction]], limit: int) -> int:
    """min over (cap, spent, each) of ⌊(cap − spent)/each⌋ (no bound where each = 0)."""
    best = limit
    for cap, spent, each in caps:
        if each > 0:
            best = min(best, max(0, math.floor((cap - spent) / each)))
        elif spent > cap:
            return 0
    return best
