"""What an answer's bounds cut, per released value: post-processing of the bias measures.

The plan's bias measures (dpsql.plan.bias: rows cut by R, the value mass they held, the mass
the clamps removed) are noised and released with the query's other measures. From them each
COUNT, SUM and AVG gets, per group, an estimate ``b`` of its bias (true − released bounded
value, in the answer's units) and the half-width ``h`` of that estimate's own noise:

- COUNT(*) / COUNT(x): b = dropped rows (for COUNT(x), rows whose x is NULL are counted too:
  an over-estimate when x has NULLs);
- SUM(x): b = (cut mass + clamped mass) · g;
- AVG(x): b = (S + b_SUM) / (N + dropped) − AVG, with S = AVG · N from the released values
  (the value the bounds would not have cut, at the released noise), linearised for h.

Each part's half-width is its noise's at 97.5% (two parts: 95% jointly by the union bound),
added. Nothing here reads data: only the noisy measures and the plan's public noise scales.
VAR, STDDEV, quantiles and COUNT(DISTINCT) get no estimate (None).

The bias-inclusive interval of a value with noise interval [lo, hi] is
``[lo + min(0, b − h), hi + max(0, b + h)]``: it holds the bounded value whenever the noise
interval does, and the value the bounds would not have cut (as far as the capped estimates
see it) whenever the bias estimate is within h of its estimand too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# No dpsql import (the release and the results read it): plans, measures and outputs (Any
# below) are dpsql.plan.values's, read by attribute.

PART_CONFIDENCE = 0.975  # each of a bias's (at most two) parts: 95% jointly


def _find(plan: Any, kind: str, column: str | None) -> Any | None:
    return next((m for m in plan.measures if m.kind == kind and m.column == column), None)


def _part(m: Any | None, noisy: dict[str, np.ndarray], n: int) -> tuple[np.ndarray, float]:
    """A bias measure's noisy value in answer units and its noise's half-width (0s: absent)."""
    if m is None:
        return np.zeros(n), 0.0
    half = m.mechanism.interval_halfwidth(PART_CONFIDENCE) * m.unit
    return np.asarray(noisy[m.name], dtype=float) * m.granularity, float(half)


def estimates(
    plan: Any, noisy: dict[str, np.ndarray], outputs: list[np.ndarray]
) -> list[np.ndarray | None]:
    """Per output, an (n_groups, 2) array of (bias estimate, its half-width), or None when
    the plan measures no bias for it (bias_estimate off, or a kind not estimated)."""
    if not any(m.measure_kind.bias for m in plan.measures):
        return [None] * len(plan.outputs)
    return [_estimate(o, plan, noisy, v) for o, v in zip(plan.outputs, outputs, strict=True)]


def _estimate(
    output: Any, plan: Any, noisy: dict[str, np.ndarray], value: np.ndarray
) -> np.ndarray | None:
    kind = output.call.kind
    n = len(value)
    dropped = _find(plan, "dropped", None)
    if kind == "count":
        if dropped is None:
            return None
        d, h = _part(dropped, noisy, n)
        return np.stack([d, np.full(n, h)], axis=1)
    if kind not in ("sum", "avg"):
        return None
    column = output.call.column
    cut, clamped = _find(plan, "cut", column), _find(plan, "clamped", column)
    if cut is None and clamped is None:
        return None
    c, hc = _part(cut, noisy, n)
    k, hk = _part(clamped, noisy, n)
    mass, mass_half = c + k, hc + hk
    if kind == "sum":
        return np.stack([mass, np.full(n, mass_half)], axis=1)
    # AVG = S / N: the uncut mean (S + mass) / (N + dropped), from the released values
    d, hd = _part(dropped, noisy, n)
    count = np.maximum(np.asarray(noisy[output.measures[1]], dtype=float), 1.0)
    total = value * count
    uncut = np.maximum(count + d, 1.0)
    b = (total + mass) / uncut - value
    h = (mass_half + np.abs(value) * hd) / uncut
    return np.stack([b, h], axis=1)


def widened(low: float, high: float, b: float, h: float) -> tuple[float, float]:
    """The bias-inclusive interval of a value with noise interval [low, high] (module doc)."""
    return low + min(0.0, b - h), high + max(0.0, b + h)
