"""Shared measures, the ε split of a query, and the choice of partition selection.

Three planner decisions that change how much answer a query gets for its ε, none of which
changes a sensitivity or the kind of a cost (dpsql.plan.values calls them; docs/mechanisms.md
derives them):

- :func:`canonical`: measures that are equal on every dataset are one measure. COUNT(col) of
  a column the policy declares ``nullable = false`` *is* COUNT(*) (by the declaration: a NULL
  that violates it is counted as a row, the same on every dataset, so neighbours still differ
  by one unit's rows only); with one row per unit and group (R = 1) the row count *is* the
  unit count, so COUNT(*), COUNT(DISTINCT unit) and the thresholding count are one measure.
- :func:`split`: the query's ε over its noisy measures (and the selection), minimising the
  sum over released values of their linearised noise variance, each normalised to a relative
  error: Σ_i C_i / ε_i² under Σ_i ε_i = ε gives ε_i ∝ C_i^(1/3).
- :func:`choose`: optimal partition selection or τ-thresholding whose noisy count is reused,
  whichever releases a group at the smaller unit count (n at which P(keep) reaches 1/2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction

from dpsql.aggregates import KINDS
from dpsql.frontend.nullability import column_may_be_null
from dpsql.plan.measure_kinds import MEASURE_KINDS
from dpsql.policy import TablePolicy
from dpsql.privacy.mechanisms import Mechanism

Spec = tuple[str, str | None]

SELECTION_MODES = ("auto", "optimal", "threshold")


def canonical(table: TablePolicy, spec: Spec, units_measured: bool, max_rows: int) -> Spec:
    """The one measure that stands for ``spec`` (see the module docstring)."""
    kind, column = spec
    # each measure kind names the measure it equals (dpsql.plan.measure_kinds: non_null, one_row)
    non_null = MEASURE_KINDS[kind].non_null
    if non_null is not None and column is not None:
        col = table.columns[column]
        if not column_may_be_null(col):  # the rule of a column's nullable fact
            kind, column = non_null, None
    one_row = MEASURE_KINDS[kind].one_row
    if one_row is not None and units_measured and max_rows == 1:
        kind = one_row
    return kind, column


def count_spec(table: TablePolicy, column: str, units_measured: bool, max_rows: int) -> Spec:
    """The measure that counts ``column``'s values (a centred SUM adds centre × it back)."""
    return canonical(table, ("values", column), units_measured, max_rows)


def output_coefficients(
    kind: str, parts: Sequence[Spec], sum_scale: Callable[[Spec], tuple[float, float, float]]
) -> dict[Spec, float]:
    """Per measure, the weight of its noise in one output's relative error (times N).

    ``sum_scale(spec)`` gives (h, c, M) of a sum measure in fixed-point units: the per-row
    bound after centring, the centre, and the largest |value| of the range (the value's
    scale). Counts: error X_N / N. SUM: (X_S + c X_N) / (N M). AVG: (X_S − μ_c X_N) / (N M),
    |μ_c| <= h at worst (the minimax weight). VAR/STDDEV: equal weights on its three measures.
    Each weight multiplies the measure's own per-row bound, so C_i = Σ_o (weight × bound)².
    """
    # each kind's own formula (dpsql.aggregates.AggregateKind.noise_weights); the variance
    # family and the distinct kinds: an equal split
    return KINDS[kind].noise_weights(parts, sum_scale)


def split(epsilon: float, weights: Sequence[float]) -> list[float]:
    """ε_i = ε C_i^(1/3) / Σ_j C_j^(1/3): the minimiser of Σ C_i/ε_i² with Σ ε_i = ε.

    (Lagrange: 2 C_i / ε_i³ = λ for every i.) Equal weights give ε/k exactly; the shares are
    rounded so that their exact sum never exceeds ε.
    """
    k = len(weights)
    if k == 0:
        return []
    roots = [max(w, 0.0) ** (1 / 3) for w in weights]
    if len(set(roots)) <= 1 or not all(r > 0 for r in roots):
        return [epsilon / k] * k
    total = sum(roots)
    # Shares on the grid q = 2^(e − 40) (ε = m·2^e), the last one ε minus the others: every
    # part is a multiple of ε's own ulp below ε, so each is an exact float and their exact
    # (Fraction) sum is ε itself, as the ledger charges it.
    q = math.ldexp(1.0, math.frexp(epsilon)[1] - 40)
    shares = [round(epsilon * r / total / q) * q for r in roots[:-1]]
    last = Fraction(epsilon) - sum(Fraction(x) for x in shares)
    if last <= 0 or min(shares) <= 0:
        return [epsilon / k] * k
    shares.append(float(last))
    assert sum(Fraction(x) for x in shares) == Fraction(epsilon)
    return shares


def half_keep(suppression: Callable[[int], float], start: int = 1, limit: int = 10**7) -> int:
    """The smallest unit count n >= 1 whose key is kept with probability >= 1/2 (bisection:
    suppression is non-increasing in n)."""
    lo, hi = start, max(start, 1)
    while suppression(hi) > 0.5:
        if hi >= limit:
            return limit
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if suppression(mid) > 0.5:
            lo = mid + 1
        else:
            hi = mid
    return lo


def threshold_suppression(
    units: Mechanism, tau: float, below: float = 0.0
) -> Callable[[int], float]:
    """n ↦ P(n + X < τ) − below · P(n + X = τ − 1): a key with n units is suppressed by the
    τ-threshold, which keeps a key at τ − 1 with probability ``below`` (exact pmf)."""

    def suppression(n: int) -> float:
        m = math.ceil(tau - n)
        kept = units._tail(m)
        if below:
            kept += below * (units._tail(m - 1) - kept)
        return 1.0 - kept

    return suppression
