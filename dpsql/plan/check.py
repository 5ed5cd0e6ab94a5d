"""The cost a plan charges must equal the sum of its measurements' privacy maps.

The planner calibrates each mechanism to a sensitivity it computes itself; the plan tree
(dpsql.plan.tree) derives each measure's sensitivity again from its nodes' stability (R, G,
the per-row range) and evaluates each measurement's privacy map at it. A planner that
under-states a sensitivity, mis-splits the budget or forgets a measurement fails here,
before any data is read.
"""

from __future__ import annotations

import math

from dpsql.aggregates import kind_of
from dpsql.errors import InternalError
from dpsql.plan.annotated import Plan
from dpsql.privacy.partition import Unreleased

RELATIVE = 1e-9  # floating-point calibration (b = Δ1 / ε) round trip


def check_plan(plan: Plan) -> None:
    """Raise InternalError unless charged cost == sum of the tree's privacy maps, and unless
    every exact (un-noised) measure is the selection's input and read by no output."""
    _check_exact(plan)
    release = plan.release
    for measurement, measure in zip(release.measurements, plan.measures, strict=True):
        if measurement.l1 > measure.l1 * (1 + RELATIVE) or measurement.l2 > measure.l2 * (
            1 + RELATIVE
        ):
            raise InternalError(
                f"measure {measure.name}: its noise is calibrated to a smaller sensitivity "
                "than the plan's nodes allow",
                construct=measure.kind,
                hint="this is a dpsql bug; nothing was spent",
            )
    for qm, quantiles in zip(release.quantile_measurements, plan.quantiles, strict=True):
        if qm.calibrated_values < qm.max_values or quantiles.groups < qm.groups:
            raise InternalError(
                f"quantiles {quantiles.name}: calibrated for fewer values or groups per unit "
                "than the plan's nodes allow",
                construct=quantiles.column,
                hint="this is a dpsql bug; nothing was spent",
            )
    # compared within RELATIVE, so summed as floats: the exact sum (release.cost()) adds
    # rationals with ~2^50 denominators (each map is Δ1 / b of two floats) for nothing
    maps = release.privacy_maps()
    charged = plan.cost
    for part in ("epsilon", "delta", "rho"):
        a, b = math.fsum(getattr(m, part) for m in maps), getattr(charged, part)
        if not math.isclose(a, b, rel_tol=RELATIVE, abs_tol=1e-300):
            raise InternalError(
                f"the plan charges {part} {b!r} but its measurements cost {a!r}",
                construct="plan",
                hint="this is a dpsql bug; nothing was spent",
            )


def _check_exact(plan: Plan) -> None:
    selection = plan.selection
    allowed = selection.measure if selection is not None and selection.mechanism else None
    exact = {m.name for m in plan.measures if isinstance(m.mechanism, Unreleased)}
    read = set()
    for output in plan.outputs:
        read |= set(output.measures) | kind_of(output).interval_measures(output, plan)
    if plan.threshold is not None:
        read.add(plan.threshold.measure)
    if exact - {allowed} or exact & read:
        raise InternalError(
            "an exact measure would be released or is not the partition selection's input",
            construct="plan",
            hint="this is a dpsql bug; nothing was spent",
        )
