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

from dpsql.aggregates import KINDS, BiasPart

# Plans, measures and outputs (Any below) are dpsql.plan.values's, read by attribute; each
# aggregate kind's object (dpsql.aggregates) says which bias measures it reads
# (``bias_reads``) and combines them (``bias_estimate``: the formulas above).

PART_CONFIDENCE = 0.975  # each of a bias's (at most two) parts: 95% jointly


def _find(plan: Any, kind: str, column: str | None) -> Any | None:
    """The plan's bias measure of ``kind`` for ``column``: ``dropped`` is per pair, of no
    column; the others are of the output's column."""
    return next((m for m in plan.measures if m.kind == kind and m.column in (column, None)), None)


def _part(m: Any | None, noisy: dict[str, np.ndarray]) -> BiasPart:
    """A bias measure's noisy value in answer units and its noise's half-width (None: absent)."""
    if m is None:
        return None
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
    kind = KINDS[output.call.kind]
    if not kind.bias_reads:
        return None
    column = output.call.column
    parts = {b: _part(_find(plan, b, column), noisy) for b in kind.bias_reads}
    return kind.bias_estimate(output, parts, noisy, value)


def widened(low: float, high: float, b: float, h: float) -> tuple[float, float]:
    """The bias-inclusive interval of a value with noise interval [low, high] (module doc)."""
    return low + min(0.0, b - h), high + max(0.0, b + h)
