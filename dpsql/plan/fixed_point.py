"""A column's fixed-point range: the integers one row's value may take, as the plan's
sensitivities assume and every lowering clamps to (a property of the policy's declared
range and granularity alone, so the planner, the lowerings and the store share it).
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache


@lru_cache(maxsize=4096)  # a pure function of the policy's numbers: each column's once
def fixed_point_bounds(lower: float, upper: float, g: float) -> tuple[int, int]:
    """The integer range [lo, hi] of one row's fixed-point value, as the sensitivity assumes.

    Each bound goes to its nearest multiple of ``g``, a tie toward the inside of [lower, upper]
    (the smaller range), computed exactly on the decimal values the policy states (no float
    quotient: 0.35 / 0.1 is a tie, not 3.4999...). The engine clamps ``x / g`` to these very
    integers before rounding it (:func:`fixed_point_expr`), so its own tie
    rule (DuckDB and Spark round half away from zero) cannot leave [lo, hi]; and a row's value
    stays within g/2 of its clamped x whether or not the bounds are multiples of ``g``.
    """
    a, b = Fraction(repr(lower)) / Fraction(repr(g)), Fraction(repr(upper)) / Fraction(repr(g))
    lo, hi = math.floor(a + Fraction(1, 2)), math.ceil(b - Fraction(1, 2))
    # lo > hi only when lower == upper sits on a tie: either neighbour is as near
    return min(lo, hi), hi
