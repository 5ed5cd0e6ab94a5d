"""Partition selection: which non-public GROUP BY keys to release.

A key that appears in the data is released with a probability that depends on its exact
*unit count* n (the number of distinct privacy units in the group, computed by the engine and
never released). Two mechanisms share one interface (:class:`Selection`):

- :class:`OptimalSelection`: the optimal mechanism of Desfontaines, Voss, Gipson & Mandayam,
  "Differentially private partition selection", PoPETs 2022 (Theorem 1). For one group per
  unit it keeps a key with probability π(n), the largest function allowed by (ε, δ)-DP:

      π(0) = 0,
      π(n) = min(e^ε π(n−1) + δ,  1 − e^(−ε)(1 − π(n−1) − δ),  1).

  The first branch is π(n) = δ(e^(nε) − 1)/(e^ε − 1) until it meets the second, along which
  1 − π(n) falls by e^(−ε) per unit (minus δ e^(−ε)); π saturates at 1 after a finite n. One
  unit in up to G groups changes G unit counts by one each; the G keep decisions are
  independent and each sees one count, so running the one-group mechanism at (ε/G, δ/G)
  is (ε, δ)-DP by basic composition (the paper's reduction for several partitions per user).
- :class:`GaussianSelection`: discrete-Gaussian noise on the unit count, key kept when the
  noisy count reaches τ, and the noisy count *reused* as the released COUNT(DISTINCT unit)
  (and, when each unit has one row per group, COUNT(*)): one measure pays for both.

Exactness of the keep draw. π(n) is computed in integer arithmetic on the grid 2⁻⁵³: each
value is the floor of the recursion applied to the previous (already rounded) value, with e^ε
replaced by a rational r ≤ e^ε (so 1/r ≥ e^(−ε)). Rounding π(n) down keeps both privacy
inequalities true for the rounded table (they bound π(n+1) from above, in terms of π(n), and
π(n+1) is computed from the rounded π(n)), and, because r ≤ e^ε, they hold for the real ε. A
key is kept iff U < π(n) with U = k·2⁻⁵³ from :meth:`NoiseSource.uniform`, k uniform on
[0, 2⁵³): P(keep) = π(n) exactly, no floating-point rounding involved.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import numpy as np

from dpsql.privacy.accounting import Cost
from dpsql.privacy.mechanisms import Gaussian, discrete_gaussian_tail
from dpsql.privacy.samplers import NoiseSource

GRID_BITS = 53  # π(n) is a multiple of 2⁻⁵³, as is NoiseSource.uniform's output
_ONE = 1 << GRID_BITS
MAX_TABLE = 2_000_000  # longest π table computed (ε/G ≈ 1e-5 at δ = 1e-6); beyond: refused


class Selection(Protocol):
    """What the planner needs from a partition-selection mechanism."""

    name: str

    @property
    def cost(self) -> Cost: ...

    def keep(self, unit_counts: np.ndarray, source: NoiseSource) -> np.ndarray:
        """A bool mask over groups: which keys to release (counts are exact, >= 1)."""
        ...

    def suppression_probability(self, n: int) -> float:
        """P(a key with n units is not released): for EXPLAIN and the released rows."""
        ...


def _check(epsilon: float, delta: float, max_groups: int) -> None:
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError("partition selection needs a finite epsilon > 0")
    if not 0 < delta < 1:
        raise ValueError("partition selection needs 0 < delta < 1")
    if not (isinstance(max_groups, int) and max_groups >= 1):
        raise ValueError("max_groups must be an integer >= 1")


def _exp_below(epsilon: float) -> Fraction:
    """A rational r <= e^ε, within 2⁻⁵⁰ relative: the float exp rounded down by a margin."""
    r = Fraction(math.exp(epsilon)) * (1 - Fraction(1, 2**50))
    return max(r, Fraction(1))


def table_length(epsilon: float, delta: float) -> float:
    """The closed form of the π table's length (one group per unit): π grows as
    δ(e^(nε) − 1)/(e^ε − 1) to 1/2 and 1 − π falls back symmetrically, so the table has
    N ≈ 2·ln(1 + (e^ε − 1)/(2δ))/ε entries (the rounded recursion's is within 1 above it).
    O(1): what decides a refusal before any table is built."""
    if epsilon > 50:  # e^ε − 1 ≈ e^ε: no overflow
        growth = epsilon + math.log(0.5 / delta)
    else:
        growth = math.log1p(math.expm1(epsilon) / (2 * delta))
    return 2 * growth / epsilon


def keep_table(epsilon: float, delta: float) -> tuple[int, ...]:
    """π(0), π(1), ..., π(m) = 1 as integers P with π = P / 2⁵³ (one group per unit).

    Integer recursion on the grid (see the module docstring): each step takes the smaller of
    ⌊r·P + δ·2⁵³⌋ and ⌊2⁵³ − (2⁵³ − P − δ·2⁵³)/r⌋, capped at 2⁵³, for a rational r <= e^ε.
    A table longer than :data:`MAX_TABLE` is refused (ValueError) from its closed-form length
    before any step runs; the outcome, refusals included, is cached per (ε, δ) (public
    parameters only), so a repeated EXPLAIN or plan does no work at all.
    """
    _check(epsilon, delta, 1)
    out = _keep_table(epsilon, delta)
    if isinstance(out, str):
        raise ValueError(out)
    return out


@functools.lru_cache(maxsize=256)
def _keep_table(epsilon: float, delta: float) -> tuple[int, ...] | str:
    """The table, or the refusal's message: an lru_cache does not keep exceptions."""
    too_long = (
        "partition selection at this epsilon needs more than "
        f"{MAX_TABLE} units per group before keys are surely released"
    )
    if table_length(epsilon, delta) - 2 > MAX_TABLE:
        return too_long
    try:
        return _build_table(epsilon, delta)
    except OverflowError:
        return "partition selection at this epsilon: e^epsilon overflows"
    except ValueError:  # the closed form is within 1 step: a guard, never reached
        return too_long


def _build_table(epsilon: float, delta: float) -> tuple[int, ...]:
    r = _exp_below(epsilon)
    a, b = r.numerator, r.denominator
    d = Fraction(delta) * _ONE  # δ on the grid, exact
    dn, dd = d.numerator, d.denominator
    table = [0]
    p = 0
    while p < _ONE:  # at most MAX_TABLE + 1 steps (table_length checked before)
        if len(table) > MAX_TABLE:
            raise ValueError("table longer than MAX_TABLE")
        # first = ⌊(a/b)·p + dn/dd⌋, second = ⌊ONE − (ONE − p − dn/dd)·b/a⌋ (ceil of the part)
        first = (a * p * dd + dn * b) // (b * dd)
        gap_num = (_ONE - p) * dd - dn  # (ONE − p − δ') · dd
        second = _ONE - (-((-gap_num * b) // (a * dd))) if gap_num > 0 else _ONE
        p = min(first, second, _ONE)
        table.append(p)
    return tuple(table)


def _split(epsilon: float, delta: float, max_groups: int) -> tuple[float, float]:
    """The per-group (ε, δ): (ε/G, δ/G), rounded down so that G shares never exceed the whole."""
    eps, dlt = epsilon / max_groups, delta / max_groups
    while eps * max_groups > epsilon:
        eps = math.nextafter(eps, 0.0)
    while dlt * max_groups > delta:
        dlt = math.nextafter(dlt, 0.0)
    return eps, dlt


@dataclass(frozen=True)
class OptimalSelection:
    """Desfontaines et al. (2022) partition selection: (ε, δ)-DP for ``max_groups`` groups per
    unit, releasing each present key with the largest probability any such mechanism can."""

    epsilon: float
    delta: float
    max_groups: int = 1

    name = "optimal_partition_selection"

    def __post_init__(self) -> None:
        _check(self.epsilon, self.delta, self.max_groups)

    @property
    def per_group(self) -> tuple[float, float]:
        """The (ε, δ) each group's decision runs at."""
        return _split(self.epsilon, self.delta, self.max_groups)

    @property
    def cost(self) -> Cost:
        """(ε, δ); zCDP G·(ε/G)²/2: G independent (ε/G, δ/G)-DP decisions, each δ/G-approx
        (ε/G)²/2-zCDP (Bun & Steinke 2016, §8)."""
        eps, _ = self.per_group
        return Cost(
            epsilon=self.epsilon, delta=self.delta, zrho=Cost(eps).exact_zrho * self.max_groups
        )

    @property
    def table(self) -> tuple[int, ...]:
        return keep_table(*self.per_group)

    @property
    def saturation(self) -> int:
        """The smallest unit count whose key is always released."""
        return len(self.table) - 1

    def keep_numerator(self, n: int) -> int:
        """π(n) · 2⁵³, exactly."""
        if n <= 0:
            return 0
        table = self.table
        return table[n] if n < len(table) else _ONE

    def keep_probability(self, n: int) -> float:
        return self.keep_numerator(n) / _ONE

    def suppression_probability(self, n: int) -> float:
        return (_ONE - self.keep_numerator(n)) / _ONE

    def keep(self, unit_counts: np.ndarray, source: NoiseSource) -> np.ndarray:
        """Keep each key with probability π(n), exactly (U = k·2⁻⁵³ < π(n))."""
        counts = np.asarray(unit_counts, dtype=np.int64)
        if counts.size and counts.min() < 0:
            raise ValueError("unit counts must be >= 0")
        table = np.asarray(self.table, dtype=np.uint64)
        index = np.minimum(counts, len(table) - 1)
        p = table[index].astype(np.float64) * 2.0**-GRID_BITS  # exact: multiples of 2⁻⁵³
        u = np.asarray(source.uniform(counts.size), dtype=np.float64)
        return u < p


@dataclass(frozen=True)
class GaussianSelection:
    """Noisy unit count (discrete Gaussian, L2 sensitivity √G), key kept iff noisy >= τ.

    Cost: ρ = G/(2σ²) for the noisy counts, which are released (``noisy_counts``) and reused
    as COUNT(DISTINCT unit); plus δ_T for keys a single unit creates: P(1 + X >= τ) <= δ_T/G
    per group, and one unit creates at most G keys (union bound). σ is the analytic Gaussian
    for (ε, δ − δ_T) with δ_T = δ/2, so a caller holding (ε, δ) for the whole selection can
    compare it with :class:`OptimalSelection` at the same (ε, δ).
    """

    epsilon: float
    delta: float
    max_groups: int = 1

    name = "gaussian_threshold"

    def __post_init__(self) -> None:
        _check(self.epsilon, self.delta, self.max_groups)

    @functools.cached_property
    def mechanism(self) -> Gaussian:
        return Gaussian(l2=math.sqrt(self.max_groups), epsilon=self.epsilon, delta=self.delta / 2)

    @functools.cached_property
    def tau(self) -> float:
        return self.mechanism.threshold(self.delta / 2, self.max_groups)

    @property
    def cost(self) -> Cost:
        return Cost(delta=self.delta / 2, rho=self.mechanism.rho)

    def noisy_counts(self, unit_counts: np.ndarray, source: NoiseSource) -> np.ndarray:
        counts = np.asarray(unit_counts, dtype=np.int64)
        return counts + self.mechanism.sample(source, counts.size)

    def keep(self, unit_counts: np.ndarray, source: NoiseSource) -> np.ndarray:
        return self.select(unit_counts, source)[0]

    def select(self, unit_counts: np.ndarray, source: NoiseSource) -> tuple[np.ndarray, np.ndarray]:
        """(keep mask, noisy counts): the counts of kept keys may be released as they are."""
        noisy = self.noisy_counts(unit_counts, source)
        return noisy >= self.tau, noisy

    def suppression_probability(self, n: int) -> float:
        """P(n + X < τ) from the exact pmf of the discrete noise."""
        m = math.ceil(self.tau - n)  # need X >= τ − n
        return 1.0 - discrete_gaussian_tail(self.mechanism.scale, m)


def expected_suppression(selection: Selection, unit_counts: np.ndarray) -> float:
    """The expected fraction of present keys a mechanism suppresses (exact, no sampling)."""
    counts = np.asarray(unit_counts, dtype=np.int64)
    if not counts.size:
        return 0.0
    return float(np.mean([selection.suppression_probability(int(n)) for n in counts]))


def suppression_lower_bound(epsilon: float, delta: float, unit_counts: np.ndarray) -> float:
    """The smallest expected suppression ANY (ε, δ)-DP selection (one group per unit) can
    achieve on these counts: the optimal mechanism's, by Desfontaines et al.'s Theorem 1."""
    return expected_suppression(OptimalSelection(epsilon, delta), unit_counts)


@dataclass(frozen=True)
class Unreleased:
    """The "mechanism" of an exact measure that only a partition selection reads.

    :class:`OptimalSelection` decides on the *exact* unit count of each group, so the engine
    computes it like any measure; it is never noised and never released. Its own privacy map
    is zero: the selection node charges the selection's cost, and dpsql.plan.check refuses a
    plan in which any output (or interval) reads such a measure.
    """

    l1: float = 1.0
    l2: float = 1.0

    name = "none (exact, read by the partition selection only)"
    scale = 0.0

    @property
    def cost(self) -> Cost:
        return Cost()

    def privacy_map(self, l1: float, l2: float, groups: int = 1) -> Cost:
        """Zero at any sensitivity: nothing is released (the selection node charges the
        selection's cost, and no output may read it: dpsql.plan.check)."""
        return Cost()

    def sample(self, source: NoiseSource, size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.int64)

    def interval_halfwidth(self, confidence: float = 0.95) -> float:
        return 0.0
