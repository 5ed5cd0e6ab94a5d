"""Automatic clipping at run time: release each auto-clipped column's range, then plan again.

Runs after the reserve (the whole query's cost, its clipping histograms' included, is already
charged): each range is a noisy histogram of |x| (dpsql.privacy.clipping), and the query is
planned again with those ranges as its bounds at no more than the cost charged.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsql.errors import InternalError
from dpsql.lower.compile import compile_clip_histograms
from dpsql.plan.annotated import Plan
from dpsql.plan.planner import with_clip_ranges

if TYPE_CHECKING:
    from dpsql.engine.api import QueryHandle
    from dpsql.privacy.samplers import NoiseSource


def clip_and_replan(
    engine: Any, noise: NoiseSource, plan: Plan, secret: int, handle: QueryHandle | None
) -> tuple[Plan, list[str]]:
    """Release each auto-clipped column's range (its histogram of |x|, noised: ε_b) and
    plan the query again with those ranges as bounds. Runs after the reserve: the whole
    query's cost, clipping included, is already charged."""
    ranges: dict[str, tuple[float, float]] = {}
    notes = []
    for clip, query in zip(plan.clips, compile_clip_histograms(plan, secret), strict=True):
        bins = engine.execute(query, handle)
        counts = np.zeros(clip.histogram.bins, dtype=np.int64)
        for row, c in zip(bins.key_rows, bins.measures[0], strict=True):
            counts[int(row[-1])] += int(c)
        col = plan.query.table.columns[clip.column]
        got = clip.mechanism.release(counts, noise, col.lower, col.upper)  # type: ignore[arg-type]
        ranges[clip.column] = (got.lower, got.upper)
        bias = got.bias()
        notes.append(
            f"{col.expr or clip.column}: clamped to the DP range [{got.lower:g}, "
            f"{got.upper:g}] (ε {clip.epsilon:.3g} of the query's, declared "
            f"[{col.lower:g}, {col.upper:g}]); about {bias.clipped_share:.1%} of its values "
            f"lie beyond it, so SUM/AVG are biased towards zero by about "
            f"{bias.sum_bias:.3g} in total"
        )
    run = with_clip_ranges(plan, ranges)
    spent = run.cost
    for clip in plan.clips:
        spent = spent + clip.cost
    if spent.exact_epsilon > plan.cost.exact_epsilon * (1 + Fraction(1, 10**9)) or (
        spent.exact_rho > plan.cost.exact_rho * (1 + Fraction(1, 10**9))
    ):
        raise InternalError("the clipped plan costs more than was charged", construct="clip")
    return run, notes
