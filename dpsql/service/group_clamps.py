"""A clamp per group for a grouped AVG whose policy states no clip (issue 31 items 2 and 7).

One clamp for every group (the default clamp range, dpsql.service.bounds) must serve groups of
every size: in a group of thousands of values the noise is negligible and any clamp below the
tail is pure bias, in a group of ten the noise of a high clamp swamps the mean. Each AVG
releases its group's count anyway (its denominator), so the run releases that count first
and chooses each group's clamp from it:

1. the plan's engine pass (planned at the table-wide clamp, as before) runs; of its exact
   values only each AVG's count measure is noised and released (``n̂_g``, its mechanism as
   planned); the rest is dropped unread;
2. per group, the clamp C_g minimising the expected squared bias plus noise variance of the
   group's SUM, ``(n̂_g / N̂)² · E[(Σ_b n_b e_b(C))²] + Var(noise at C)``, the bins' true counts
   estimated from the kept DP histogram of |x| (dpsql.privacy.clipping "posterior", N̂ its
   total, e_b(C) the mean excess of a bin's values over C) and the noise at C that of the
   plan's SUM measure scaled by the range's width: post-processing of released values only;
3. the groups sharing a clamp form a class; each class's plan is the query planned with that
   clamp as the column's bounds (same ε, same measures, same split: checked, else the class
   keeps the table-wide clamp), run with the same secret (so the same rows of each unit are
   kept: the bounding does not read the clamp), and released with the counts of step 1 given,
   every other measure noised at its class plan's scale; each group's row comes from its
   class.

Privacy (the charge is the plan's, unchanged). Write U_g for group g's row bound of the SUM
measure (its clamp's width, centred as planned; fixed before step 3 from released values
only) and U for the table-wide one. Releasing S_g + Lap(G·R·U_g/ε_s) for every g is releasing
the vector (S_g / U_g)_g plus Lap(G·R/ε_s) on each coordinate, rescaled (post-processing).
Adding or removing one unit changes at most G groups (the bounding keeps G), in each at most
R rows, each row's clamped value by at most U_g: so each coordinate S_g / U_g moves by at most
R, and the vector's L1 norm by at most G·R, L2 by sqrt(G)·R — exactly the sensitivities of the
single-clamp plan's vector S_g / U, for which the same noise is ε_s-DP (Laplace) or
ρ-zCDP (Gaussian: the discrete Gaussian's σ scaled with U_g likewise). The bias measures that
read the clamp (``clamped``, ``cut``) are the same argument with their own row bounds. The
counts are released once (step 1), with the plan's mechanism. The clamps are a function of
step 1's release and the kept histogram (already paid), so by adaptive composition the whole
answer costs the plan's ε: count + SUM + bias shares, as charged before the engine read a row.
tests/test_group_clamps.py checks the noise scales a run draws against this (a run whose SUM
noise were not scaled per group fails it) and the answers on noise-free data.

Nothing here can fail because of the data: the clamps are chosen from released values by
arithmetic on public bins; a class plan that would differ from the charged one in anything
but its clamp (never seen: the split does not read the bounds) keeps the charged clamp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from typing import Any

import numpy as np

from dpsql.aggregates import kind_of
from dpsql.errors import Error
from dpsql.lower.compile import compile_plan
from dpsql.plan.annotated import Plan
from dpsql.plan.values import Measure
from dpsql.privacy.clipping import clip_range, posterior_candidates, posterior_counts
from dpsql.privacy.release import Released, group_index, release, released_measures
from dpsql.service.bounds import (
    Chosen,
    PerGroupClamp,
    clamp_columns,
    clamp_histogram,
    declared_range,
    per_group_columns,
)

#: groups listed by name in the answer's note (the rest counted)
NOTE_GROUPS = 8
#: the most distinct clamps of a column in one query: its engine passes are at most this many
#: more than the plan's (a public bound: the work after the charge never depends on the data)
MAX_CLASSES = 4


def planned(plan: Plan) -> tuple[PerGroupClamp, ...]:
    """The per-group clamps ``plan``'s run chooses (none: it runs as planned). Only a plan
    whose keys are all public (every group released, no thresholding or selection) and with
    no automatic clipping of its own; decided from the plan: public."""
    chosen = plan.extra.get("bounds")
    if not isinstance(chosen, Chosen) or chosen.pending is not None or not chosen.per_group:
        return ()
    if not _every_group_public(plan) or "bounds_settings" not in plan.extra:
        return ()
    return tuple(p for p in chosen.per_group if _measures_of(plan, p.column) is not None)


def _every_group_public(plan: Plan) -> bool:
    """Every key public (every group released: no thresholding or selection) and no
    automatic clipping of the plan's own: the plans whose AVGs may take a clamp per group."""
    return (
        bool(plan.keys)
        and all(kp.domain is not None for kp in plan.keys)
        and plan.threshold is None
        and plan.selection is None
        and not plan.clips
    )


def bounds_notes(plan: Plan) -> list[str]:
    """The answer's notes on the bounds ``plan`` was planned with (dpsql.service.bounds.Chosen),
    saying a clamp is chosen per group only where the run chose one (keys released by
    thresholding keep the table-wide range, whose note is given instead)."""
    chosen = plan.extra.get("bounds")
    if not isinstance(chosen, Chosen):
        return [] if chosen is None else list(chosen.notes())
    return replace(chosen, per_group=planned(plan)).notes()


def explain_lines(plan: Plan) -> list[str]:
    """EXPLAIN's words on the per-group clamps the run of ``plan`` chooses (none: no line).
    A plan still buying its histogram (a pending choice) says what the run will do."""
    chosen = plan.extra.get("bounds")
    columns = [p.column for p in planned(plan)]
    pending = isinstance(chosen, Chosen) and chosen.pending is not None
    if not columns and pending and _every_group_public(plan):
        summed = clamp_columns(plan.query)
        columns = [c for c in per_group_columns(plan.query, summed) if _measures_of(plan, c)]
    if not columns:
        return []
    keys = ", ".join(kp.key.sql for kp in plan.keys)
    return [
        f"the clamp of {c} is chosen per {keys} group at run time: each AVG's count (its "
        "measure above, no extra ε) is released first, then each group's clamp is the range "
        "minimising the "
        "expected squared bias plus noise of the group's AVG at its released count, from the "
        f"kept DP histogram of |{c}| (at most {MAX_CLASSES} distinct clamps, one engine pass "
        "each with the same secret; the range above is the first pass's); each group's sum "
        "is noised at its own clamp's scale, so the charge is the plan's (docs/mechanisms.md)"
        for c in columns
    ]


def for_intervals(plan: Plan) -> Plan:
    """``plan`` as dpsql.privacy.release.at_confidence reads it for a per-group run: each
    per-group AVG's released range is its declared one (a group's own clamp may lie above
    the table-wide range the plan states), so an interval at another level is never cut to
    a range its group was not clamped to. Any other plan: itself."""
    per_group = {p.column: p.declared for p in planned(plan)}
    if not per_group:
        return plan
    outputs = tuple(
        replace(o, lower=per_group[o.call.column][0], upper=per_group[o.call.column][1])
        if kind_of(o).group_clamp and o.call.column in per_group
        else o
        for o in plan.outputs
    )
    return plan.with_(outputs=outputs)


def _measures_of(plan: Plan, column: str) -> tuple[Measure, Measure] | None:
    """The SUM and count measures of the AVG of ``column`` (the first AVG's: every AVG of a
    column reads the same two)."""
    for output in plan.outputs:
        if kind_of(output).group_clamp and output.call.column == column:
            return plan.measure(output.measures[0]), plan.measure(output.measures[1])
    return None


def _range(col: Any, bound: float) -> tuple[float, float]:
    """The clamp range bound C gives ``col``, as the table-wide choice takes it
    (dpsql.privacy.clipping.clip_range, then dpsql.service.bounds.declared_range)."""
    return declared_range(col, *clip_range(float(col.lower), float(col.upper), bound))


def errors(
    per_group: PerGroupClamp,
    col: Any,
    counts: np.ndarray,
    sum_measure: Measure,
    count_measure: Measure,
) -> tuple[list[tuple[float, float]], np.ndarray]:
    """The candidate ranges and, per group (rows) and candidate (columns), the expected squared
    error of the group's AVG times its count squared (module doc, step 2). Post-processing:
    reads the kept histogram, the released counts and the plan's public noise only. ``col``:
    the column as planned (its bounds the table-wide clamp); the ranges lie in its declared
    bounds, the histogram's.

    The AVG is released as c + (S − n·c + e_S)/(n + e_N), c the range's centre (the planner
    centres the SUM to halve its noise), so its error is about e_S/n − (c − μ)·e_N/n: beside
    the SUM's noise, the count's noise weighs (c − μ)², μ the clamped mean, estimated from the
    histogram (a column of |x| that may be negative: 0, the sign of its values is unknown)."""
    declared = replace(col, lower=per_group.declared[0], upper=per_group.declared[1])
    hist = clamp_histogram(declared)
    mean, var = posterior_counts(
        np.asarray(per_group.noisy, dtype=np.float64), per_group.noise_scale
    )
    mean, var = mean * per_group.weight, var * per_group.weight**2
    candidates, excess = posterior_candidates(hist)
    bias_total = (excess @ mean) ** 2 + (excess**2) @ var  # E[(table-wide SUM bias)²] per C
    total = max(float(mean.sum()), 1.0)
    ranges = [_range(declared, float(c)) for c in candidates]
    lows, highs = np.array([r[0] for r in ranges]), np.array([r[1] for r in ranges])
    # the SUM's noise variance at the planned range, scaled by each candidate range's width
    width = (sum_measure.hi - sum_measure.lo) * sum_measure.granularity
    noise = _variance(sum_measure) * ((highs - lows) / width) ** 2 if width > 0 else 0 * highs
    if declared.lower >= 0:
        mids = hist.midpoints()
        mids[-1] = hist.maximum  # values beyond the declared bound are clamped there
        clamped = (np.minimum(mids[None, :], highs[:, None]) * mean[None, :]).sum(axis=1) / total
        noise = noise + _variance(count_measure) * ((lows + highs) / 2 - clamped) ** 2
    share = np.minimum(np.maximum(np.asarray(counts, dtype=np.float64), 1.0) / total, 1.0)
    return ranges, share[:, None] ** 2 * bias_total[None, :] + noise[None, :]


def _variance(m: Measure) -> float:
    """A measure's noise variance in released units (the mechanism's own: discrete Laplace of
    scale b about 2b², the discrete Gaussian's σ², the staircase's in closed form)."""
    return float(m.mechanism.variance) * float(m.unit) ** 2  # type: ignore[union-attr]


def classes(err: np.ndarray, most: int) -> np.ndarray:
    """Each group's candidate (column of ``err``), at most ``most`` distinct: each group's
    best, or, where more differ, the groups sorted by their best cut into ``most`` runs of
    consecutive bests, each run taking the candidate of least summed relative excess
    err/min(err) over its groups. Bounds the engine passes by the policy, never the data."""
    best = np.argmin(err, axis=1)
    distinct = np.unique(best)
    if len(distinct) <= most:
        return best
    relative = err / np.maximum(err.min(axis=1, keepdims=True), 1e-300)
    out = best.copy()
    for run in np.array_split(distinct, most):
        members = np.isin(best, run)
        out[members] = int(np.argmin(relative[members].sum(axis=0)))
    return out


def _same_charge(base: Plan, other: Plan, columns: set[str], counts: set[str]) -> bool:
    """``other`` differs from the charged ``base`` only in the clamps of ``columns``: the same
    measures in the same order with the same ε and δ, the same mechanisms for every measure
    that does not read those columns and for the released counts, and the same cost."""
    if len(base.measures) != len(other.measures):
        return False
    for a, b in zip(base.measures, other.measures, strict=True):
        if (a.name, a.kind, a.column, a.epsilon, a.delta) != (
            b.name,
            b.kind,
            b.column,
            b.epsilon,
            b.delta,
        ):
            return False
        reads = a.column in columns and a.name not in counts
        if not reads and a.mechanism != b.mechanism:
            return False
        if type(a.mechanism) is not type(b.mechanism):
            return False
    # never more than charged (a Gaussian's ρ is recomputed from its scaled σ: float slack)
    charged, cost = base.cost, other.cost
    slack = 1 + Fraction(1, 10**9)
    return (
        cost.exact_epsilon <= charged.exact_epsilon * slack
        and cost.exact_rho <= charged.exact_rho * slack
        and Fraction(cost.delta) <= Fraction(charged.delta) * slack
    )


def run(
    service: Any,
    plan: Plan,
    compiled: Any,
    handle: Any,
    check: Callable[[], None],
) -> tuple[Released, list[str]]:
    """Run ``plan`` with a clamp per group (module doc). Runs after the reserve: the plan's
    whole cost is charged; every pass reuses ``compiled``'s secret."""
    per_group = planned(plan)
    result = service.engine.execute(compiled, handle)
    groups, exact = group_index(plan, result)
    table = plan.query.table
    pairs = {p.column: _measures_of(plan, p.column) for p in per_group}
    count_names = tuple(dict.fromkeys(m[1].name for m in pairs.values() if m is not None))
    counts = released_measures(plan, exact, service.noise, {}, count_names)
    # per group: each column's range, chosen from its count
    by_column = {}
    for p in per_group:
        pair = pairs[p.column]
        if pair is None:
            continue
        ranges, err = errors(p, table.columns[p.column], counts[pair[1].name], *pair)
        by_column[p.column] = [ranges[i] for i in classes(err, MAX_CLASSES)]
    columns = tuple(by_column)
    keys = [tuple(by_column[c][i] for c in columns) for i in range(len(groups))]
    # the planned (table-wide) range: its class runs on the first pass's result
    base_key = tuple(_range(table.columns[c], math.inf) for c in columns)
    settings, domains = plan.extra["bounds_settings"]
    by_class: dict[tuple, Released] = {}
    applied: dict[tuple, tuple] = {}  # the range each class was released with
    for key in dict.fromkeys(keys):
        class_plan, class_result = plan, result
        applied[key] = base_key
        if key != base_key:
            cols = dict(table.columns)
            for c, (lo, hi) in zip(columns, key, strict=True):
                bound: Any = int if cols[c].type == "int" else float
                cols[c] = replace(cols[c], lower=bound(lo), upper=bound(hi))
            query = plan.query.with_table(replace(table, columns=cols))
            try:  # planning reads no data; any refusal keeps the charged range (never fails)
                candidate = service.plan_typed(
                    query, domains, replace(settings, epsilon=plan.epsilon)
                )
            except (Error, ValueError, OverflowError, ZeroDivisionError):
                candidate = plan
            if candidate is not plan and _same_charge(
                plan, candidate, set(columns), set(count_names)
            ):
                class_plan, applied[key] = candidate, key
                class_result = service.engine.execute(
                    compile_plan(candidate, compiled.secret), handle
                )
        by_class[key] = release(class_plan, class_result, service.noise, check, given=counts)
    released = _merged(keys, by_class)
    return released, [_note(columns, groups, [applied[k] for k in keys])]


def _merged(keys: list[tuple], classes: dict[tuple, Released]) -> Released:
    """Each group's row from its class's release (every class releases every public group,
    in the same order: group_index)."""
    first = next(iter(classes.values()))
    outputs = [np.array(o, copy=True) for o in first.outputs]
    intervals = [np.array(v, copy=True) for v in first.intervals]
    biases = [None if b is None else np.array(b, copy=True) for b in first.biases]
    for i, key in enumerate(keys):
        r = classes[key]
        for j in range(len(outputs)):
            outputs[j][i] = r.outputs[j][i]
            intervals[j][i] = r.intervals[j][i]
            b = r.biases[j] if j < len(r.biases) else None
            if biases[j] is not None and b is not None:
                biases[j][i] = b[i]  # type: ignore[index]
    return Released(first.key_values, outputs, intervals, first.suppressed_probability, biases)


def _note(columns: tuple[str, ...], groups: list[tuple], keys: list[tuple]) -> str:
    """The answer's note: each group's clamp (public: chosen from released values)."""
    parts = []
    for k, c in enumerate(columns):
        shown = [
            f"{', '.join(str(v) for v in g)} [{key[k][0]:g}, {key[k][1]:g}]"
            for g, key in zip(groups[:NOTE_GROUPS], keys, strict=False)
        ]
        more = f" and {len(groups) - NOTE_GROUPS} more groups" if len(groups) > NOTE_GROUPS else ""
        parts.append(
            f"{c} clamped per group, each clamp chosen from the group's released count (no "
            f"extra ε; the sums' noise scaled to each clamp): {'; '.join(shown)}{more}"
        )
    return ". ".join(parts)
