"""What the bounds may cut, in words: EXPLAIN's lines before a query runs, and the notes
beside each answer (every door shows them: DB-API ``cursor.bias_notes``, the CLI's ``--``
lines, a NOTICE over the wire). Built from the plan and the released (noisy) values only.
"""

from __future__ import annotations

import math
from typing import Any

from dpsql.plan import bias

# plans (Any below) are dpsql.plan.values's, not imported: this module stays out of the
# planner's import cycle


def _n(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if abs(x) >= 1e15 or abs(x) < 1e-3:
        return f"{x:.3g}"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _summed(plan: Any) -> list[str]:
    """Columns whose values a released SUM / AVG / VAR / STDDEV clamps (the kinds whose
    object is ``summed``: dpsql.frontend.bind.AggregateCall.summed)."""
    return list(
        dict.fromkeys(o.call.column for o in plan.outputs if o.call.summed and o.call.column)
    )


def bounds_lines(plan: Any) -> list[str]:
    """Which bounds may cut this query's values, and how the cut is estimated (EXPLAIN)."""
    table = plan.query.table
    lines = []
    if table.privacy_unit is not None and table.unit_is_row and plan.outputs:
        lines.append(
            f"each unit ({table.privacy_unit}) is one row (declared unique): R = 1 and G = 1 "
            "cut nothing, and nothing is measured for them"
        )
    elif table.privacy_unit is not None and plan.outputs:
        R = plan.max_rows
        lines.append(
            f"R = {R} may drop rows of units ({table.privacy_unit}) with more than {R} rows "
            f"of {table.name} in a group"
        )
        if plan.keys:
            lines.append(
                f"G = {plan.max_groups} may drop groups of units in more than "
                f"{plan.max_groups} groups (not estimated)"
            )
    kept = []  # clamp ranges chosen from a kept histogram, whose estimate stands for the cut
    for column in _summed(plan):
        col = table.columns[column]
        lines.append(
            f"the clamp of {col.expr or column} to [{col.lower:g}, {col.upper:g}] may cut its "
            "values beyond it"
        )
        if col.clip == bias.CLIP_CHOSEN and not plan.keys:
            kept.append(col.expr or column)
    if kept and plan.extra.get("bias_estimate"):
        lines.append(
            f"bias estimate of the clamp of {', '.join(kept)}: from the kept DP histogram its "
            "range was chosen from (post-processing, free; the answer's note gives it)"
        )
    measured = [m for m in plan.measures if m.measure_kind.bias]
    if measured:
        eps = sum(m.epsilon for m in measured)
        cap = bias.cap(plan.max_rows)
        what = [m.measure_kind.bias_note.format(column=m.column, cap=cap) for m in measured]
        lines.append(
            f"bias estimate: ε {eps:.3g} ({bias.BIAS_SHARE:.0%} of the query's, after any "
            "clipping share) measures "
            + ", ".join(what)
            + "; SET bias_estimate = off gives it to the answer"
        )
    elif lines and table.bias_by_histogram:
        lines.append(
            "bias estimate: this query's share buys the contribution bounds' DP histogram, "
            "whose estimate of the rows beyond R is given instead (later queries on this data "
            "version measure the rows and the mass the bounds cut)"
        )
    elif kept and len(kept) == len(_summed(plan)) and plan.extra.get("bias_estimate"):
        pass  # the clamps' cut: estimated from the kept histograms (the line above)
    elif lines and plan.extra.get("bias_estimate") and table.unit_is_row and not _summed(plan):
        lines.append("bias estimate: nothing to measure (no bound of this query can cut a row)")
    elif lines:
        lines.append("bias estimate: off for this query (SET bias_estimate = on measures it)")
    return lines


def answer_notes(
    plan: Any,
    description: list[tuple[str, str]],
    biases: list[Any],
    intervals: list[Any] | None = None,
) -> list[str]:
    """One note per released column with a bias estimate: the estimate (the range over the
    groups when there are several) and, for one group, the bias-inclusive interval. An
    estimate within its own noise (the widened interval reaches past both ends of the noise
    interval) is reported as such, never as a cut in one direction."""
    notes = []
    for j, (name, _) in enumerate(description):
        cells = [row[j] for row in biases if j < len(row) and row[j] is not None]
        if not cells:
            continue
        if len(cells) == 1 and len(biases) == 1:
            b, low, high = cells[0]
            span = intervals[0][j] if intervals and intervals[0][j] is not None else None
            said = (
                f"bias: {name} is computed from bounded rows; the bounds cut an estimated "
                f"{_n(b)} from it"
            )
            if span is not None and low < span[0] and high > span[1]:
                said += " (not distinguishable from 0 at this ε)"
            else:
                said += f" (the true value is likely {'higher' if b >= 0 else 'lower'})"
            notes.append(f"{said}; the 95% interval with that bias is [{_n(low)}, {_n(high)}]")
        else:
            notes.append(_grouped_note(name, j, biases, intervals))
    table = plan.query.table
    if notes and plan.query.keys and table.privacy_unit is not None and not table.unit_is_row:
        notes.append(f"bias: G = {plan.max_groups} may cut groups too; that is not estimated")
    return notes


def _half_width(cell: Any, span: Any) -> float | None:
    """The half-width h of a group's estimate b when b is within it (b − h < 0 < b + h: the
    bias-inclusive interval reaches past both ends of the noise interval), else None."""
    if span is None or span[0] is None or span[1] is None:
        return None
    _, low, high = cell
    if not (low < span[0] and high > span[1]):
        return None
    return ((high - span[1]) - (low - span[0])) / 2


def _grouped_note(name: str, j: int, biases: list[Any], intervals: list[Any] | None) -> str:
    """The note of a column over several groups: the range of the estimates that stand out
    of their own noise, and how many do not. A range over estimates each within its noise
    (an AVG of cost in [0, 5000] "cut -8,855 to 4,423") reads as a finding and is none."""
    told: list[float] = []  # estimates that stand out of their noise
    noisy: list[float] = []  # half-widths of those within it
    for r, row in enumerate(biases):
        if j >= len(row) or row[j] is None:
            continue
        span = (
            intervals[r][j] if intervals and r < len(intervals) and j < len(intervals[r]) else None
        )
        h = _half_width(row[j], span)
        (told if h is None else noisy).append(row[j][0] if h is None else h)
    head = f"bias: {name} is computed from bounded rows; "
    tail = " (each one and the 95% interval with it: SET bias_interval = on)"
    if not told:
        return (
            head + f"the estimates of what the bounds cut are each within their own noise in "
            f"all {len(noisy)} groups (up to ±{_n(max(noisy))} at 95%): too noisy to tell at "
            "this ε" + tail
        )
    low, high = min(told), max(told)
    # an estimate is the true value minus the answer, with noise: below 0 either little was
    # cut there (a count's cut is never below 0) or a clamp raised the answer; "cut -7,847"
    # alone said neither
    sign = (
        " (each noisy; one below 0 means little was cut there, or that the bounds raised"
        " the answer)"
        if low < 0
        else ""
    )
    where = f"over its {len(told)} groups"
    if noisy:
        where = (
            f"in {len(told)} of its {len(told) + len(noisy)} groups (in the other "
            f"{len(noisy)}, each estimate is within its own noise)"
        )
    amount = _n(low) if len(told) == 1 else f"{_n(low)} to {_n(high)} per group"
    return head + f"the bounds cut an estimated {amount}{sign} {where}" + tail
