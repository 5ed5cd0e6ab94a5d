"""What the contribution bounds cut from an answer, measured privately in the same query.

A released value is computed from *bounded* rows: each privacy unit keeps at most R =
``max_rows_per_unit`` rows per group (the rest are dropped, or its partial sums rescaled to R
rows), at most G = ``max_groups_per_unit`` groups, and every value is clamped to its column's
declared range. The noise interval covers the bounded value, not the true one. With the
session setting ``bias_estimate = on`` (the default) the plan adds up to three measures, run by
the engine in the same bounded query and noised from BIAS_SHARE of the query's ε (the rest is
the answer's; ``SET bias_estimate = off`` gives it all to the answer):

``dropped`` (one per query)
    Per (unit, group) pair the bounding keeps, ``d = min(max(n - R, 0), C)`` with n the pair's
    rows after the WHERE and C = CAP_FACTOR · R: the rows R cut from the pair, at most C.
    Estimates Σ min((n − R)⁺, C) over the kept pairs: exactly the rows R drops when no unit has
    more than R + C rows in a group, a lower bound otherwise (each pair's excess over R + C
    is not counted: stated in every note).

    Sensitivity. Adding or removing one unit changes only its own pairs. It keeps at most G
    pairs, each with d in [0, C]: L1 <= G·C, L2 <= sqrt(G)·C. Under group scaling (a unit in
    k > G public groups keeps all k at G/k each) its pairs add d·G/k each: L1 <= k·C·G/k =
    G·C, L2 <= sqrt(k)·C·G/k <= sqrt(G)·C. A unit's d is clipped at C: without the clip one
    unit with a million rows would move the count by a million (unbounded sensitivity).

``cut`` (per SUM / AVG column x)
    Per kept pair, ``v · d / n`` with v the pair's sum over all its n rows of x in fixed-point
    units clamped to the *widened* range [lo − W, hi + W] (W = hi − lo, the column's width):
    the mass of the d rows cut, at the pair's mean (truncated toward zero). Under sampling
    the R kept rows are a uniform sample of the pair's rows, so the cut rows' mass is
    v · (n − R) / n in expectation: unbiased for the mass cut when no pair exceeds R + C rows
    and no value lies more than W beyond a bound (else a lower bound in magnitude). Under
    rescaling (bounding = "scale") the pair's sum is cut by v · (1 − R/n) exactly. The widened
    range is what makes ``cut`` + ``clamped`` the whole bias of a SUM: true − released =
    Σ_pairs [Σx · (n − R)/n + Σ(x − clamp x) · R/n] = cut + clamped.

    Sensitivity: |v| <= n·M (M = max(|lo − W|, |hi + W|)), so |v·d/n| <= C·M per pair; a unit
    keeps <= G pairs: L1 <= G·C·M, L2 <= sqrt(G)·C·M (group scaling as above).

``clamped`` (per SUM / AVG column x)
    Per bounded row, ``e = round((x − clamp(x)) / g)`` clipped to [−W, W], W = hi − lo (the
    column's fixed-point width), 0 for NULL: the signed mass the clamp removed from the row.
    Summed over the same bounded (sampled or rescaled) rows as the SUM, so it estimates the
    clamp's bias of the released SUM itself: exactly, when no value lies more than the
    range's width beyond a bound (else such a row counts W: a lower bound in magnitude).

    Sensitivity: a row adds at most W in magnitude; a unit adds <= R rows to each of <= G
    groups (the bounding, unchanged): L1 <= G·R·W, L2 <= sqrt(G)·R·W — a SUM's bounds with
    row bound W (rescaled rows likewise, the same argument as the SUM's in dpsql.plan.values).

G is not estimated: a unit's groups beyond G are dropped (or rescaled) whole and a per-group
estimate of them would need the pairs the ranking drops; EXPLAIN and every note say that G
may cut more. Each bias measure is one :class:`BiasKind` (BIAS_KINDS) owning what the planner,
the measure kinds and the engines ask of it: per pair or per row, of a column or not, the range
it reads and its bound per pair (row) from the proofs above. The bias measures are released
like any other measure (their noise is Laplace, pure ε, whatever the plan's mechanism) and
charged in the query's one reservation.
What an answer reports (post-processing of the noisy measures, free) is in
dpsql.privacy.bias.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpsql.aggregates import KINDS as AGGREGATE_KINDS

# Imports only the aggregate kinds (which bias measures each reads): the planner, the measure
# kinds, the tree check and the notes all read it.

#: The share of the query's ε (after any automatic clipping share) spent on the bias measures.
BIAS_SHARE = 0.1
#: C = CAP_FACTOR · R: a (unit, group) pair's rows cut by R are counted up to C.
CAP_FACTOR = 2
#: ColumnPolicy.clip of a column planned with the clamp range chosen from its kept DP
#: histogram (dpsql.service.bounds.CLIP_CHOSEN): a single total's clamp bias is that
#: histogram's estimate (post-processing), so no ``clamped`` measure is planned for it.
CLIP_CHOSEN = "chosen"
_LIMIT = 2**62  # 64-bit engine sums: larger per-row bounds are not measured


def cap(R: int) -> int:
    return CAP_FACTOR * R


def share(epsilon: float) -> float:
    """The bias measures' part of ``epsilon``."""
    return epsilon * BIAS_SHARE


def parts(total: float, k: int) -> list[float]:
    """``total`` in k equal shares fl(total / k): the ledger reads each as total / k
    (dpsql.privacy.accounting.exact), so they add up to ``total`` (within a float's error
    where ``total`` itself is no short decimal)."""
    return [total / k] * k


@dataclass(frozen=True)
class BiasKind:
    """One bias measure (module docstring): ``per_pair``, measured once per kept (unit, group)
    pair, not per row (a unit adds <= its row bound per group); ``of_column``, a column's (else
    of no column, the rows R cuts: at most one per query); ``widened``, it reads the column's
    [lo, hi] widened by its width W on each side (so with ``clamped`` it sees what the clamp
    removed from the rows R cuts too); ``by_histogram``, a single total of a column whose clamp
    was chosen from its kept DP histogram (CLIP_CHOSEN) is estimated by that histogram, not
    measured; ``bound``, the largest |value| one pair (one row) adds, from the fixed-point
    range it reads and R (the proofs: module docstring)."""

    name: str
    per_pair: bool
    of_column: bool
    bound: Callable[[int, int, int], int]
    widened: bool = False
    by_histogram: bool = False

    def measure_range(self, lo: int, hi: int) -> tuple[int, int]:
        if not self.widened:
            return lo, hi
        width = hi - lo
        return lo - width, hi + width


BIAS_KINDS = {
    k.name: k
    for k in (
        BiasKind("dropped", per_pair=True, of_column=False, bound=lambda lo, hi, R: cap(R)),
        BiasKind(
            "cut",
            per_pair=True,
            of_column=True,
            widened=True,
            bound=lambda lo, hi, R: cap(R) * max(abs(lo), abs(hi), 1),
        ),
        BiasKind(
            "clamped",
            per_pair=False,
            of_column=True,
            by_histogram=True,
            bound=lambda lo, hi, R: max(hi - lo, 1),
        ),
    )
}
#: Measured once per kept (unit, group) pair, not per row: a unit adds <= row_bound per group.
PAIR_KINDS = tuple(name for name, k in BIAS_KINDS.items() if k.per_pair)
#: Of no column (the rows R cuts): at most one per query.
OF_NO_COLUMN = tuple(name for name, k in BIAS_KINDS.items() if not k.of_column)
KINDS = tuple(BIAS_KINDS)


def measure_range(kind: str, lo: int, hi: int) -> tuple[int, int]:
    """The fixed-point range a bias measure reads a column's values in (BiasKind.widened)."""
    return BIAS_KINDS[kind].measure_range(lo, hi)


def row_bound(kind: str, lo: int, hi: int, R: int) -> int:
    """The largest |value| one pair (PAIR_KINDS) or one row (clamped) adds to a bias measure,
    from the column's fixed-point range [lo, hi] (see the module docstring)."""
    return BIAS_KINDS[kind].bound(lo, hi, R)


def bias_specs(
    query: Any,  # dpsql.frontend.bind.DPQuery
    on: bool,
    R: int,
    fixed: Callable[[Any], tuple[int, int]],  # a ColumnPolicy's fixed-point [lo, hi]
) -> list[tuple[str, str | None]]:
    """The (kind, column) bias measures of a query: ``dropped`` when a unit is bounded and a
    COUNT or AVG is released, ``cut`` and ``clamped`` per SUM / AVG column (``clamped``
    on row-level tables too: only the clamps cut there). ``fixed``: a column's fixed-point
    range. Columns whose bounds are too large for 64-bit sums are left out."""
    if not on or query.table.bias_by_histogram:
        return []
    # R and G can cut a row only where a unit may have several: not on a row-level table, nor
    # where the unit is declared primary_key / unique with R = G = 1 (TablePolicy.unit_is_row)
    bounded = not query.table.unit_is_row
    specs: list[tuple[str, str | None]] = []
    # each aggregate kind's object says which bias measures estimate it (dpsql.aggregates:
    # COUNT the rows dropped, SUM the mass cut and clamped, AVG all three); pairs, and the rows
    # R cuts from them, exist only where a unit is bounded
    reads = [
        (c, [k for k in AGGREGATE_KINDS[c.kind].bias_reads if bounded or k not in PAIR_KINDS])
        for c in query.aggregates
    ]
    specs += [(k, None) for k in OF_NO_COLUMN if any(k in kinds for _, kinds in reads)]
    for call, kinds in reads:
        of_column = [k for k in kinds if k not in OF_NO_COLUMN]
        if call.column is None or not of_column:
            continue
        col = query.table.columns[call.column]
        lo, hi = fixed(col)
        for kind in of_column:
            if BIAS_KINDS[kind].by_histogram and col.clip == CLIP_CHOSEN and not query.keys:
                continue  # estimated by the kept histogram the range was chosen from
            b = row_bound(kind, *measure_range(kind, lo, hi), R)
            per_unit = b if kind in PAIR_KINDS else b * R
            if (kind, call.column) not in specs and per_unit <= _LIMIT:
                specs.append((kind, call.column))
    return specs
