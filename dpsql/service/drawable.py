"""Whether every mechanism of a plan can run at its ε: a free refusal before anything is read.

Decided by the plan's public parameters alone (the exact sampler's range at each noise scale,
the interval search, the quantile and selection tables), so it runs before the reserve; after
it, no mechanism refuses because of its ε.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

from dpsql.errors import DataError
from dpsql.plan.values import QuantileMeasure

if TYPE_CHECKING:
    from dpsql.plan.annotated import Plan
    from dpsql.privacy.samplers import NoiseSource


def check_drawable(plan: Plan, noise: NoiseSource) -> None:
    """Every mechanism of the plan can run at its ε, or a free refusal before anything is
    read: each measure's noise (the exact sampler's range) and its interval search, each
    quantile release's exponential mechanism (or smooth median), each automatic clipping
    histogram and its τ, and the optimal selection's π table. All decided by the plan's
    public parameters; afterwards no mechanism refuses because of its ε.

    A plan whose measures, quantiles and selection are the very objects of a plan that passed
    (with the same source; no clipping) passes again without asking: a text shape's plans
    share their shape's (dpsql.service.shape_cache), and the answer is theirs alone."""
    from dpsql.privacy.quantiles import check_drawable as quantiles_drawable

    parts = (plan.measures, plan.quantiles, plan.selection, noise)
    held = _PASSED.get(id(plan.measures))
    if held is not None and all(a is b for a, b in zip(held, parts, strict=True)):
        return
    for m in plan.measures:
        try:
            mechanism = m.mechanism
            if _hashable(mechanism):
                _measure_drawable(mechanism, cast(Hashable, noise))  # hashed by identity
            else:
                _measure_drawable.__wrapped__(mechanism, noise)
        except (ValueError, OverflowError):
            raise undrawable(f"{m.kind}({m.column or '*'})") from None
    for qm in plan.quantiles:
        try:
            if not isinstance(qm, QuantileMeasure):
                qm.check_drawable()  # its own mechanism (MODE's noisy max)
                continue
            quantiles_drawable(qm.grid, qm.part_epsilon, [len(p) for p in qm.parts], qm.method)
        except (ValueError, OverflowError):
            what = "quantiles" if isinstance(qm, QuantileMeasure) else qm.kind
            raise undrawable(f"the {what} of {qm.column}", bounds=False) from None
    for clip in plan.clips:
        try:
            approx = clip.mechanism
            approx.mechanism.sample(noise, 0)
            if approx.method == "threshold":
                _ = approx.threshold
        except (ValueError, OverflowError):
            raise undrawable(f"the clipping range of {clip.column}") from None
    selection = plan.selection
    if selection is not None and selection.mechanism is not None:
        try:
            _ = selection.mechanism.table  # cached per (ε, δ): released from it later
        except (ValueError, OverflowError):
            raise undrawable("the partition selection", bounds=False) from None
    if not plan.clips:
        if len(_PASSED) >= _PASSED_MAX:
            _PASSED.clear()
        _PASSED[id(plan.measures)] = parts  # held: its ids are not reused while kept


#: plans that passed, by their measures' id: (measures, quantiles, selection, noise source)
_PASSED: dict[int, tuple[Any, ...]] = {}
_PASSED_MAX = 256


@lru_cache(maxsize=1024)
def _measure_drawable(mechanism: Any, noise: NoiseSource) -> None:
    """A measure's noise draws (0 of them: the sampler's range check) and its interval search
    at its mechanism's public parameters; remembered for a mechanism and source that passed
    (a frozen, hashable mechanism decides it alone), raised again each time for one that
    did not (lru_cache keeps no exception). A shape's plans with new numbers share their
    mechanisms, so a statement of a known shape does not search again."""
    mechanism.sample(noise, 0)
    mechanism.interval_halfwidth()


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def undrawable(what: str, *, bounds: bool = True) -> DataError:
    """The free refusal of a mechanism that cannot run at the plan's ε (SQLSTATE 22023)."""
    fix = ", or narrow the column's declared bounds" if bounds else ""
    return DataError(
        f"cannot draw noise for {what}: the noise scale is too large for the exact sampler "
        "at this epsilon",
        sqlstate="22023",
        construct="epsilon",
        hint=f"raise epsilon (SET epsilon = ...){fix}; nothing was spent",
    )
