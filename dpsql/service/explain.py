"""EXPLAIN (FORMAT TEXT): the plan as an analyst reads it, in plain words.

One text column ("QUERY PLAN", as PostgreSQL's EXPLAIN), the same from SQL, the DB-API and the
CLI (``dpsql explain`` prints it). Everything here is computed from the plan and the public
noise distributions: EXPLAIN reads no data and spends nothing.

Sections: the released values (how each is computed, its mechanism, sensitivity, noise scale,
share of ε/δ and the 95% half-width *of the released value*), the groups (public domain or
threshold), the cost and what would remain, the plan tree (dpsql.plan), the engine SQL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlglot

from dpsql.aggregates import KINDS
from dpsql.aggregates.mode import ModeMeasure
from dpsql.errors import BudgetExhaustedError
from dpsql.lower.compile import compile_plan
from dpsql.plan.tree import tree_lines
from dpsql.service import group_clamps
from dpsql.service.bias_notes import bounds_lines
from dpsql.service.results import Result

if TYPE_CHECKING:
    from dpsql.plan.annotated import Plan
    from dpsql.plan.values import Measure, OutputAggregate
    from dpsql.service.protocol import Service

# each kind's formula: its object says it (dpsql.aggregates.AggregateKind.explain); what
# each measure sums, and whether it is a bias measure: Measure.measure_kind
# (dpsql.plan.measure_kinds)
FORMULA = {name: kind.explain for name, kind in KINDS.items()}


_CLIP_CHOICE = {
    "sum": "the bound minimising the estimated bias + noise of its SUM",
    "quantile": "the bound at the noisy {q:g} quantile of |values|",
    "threshold": "the top of the highest bin passing a noise threshold (ApproxBounds)",
}


def _n(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1e15 or abs(x) < 1e-4:
        return f"{x:.3g}"
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.0f}"


def _shown_column(plan: Plan, column: str | None) -> str:
    if column is None:
        return "*"
    spec = plan.query.table.columns.get(column)
    return spec.expr if spec is not None and spec.expr else column


def _measure_line(plan: Plan, m: Measure) -> str:
    g = m.unit
    what = m.measure_kind.what.format(column=_shown_column(plan, m.column))
    cost = m.mechanism.cost
    share = f"ε {_n(m.epsilon)}" if cost.rho == 0 else f"ρ {_n(float(cost.rho))}"
    return (
        f"    {what}: {m.mechanism.name} noise, sensitivity {_n(m.l1 * g)} "
        f"(L2 {_n(m.l2 * g)}), scale {_n(m.mechanism.scale * g)}, {share}, "
        f"±{_n(m.mechanism.interval_halfwidth() * g)} at 95%"
    )


def explain_lines(service: Service, plan: Plan, analyst: str | None) -> list[str]:
    lines = ["Released values"]
    names = [item.alias_or_name for item in plan.query.post.expressions]
    for output in plan.outputs:
        label = output.call.label
        lines.append(f"  {label}: {FORMULA.get(output.call.kind, output.call.kind)}")
        if not output.measures:
            qm = plan.quantile_of(output)
            # a histogram measure other than a quantile explains itself (MODE)
            lines.extend(
                qm.explain() if isinstance(qm, ModeMeasure) else _quantile_lines(plan, output)
            )
            continue
        for name in output.measures:
            lines.append(_measure_line(plan, plan.measure(name)))
        first = plan.measure(output.measures[0])
        if KINDS[output.call.kind].ratio:  # a sum over a count (AVG): per row of a group
            half = first.mechanism.interval_halfwidth() * first.unit
            lines.append(
                f"    the average of a group of n rows is within about ±{_n(half)} / n "
                f"(±{_n(half / 1000)} at n = 1,000), plus the count's share"
            )
    if names:
        lines.append("  released columns: " + ", ".join(names))
    lines.append("Groups")
    if not plan.keys:
        lines.append("  one group (no GROUP BY)")
    for kp in plan.keys:
        if kp.domain is not None:
            lines.append(
                f"  {kp.key.sql}: public domain of {len(kp.domain)} values, every one "
                "released (empty ones too)"
            )
        else:
            how = "thresholding"
            if plan.selection is not None and plan.selection.mode == "optimal":
                how = "optimal partition selection"
            lines.append(f"  {kp.key.sql}: not public, released by {how}")
    if plan.threshold is not None:
        lines.append(
            f"  a group is released when its noisy unit count reaches {_n(plan.threshold.tau)} "
            + (
                f"(or is {_n(plan.threshold.tau - 1)}, with probability "
                f"{plan.threshold.below:.3f}: all of δ {_n(plan.threshold.delta)} spent)"
                if plan.threshold.below
                else f"(δ {_n(plan.threshold.delta)})"
            )
        )
    lines.extend(_selection_lines(plan))
    unit = plan.query.table.privacy_unit
    lines.append("Contribution bounds")
    if unit is None:
        lines.append("  each row is its own privacy unit")
    else:
        how = "rows and groups chosen by keyed hash, in the engine"
        if plan.bounding == "scale":
            how = "a group with n > R of its rows counts R/n of each; groups chosen by keyed hash"
            if plan.group_scaling:
                how = (
                    "a group with n > R of its rows counts R/n of each, and a unit in k > G "
                    "groups counts G/k in each"
                )
        lines.append(
            f"  each {unit} keeps at most {plan.max_rows} rows per group and "
            f"{plan.max_groups} groups ({how})"
        )
    cut = bounds_lines(plan)
    if cut:
        lines.append("What the bounds may cut (docs/bias.md)")
        lines.extend("  " + line for line in cut)
        lines.extend(
            _measure_line(plan, m).replace("    ", "    bias: ", 1)
            for m in plan.measures
            if m.measure_kind.bias
        )
    per_group = group_clamps.explain_lines(plan)
    if per_group:
        lines.append("Clamp per group")
        lines.extend("  " + line for line in per_group)
    if plan.clips:
        lines.append("Automatic clipping")
    for clip in plan.clips:
        col = plan.query.table.columns[clip.column]
        lines.append(
            f"  {_shown_column(plan, clip.column)}: ε {_n(clip.epsilon)} buys a noisy histogram "
            f"of its |values| on {clip.histogram.bins} log bins (Laplace, scale "
            f"{_n(clip.mechanism.mechanism.scale)}); {_CLIP_CHOICE[clip.method].format(q=clip.q)} "
            f"replaces the declared [{_n(col.lower)}, {_n(col.upper)}]"  # type: ignore[arg-type]
        )
        lines.append(
            "    the sums' noise above is at the declared bounds (at most); the run states "
            "the range it used and the estimated bias towards zero"
        )
    lines.extend(_split_lines(plan))
    c = plan.cost
    lines.append("Cost")
    lines.append(f"  ε {_n(c.epsilon)}, δ {_n(c.delta)}" + (f", ρ {_n(c.rho)}" if c.rho else ""))
    if analyst is not None:
        budget = service.policy.budget
        spent = service.ledger.spent(analyst, service.policy.dataset)
        eps_left, delta_left = budget.remaining(spent)
        lines.append(f"  remaining before it: ε {_n(eps_left)}, δ {_n(delta_left)}")
    lines.append("Plan tree (each node's stability; each measurement's privacy map)")
    lines.extend("  " + line for line in tree_lines(plan.root))
    lines.append(f"Engine SQL ({service.engine.dialect}; the secret is drawn per query)")
    compiled = compile_plan(plan, 0)
    for i, query in enumerate((compiled, *compiled.extras)):
        if i:
            lines.append(f"  -- bin counts of {plan.quantiles[i - 1].column} (same bounded rows)")
        sql = query.render(service.engine.dialect)
        try:
            pretty = sqlglot.transpile(sql, read=service.engine.dialect, pretty=True)[0]
        except sqlglot.errors.SqlglotError:
            pretty = sql
        lines.extend("  " + line for line in pretty.splitlines())
    return lines


def _quantile_lines(plan: Plan, output: OutputAggregate) -> list[str]:
    """A quantile's mechanism, grid, ε and its public 95% guarantee, which is in ranks."""
    from dpsql.aggregates import quantile_target
    from dpsql.plan.values import QuantileMeasure
    from dpsql.privacy.quantiles import ExponentialQuantile, target

    qm = plan.quantile_of(output)
    assert isinstance(qm, QuantileMeasure)
    kind, q = quantile_target(output.call)
    grid = qm.grid
    tgt = target(kind, q)
    h = ExponentialQuantile(grid, qm.part_epsilon, max_values=qm.max_values).rank_halfwidth(tgt)
    spacing = "one bin per value" if grid.integer else f"{grid.scale} bins"
    where = {"min": "the smallest value", "max": "the largest value"}.get(kind) or (
        f"the {q:g} quantile"
    )
    share = len(qm.parts) * qm.groups
    if qm.method == "smooth":
        return [
            f"    smooth-sensitivity median (Cauchy noise, pure ε {_n(qm.part_epsilon)} per group, "
            f"x {qm.groups} groups per unit) on {grid.bins} public bins, snapped to its bin",
            "    its noise scale depends on the data (smooth sensitivity): no interval is "
            "released for it (x_low, x_high are NULL)",
        ]
    how = "permute-and-flip" if qm.method == "pf" else "exponential mechanism"
    lines = [
        f"    {grid.bins} public bins on [{_n(grid.lower)}, {_n(grid.upper)}] ({spacing}); "
        f"each group's {len(qm.parts)} release(s) of {qm.column} take ε {_n(qm.part_epsilon)} "
        f"each (x {qm.groups} groups per unit: ε {_n(qm.part_epsilon * share)}); utility "
        f"sensitivity {qm.max_values} x max(q, 1 − q) (<= {qm.max_values} values per unit)",
        (
            f"    95%: the released value lies between the values ranked {_n(h)} below and "
            f"above {where} of the bounded data, to the bin (a group of n values: ± {_n(h)} / n "
            "in level)"
            if kind != "quantile"
            else f"    95%: the released bin's score |(1 − q)·#below − q·#above| is within "
            f"{_n(h)} of the best bin's; the score is at least the bin's distance in ranks from "
            f"{where}, so without ties the released value is within about {_n(h)} ranks of it "
            f"(± {_n(h)} / n in level for a group of n values)"
        ),
        "    no value interval is released for it (x_low, x_high are NULL): it would depend "
        "on the data",
    ]
    if qm.method == "pf":
        lines.insert(0, f"    sampled by {how} (same ε, never less accurate in expectation)")
    return lines


def explain_text(service: Service, plan: Plan, analyst: str | None) -> Result:
    rows = [(line,) for line in explain_lines(service, plan, analyst)]
    result = Result([("QUERY PLAN", "VARCHAR")], rows, status="EXPLAIN")
    result.notes = budget_notes(service, plan, analyst)
    return result


def _selection_lines(plan: Plan) -> list[str]:
    """How the non-public keys are selected, the chance a key of n units is dropped, and
    the candidate the planner compared it with (partition_selection = 'auto')."""
    selection = plan.selection
    if selection is None:
        return []
    lines = []
    sel = selection.mechanism
    if sel is not None:
        lines.append(
            f"  optimal partition selection (Desfontaines et al. 2022) on the exact unit count, "
            f"ε {_n(sel.epsilon)}, δ {_n(sel.delta)}: a group of n units is kept with "
            "probability π(n), the largest any (ε, δ)-DP selection allows; the count is never "
            "released"
        )
        points = sorted({1, 5, 10, 20, 50, 100, sel.saturation})
        lines.append(
            "  P(a group of n units is suppressed): "
            + ", ".join(f"n = {n}: {sel.suppression_probability(n):.3g}" for n in points)
        )
    else:
        units = plan.measure(plan.threshold.measure) if plan.threshold is not None else None
        if units is not None:
            reused = [o.call.label for o in plan.outputs if units.name in o.measures]
            if reused:
                lines.append(f"  its noisy unit count is reused by: {', '.join(reused)}")
    compared = ", ".join(f"{mode} from n = {n}" for mode, n in selection.n_half)
    lines.append(
        f"  partition_selection = '{selection.requested}': {selection.mode} (a group is kept "
        f"with probability >= 1/2: {compared})"
    )
    return lines


def _split_lines(plan: Plan) -> list[str]:
    """The ε split over the noisy measures (and the selection), and the rule behind it."""
    shares = [
        f"{m.name} {_n(m.epsilon)}" for m in plan.measures if m.epsilon > 0 and m.mechanism.scale
    ]
    if plan.selection is not None and plan.selection.mechanism is not None:
        shares.append(f"selection {_n(plan.selection.epsilon)}")
    if len(shares) < 2:
        return []
    return [
        "ε split",
        "  " + ", ".join(shares) + " (ε_i ∝ C_i^(1/3): minimises the summed relative noise "
        "variance of the released values; shared measures count once)",
    ]


def budget_notes(service: Service, plan: Plan, analyst: str | None) -> list[str]:
    """EXPLAIN's warning when running ``plan`` now would be refused for budget (a read of
    the analyst's own budget: free, like SHOW budget)."""
    if analyst is None:
        return []
    try:
        service.ledger.check(
            analyst, service.policy.dataset, with_choice(plan), service.policy.budget
        )
    except BudgetExhaustedError as exc:
        return [f"running this query would be refused: {exc.message}; nothing was spent"]
    return []


def pending_choice(plan: Plan) -> Any:
    """The bounds choice (dpsql.service.bounds.Pending) the run of ``plan`` buys first, or None:
    contribution bounds or clamp ranges not yet bought by this analyst at this data version."""
    bounds = plan.extra.get("bounds")
    return None if bounds is None else bounds.pending


def with_choice(plan: Plan) -> Any:
    """What running ``plan`` now charges: its cost, and first the bounds choice it buys."""
    pending = pending_choice(plan)
    return plan.cost if pending is None else pending.cost + plan.cost
